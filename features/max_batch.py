"""--find-max-batch: the largest batch that completes, found by bisection over real runs.

Attempt n runs the first n prompts with the other flags as given, in this process, and frees
everything it allocated before the next attempt. Batch n + 1 holds batch n's requests and one
more, so if n does not fit, nothing larger does: bisection finds the boundary in about log2(N)
runs. The naive script's limit comes from max_seq_len alone; the paged one's from how long the
requests really grow, which only a real run shows.

More in docs/engine-notes.md.
"""

import dataclasses
import gc
import time

import numpy as np
import torch

from block_manager import OutOfBlocks
from plumbing import inputs
from plumbing.cli import OUT_OF_MEMORY, UserError, format_bytes
from engine.report import memory_report
from plumbing.cli import write_json


@dataclasses.dataclass
class Attempt:
    num_requests: int
    outcome: str  # "completes", "out of KV blocks" (or pages) or "out of memory"
    seconds: float
    kv_pool_blocks: int | None = None  # the paged pool is sized anew each attempt
    block_size: int | None = None
    fragmented_bytes: int | None = None  # of a run that completes
    fragmented_percent_of_device: float | None = None
    output_tokens_per_second: float | None = None


def run_batch(run, allocate_kv_cache, generate):
    """One run as the script's main() makes it. The cache lives in this frame only, so it is
    freed on return, or with the traceback when the run fails."""
    cache, manager = allocate_kv_cache(run)
    generation = generate(run, cache, manager, progress=True)
    return generation, memory_report(run, cache, manager, generation)


def attempt(run, num_requests: int, allocate_kv_cache, generate) -> Attempt:
    """One run of the first `num_requests` prompts, in this process."""
    args = dataclasses.replace(run.args, num_requests=num_requests)
    per_prompt = run.num_sequences // len(run.prompts)
    batch = dataclasses.replace(run, args=args, prompts=run.prompts[:num_requests],
                                num_sequences=num_requests * per_prompt)
    print(f"  N={num_requests:<6,} running ...", flush=True)  # a bar shows its decode steps
    start = time.perf_counter()
    try:
        generation, memory = run_batch(batch, allocate_kv_cache, generate)
        result = Attempt(num_requests, "completes", 0.0, memory["kv_pool_blocks"],
                         memory["block_size_tokens"], memory["fragmented_bytes"],
                         memory["fragmented_percent_of_device"], generation.num_generated_tokens
                         / (generation.prefill_seconds + generation.decode_seconds))
    except OutOfBlocks as e:
        result = Attempt(num_requests, f"out of KV {e.unit}", 0.0, kv_pool_blocks=e.total,
                         block_size=e.block_size)
    except torch.OutOfMemoryError:
        result = Attempt(num_requests, "out of memory", 0.0)
    except UserError as e:
        if e.exit_code != OUT_OF_MEMORY:
            raise
        result = Attempt(num_requests, "out of memory", 0.0)
    gc.collect()  # the failed run's tensors, held by its traceback until now
    if run.device.type == "cuda":
        # cuBLAS keeps a workspace for every stream that ran a matmul, the CUDA graphs' capture
        # stream too (32 MiB on Hopper): a fresh process has none for it when it sizes its pool
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    result.seconds = time.perf_counter() - start
    pool = f", pool of {result.kv_pool_blocks:,} blocks" if result.kv_pool_blocks else ""
    fragmented = (f", Fragmented Memory {format_bytes(result.fragmented_bytes)} "
                  f"({result.fragmented_percent_of_device:.2f}%)"
                  if result.fragmented_bytes is not None else "")
    print(f"  N={num_requests:<6,} {result.outcome} in {result.seconds:.1f} s{pool}{fragmented}",
          flush=True)
    return result


def find_max_batch(run, allocate_kv_cache, generate) -> None:
    """Print (and write to --json) the largest n <= N, the command line's, whose run completes;
    0 if not even one request fits. `allocate_kv_cache` is the script's."""
    upper, replayable = run.args.num_requests, lengths_known(run)
    search = "Replaying and bisecting" if replayable else "Bisecting"
    print(f"{search} for the largest batch of at most {upper:,} requests that completes:")
    attempts = [attempt(run, upper, allocate_kv_cache, generate)]
    fits, fails = (upper, upper + 1) if attempts[-1].outcome == "completes" else (0, upper)
    while fails - fits > 1:  # invariant: `fits` completes (0 trivially), `fails` does not
        last = attempts[-1]
        predicted = (fits_in_pool(run, last.kv_pool_blocks, last.block_size)
                     if replayable and last.kv_pool_blocks else None)
        n = next_attempt(fits, fails, predicted)
        attempts.append(attempt(run, n, allocate_kv_cache, generate))
        fits, fails = (n, fails) if attempts[-1].outcome == "completes" else (fits, n)
    runs = f"{len(attempts)} run{'s' if len(attempts) > 1 else ''}"
    print(f"Largest batch that completes: {fits:,} requests "
          f"({runs}, {sum(a.seconds for a in attempts):.0f} s)")
    if run.args.json:
        write_json(run.args, {"script": run.args.script, "largest_batch_that_completes": fits,
                                "attempts": [dataclasses.asdict(a) for a in attempts]})
    if fits == 0:
        raise UserError(f"Not even one request completes: the first alone ran {attempts[-1].outcome}. "
                        f"Give the KV cache more memory (--kv-budget-gb, or "
                        f"--gpu-memory-utilization on a GPU), or ask for less: a smaller "
                        f"--max-seq-len (naive), --block-size or --model.", OUT_OF_MEMORY)


def next_attempt(fits: int, fails: int, predicted: int | None) -> int:
    """The replay's boundary if it lies between what completed and what did not, else the batch
    just past it (which should not complete), else bisection's middle."""
    for n in ([predicted, predicted + 1] if predicted is not None else []):
        if fits < n < fails:
            return n
    return (fits + fails) // 2


def lengths_known(run) -> bool:
    """Whether a replay can say what a batch needs: the paged script's static batch, random
    weights (each request grows to its reply's length, inputs.new_token_budgets), and each prompt
    its own blocks (no samples, beams or prefix cache sharing them)."""
    return (run.args.cache == "paged" and run.args.random_weights
            and run.num_sequences == len(run.prompts) and run.system_prompt is None)


def fits_in_pool(run, pool_blocks: int, block_size: int) -> int:
    """The largest n whose first n requests, admitted at once, never hold more than pool_blocks
    blocks of block_size: the lesson's static batch replayed without a model. A request of p
    prompt tokens and a budget of b new tokens holds ceil((p + k) / block_size) blocks at step k,
    for k = 0 (admitted, its prompt cached) to b - 1 (the step that makes its last token)."""
    budgets = inputs.new_token_budgets(run)
    demand = np.zeros(max(budgets), dtype=np.int64)  # [steps]: blocks held at each step
    for n, (prompt, budget) in enumerate(zip(run.prompts, budgets)):
        demand[:budget] += -(-(len(prompt.prompt_tokens) + np.arange(budget)) // block_size)
        if demand.max() > pool_blocks:
            return n
    return len(run.prompts)
