"""How close the scripts come to the GPU's limits, on a fixed workload.

    python tools/bench.py paged                  # workload W through llama3_paged.py's cache
    python tools/bench.py naive                  # the same W through llama3_naive.py's cache
    python tools/bench.py paged --attn torch     # W with the PyTorch reference attention
    python tools/bench.py paged --workload W2    # W2: a stream of 2,000 requests, --continuous
    python tools/bench.py paged --workload W2 --system-prompt-file system_prompt.txt
                                                 # W2 after a shared system prompt, cached once
    python tools/bench.py virtual --workload P   # P: prefill-heavy, 4,096-token prompts

Workload W: the first 256 prompts of sharegpt_filtered.json, chat-formatted; exactly 256 new
tokens each, greedy, end-of-text ignored; random 8b weights in bf16 (--model: other shapes;
smollm2, its real weights); --max-seq-len 1536 (so the naive caches fit); flash-attn; one static
batch. Workload W2: the first 2,000 prompts, each
generating its ShareGPT reply's length (at most 2,048), end-of-text ignored, --max-seq-len 8192,
the default memory utilization, continuous batching. Workload P (prefill-heavy, vAttention's
case): 256 prompts of exactly 4,096 tokens, ShareGPT's turns one after another cut to length,
16 new tokens each, --max-seq-len 4224, continuous batching. Every flag changes one part of one.

The floor (a roofline): a decode step of B tokens must compute its projections, B x ~15 GFLOP for
8B, and read every weight once: whichever takes longer, at the bf16 matmul rate and the copy
bandwidth measured here, on this GPU. It must also read the K/V of every token cached so far.
The prefill must compute the prompts' FLOPs at the matmul rate. The workload's floor is the
prefill's and every decode step's added up, and each measured figure is set against its own.
GPU work is timed with CUDA events after a warm-up; figures are medians.

Also a CPU micro-benchmark of the scheduler's and block manager's bookkeeping per decode step
with 1,000 requests running: the host work a step needs before the GPU can start it.
"""

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("bench.py")  # before torch loads

from plumbing.cli import MODELS, UserError, kv_cache_dtype, writable_file

import numpy as np
import torch

from block_manager import BlockManager
from engine.attention_metadata import AttentionMetadata, Phase
from engine.request import EngineRequest, append_tokens_at
from engine.engine_core import EngineCore
from engine.model_runner import greedy
from plumbing.inputs import TOKENS_PER_PASS
from llama3_paged import Llama
from features.arrivals import latency_report
from engine.scheduler import Scheduler
from features.virtual.mapping_ahead import MappingAheadManager, mapping_seconds
from plumbing.cli import (HelpFormatter, first_paragraph, fraction,
                          one_paragraph_errors, positive_int, refuse_output_over_input,
                          request_rate, sequence_length, write_atomically)
from plumbing.inputs import PROMPTS_FILE, REBUILD, read_records
from plumbing.cli import GB, torchrun_process
from plumbing.cli import standard_json
from engine.report import scheduling_report, sharing_report
from plumbing.inputs import DTYPES, shapes_only
from engine.config import CACHES, Config, add_fast_path_arguments, logprobs_count
from engine.loader import decode_kernel, load
from engine.build import (allocate_kv_cache, arrival_times, decodes_with_graphs, make_runner,
                          make_scheduler, model_forward, warm_up)
from tools.kernel_profile import profile_engine
from tools.shared import (ClockSampler, as_graph, clock_line, collective_seconds_per_step,
                          copy_bandwidth, matmul_flops_per_second, median_cuda_seconds,
                          write_profile)

WORKLOADS = {  # what each flag left unset takes
    "W": dict(num_requests=256, new_tokens=256, sharegpt_replies=False, max_seq_len=1536,
              continuous=False, prompt_tokens=None),
    "W2": dict(num_requests=2000, new_tokens=2048, sharegpt_replies=True, max_seq_len=8192,
               continuous=True, prompt_tokens=None),
    "P": dict(num_requests=256, new_tokens=16, sharegpt_replies=False, max_seq_len=4224,
              continuous=True, prompt_tokens=4096),
    # nano-vllm's own yardstick (its README's bench.py): random lengths, see nano_vllm_requests
    "N": dict(num_requests=256, new_tokens=1024, sharegpt_replies=False, max_seq_len=2048,
              continuous=True, prompt_tokens=None),
}
NANO_VLLM_LENGTHS = (100, 1024)  # nano-vllm's bench.py: prompt and new tokens, each uniform in
ATTENTION_REQUESTS = 256  # the attention kernel is timed alone on the first 256 requests


