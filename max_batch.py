"""--find-max-batch: the largest batch that completes, found by bisection over real runs.

Attempt n runs the first n prompts with the other flags as given, in this process, and frees
everything it allocated before the next attempt. Batch n + 1 holds batch n's requests and one
more, so if n does not fit, nothing larger does: bisection finds the boundary in about log2(N)
runs. The naive script's limit comes from max_seq_len alone; the paged one's from how long the
requests really grow, which only a real run shows.
"""

import argparse
import dataclasses
import gc
import time

import torch

from block_manager import OutOfBlocks
from errors import OUT_OF_MEMORY, UserError
from report import GB


@dataclasses.dataclass
class Attempt:
    num_requests: int
    outcome: str  # "completes", "out of KV blocks" or "out of GPU memory"
    seconds: float
    kv_pool_blocks: int | None = None  # the paged pool is sized anew each attempt
    fragmented_bytes: int | None = None  # of a run that completes
    fragmented_percent_of_device: float | None = None
    output_tokens_per_second: float | None = None


def attempt(setup, num_requests: int, generate_answers) -> Attempt:
    args = argparse.Namespace(**vars(setup.args) | {"num_requests": num_requests})
    batch = dataclasses.replace(setup, args=args, requests=setup.requests[:num_requests])
    start = time.perf_counter()
    try:
        generation, memory = generate_answers(batch)
        result = Attempt(num_requests, "completes", 0.0, memory["kv_pool_blocks"],
                         memory["fragmented_bytes"], memory["fragmented_percent_of_device"],
                         generation.generated_tokens
                         / (generation.prefill_seconds + generation.decode_seconds))
    except OutOfBlocks as e:
        result = Attempt(num_requests, "out of KV blocks", 0.0, kv_pool_blocks=e.total)
    except torch.OutOfMemoryError:
        result = Attempt(num_requests, "out of GPU memory", 0.0)
    except UserError as e:
        if e.exit_code != OUT_OF_MEMORY:
            raise
        result = Attempt(num_requests, "out of GPU memory", 0.0)
    gc.collect()  # the failed run's tensors, held by its traceback until now
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    result.seconds = time.perf_counter() - start
    pool = f", pool of {result.kv_pool_blocks:,} blocks" if result.kv_pool_blocks else ""
    fragmented = (f", Fragmented Memory {result.fragmented_bytes / GB:.2f} GB "
                  f"({result.fragmented_percent_of_device:.2f}%)" if result.fragmented_bytes is not None else "")
    print(f"  N={num_requests:<6,} {result.outcome} in {result.seconds:.1f} s{pool}{fragmented}",
          flush=True)
    return result


def find_max_batch(setup, generate_answers) -> tuple[int, list[Attempt]]:
    """Largest n <= N (the command line's) whose run completes; 0 if not even one request fits.
    `generate_answers(setup)` is one run, raising when it runs out of memory."""
    upper = setup.args.num_requests
    print(f"Bisecting for the largest batch of at most {upper:,} requests that completes:")
    attempts = [attempt(setup, upper, generate_answers)]
    fits, fails = (upper, upper + 1) if attempts[-1].outcome == "completes" else (0, upper)
    while fails - fits > 1:  # invariant: `fits` completes (0 trivially), `fails` does not
        middle = (fits + fails) // 2
        attempts.append(attempt(setup, middle, generate_answers))
        fits, fails = (middle, fails) if attempts[-1].outcome == "completes" else (fits, middle)
    print(f"Largest batch that completes: {fits:,} requests "
          f"({len(attempts)} runs, {sum(a.seconds for a in attempts):.0f} s)")
    return fits, attempts
