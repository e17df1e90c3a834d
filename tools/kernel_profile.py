"""Where a step's GPU time goes, kernel class by kernel class, ours beside nano-vllm's.

    python tools/bench.py paged --profile ours.json              # ours: W's first 256 requests
    python tools/nano_vllm_bench.py NANO_VLLM_DIR --profile nano.json
    python tools/kernel_profile.py ours.json nano.json           # the table, side by side
    python tools/kernel_profile.py ours.json nano.json --kernels 12   # and each one's largest kernels
    python tools/kernel_profile.py ours.json nano.json --gaps         # and where the GPU waited
    python tools/bench.py paged -q fp8 --profile fp8.json    # FP8 weights, beside bf16's ours.json

Each engine's profile is two runs of the same requests under torch.profiler (CUDA activities):
prefill only (one new token each, which prefill computes) and the whole run (at most
PROFILE_NEW_TOKENS new tokens each, as many profiled steps as the trace can hold). Every kernel
is put in a class by its name (KERNEL_CLASSES, as it reads today: a profile's classes are summed
again from its kernels' names when it is read); the decode part of a class is the whole run's
time less the prefill-only run's, per decoded token, so that two engines stepping differently
are compared per unit of work. "gaps" is the wall time the GPU ran no kernel: waiting for the
host. Kernels replayed inside CUDA graphs are traced one by one, as eager ones are. Each
profiled run's prompts begin with a token no other run's do, so that a prefix cache (nano-vllm's
is always on) finds nothing: both engines compute every prompt token. tools/bench.py's profile
also holds the same requests' floor (matmuls and attention at the rates it measured, nothing for
the other classes), printed as the table's last column.
"""

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("kernel_profile.py")  # before torch loads

import argparse

from plumbing.cli import (HelpFormatter, UserError, first_paragraph, one_paragraph_errors,
                          positive_int)
from tools.arguments import json_file

PROFILE_REQUESTS = 256  # the workload's first requests: a trace of the whole of W2 would not fit
PROFILE_NEW_TOKENS = 64  # new tokens per request at most, in the profiled run
KERNEL_CLASSES = [  # (class, pattern in the kernel's name, lower case): the first match wins
    # Our own Triton kernels are named here too: paged_decode and the cascade's merge_kernel
    # (features/), write_rows (the engine's cache write, 16-bit or float8), rope_kernel (compiled
    # layers' RoPE, under "rope"), swiglu_quantize (down's float8 input), row_stats
    # (log-probabilities), and partial_sums (FP8 weights' split-K matmul, since removed: it is in
    # the profiles of older commits, which comparisons against them read).
    ("fused (torch.compile)", r"^triton_(poi|red|per|tem)_"),  # inductor's generated kernels
    ("collectives (NCCL)", r"nccl"),  # tensor parallelism's all-reduces and gathers
    ("attention", r"flash|fmha|paged_decode|attention|^merge_kernel"),
    ("matmul", r"gemm|cutlass|xmma|cublas|nvjet|sm90_|sm80_|matmul|partial_sums"),
    ("norm", r"rms|norm"),
    ("rope", r"rotary|rope|complex"),
    ("cache write", r"index_copy|store_kvcache|index_put|scatter|write_rows"),
    ("sampling", r"argmax|softmax|multinomial|topk|sort|exponential|distribution|gumbel|row_stats"),
    ("copies", r"memcpy|memset|copy"),
    ("elementwise", r"elementwise|vectorized|reduce|cat_|fill|silu|swiglu|mul|add"),
]
GAPS_KEPT = 10  # of each profiled run: its largest idle gaps (--gaps)
FIRST_TOKENS = (127_000, 127_001)  # of the profiled runs' prompts: no workload's first token
CLASS_ORDER = [name for name, _ in KERNEL_CLASSES] + ["other", "gaps"]


def kernel_class(name: str) -> str:
    name = name.lower()
    return next((cls for cls, pattern in KERNEL_CLASSES if re.search(pattern, name)), "other")


def idle_gaps(kernels: list[tuple[float, float, str]]) -> dict:
    """Where the GPU waited for the host, from its kernels' (start, end, name) in microseconds,
    in any order: the span from the first start to the last end, the idle time inside it, and
    its GAPS_KEPT largest gaps, each with the kernel that ended before it, the one that began
    after it, and when (ms from the span's start). Kernels that overlap (two streams) are one
    busy stretch. The wall time outside the span is the host's before the first launch and
    after the last kernel."""
    kernels = sorted(kernels)
    first, busy_until, last_name = kernels[0]
    gaps = []
    for start, end, name in kernels[1:]:
        if start > busy_until:
            gaps.append({"us": start - busy_until, "after": last_name, "before": name,
                         "at_ms": (busy_until - first) / 1e3})
        if end > busy_until:
            busy_until, last_name = end, name
    return {"span_seconds": (busy_until - first) / 1e6,
            "idle_seconds": sum(gap["us"] for gap in gaps) / 1e6,
            "largest": sorted(gaps, key=lambda gap: -gap["us"])[:GAPS_KEPT]}