def prefill_flops(args, prompt_lens: list[int], cached_lens: list[int] | None = None) -> float:
    """Matmul FLOPs of a prefill: projections on every token computed, the output head on each
    prompt's last token, and causal attention (QK^T and PV over the tokens before each query).
    Tokens a prompt found cached (cached_lens, the prefix cache's) are not computed."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_layer_params = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.ffn_dim
    cached_lens = cached_lens or [0] * len(prompt_lens)
    tokens = sum(prompt_lens) - sum(cached_lens)
    return (2 * per_layer_params * tokens * args.n_layers
            + causal_attention_flops(args, prompt_lens, cached_lens)
            + 2 * args.dim * args.vocab_size * len(prompt_lens))


def causal_attention_flops(args, prompt_lens: list[int], cached_lens: list[int]) -> float:
    """QK^T and PV of a prefill, every layer: the query at position t meets t + 1 keys."""
    return args.n_layers * sum(2 * args.n_heads * args.head_dim * (n * (n + 1) - c * (c + 1))
                               for n, c in zip(prompt_lens, cached_lens))


def decode_flops_per_token(args) -> float:
    """Matmul FLOPs to decode one token: every projection once, and the output head over the
    vocabulary. (Attention's, 4 x n_heads x head_dim per cached token, are left out: reading the
    K/V, not computing on it, is what bounds it.)"""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_layer_params = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.ffn_dim
    return 2 * (per_layer_params * args.n_layers + args.dim * args.vocab_size)


def step_floor_seconds(batch: int, kv_bytes: float, weight_bytes: float, flops_per_token: float,
                       hardware: dict) -> float:
    """The fastest one decode step of `batch` tokens can be on this GPU: the projections take the
    longer of computing their FLOPs at the measured matmul rate and reading every weight at the
    measured bandwidth (small batches are bound by the reading, large ones by the computing), and
    the K/V must be read besides."""
    projections = max(batch * flops_per_token / hardware["matmul_flops_per_second"],
                      weight_bytes / hardware["copy_bandwidth_bytes_per_second"])
    return projections + kv_bytes / hardware["copy_bandwidth_bytes_per_second"]


def profile_floor(args, prompts: list[list[int]], budgets: list[int], kv_bytes_per_token: float,
                  weight_bytes: float, hardware: dict) -> dict:
    """The floor of tools/kernel_profile.py's two profiled runs, by kernel class: the least the
    matmuls and the attention can take at the measured rates; every other class's is 0, as if
    fused away. Prefill: the prompts' projection and causal-attention FLOPs at the matmul rate.
    Decode, per decoded token: the requests decoding together from the first step (both engines
    hold these few hundred at once), each step's projections as step_floor_seconds counts them,
    and each request's cached K/V (its prompt and the tokens so far) read at the copy bandwidth."""
    lens, rate = [len(p) for p in prompts], hardware["matmul_flops_per_second"]
    bandwidth = hardware["copy_bandwidth_bytes_per_second"]
    attention_flops = causal_attention_flops(args, lens, [0] * len(lens))
    per_token, projections, kv_tokens = decode_flops_per_token(args), 0.0, 0
    for step in range(1, max(budgets)):  # decode step `step` draws each one's token step + 1
        decoding = [n for n, b in zip(lens, budgets) if b > step]
        projections += step_floor_seconds(len(decoding), 0, weight_bytes, per_token, hardware)
        kv_tokens += sum(decoding) + step * len(decoding)  # the newest token's K/V included
    decoded = max(sum(budgets) - len(budgets), 1)
    return {"prefill_seconds": {"matmul": (prefill_flops(args, lens) - attention_flops) / rate,
                                "attention": attention_flops / rate},
            "decode_seconds_per_token": {"matmul": projections / decoded,
                                         "attention": kv_tokens * kv_bytes_per_token
                                         / bandwidth / decoded}}


def weight_bytes_read_per_step(model) -> int:
    """Every weight, except that the embedding table gives only the batch's rows (unless it is
    also the output head)."""
    total = sum(p.nbytes for p in model.parameters())  # tied weights counted once
    return total if model.args.tie_embeddings else total - model.tok_embeddings.weight.nbytes


def gpu_wait_seconds_per_step(generation) -> float:
    """Mean time per decode step that the GPU spends waiting for the host: the decode steps' wall
    time less their GPU time (CUDA events around each step's kernels). What is left is the host
    work between steps (scheduling, bookkeeping, the copy of the tokens back) that the GPU does
    not overlap with anything."""
    steps = generation.timeline
    if not steps:
        return 0.0
    return max(generation.decode_seconds - sum(s.seconds for s in steps), 0.0) / len(steps)


