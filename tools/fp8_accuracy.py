"""What float8 costs in accuracy: the logits of an FP8 KV cache (--kv-cache-dtype fp8) or of FP8
weights (--quantization fp8) against the model dtype's, step by step.

    python tools/fp8_accuracy.py --model smollm2 --device cpu     # the real SmolLM2, float32
    python tools/fp8_accuracy.py                                  # random 8B weights, bf16, a GPU
    python tools/fp8_accuracy.py --what weights                   # FP8 weights, not K/V

Both runs take the same prompts, greedy, teacher-forced: each step of both feeds the token the
reference run chose, so one flipped token does not change every later step. Reported per step and
over all: the largest and the mean |logit difference|, the spread of the logits (their standard
deviation, for scale), and top-1 agreement: how often the two runs' likeliest next tokens are the
same. The attention kernels are the same in both runs (flash-attn's prefill; the Triton decode
kernel on a GPU, the PyTorch reference on the CPU): only the K/V storage, or the projections'
weights (on a GPU multiplied by torch._scaled_mm, on the CPU by the reference), differ.
"""

import argparse
import copy
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("fp8_accuracy.py")  # before torch loads

from plumbing.cli import (MODELS, HelpFormatter, first_paragraph,
                          one_paragraph_errors, positive_int, write_json, writable_file)


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog="fp8_accuracy.py", description=first_paragraph(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", choices=MODELS, default="8b",
                   help="smollm2: the real weights; the others: random weights of their shapes")
    p.add_argument("--device", help="cpu or cuda (default: cuda if there is one)")
    p.add_argument("--what", choices=["kv-cache", "weights"], default="kv-cache",
                   help="what is in float8: the K/V cache, or the projections' weights")
    p.add_argument("--num-prompts", type=positive_int, default=16, help="ShareGPT prompts")
    p.add_argument("--steps", type=positive_int, default=64, help="decode steps per prompt")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write every figure here")
    return p.parse_args(argv)


class ForcedSampler:
    """Records each step's logits and answers with the reference run's token at that position
    (the likeliest, where there is no reference yet)."""

    def __init__(self, prompt_lengths, forced=None):
        self.prompt_lengths, self.forced, self.logits = prompt_lengths, forced, {}

    def __call__(self, logits, rows, positions):
        import torch
        steps = positions - self.prompt_lengths[rows]  # 0 for prefill's token, then 1, 2, ...
        for row, step, row_logits in zip(rows.tolist(), steps.tolist(), logits.float()):
            self.logits[row, step] = row_logits
        if self.forced is None:
            return logits.argmax(-1)
        return torch.stack([self.forced[row][step] for row, step in zip(rows.tolist(), steps.tolist())])


def run_cache(run, model, cache_class, prompts, steps, forced=None) -> ForcedSampler:
    import torch
    from block_manager import BlockManager
    from engine.engine_core import EngineCore
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.request import EngineRequest
    block_size = 16
    blocks_each = max(len(p) for p in prompts) // block_size + steps // block_size + 2
    num_blocks = blocks_each * len(prompts)
    cache = cache_class(model.args, num_blocks, block_size, run.dtype, run.device, run.attention)
    manager = BlockManager(num_blocks, block_size, len(prompts), blocks_each, run.device)
    lengths = torch.tensor([len(p) for p in prompts], device=run.device)
    sampler = ForcedSampler(lengths, forced)
    requests = [EngineRequest(i, p, steps) for i, p in enumerate(prompts)]
    runner = ModelRunner(model, cache, manager, sampler)
    EngineCore(runner, Scheduler(manager, requests), stop_ids=set()).generate(progress=False)
    return sampler


def measure(a) -> dict:
    import torch
    from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
    from features.fp8.cache import FP8KVCache
    from engine.config import Config
    from engine.loader import load
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    run = load(Config.from_options("paged", dict(model=a.model, device=device,
                                                 random_weights=a.model != "smollm2"),
                                   num_requests=a.num_prompts))
    if device == "cpu":
        attention = TorchAttentionAfterPrefix()
    else:
        from features.triton_attention import TritonDecode
        attention = TritonDecode()  # the kernels fp8 runs with; bf16 runs them too here
    run = dataclasses.replace(run, attention=attention)
    prompts = [p.prompt_tokens for p in run.prompts]
    reference = run_cache(run, run.model, EngineKVCache, prompts, a.steps)
    forced = [[int(reference.logits[r, s].argmax()) for s in range(a.steps)] for r in range(len(prompts))]
    forced = [torch.tensor(f, device=run.device) for f in forced]
    if a.what == "weights":
        from features.fp8.weights import quantize_weights
        model = copy.deepcopy(run.model)
        quantize_weights(model)
        fp8 = run_cache(run, model, EngineKVCache, prompts, a.steps, forced)
    else:
        fp8 = run_cache(run, run.model, FP8KVCache, prompts, a.steps, forced)
    per_step = []
    for s in range(a.steps):
        ref = torch.stack([reference.logits[r, s] for r in range(len(prompts))])
        got = torch.stack([fp8.logits[r, s] for r in range(len(prompts))])
        diff = (got - ref).abs()
        per_step.append({"step": s, "max_abs_logit_error": diff.max().item(),
                         "mean_abs_logit_error": diff.mean().item(), "logit_std": ref.std().item(),
                         "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()})
    return {"what": a.what, "model": a.model + ("" if a.model == "smollm2" else ", random weights"),
            "device": str(device), "dtype": str(run.dtype).removeprefix("torch."),
            "prompts": len(prompts), "steps": a.steps, "per_step": per_step,
            "max_abs_logit_error": max(p["max_abs_logit_error"] for p in per_step),
            "mean_abs_logit_error": statistics.fmean(p["mean_abs_logit_error"] for p in per_step),
            "logit_std": statistics.fmean(p["logit_std"] for p in per_step),
            "top1_agreement": statistics.fmean(p["top1_agreement"] for p in per_step)}


def main(argv=None) -> None:
    with one_paragraph_errors("fp8_accuracy.py"):
        a = parse_arguments(argv)
        r = measure(a)
        if a.json:
            write_json(a, r)
        what = "K/V" if r["what"] == "kv-cache" else "weights"
        print(f"FP8 {what} against {r['dtype']} {what}: {r['model']}, {r['device']}, {r['prompts']} prompts "
              f"x {r['steps']} teacher-forced steps")
        print(f"  top-1 agreement {100 * r['top1_agreement']:.2f}%; |logit error| mean "
              f"{r['mean_abs_logit_error']:.4f}, largest {r['max_abs_logit_error']:.3f} "
              f"(logits' standard deviation {r['logit_std']:.2f})")
        worst = min(r["per_step"], key=lambda p: p["top1_agreement"])
        print(f"  the worst step: {worst['step']}, {100 * worst['top1_agreement']:.1f}% agreement")


if __name__ == "__main__":
    main()
