"""What a run prints: the answers, throughput, and where the KV cache's memory went.

Reserved: KV slots in blocks owned by running requests. Filled: the reserved slots that hold a
token's K and V. Unfilled: reserved minus filled, memory no one can use until its request ends;
the block manager counts it. Fragmented Memory is the unfilled memory at the step the cache held
the most tokens, in GB (10^9 bytes; MB under a GB) and as a percentage of the device's total
memory, as the original experiment printed it.
"""

import statistics

import numpy as np
import torch

from engine.build import shares_blocks
from engine.seams import plug
from plumbing.cli import format_bytes, per_token, write_json
from plumbing.inputs import device_total_bytes, lengths_note, print_answers


def report(run, cache, manager, generation) -> None:
    """Write --json if asked, then print the first answers and the report: the file first, so
    that a reader who stops reading the output early (`| head`) still gets it."""
    args = run.args
    memory = memory_report(run, cache, manager, generation)
    if run.split:  # the model split over torchrun's processes
        summed = plug("tensor parallelism", "summed_over_processes")(memory, run.device)
        memory["summed_over_processes"] = summed
    throughput = throughput_report(generation)
    scheduling = scheduling_report(generation, args.continuous)
    sharing = sharing_report(run, manager, generation)
    latency = None
    if args.continuous:  # requests that wait in a queue: how long they waited for their tokens
        latency = plug("arrivals", "latency_report")(generation.requests)
    if args.json:
        samples = [(p, k) for p in run.prompts for k in range(args.samples)]  # one per sequence
        write_json(args, {
            "script": args.script,
            "requests": [{"id": p.id, "sample": k, "prompt_tokens": p.prompt_tokens,
                          "output_tokens": r.output_tokens, "arrival_seconds": r.arrival_time,
                          "token_seconds": r.token_times} | logprobs_record(r, args.logprobs)
                         for (p, k), r in zip(samples, generation.requests)],
            "latency": latency,
            "preemptions": scheduling["preemptions"], "max_running": generation.most_running,
            "memory": memory, "throughput": throughput, "scheduling": scheduling,
            "sharing": sharing,
            "timeline": [kv_snapshot_bytes(s, memory["kv_bytes_per_token"]) | {"seconds": s.seconds}
                         for s in generation.timeline]})
    print_answers(run.prompts, generation.output_tokens, run.tokenizer, args.show_all, args.samples)
    print_report(args.script, memory, throughput, scheduling, sharing, latency,
                 lengths_note(run, generation.requests))
    if run.split:
        print(plug("tensor parallelism", "report_line")(memory, run.model))


def logprobs_record(request, k: int | None) -> dict:
    """--logprobs K: each output token's log-probability, rank and the K likeliest as [id,
    log-probability] (features/logprobs/'s rows)."""
    if k is None:
        return {}
    top_of = plug("log-probabilities", "top_of")
    return {"logprobs": [{"logprob": float(row[1]), "rank": int(row[2]),
                          "top": [list(pair) for pair in top_of(row, k)]}
                         for row in request.logprobs]}


def kv_snapshot_bytes(snapshot, kv_bytes_per_token: int) -> dict:
    reserved = snapshot.reserved_slots * kv_bytes_per_token
    unfilled = snapshot.unfilled_slots * kv_bytes_per_token
    return {"step": snapshot.step, "running_requests": snapshot.running_requests,
            "waiting_requests": snapshot.waiting_requests,
            "reserved_bytes": reserved, "filled_bytes": reserved - unfilled,
            "unfilled_bytes": unfilled,
            "unfilled_percent_of_reserved": 100 * unfilled / reserved if reserved else 0.0}


def memory_report(run, cache, manager, generation) -> dict:
    kv_bytes_per_token = run.kv_bytes_per_token  # fp8: half the model dtype's
    total = device_total_bytes(run.device)
    fullest = kv_snapshot_bytes(generation.fullest, kv_bytes_per_token) if generation.timeline else None
    last = kv_snapshot_bytes(generation.timeline[-1], kv_bytes_per_token) if generation.timeline else None
    fragmented = fullest["unfilled_bytes"] if fullest else 0
    weights = sum(p.nbytes for p in run.model.parameters())  # tied weights counted once
    return {
        "device_total_bytes": total,
        "weights_bytes": weights,
        "weights_dtype": ("float8 projections, " if run.args.quantization else "")
                         + str(run.dtype).removeprefix("torch."),
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_pool_bytes": cache.nbytes,
        "kv_pool_blocks": manager.num_blocks,
        "kv_pool_unit": "pages" if run.args.cache == "virtual" else "blocks",
        "block_size_tokens": manager.block_size,
        "peak_allocated_bytes": (torch.cuda.max_memory_allocated(run.device)
                                 if run.device.type == "cuda" else None),
        "at_fullest_step": fullest,
        "at_last_step": last,
        "fragmented_bytes": fragmented,
        "fragmented_percent_of_device": 100 * fragmented / total,
    }