def bookkeeping_seconds_per_step(block_size: int, running: int = 1000, steps: int = 500) -> float:
    """Median host time of the scheduler's part of a decode step, as generate runs it: a slot
    for every running request (a new block only at a boundary), then the blocks of those that
    finish back to the pool. Requests wait in the queue to take their places, so that `running`
    stay running. On the CPU, as the scripts do it between two GPU steps. Recording each
    request's new token (engine/request.py's append_tokens_at) happens between the two and is not counted."""
    rng = np.random.default_rng(0)
    n = 4 * running
    prompt_lens, limits = rng.integers(1, 1000, n), rng.integers(1, 1000, n)
    manager = BlockManager(num_blocks=running * 2048 // block_size, block_size=block_size,
                           max_requests=n, max_blocks_per_request=2048 // block_size)
    requests = [EngineRequest(r, [0] * int(p), int(g)) for r, (p, g) in enumerate(zip(prompt_lens, limits))]
    scheduler = Scheduler(manager, requests, True, running, TOKENS_PER_PASS)
    times = []
    while scheduler.has_work() and len(times) < steps:
        start = time.perf_counter()
        step = scheduler.schedule()
        scheduling = time.perf_counter() - start
        done = append_tokens_at(step.requests, np.zeros(len(step.requests), dtype=np.int64), (), 0.0)
        start = time.perf_counter()
        scheduler.finish(done)
        if step.kind == "decode":  # admissions are a prefill's host work
            times.append(scheduling + time.perf_counter() - start)
    return statistics.median(times)


def attention_seconds_per_layer(setup, cache, lengths: list[int]) -> tuple[float, int]:
    """One layer's decode attention alone, for requests cached to `lengths` (as many of the
    first as the pool holds), over the pool's current contents: the cache's own decode call
    (a float8 cache's with its scales), without the rest of the step. Returns the seconds and
    how many requests it took. Replayed as a CUDA graph where the engine's decode step is one, so
    that Python's time to launch a Triton kernel, longer than the kernel's own on W, is not
    counted as the kernel's."""
    block_size, device = cache.block_size, setup.device
    manager = BlockManager(cache.num_blocks, block_size, len(lengths),
                           -(-max(lengths) // block_size), device)
    fitting = []
    for r, n in enumerate(lengths):
        if manager.blocks_needed(n) > manager.num_free_blocks:
            break
        manager.allocate(EngineRequest(r, [0] * n, 1))
        fitting.append(n)
    lengths = fitting
    args = setup.model.args
    q = torch.randn(len(lengths), args.n_heads, args.head_dim, dtype=setup.dtype, device=device)
    batch = AttentionMetadata(Phase.DECODE, None, block_table=manager.block_table[:len(lengths)],
                              cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                                         device=device),
                              max_cache_seqlen=max(lengths))

    def attend():
        return cache.decode_attention(0, q, batch)
    seconds = median_cuda_seconds(as_graph(attend) if decodes_with_graphs(setup) else attend)
    return seconds, len(lengths)


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("script", choices=CACHES,
                   help="whose KV cache: llama3_naive.py's, llama3_paged.py's or llama3_virtual.py's")
    p.add_argument("--workload", choices=WORKLOADS, default="W",
                   help="W static, W2 stream, P long, N nano-vllm's (docs/speed.md)")
    p.add_argument("--num-requests", type=positive_int, help="default: the workload's")
    p.add_argument("--new-tokens", type=positive_int,
                   help="tokens generated per request (default: the workload's)")
    p.add_argument("--prompt-tokens", type=positive_int,
                   help="every prompt this long, ShareGPT cut to length (default: as is)")
    p.add_argument("--sharegpt-replies", action="store_true", default=None,
                   help="each request generates its ShareGPT reply's length, at most --new-tokens")
    p.add_argument("--max-seq-len", type=sequence_length, help="default: the workload's")
    p.add_argument("--continuous", action="store_true", default=None,
                   help="continuous batching (W2 always has it)")
    p.add_argument("--max-running", type=positive_int, help="with --continuous")
    p.add_argument("--max-batched-tokens", type=positive_int, metavar="TOKENS",
                   help="with --continuous: mixed steps of at most this many tokens")
    p.add_argument("--request-rate", type=request_rate, default=math.inf, metavar="R",
                   help="with --continuous: requests arrive at R per second (Poisson)")
    p.add_argument("--gpu-memory-utilization", type=fraction,
                   help="share of the GPU for weights, activations and K/V (default: 0.9)")
    p.add_argument("--block-size", type=positive_int, default=256, help="paged only")
    p.add_argument("--layout", choices=["per-token", "per-layer"], default="per-token",
                   help="virtual only")
    p.add_argument("--sync-mapping", action="store_true",
                   help="virtual only: map pages in the loop, not ahead on a background thread")
    p.add_argument("--attn", choices=["flash", "triton", "torch"], default="flash",
                   help="the attention kernels (triton: ours for prefill and decode)")
    p.add_argument("--decode-kernel", choices=["auto", "flash", "triton"], default="auto",
                   help="paged, flash-attn: the decode kernel (auto: the faster)")
    add_fast_path_arguments(p)
    p.add_argument("--system-prompt-file", type=Path, metavar="PATH",
                   help="a system turn before every prompt (system_prompt.txt: about 1,000 tokens)")
    p.add_argument("--no-prefix-cache", action="store_true", help="paged only")
    p.add_argument("--cascade", choices=["auto", "on", "off"], default="auto",
                   help="paged, with a system prompt: read its blocks once a step")
    p.add_argument("--model", choices=MODELS, default="8b",
                   help="random weights of these shapes; smollm2: its real weights")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                   help="of the weights and the K/V")
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype, default="auto", metavar="{auto,fp8}",
                   help="fp8 (fp8_e4m3): K/V in float8, decoded by the Triton kernel")
    p.add_argument("-q", "--quantization", choices=["fp8"],
                   help="fp8: the projections' weights in float8 (features/fp8/weights.py)")
    p.add_argument("--logprobs", type=logprobs_count, metavar="K",
                   help="every request asks for its tokens' log-probabilities and the top K")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write every figure here")
    p.add_argument("--profile", type=writable_file, metavar="PATH",
                   help="kernel time by class, to PATH (tools/kernel_profile.py)")
    a = p.parse_args(argv)
    for name, value in WORKLOADS[a.workload].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    return a


