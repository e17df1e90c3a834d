"""What log-probabilities cost a decode step: features/logprobs/logprobs.py's `token_logprobs`
and its parts, on one batch of logits, timed with CUDA events (medians of 50, after 5 warm-ups).

    python tools/logprobs_cost.py                    # W2's batch: 218 rows of Llama 3's vocabulary

The logits are random bf16 ([rows, vocab]); each row's chosen token is its argmax. PyTorch's
parts (a float32 copy, logsumexp, the rank's comparison and sum, topk) against the one-read
kernel (features/logprobs/kernel.py) and the whole, eager and as a CUDA graph.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from plumbing.cli import HelpFormatter, first_paragraph, positive_int  # noqa: E402
from tools.shared import median_cuda_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__),
                                     formatter_class=HelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=218, help="the batch's rows")
    parser.add_argument("--vocab", type=positive_int, default=128_256, help="logits per row")
    parser.add_argument("--top", type=int, default=20, help="top log-probabilities (k)")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("logprobs_cost.py times CUDA kernels: run it on a GPU.")
    from features.logprobs.kernel import row_stats
    from features.logprobs.logprobs import token_logprobs
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(a.rows, a.vocab, device="cuda", generator=g) * 3).bfloat16()
    tokens = logits.argmax(-1)
    graph = torch.cuda.CUDAGraph()
    token_logprobs(logits, tokens, a.top)  # compiled and loaded before capture
    with torch.cuda.graph(graph):
        token_logprobs(logits, tokens, a.top)
    parts = {
        "float32 copy": lambda: logits.float(),
        "logsumexp (of the copy)": lambda: torch.logsumexp(logits.float(), -1),
        "rank: compare and sum": lambda: (logits > logits.gather(-1, tokens[:, None])).sum(-1),
        f"topk({a.top}), bf16": lambda: logits.topk(a.top, -1),
        "kernel.py: sum, log-prob, rank": lambda: row_stats(logits, tokens),
        "token_logprobs, eager": lambda: token_logprobs(logits, tokens, a.top),
        "token_logprobs, a CUDA graph": graph.replay,
    }
    print(f"{torch.cuda.get_device_name()}, {a.rows} rows x {a.vocab:,} bf16 logits")
    for name, run in parts.items():
        print(f"  {name:32s} {median_cuda_seconds(run, repeats=50, warmup=5) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