def profile_seconds(run) -> dict:
    """run() under torch.profiler: GPU seconds by kernel class, "gaps" (wall time with no kernel
    running), the wall time, and where the GPU sat idle (idle_gaps)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = {}
    for event in trace.key_averages():
        own = getattr(event, "self_device_time_total", None)
        if own is None:  # torch before 2.4 said cuda
            own = event.self_cuda_time_total
        if own > 0:
            kernels[event.key] = own / 1e6
    seconds = seconds_by_class(kernels, gaps=max(wall - sum(kernels.values()), 0.0))
    on_gpu = [(event.time_range.start, event.time_range.end, event.name)
              for event in trace.events() if event.device_type == DeviceType.CUDA]
    return {"seconds": seconds, "wall_seconds": wall, "kernel_seconds": kernels,
            "idle": idle_gaps(on_gpu) if on_gpu else None}


def seconds_by_class(kernel_seconds: dict, gaps: float) -> dict:
    seconds = dict.fromkeys(CLASS_ORDER, 0.0)
    for name, s in kernel_seconds.items():
        seconds[kernel_class(name)] += s
    return seconds | {"gaps": gaps}


def decode_per_token(prefill: dict, whole: dict, decoded: int) -> dict:
    """Each class's (and gaps') time in the whole run less the prefill-only run's, per decoded
    token; never below 0."""
    return {c: max(whole["seconds"][c] - prefill["seconds"][c], 0.0) / max(decoded, 1)
            for c in CLASS_ORDER}


def classed_as_today(profile: dict) -> dict:
    """The profile's classes summed again from its kernels' names by today's KERNEL_CLASSES, so
    that a profile written before one of its kernels was named there shows it in its class.
    Profiles written before kernels were recorded by name keep their classes."""
    if "kernel_seconds" not in profile["prefill"] or "whole" not in profile:
        return profile
    prefill, whole = ({**run, "seconds": seconds_by_class(run["kernel_seconds"],
                                                          run["seconds"]["gaps"])}
                      for run in (profile["prefill"], profile["whole"]))
    return profile | {"prefill": prefill, "whole": whole,
                      "decode_seconds_per_token": decode_per_token(prefill, whole,
                                                                   profile["decoded_tokens"])}


def profile_engine(generate, prompts: list, budgets: list, floor=None) -> dict:
    """The two profiled runs of `generate(prompts, budgets)` (which returns how many tokens it
    generated): prefill only, then the whole, and the decode part per decoded token. With
    `floor(prompts, budgets)` (tools/bench.py's profile_floor), what the same runs take at least,
    by class."""
    prompts = prompts[:PROFILE_REQUESTS]
    budgets = [min(b, PROFILE_NEW_TOKENS) for b in budgets[:PROFILE_REQUESTS]]
    # Each run's prompts begin with a token of its own: a prefix cache (nano-vllm's is always on)
    # must find nothing of an earlier run's, or its prefill would skip what the other computes.
    fresh = lambda run: [[FIRST_TOKENS[run]] + p[1:] for p in prompts]
    prefill = profile_seconds(lambda: generate(fresh(0), [1] * len(prompts)))
    whole = profile_seconds(lambda: generate(fresh(1), budgets))
    decoded = sum(budgets) - len(prompts)  # the first token of each came from prefill
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "decoded_tokens": decoded, "prefill": prefill, "whole": whole,
            "decode_seconds_per_token": decode_per_token(prefill, whole, decoded),
            "decode_kernel_seconds_per_token": {
                name: max(s - prefill["kernel_seconds"].get(name, 0.0), 0.0) / max(decoded, 1)
                for name, s in whole["kernel_seconds"].items()},  # as the classes: never below 0
            "floor": floor(prompts, budgets) if floor else None}


def profile_json(text: str) -> dict:
    record = json_file(text)
    if not (isinstance(record, dict) and isinstance(record.get("profile"), dict)
            and all(isinstance(record["profile"].get(k), dict)
                    for k in ("prefill", "decode_seconds_per_token"))):
        raise argparse.ArgumentTypeError(f"{text} is no --profile JSON of tools/bench.py or "
                                         f"tools/nano_vllm_bench.py")
    return record | {"path": text, "profile": classed_as_today(record["profile"])}


def print_side_by_side(records: list[dict]) -> None:
    names = [r.get("engine", r["path"]) for r in records]
    profiles = [r["profile"] for r in records]
    joined = lambda key: ", ".join(f"{p[key]:,}" for p in profiles)
    devices = ", ".join(f"{n} on {r.get('device', '?')}" for n, r in zip(names, records))
    print(f"Kernel time by class: {devices}")
    print(f"  requests {joined('requests')}; prompt tokens {joined('prompt_tokens')}; decoded "
          f"tokens {joined('decoded_tokens')}")
    # Columns: (name, prefill seconds by class, prefill wall, decode seconds per token by class)
    columns = [(n, p["prefill"]["seconds"], p["prefill"]["wall_seconds"],
                p["decode_seconds_per_token"]) for n, p in zip(names, profiles)]
    # The same requests' floor (tools/bench.py's profile_floor), from the first profile with one
    with_floor = [(n, p["floor"]) for n, p in zip(names, profiles) if p.get("floor")]
    if with_floor:
        measured_by, floor = with_floor[0]
        columns.append(("floor", floor["prefill_seconds"], sum(floor["prefill_seconds"].values()),
                        floor["decode_seconds_per_token"]))
        print(f"  floor: the least these requests' matmuls and attention take at the matmul rate "
              f"and copy bandwidth {measured_by} measured; nothing for the other classes")
    head = "".join(f"{name[:12]:>14}" for name, *_ in columns)
    print(f"\n  {'class':22} prefill, ms{head}   decode, us per token{head}")
    for c in CLASS_ORDER:
        pre = "".join(f"{1e3 * prefill.get(c, 0.0):>14,.1f}" for _, prefill, _, _ in columns)
        dec = "".join(f"{1e6 * decode.get(c, 0.0):>14,.2f}" for *_, decode in columns)
        print(f"  {c:22} {'':11}{pre}   {'':20}{dec}")
    pre = "".join(f"{1e3 * wall:>14,.1f}" for _, _, wall, _ in columns)
    dec = "".join(f"{1e6 * sum(decode.values()):>14,.2f}" for *_, decode in columns)
    print(f"  {'all (wall)':22} {'':11}{pre}   {'':20}{dec}")


def print_largest_kernels(records: list[dict], n: int) -> None:
    """Each profile's n largest kernels by name, decode (per decoded token) and prefill: what
    makes up a class."""
    for record in records:
        profile, name = record["profile"], record.get("engine", record["path"])
        if "decode_kernel_seconds_per_token" not in profile:
            print(f"\n{name}: no kernel names in this profile (written before --kernels): run it "
                  f"again to list them")
            continue
        print(f"\n{name}: its {n} largest kernels in decode (us per decoded token) and prefill (ms)")
        decode = sorted(profile["decode_kernel_seconds_per_token"].items(), key=lambda k: -k[1])
        prefill = sorted(profile["prefill"]["kernel_seconds"].items(), key=lambda k: -k[1])
        for part, kernels, scale in (("decode", decode, 1e6), ("prefill", prefill, 1e3)):
            for kernel, seconds in kernels[:n]:
                print(f"  {part:8}{scale * seconds:>9,.2f}  {kernel_class(kernel)[:12]:12}  "
                      f"{kernel[:64]}")


def print_idle_gaps(records: list[dict]) -> None:
    """Each profiled run's idle GPU time, outside its kernels' span and inside it, and its largest
    gaps between kernels: what the GPU waited for."""
    for record in records:
        name = record.get("engine", record["path"])
        for run in ("prefill", "whole"):
            idle = record["profile"].get(run, {}).get("idle")
            if not idle:
                print(f"\n{name}, {run}: no idle gaps in this profile (written before --gaps): "
                      f"run it again to list them")
                continue
            wall = record["profile"][run]["wall_seconds"]
            print(f"\n{name}, {run} run: wall {1e3 * wall:,.1f} ms; before the first kernel and "
                  f"after the last {1e3 * (wall - idle['span_seconds']):,.1f} ms; idle between "
                  f"kernels {1e3 * idle['idle_seconds']:,.1f} ms, the largest gaps:")
            for gap in idle["largest"]:
                print(f"  {gap['us'] / 1e3:>8,.2f} ms at {gap['at_ms']:>9,.1f} ms  after "
                      f"{gap['after'][:40]:40}  before {gap['before'][:40]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="kernel_profile.py", description=first_paragraph(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("profiles", nargs="+", type=profile_json,
                   help="--profile JSON files of tools/bench.py or tools/nano_vllm_bench.py")
    p.add_argument("--kernels", type=positive_int, metavar="N",
                   help="also list each profile's N largest kernels by name")
    p.add_argument("--gaps", action="store_true",
                   help="also list where each profiled run's GPU sat idle, largest gaps first")
    a = p.parse_args(argv)
    with one_paragraph_errors("kernel_profile.py"):
        if len(a.profiles) > 4:
            raise UserError("At most 4 profiles side by side; give fewer files.")
        print_side_by_side(a.profiles)
        if a.kernels:
            print_largest_kernels(a.profiles, a.kernels)
        if a.gaps:
            print_idle_gaps(a.profiles)


if __name__ == "__main__":
    main()