def script_arguments(bench_args):
    """The same run as the script's command line would set it up."""
    a = bench_args
    options = dict(random_weights=a.model != "smollm2",  # SmolLM2's weights are real (its GGUF)
                   model=a.model, dtype=a.dtype, attn=a.attn, max_seq_len=a.max_seq_len,
                   max_new_tokens=a.new_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
                   kv_cache_dtype=a.kv_cache_dtype, eager=a.eager, compile=a.compile,
                   overlap=a.overlap, continuous=a.continuous, max_running=a.max_running,
                   max_batched_tokens=a.max_batched_tokens, request_rate=a.request_rate,
                   system_prompt_file=a.system_prompt_file, logprobs=a.logprobs,
                   quantization=a.quantization)
    if a.script == "paged":
        options |= dict(block_size=a.block_size, no_prefix_cache=a.no_prefix_cache,
                        cascade=a.cascade, decode_kernel=a.decode_kernel)
    if a.script == "virtual":
        options |= dict(layout=a.layout, sync_mapping=a.sync_mapping)
    return Config.from_options(a.script, options, num_requests=a.num_requests)


def long_prompts(tokenizer, num_requests: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts of exactly prompt_tokens tokens: begin-of-text, then the text of ShareGPT's turns
    (questions and replies, one conversation after another) cut into pieces."""
    needed, stream = num_requests * (prompt_tokens - 1), []
    for i, conversation in enumerate(read_records(PROMPTS_FILE)):
        try:
            stream += [t for turn in conversation["conversations"] for t in tokenizer.encode(turn["value"])]
        except (KeyError, TypeError) as e:
            raise UserError(f"Record {i} of {PROMPTS_FILE} has no conversation of texts. "
                            f"{REBUILD}") from e
        if len(stream) >= needed:
            break
    else:
        raise UserError(f"{PROMPTS_FILE.name} holds {len(stream):,} tokens, fewer than "
                        f"{num_requests:,} prompts of {prompt_tokens:,}: ask for fewer.")
    piece = prompt_tokens - 1
    return [[tokenizer.bos_id] + stream[i * piece:(i + 1) * piece] for i in range(num_requests)]


def workload_requests(prompts, tokenizer, a) -> tuple[list[list[int]], list[int]]:
    """The workload's prompts (token ids) and new tokens per request, from plumbing/inputs.py's
    Prompts (or long_prompts with --prompt-tokens): exactly --new-tokens, or each ShareGPT
    reply's length (at most --new-tokens, and no further than --max-seq-len)."""
    if a.workload == "N":
        return nano_vllm_requests(a.num_requests)
    if a.prompt_tokens:
        tokens = long_prompts(tokenizer, a.num_requests, a.prompt_tokens)
        return tokens, [min(a.new_tokens, a.max_seq_len - a.prompt_tokens)] * len(tokens)
    tokens = [p.prompt_tokens for p in prompts]
    if not a.sharegpt_replies:
        return tokens, [a.new_tokens] * len(tokens)
    return tokens, [min(p.num_reply_tokens, a.new_tokens, a.max_seq_len - len(p.prompt_tokens))
                    for p in prompts]


def nano_vllm_requests(num_requests: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's README benchmark, as its bench.py draws it (Python's random, seed 0): prompts
    of random token ids below 10,000, lengths uniform in NANO_VLLM_LENGTHS, then each request's
    new tokens from the same range (end-of-text ignored: random weights have no stop token)."""
    rng, (low, high) = random.Random(0), NANO_VLLM_LENGTHS
    prompts = [[rng.randint(0, 10_000) for _ in range(rng.randint(low, high))]
               for _ in range(num_requests)]
    return prompts, [rng.randint(low, high) for _ in range(num_requests)]


def bench(a) -> dict:
    config = script_arguments(a)
    setup = load(config)  # under torchrun: this process's GPU and slice of the model
    a.decode_kernel = decode_kernel(config)  # as engine/loader.py resolves it (auto: its table)
    process = torchrun_process()
    writes = process is None or process[0] == 0  # rank 0 writes, as it prints
    if not writes:
        a.json = None
    # What it is doing, on stderr (the table goes to stdout): a run is minutes of silence otherwise
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if writes else (lambda text: None)
    say("Measuring the copy bandwidth and the matmul rate; capturing CUDA graphs ...")
    bandwidth = copy_bandwidth(setup.device)
    matmul_rate = matmul_flops_per_second(setup.device, DTYPES[a.dtype])
    sixteen_bit = {"matmul_flops_per_second": matmul_rate, "copy_bandwidth_bytes_per_second": bandwidth}
    if a.quantization:  # float8 weights: the floor of float8 matmuls, the 16-bit one beside it
        matmul_rate = matmul_flops_per_second(setup.device, torch.float8_e4m3fn)
    hardware = {"matmul_flops_per_second": matmul_rate, "copy_bandwidth_bytes_per_second": bandwidth}
    weights_read = weight_bytes_read_per_step(setup.model)
    a.compile = setup.args.compile  # as the flags resolved it: on by default unless --eager
    cache, manager = allocate_kv_cache(setup, served=True)  # as a served engine's pool
    runner = make_runner(setup, model_forward(setup), cache, manager, greedy,
                         min(len(setup.prompts), a.max_running or len(setup.prompts)),
                         arrivals=not math.isinf(a.request_rate))
    prompts, budgets = workload_requests(setup.prompts, setup.tokenizer, a)

    def run(prompts, budgets, arrivals=None):
        arrivals = arrivals or [0.0] * len(prompts)
        requests = [EngineRequest(r, p, min(b, a.max_seq_len - len(p)), arrival_time=t)
                    for r, (p, b, t) in enumerate(zip(prompts, budgets, arrivals))]
        return EngineCore(runner, make_scheduler(setup, cache, manager, requests)).generate(False)
    # Warm-up: kernels chosen, caches filled. Prompts the run does not share, so that it finds
    # nothing of its own in the prefix cache.
    say("Warming up: each kind of pass once (compiling the layers: tens of seconds on a first run) ...")
    run([[1] * len(p) for p in prompts[:8]], [16] * min(8, len(prompts)))
    warm_up(lambda prompts: run(prompts, [16] * len(prompts)),  # each kind of pass
            a.compile, cache, manager, a.max_seq_len, 16)
    torch.cuda.synchronize()
    mapping_before = mapping_seconds(cache, manager) if a.script == "virtual" else None
    say(f"Timing workload {a.workload}: {len(prompts):,} requests, {sum(budgets):,} new tokens ...")
    sampler, start = ClockSampler(), time.perf_counter()
    result = run(prompts, budgets, arrival_times(setup.args, len(prompts)))
    torch.cuda.synchronize()
    wall, clocks = time.perf_counter() - start, sampler.stop()
    if result.num_generated_tokens != sum(budgets):
        raise UserError(f"{result.num_generated_tokens} tokens generated, {sum(budgets)} asked for: "
                        f"raise --max-seq-len so that every prompt has room for its new tokens.")
    if a.profile:  # after the timed run, on the workload's first requests; under torchrun
        # every process runs them (their collectives pair up) and rank 0 writes
        generated = lambda prompts, budgets: run(prompts, budgets).num_generated_tokens
        floor = lambda prompts, budgets: profile_floor(
            setup.model.args, prompts, budgets, setup.kv_bytes_per_token, weights_read, hardware)
        say("Profiling the workload's first requests (torch.profiler) ...")
        profile = profile_engine(generated, prompts, budgets, floor)
        if writes:
            fp8 = ", fp8 weights" if a.quantization else ""  # a column beside the bf16 one
            write_profile(a.profile, f"ours ({a.script}{fp8})", a.workload, profile)

    # The paged attention kernel alone, halfway through: each request at its prompt + half its
    # tokens. (The virtual cache's rows are not blocks: its step time says what its kernel costs.)
    attention_seconds, attention_requests = attention_seconds_per_layer(
        setup, cache, [len(p) + b // 2 for p, b in zip(prompts, budgets)][:ATTENTION_REQUESTS]
    ) if a.script != "virtual" else (None, 0)
    mapping = None
    if a.script == "virtual":  # host seconds per decode step, on the critical path and off it
        after = mapping_seconds(cache, manager)
        mapping = {key: (after[key] - mapping_before[key]) / len(result.timeline) for key in after}
        if isinstance(manager, MappingAheadManager):
            manager.close()
    kv_bytes_per_token = setup.kv_bytes_per_token
    per_token = decode_flops_per_token(setup.model.args)
    floors = [step_floor_seconds(s.running_requests, s.filled_slots * kv_bytes_per_token,
                                 weights_read, per_token, hardware) for s in result.timeline]
    by_time = sorted(range(len(result.timeline)), key=lambda i: result.timeline[i].seconds)
    median_step = by_time[len(by_time) // 2]
    step_seconds = result.timeline[median_step].seconds
    # At the median batch (the same on every process, as their schedules are: their collectives
    # must pair up; the median step by time is each process's own)
    collectives = (collective_seconds_per_step(
        setup.model.args, statistics.median_low(s.running_requests for s in result.timeline),
        setup.dtype, setup.device)
        if process is not None and torch.distributed.get_backend() == "nccl" else None)
    # What each prompt found cached when first admitted (prefix caching), not to be computed.
    first_cached = getattr(manager, "first_cached", np.zeros(len(prompts), dtype=np.int64))
    cached = np.maximum(first_cached[:len(prompts)], 0).tolist()
    flops = prefill_flops(setup.model.args, [len(p) for p in prompts], cached)
    sharing = sharing_report(setup, manager, result)  # what the scripts report, from the same run
    scheduling = scheduling_report(result, a.continuous)
    # Recomputation prefills more than the prompts less what they found cached: then those FLOPs
    # are not the work done.
    # Mixed steps compute prompt chunks inside decode steps: prefill time is not their cost.
    exact = (result.num_prefilled_tokens == sum(len(r.prompt_tokens) for r in result.requests) - sum(cached)
             and not mixed_steps(a))
    prefill_share = flops / result.prefill_seconds / matmul_rate if exact else None
    floor = {"prefill_seconds": flops / matmul_rate, "decode_seconds": sum(floors)}
    return {
        "workload": vars(a) | {"json": str(a.json) if a.json else None,
                               "profile": str(a.profile) if a.profile else None},
        "device": torch.cuda.get_device_name(setup.device),
        "copy_bandwidth_bytes_per_second": bandwidth,
        "matmul_flops_per_second": matmul_rate,
        "cuda_graphs": runner.graphs is not None,
        "num_prompt_tokens": sum(len(r.prompt_tokens) for r in result.requests),
        "num_generated_tokens": result.num_generated_tokens,
        "wall_seconds": wall,
        "output_tokens_per_second": result.num_generated_tokens / wall,
        "clock": clocks,
        "prefill_seconds": result.prefill_seconds,
        "prefill_gpu_seconds": result.prefill_gpu_seconds,
        "prefill_flops": flops,
        "prefill_share_of_matmul_rate": prefill_share,
        "preemptions": scheduling["preemptions"],
        "recomputed_tokens": scheduling["recomputed_tokens"],
        "max_running": result.most_running,
        "latency": latency_report(result.requests) if a.continuous else None,
        "num_prefilled_tokens": result.num_prefilled_tokens,
        "prompt_tokens_from_prefix_cache": sharing["prompt_tokens_from_prefix_cache"],
        "system_prompt_tokens": sharing["system_prompt_tokens"],
        "system_prompt_hit_percent": sharing["system_prompt_hit_percent"],
        "decode_seconds": result.decode_seconds,
        "decode_steps": len(result.timeline),
        "gpu_wait_seconds_per_decode_step": gpu_wait_seconds_per_step(result),
        "gpu_idle_seconds_per_step": result.gpu_idle_seconds / max(result.num_steps, 1),
        "overlap": runner.overlap,
        "median_step": {"step": median_step, "seconds": step_seconds,
                        "running_requests": result.timeline[median_step].running_requests,
                        "weight_bytes": weights_read,
                        "kv_bytes": result.timeline[median_step].filled_slots * kv_bytes_per_token,
                        "floor_seconds": floors[median_step],
                        "ratio_to_floor": step_seconds / floors[median_step],
                        "floor_16_bit_seconds": step_floor_seconds(
                            result.timeline[median_step].running_requests,
                            result.timeline[median_step].filled_slots * kv_bytes_per_token,
                            weight_bytes_read_per_step(shapes_only(Llama, setup.model.args,
                                                                   setup.dtype)),
                            per_token, sixteen_bit) if a.quantization else None},
        "floor": floor | {"wall_seconds": floor["prefill_seconds"] + floor["decode_seconds"]},
        "attention_seconds_per_layer_halfway": attention_seconds,
        "attention_requests": attention_requests,
        "collectives_per_decode_step": collectives,
        "page_mapping_seconds_per_decode_step": mapping,
        "median_ratio_to_floor": statistics.median(
            s.seconds / b for s, b in zip(result.timeline, floors)),
        # Every decode step, in order: its GPU seconds, its batch and its floor, so that two runs
        # of one workload (one schedule) can be set side by side step by step.
        "step_seconds": [s.seconds for s in result.timeline],
        "step_running_requests": [s.running_requests for s in result.timeline],
        "step_floor_seconds": floors,
        "bookkeeping_seconds_per_step_1000_running": {
            str(size): bookkeeping_seconds_per_step(size) for size in sorted({16, a.block_size})},
    }


def mixed_steps(workload) -> bool:
    """Whether the run mixed prompt chunks into decode steps (engine/scheduler.py)."""
    workload = workload if isinstance(workload, dict) else vars(workload)
    return bool(workload["continuous"] and workload["max_batched_tokens"])


def print_table(r: dict) -> None:
    w, m = r["workload"], r["median_step"]
    graphs = ("CUDA graphs" if r["cuda_graphs"] else "eager") + (", compiled" if w["compile"] else "")
    block = (f", block {w['block_size']}" if w["script"] == "paged" else
             f", {w['layout']} rows" if w["script"] == "virtual" else "")
    batching = "continuous" if w["continuous"] else "static"
    decode = " (Triton decode)" if w["decode_kernel"] == "triton" else ""
    if mixed_steps(w):
        batching += f" (mixed steps of {w['max_batched_tokens']:,} tokens)"
    print(f"\n{w['script']}, workload {w['workload']}: {w['num_requests']:,} requests x "
          f"{w['new_tokens']} new tokens{' (ShareGPT reply lengths)' if w['sharegpt_replies'] else ''}, "
          f"{r['num_prompt_tokens']:,} prompt tokens; {w['model']} {'real' if w['model'] == 'smollm2' else 'random'} weights, {w['dtype']}, "
          f"--attn {w['attn']}{decode}, {graphs}{block}, --max-seq-len {w['max_seq_len']}, {batching} "
          f"batching; {r['device']}")
    print(f"  measured: copy bandwidth {r['copy_bandwidth_bytes_per_second'] / 1e12:.2f} TB/s, "
          f"{'float8' if w['quantization'] else w['dtype']} matmul "
          f"{r['matmul_flops_per_second'] / 1e12:.0f} TFLOP/s")
    # The wall beyond the steps' own time: setting the run up, reading its timers, host pauses
    # (before the warm-up froze the heap, a full garbage collection of 0.3 s: docs/fp8.md)
    outside = r["wall_seconds"] - r["prefill_seconds"] - r["decode_seconds"]
    print(f"  wall                {r['wall_seconds']:.2f} s, "
          f"{r['output_tokens_per_second']:,.0f} output tokens/s; "
          f"{outside:.2f} s of it outside the steps")
    print(f"  clock               {clock_line(r['clock'])}")
    share = r["prefill_share_of_matmul_rate"]
    print(f"  prefill             {r['prefill_seconds']:.2f} s ({r['prefill_gpu_seconds']:.2f} s on the GPU)"
          + (f", {r['prefill_flops'] / r['prefill_seconds'] / 1e12:.0f} TFLOP/s = "
             f"{100 * share:.0f}% of the matmul rate" if share else
             f", {r['num_prefilled_tokens']:,} tokens (recomputed or cached: not the prompts')"))
    print(f"  decode              {r['decode_steps']} steps in {r['decode_seconds']:.2f} s; between "
          f"steps the GPU idles {r['gpu_idle_seconds_per_step'] * 1e3:.3f} ms per step "
          f"({'overlapped' if r['overlap'] else 'not overlapped'}: engine/engine_core.py)")
    if r["latency"]:
        mean_p99 = lambda key: (f"{r['latency'][key]['mean'] * 1e3:,.1f} ms (p99 "
                                f"{r['latency'][key]['p99'] * 1e3:,.1f} ms)")
        print(f"  latency             time to first token {mean_p99('time_to_first_token')}; "
              f"between tokens {mean_p99('time_between_tokens')}; normalized "
              f"{mean_p99('normalized_seconds_per_token')} per token")
    print(f"  scheduling          at most {r['max_running']:,} running at once; "
          f"{r['preemptions']:,} preemptions, {r['recomputed_tokens']:,} tokens recomputed")
    print(f"  prefix cache        {r['prompt_tokens_from_prefix_cache']:,} of "
          f"{r['num_prompt_tokens']:,} prompt tokens found cached; "
          f"{r['num_prefilled_tokens']:,} tokens prefilled"
          + (f"; {r['system_prompt_hit_percent']:.1f}% of the {r['system_prompt_tokens']:,}-token "
             f"system prompt's tokens" if r["system_prompt_tokens"] else ""))
    print(f"  median decode step  {m['seconds'] * 1e3:.2f} ms at batch {m['running_requests']}; floor "
          f"{m['floor_seconds'] * 1e3:.2f} ms ({m['weight_bytes'] / GB:.2f} GB weights + "
          f"{m['kv_bytes'] / GB:.2f} GB K/V); {m['ratio_to_floor']:.2f}x the floor")
    if m["floor_16_bit_seconds"]:
        print(f"  16-bit floor        {m['floor_16_bit_seconds'] * 1e3:.2f} ms: the same step with "
              f"{w['dtype']} weights and matmuls (the floor above: float8's, "
              f"{r['matmul_flops_per_second'] / 1e12:.0f} TFLOP/s)")
    f = r["floor"]
    parts = ("prefill and decode share steps" if mixed_steps(w) else
             f"prefill {100 * f['prefill_seconds'] / r['prefill_seconds']:.0f}%, decode "
             f"{100 * f['decode_seconds'] / r['decode_seconds']:.0f}%")
    print(f"  floor               {f['wall_seconds']:.2f} s = prefill {f['prefill_seconds']:.2f} s + "
          f"decode {f['decode_seconds']:.2f} s; the run goes at "
          f"{100 * f['wall_seconds'] / r['wall_seconds']:.0f}% of the floor's speed ({parts})")
    if r["attention_seconds_per_layer_halfway"]:
        print(f"  attention kernel    {r['attention_seconds_per_layer_halfway'] * 1e6:.1f} us per "
              f"layer, the first {r['attention_requests']} requests at their prompt + half their "
              f"new tokens")
    c = r.get("collectives_per_decode_step")
    if c:
        print(f"  collectives         {c['seconds'] * 1e6:,.0f} us per decode step at batch "
              f"{c['rows']} ({c['all_reduces']} all-reduces and the logits' gather over "
              f"{c['processes']} processes, alone as a CUDA graph); floor "
              f"{c['floor_seconds'] * 1e6:,.0f} us: {c['bytes_sent'] / 1e6:,.1f} MB sent at the "
              f"link's {c['bus_bandwidth_bytes_per_second'] / 1e9:,.0f} GB/s")
    mapping = {k: v * 1e3 for k, v in (r["page_mapping_seconds_per_decode_step"] or {}).items()}
    if "in_the_loop" in mapping:
        print(f"  page mapping        {mapping['in_the_loop']:.3f} ms per decode step, in the loop "
              f"(--sync-mapping)")
    elif mapping:
        print(f"  page mapping        {mapping['off_critical_path']:.3f} ms per decode step on the "
              f"thread; the loop waits {mapping['growth']:.3f} ms per step for growing requests' "
              f"pages, {mapping['admission']:.3f} for admitted prompts'")
    for size, seconds in r["bookkeeping_seconds_per_step_1000_running"].items():
        print(f"  scheduler           {seconds * 1e3:.3f} ms per step, 1,000 running, block {size} (CPU)")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("bench.py"):
        refuse_output_over_input(a.json, [PROMPTS_FILE, a.system_prompt_file], "--json")
        refuse_output_over_input(a.profile, [PROMPTS_FILE, a.system_prompt_file, a.json],
                                 "--profile")
        if a.decode_kernel != "auto" and a.script != "paged":
            raise UserError(f"--decode-kernel chooses the kernel that reads paged blocks; the "
                            f"{a.script} cache has none to choose: drop it, or bench paged.")
        if not torch.cuda.is_available():
            raise UserError("needs a CUDA GPU; the figures it reports are GPU limits.")
        result = bench(a)
        if a.json:  # before the table, which a closed pipe may cut short
            text = standard_json(result)
            write_atomically(a.json, lambda path: path.write_text(text))
        print_table(result)


if __name__ == "__main__":
    main()