def throughput_report(generation) -> dict:
    g = generation
    decode_tokens = g.num_generated_tokens - len(g.output_tokens)  # the first came from prefill
    return {
        "num_prompt_tokens": sum(len(r.prompt_tokens) for r in g.requests),
        "num_generated_tokens": g.num_generated_tokens,
        "num_prefilled_tokens": g.num_prefilled_tokens,
        "prefill_seconds": g.prefill_seconds,
        "prefill_tokens_per_second": g.num_prefilled_tokens / g.prefill_seconds,
        "decode_seconds": g.decode_seconds,
        "decode_steps": len(g.timeline),
        "decode_step_median_seconds": statistics.median(s.seconds for s in g.timeline)
        if g.timeline else 0.0,
        "decode_tokens_per_second": decode_tokens / g.decode_seconds if g.decode_seconds else 0.0,
        "output_tokens_per_second": g.num_generated_tokens / (g.prefill_seconds + g.decode_seconds),
    }


def scheduling_report(generation, continuous: bool) -> dict:
    g = generation
    waits = [r.admitted_at - r.arrival_time for r in g.requests if r.admitted_at is not None]
    return {
        "mode": "continuous" if continuous else "static",
        "requests_completed": len(waits),
        "max_running": g.most_running,
        # Only continuous batching preempts (engine/scheduler.py).
        "preemptions": g.scheduler.num_preemptions,
        "recomputed_tokens": g.scheduler.num_recomputed_tokens,
        "swapped": g.scheduler.num_swapped,  # --preemption swap
        "queue_wait_median_seconds": statistics.median(waits) if waits else 0.0,
        "queue_wait_max_seconds": max(waits, default=0.0),
    }


def sharing_report(run, manager, generation) -> dict:
    """What sharing blocks saved (features/sharing/block_manager.py): the samples forked, the prompt
    tokens found in the prefix cache, and the KV memory at the fullest step against what the same
    requests would hold with no block shared (the PagedAttention paper's measure, section 6.3).
    Zeros for a manager that shares nothing."""
    g, system = generation, run.num_system_prompt_tokens
    sharing = shares_blocks(run)
    n = len(g.requests)
    forked = manager.forked[:n].tolist() if sharing else [False] * n
    first_cached = np.maximum(manager.first_cached[:n], 0).tolist() if sharing else [0] * n
    prompt_lens = [len(r.prompt_tokens) for r in g.requests]
    computed = [r for r in range(n) if not forked[r]]  # not forked: prefilled
    from_cache = sum(first_cached[r] for r in computed)
    not_forked_tokens = sum(prompt_lens[r] for r in computed)
    system_from_cache = sum(min(first_cached[r], system) for r in computed)
    fullest = g.fullest if g.timeline else None
    reserved = fullest.reserved_slots * run.kv_bytes_per_token if fullest else 0
    unshared = (manager.unshared_slots_at_step[fullest.step] * run.kv_bytes_per_token
                if fullest and sharing else reserved)
    return {
        "block_sharing": sharing,
        "samples_per_prompt": run.args.samples,
        "samples_forked": sum(forked),
        "prompt_tokens_shared_by_forks": sum(n for n, f in zip(prompt_lens, forked) if f),
        "prefix_caching": sharing and manager.prefix_cache is not None,
        # Over the requests not forked, at their first admission:
        "prompt_tokens_from_prefix_cache": from_cache,
        "prefix_cache_hit_percent": 100 * from_cache / not_forked_tokens if not_forked_tokens else 0.0,
        "system_prompt_tokens": system,
        "system_prompt_hit_percent": (100 * system_from_cache / (system * len(computed))
                                      if system and computed else 0.0),
        "block_references_shared": manager.num_shared if sharing else 0,
        "blocks_copied_on_write": manager.num_copied if sharing else 0,
        "at_fullest_step_reserved_bytes": reserved,
        "at_fullest_step_unshared_bytes": unshared,
        "saved_bytes_at_fullest_step": unshared - reserved,
        "saved_percent_at_fullest_step": 100 * (unshared - reserved) / unshared if unshared else 0.0,
    }


def print_report(script: str, memory: dict, throughput: dict, scheduling: dict,
                 sharing: dict, latency: dict | None = None, lengths: str = "") -> None:
    m, t, s = memory, throughput, scheduling
    gb = format_bytes
    print(f"\n=== {script} ===")
    print(f"Tokens: {t['num_prompt_tokens']:,} prompt, {t['num_generated_tokens']:,} generated"
          + (f" ({lengths})" if lengths else ""))
    print(f"Prefill: {t['prefill_tokens_per_second']:,.0f} tokens/s ({t['prefill_seconds']:.2f} s)")
    print(f"Scheduling: {s['mode']}, {s['requests_completed']:,} requests completed, at most "
          f"{s['max_running']:,} running at once; {s['preemptions']:,} preemptions"
          + (f" ({s['swapped']:,} swapped to host memory)" if s["swapped"] else "") + ", "
          f"{s['recomputed_tokens']:,} tokens recomputed; queue wait median "
          f"{s['queue_wait_median_seconds']:.2f} s, longest {s['queue_wait_max_seconds']:.2f} s")
    print(f"Decode: {t['decode_tokens_per_second']:,.0f} tokens/s ({t['decode_steps']:,} steps in "
          f"{t['decode_seconds']:.2f} s, median step {t['decode_step_median_seconds'] * 1e3:.2f} ms); "
          f"end to end {t['output_tokens_per_second']:,.0f} output tokens/s")
    if latency:
        print_latency(latency)
    print(f"Device memory: {gb(m['device_total_bytes'])} total, weights {gb(m['weights_bytes'])} "
          f"({m['weights_dtype']})"
          + (f", peak allocated {gb(m['peak_allocated_bytes'])}" if m["peak_allocated_bytes"] else ""))
    print(f"KV cache: {gb(m['kv_pool_bytes'])} allocated up front = {m['kv_pool_blocks']:,} "
          f"{m['kv_pool_unit']} x {m['block_size_tokens']:,} tokens x "
          f"{per_token(m['kv_bytes_per_token'])} per token")
    for label, step in (("fullest step", m["at_fullest_step"]), ("last step", m["at_last_step"])):
        if step:
            print(f"  at the {label} ({step['step']}, {step['running_requests']} running): reserved "
                  f"{gb(step['reserved_bytes'])}, filled {gb(step['filled_bytes'])}, unfilled "
                  f"{gb(step['unfilled_bytes'])} ({step['unfilled_percent_of_reserved']:.1f}% of "
                  f"reserved)")
    if sharing["block_sharing"]:
        print_sharing(sharing, gb)
    print(f"Fragmented Memory: {format_bytes(m['fragmented_bytes'])} "
          f"({m['fragmented_percent_of_device']:.2f}%)")


def print_latency(latency: dict) -> None:
    """One line: each latency's mean and p99 (features/arrivals.py says what each is)."""
    names = {"time_to_first_token": "time to first token", "time_between_tokens": "between tokens",
             "end_to_end": "end to end", "normalized_seconds_per_token": "normalized"}
    parts = [f"{names[key]} {format_seconds(v['mean'])} (p99 {format_seconds(v['p99'])})"
             + ("/token" if key.startswith("normalized") else "") for key, v in latency.items()]
    print("Latency, mean: " + "; ".join(parts))


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def print_sharing(sh: dict, gb) -> None:
    print(f"Sharing: {sh['samples_per_prompt']} sample(s) per prompt, {sh['samples_forked']:,} "
          f"forked ({sh['prompt_tokens_shared_by_forks']:,} prompt tokens shared, not computed); "
          f"{sh['block_references_shared']:,} block references shared, "
          f"{sh['blocks_copied_on_write']:,} blocks copied on write")
    if sh["prefix_caching"]:
        system = sh["system_prompt_tokens"]
        print(f"  prefix cache: {sh['prompt_tokens_from_prefix_cache']:,} prompt tokens found in "
              f"the pool, not computed: {sh['prefix_cache_hit_percent']:.1f}% of those prefilled"
              + (f"; {sh['system_prompt_hit_percent']:.1f}% of the {system:,}-token system "
                 f"prompt's" if system else ""))
    else:
        print("  prefix cache: off")
    if sh["at_fullest_step_unshared_bytes"]:
        print(f"  at the fullest step: {gb(sh['at_fullest_step_reserved_bytes'])} reserved, against "
              f"{gb(sh['at_fullest_step_unshared_bytes'])} with no block shared: sharing saved "
              f"{gb(sh['saved_bytes_at_fullest_step'])} ({sh['saved_percent_at_fullest_step']:.1f}%)")
