"""Runs with features: their flags, and the engine built from the lesson's parts and the
features the flags ask for.

llama3_paged.py is the lesson: a static batch, greedy, decoded kernel by kernel. Each feature is
a file in features/ that extends the lesson's classes. This file is the one place that adds
their flags and picks them, by flag: a script hands its command line here when it names a
flag the lesson does not define, or on CUDA, where two features run by default: decode steps
replayed as CUDA graphs (features/cuda_graphs.py; --eager turns them off) and steps scheduled
while the GPU computes the one before (features/overlap.py; --no-overlap).
"""

import argparse
import dataclasses
from pathlib import Path
import math
import time

import torch

import llama3_naive
import llama3_paged as lesson
from features.request_state import ServedRequest
from features.sharing import SharingBlockManager
from features.cached_prefix import (CachedPrefixEngine, CachingScheduler, FlashAttentionAfterPrefix,
                                    KVCacheAfterPrefix, SamplingDecoder, TorchAttentionAfterPrefix,
                                    greedy)
from features import tensor_parallel
from features.timed_engine import TimedEngine
from plumbing.cli import (GB, OUT_OF_MEMORY, UserError, add_pool_arguments, argument_parser,
                          check_host_memory, format_bytes, fraction, gigabytes, importable,
                          kv_cache_dtype, needs_features, one_paragraph_errors, positive_int,
                          refuse_output_over_input, request_rate, temperature, torchrun_process,
                          writable_file)
from plumbing import inputs
from plumbing.inputs import Run

MAX_BEAM_WIDTH = 1024  # beams per prompt: more than any search uses, far fewer than a vocabulary
SWAP_SPACE_GB = 4.0  # host memory for swapped K/V unless --swap-space says otherwise
MAX_SEQUENCES = 1_000_000  # N x --samples: far more than any GPU holds, few enough to count
GREEDY_BELOW = 1e-5  # a temperature below this is greedy: logits / T would overflow, or make a
                     # softmax as one-hot as the argmax for any two logits 0.001 apart


def add_feature_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of every feature, beside the lesson's (plumbing/cli.py's argument_parser)."""
    p.add_argument("--attn", choices=["auto", "flash", "triton", "torch"], default="auto",
                   help="auto: flash-attn on CUDA (else Triton), torch on the CPU")
    p.add_argument("--samples", type=positive_int, default=1, metavar="K",
                   help="completions per prompt (vLLM's n), sharing its blocks")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0: greedy; above 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-p", type=fraction, default=1.0,
                   help="with --temperature: sample within this top probability")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system-prompt", metavar="TEXT",
                        help="a system turn that begins every request (default: none)")
    system.add_argument("--system-prompt-file", type=Path, metavar="PATH",
                        help="the system turn, from a file (system_prompt.txt: about 1,000 tokens)")
    p.add_argument("--continuous", action="store_true",
                   help="a stream: requests queue, join as blocks free up, are preempted when out")
    p.add_argument("--max-running", type=positive_int,
                   help="with --continuous: most requests running at once")
    p.add_argument("--request-rate", type=request_rate, default=math.inf, metavar="R",
                   help="with --continuous: Poisson arrivals per second")
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                   help="with --continuous: what a preempted request keeps")
    p.add_argument("--swap-space", type=gigabytes, metavar="GB",
                   help="with --preemption swap: host memory for swapped K/V (default: 4)")
    p.add_argument("--max-batched-tokens", type=positive_int, metavar="TOKENS",
                   help="with --continuous: steps that decode and prefill, up to TOKENS tokens")
    p.add_argument("--eager", action="store_true",
                   help="kernel by kernel from Python: no CUDA graphs, no compiled layers")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step while the GPU runs the one before (default: on CUDA)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse small kernels with torch.compile (default: on CUDA unless --eager)")
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype, default="auto", metavar="{auto,fp8}",
                   help="fp8 (or fp8_e4m3): K/V in float8, half the bytes")
    p.add_argument("--find-max-batch", action="store_true",
                   help="bisect for the largest batch, at most N, that completes")
    p.add_argument("--json", type=writable_file, metavar="PATH",
                   help="write arguments, token ids, memory and throughput here")


def add_paged_feature_arguments(parser) -> None:
    """Features of llama3_paged.py's pool alone."""
    add_pool_arguments(parser)
    parser.add_argument("--decode-kernel", choices=["flash", "triton"], default="flash",
                        help="with flash-attn: the decode kernel (triton: faster)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="with a system prompt: compute every prompt in full, reuse no block")
    parser.add_argument("--cascade", choices=["auto", "on", "off"], default="auto",
                        help="with a cached system prompt: read it once a step")
    parser.add_argument("--beam-width", type=beam_width, default=1, metavar="K",
                        help="beam search: K beams per prompt, sharing blocks")
    parser.add_argument("--no-sharing", action="store_true",
                        help="every sequence holds its own blocks (the comparison run)")


def load(args) -> Run:
    """Check the features' flags, then load tokenizer, prompts and model: all before any KV
    memory."""
    if args.max_running and not args.continuous:
        raise UserError("--max-running limits continuous batching; add --continuous (a static "
                        "batch runs all N requests at once).")
    if not math.isinf(args.request_rate) and not args.continuous:
        raise UserError("--request-rate spreads requests over time, which only continuous "
                        "batching can admit as they arrive; add --continuous.")
    if args.preemption == "swap" and not args.continuous:
        raise UserError("--preemption swap chooses how continuous batching preempts; a static "
                        "batch never preempts. Add --continuous.")
    if args.preemption == "swap" and args.max_batched_tokens:
        raise UserError("--preemption swap does not combine with --max-batched-tokens yet: drop "
                        "one of the two.")
    if args.max_batched_tokens and not args.continuous:
        raise UserError("--max-batched-tokens sets the size of continuous batching's mixed "
                        "steps; add --continuous (a static batch prefills every prompt first).")
    if args.compile and args.device.type != "cuda":  # an explicit --compile
        raise UserError("--compile fuses the model's small kernels into Triton kernels, which "
                        "run on CUDA only: drop it on this device.")
    if args.top_p < 1 and args.temperature == 0:
        raise UserError("--top-p chooses among the likeliest tokens when sampling, and "
                        "--temperature 0 (the default) is greedy: add --temperature, e.g. 0.8.")
    if args.overlap:  # refused now, not after minutes of loading the model
        from features.overlap import why_not_overlapped
        refuse_overlap(why_not_overlapped(args))
    if args.beam_width > 1 and (args.continuous or args.samples > 1
                                               or args.temperature > 0 or args.find_max_batch):
        raise UserError("--beam-width runs its own static search, greedy by summed "
                        "log-probabilities: it does not combine with --continuous, --samples, "
                        "--temperature or --find-max-batch. Drop those flags.")
    no_system_prompt = args.system_prompt is None and args.system_prompt_file is None
    if args.cascade == "on" and no_system_prompt:
        raise UserError("--cascade on reads a cached system prompt's blocks once per step, and this "
                        "run has no system prompt: add --system-prompt-file or drop --cascade.")
    if args.no_prefix_cache and no_system_prompt:
        raise UserError("--no-prefix-cache turns off the prefix cache, which is on only with a "
                        "system prompt, and this run has none: drop --no-prefix-cache.")
    if args.swap_space is not None and args.preemption != "swap":
        raise UserError("--swap-space sizes the host memory that --preemption swap copies "
                        "preempted K/V to, and this run recomputes them: add --preemption swap "
                        "(with --continuous) or drop --swap-space.")
    if args.find_max_batch and args.continuous:
        raise UserError("--find-max-batch finds the largest static batch that fits the KV cache; "
                        "with --continuous every batch completes, as requests wait and are "
                        "preempted when blocks run out. Drop one of the two.")
    if args.num_requests * args.samples > MAX_SEQUENCES:
        raise UserError(f"N x --samples = {args.num_requests * args.samples:,} sequences; this "
                        f"project runs at most {MAX_SEQUENCES:,} at once.")
    refuse_output_over_input(args.json, [*inputs.inputs_of(args), args.system_prompt_file],
                             "--json")
    model_class = lesson.Llama
    if torchrun_process() is not None:  # torchrun's processes split the model
        tensor_parallel.start(args)
        model_class = tensor_parallel.SplitLlama
    decode_kernel = args.decode_kernel
    if args.kv_cache_dtype == "fp8":
        refuse_fp8_combinations(args, no_system_prompt)
        if args.device.type == "cuda" and (args.attn == "flash" or args.attn == "auto"
                                           and importable("flash_attn")):
            decode_kernel = "triton"  # flash-attn 2 reads no float8: Triton decodes, flash prefills
    attention = choose_attention(args.attn, args.device, decode_kernel, args.dtype)
    if args.compile is None:
        args.compile = compiles_by_default(args, attention)
    sequences = args.samples * args.beam_width
    run = inputs.load_run(args, model_class, attention, system_prompt(args), sequences)
    if args.kv_cache_dtype == "fp8":
        from features.fp8_cache import FP8
        run = dataclasses.replace(run, kv_cache_dtype=FP8)
    return run


def refuse_fp8_combinations(args, no_system_prompt: bool) -> None:
    """What the FP8 cache does not serve yet: mixed steps, whose every step would dequantize the
    running requests' blocks (features/fp8_cache.py) and the cascade's 16-bit kernels."""
    what, why = (
        ("--max-batched-tokens", "each mixed step would copy every running request's blocks out "
         "of float8") if args.max_batched_tokens else
        ("--cascade on", "the cascade's kernels read 16-bit blocks (--cascade auto leaves it "
         "off)") if args.cascade == "on" and not no_system_prompt else (None, None))
    if what:
        raise UserError(f"--kv-cache-dtype fp8 does not combine with {what} yet: {why}. Drop one "
                        f"of the two.")


def compiles_by_default(args, attention) -> bool:
    """Compiled layers (features/compiled_layers.py) where nothing stands in their way: CUDA, a
    GPU attention kernel, and not --eager. In bf16 they round otherwise than the eager kernels,
    so tokens can differ from an --eager run's; --no-compile keeps CUDA graphs without them."""
    return args.device.type == "cuda" and attention.name != "torch" and not args.eager


def system_prompt(args) -> str | None:
    if args.system_prompt_file is None:
        return args.system_prompt
    try:
        return args.system_prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Could not read --system-prompt-file {args.system_prompt_file}: {e}") from e


def choose_attention(name: str, device: torch.device, decode_kernel: str = "flash",
                     dtype: str | None = None):
    """`auto` takes flash-attn on CUDA when it imports, else the Triton kernel on CUDA, else the
    PyTorch reference; for --dtype fp32 the reference, as both kernels read fp16 and bf16 only.
    decode_kernel "triton" (llama3_paged.py) decodes through the Triton kernel beside
    flash-attn's prefill."""
    if name == "auto":
        name = ("torch" if device.type != "cuda" or dtype == "fp32" else
                "flash" if importable("flash_attn") else "triton" if importable("triton") else "torch")
    if name != "torch" and dtype == "fp32":
        raise UserError(f"--attn {name} reads fp16 and bf16 only: with --dtype fp32 use --attn "
                        f"torch (the PyTorch reference), or --dtype bf16.")
    if decode_kernel == "triton" and name != "flash":
        raise UserError(f"--decode-kernel triton pairs the Triton decode kernel with flash-attn's "
                        f"prefill, and this run attends with --attn {name}: use --attn flash "
                        f"(with flash-attn installed), or drop --decode-kernel.")
    if name == "torch":
        return TorchAttentionAfterPrefix()
    if device.type != "cuda":
        raise UserError(f"--attn {name} needs a CUDA device; use --attn torch on the CPU.")
    if name == "triton":
        if not importable("triton"):
            raise UserError("--attn triton: Triton is not installed (it comes with PyTorch's CUDA "
                            "builds); use --attn torch.")
        from features.triton_attention import TritonAttention
        return TritonAttention()
    if not importable("flash_attn"):
        raise UserError("--attn flash: flash-attn is not installed. Install it after torch with "
                        "`pip install flash-attn --no-build-isolation`, or use --attn triton.")
    if decode_kernel == "triton":
        from features.triton_attention import TritonDecode
        return TritonDecode()
    return FlashAttentionAfterPrefix()


def kv_budget_bytes(run: Run) -> float:
    budget = inputs.kv_budget_bytes(run, sampling_peak_bytes(run))
    if torchrun_process() is not None:  # every process sizes the same pool
        budget = tensor_parallel.least_over_processes(budget)
    return budget


def sampling_peak_bytes(run) -> int:
    """Sampling's own memory (softmax, sort, sums), measured on one batch of rows."""
    if run.args.temperature < GREEDY_BELOW or run.device.type != "cuda":
        return 0  # greedy: an argmax; on the CPU the KV budget is a fixed share (no peak to read)
    sampler = make_sampler(run.args)
    from features.sampling import ROWS_AT_ONCE
    rows = min(run.num_sequences, ROWS_AT_ONCE)
    logits = torch.zeros(rows, run.model.args.vocab_size, dtype=run.dtype, device=run.device)
    ids = torch.arange(rows, device=run.device)
    torch.cuda.reset_peak_memory_stats(run.device)
    before = torch.cuda.memory_allocated(run.device)
    sampler(logits, ids, ids)
    return torch.cuda.max_memory_allocated(run.device) - before


def kv_cache(run: Run, num_blocks: int, block_size: int) -> lesson.KVCache:
    """The lesson's pool; with CUDA graphs, one spare slot more, for the graphs' padding rows."""
    from features.cuda_graphs import KVCacheWithSpareSlot
    cache_class = KVCacheWithSpareSlot if decodes_with_graphs(run) else KVCacheAfterPrefix
    if run.kv_cache_dtype is not None:
        from features.fp8_cache import FP8KVCache as cache_class
    with inputs.checked_kv_allocation(run, num_blocks, block_size):
        return cache_class(run.model.args, num_blocks, block_size, run.dtype, run.device,
                           run.attention)


def beam_width(text: str) -> int:
    value = positive_int(text)
    if value > MAX_BEAM_WIDTH:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_BEAM_WIDTH:,} beams, got {text}")
    return value


def decodes_with_graphs(run: Run) -> bool:
    """CUDA graphs where they can run: on CUDA, with an attention that reads its lengths on the
    GPU, unless --eager."""
    return not run.args.eager and run.device.type == "cuda" and run.attention.name != "torch"


def make_requests(run: Run) -> list[lesson.Request]:
    """One request per sequence: with --samples K, prompt i yields requests i*K .. i*K + K-1,
    each with the prompt's budget of new tokens (plumbing/inputs.new_token_budgets)."""
    args, requests = run.args, []
    arrivals = arrival_times(args, len(run.prompts))
    for prompt, arrival, budget in zip(run.prompts, arrivals, inputs.new_token_budgets(run)):
        requests += [ServedRequest(len(requests) + k, prompt.prompt_tokens, budget,
                                    arrival_time=float(arrival)) for k in range(args.samples)]
    return requests


def arrival_times(args, n: int) -> list[float]:
    """When each of n prompts arrives, in seconds from the start: all at once unless
    --request-rate."""
    if math.isinf(args.request_rate):
        return [0.0] * n
    from features.arrivals import poisson_arrival_times
    return poisson_arrival_times(n, args.request_rate, args.seed).tolist()


def make_sampler(args):
    if args.temperature < GREEDY_BELOW:
        return greedy
    from features.sampling import Sampler
    return Sampler(args.temperature, args.top_p, args.seed)


def make_scheduler(run, cache, manager, requests: list[lesson.Request]) -> lesson.Scheduler:
    """Static batching, or with --continuous a stream with preemption, in mixed steps with
    --max-batched-tokens, swapping with --preemption swap."""
    scheduler = scheduler_for_flags(run, cache, manager, requests)
    from features.mapping_ahead import MappingAheadManager
    if isinstance(manager, MappingAheadManager):  # it maps the next prompts' pages ahead
        manager.watch_queue(scheduler.waiting)
    return scheduler


def scheduler_for_flags(run, cache, manager, requests: list[lesson.Request]) -> lesson.Scheduler:
    args = run.args
    if not args.continuous:
        return CachingScheduler(manager, requests)
    from features.continuous import ContinuousScheduler, RequestTooLarge
    try:
        if args.preemption == "swap":
            return swapping_scheduler(run, cache, manager, requests)
        if args.max_batched_tokens:
            if isinstance(manager, SharingBlockManager):
                raise UserError("--max-batched-tokens does not combine with shared blocks yet "
                                "(--samples above 1, or a system prompt's prefix cache): add "
                                "--no-sharing, or drop --max-batched-tokens.")
            from features.mixed_steps import MixedScheduler
            return MixedScheduler(manager, requests, args.max_running, args.max_batched_tokens)
        return ContinuousScheduler(manager, requests, args.max_running, lesson.Engine.tokens_per_pass)
    except RequestTooLarge as e:
        prompt = len(e.request.prompt_tokens)
        raise UserError(
            f"Request {e.request.row} can grow to {e.largest_tokens:,} tokens ({prompt:,} prompt + "
            f"{e.request.max_new_tokens:,} new), {e.blocks:,} blocks of {e.block_size:,}: more "
            f"than the whole pool of {e.num_blocks:,}, so it could never finish. Give the KV "
            f"cache more memory (--kv-budget-gb, --gpu-memory-utilization) or lower "
            f"--max-new-tokens.", OUT_OF_MEMORY) from e


def swapping_scheduler(run, cache, manager, requests: list[lesson.Request]):
    """--preemption swap: a pool of host blocks of --swap-space, checked before it is made."""
    if not isinstance(cache, lesson.KVCache) or isinstance(manager, SharingBlockManager):
        raise UserError("--preemption swap copies a request's own blocks of the paged or naive "
                        "cache; it does not combine with shared blocks (--samples, a system "
                        "prompt's prefix cache: add --no-sharing) or llama3_virtual.py yet.")
    block_bytes = cache.block_size * run.kv_bytes_per_token
    swap_space = run.args.swap_space or SWAP_SPACE_GB
    swap_blocks = int(swap_space * GB // block_bytes)
    if swap_blocks == 0:
        raise UserError(f"--swap-space {swap_space:g} GB holds no block of "
                        f"{format_bytes(block_bytes)}: raise it.")
    check_host_memory(swap_blocks * block_bytes, "--swap-space", "Lower --swap-space.")
    from features.swapping import SwappingScheduler
    return SwappingScheduler(manager, requests, run.args.max_running, lesson.Engine.tokens_per_pass, cache,
                             swap_blocks)


def make_decoder(run, cache, manager, sampler, largest_batch: int, progress: bool):
    """CUDA graphs where they can run (CUDA, an attention that reads its lengths on the GPU),
    unless --eager; else the eager decoder. With a shared system prompt, attention may be a
    cascade (--cascade, the paged script's)."""
    if run.args.compile:
        from features.compiled_layers import compile_layers
        compile_layers(run.model, cache)
        if progress:
            print("Compiling the layers' small kernels (torch.compile) on their first step: "
                  "tens of seconds on a machine's first run, cached after; --no-compile skips it")
    cascade = None
    shared_prefix = isinstance(manager, SharingBlockManager) and manager.prefix_cache is not None
    if shared_prefix and run.args.cascade != "off":  # a system prompt, cached
        from features.cascade import cascade_for
        cascade = cascade_for(run, cache, manager)  # before the graphs record attention
    eager = decoder = SamplingDecoder(run.model, cache, manager.block_table, sampler)
    if decodes_with_graphs(run):
        from features.cuda_graphs import GraphDecoder
        start = time.perf_counter()
        decoder = GraphDecoder(eager, largest_batch)
        if progress:
            print(f"Captured {len(decoder.buckets)} CUDA graphs of a decode step, batch 1 to "
                  f"{decoder.buckets[-1]}, in {time.perf_counter() - start:.1f} s")
    if cascade:
        from features.cascade import CascadeDecoder
        return CascadeDecoder(decoder, eager, cascade, manager.table)
    return decoder


def generate(run, cache, manager, progress: bool = True):
    """Every request of the run through `cache`, with the parts the flags choose: what the
    scripts call."""
    args, requests = run.args, make_requests(run)
    sampler = make_sampler(args)
    scheduler = make_scheduler(run, cache, manager, requests)
    largest_batch = min(len(requests), args.max_running or len(requests))
    decoder = make_decoder(run, cache, manager, sampler, largest_batch, progress)
    stop_ids = set() if args.random_weights else run.tokenizer.stop_ids
    engine = make_engine(run, cache, manager, sampler, decoder)
    return engine.generate(scheduler, stop_ids, progress)


def make_engine(run, cache, manager, sampler, decoder) -> TimedEngine:
    """The core loop, or with --overlap (the default on CUDA) steps scheduled while the GPU runs
    the one before, where the run allows it."""
    overlap = run.args.overlap
    if overlap is None:
        overlap = run.device.type == "cuda"
    engine_class = TimedEngine
    if run.args.continuous and run.args.max_batched_tokens:
        from features.mixed_steps import MixedEngine as engine_class
    if overlap:
        from features.overlap import OverlappedEngine, why_not_overlapped
        why_not = why_not_overlapped(run.args, manager)  # the manager too: --find-max-batch's
        if run.args.overlap:
            refuse_overlap(why_not)
        engine_class = engine_class if why_not else OverlappedEngine
    engine = engine_class(run.model, cache, manager, sampler, decoder)
    # The attention kernel's programs, longest first: its last wave short (longest_first.py).
    engine.decode_longest_first = run.device.type == "cuda"
    return engine


def refuse_overlap(why_not: str | None) -> None:
    """An explicit --overlap that the run cannot have ends here, with the reason."""
    if why_not:
        raise UserError(f"--overlap does not combine with this run: {why_not}. Drop --overlap.")


def find_max_batch(run: Run, allocate_kv_cache) -> None:
    """--find-max-batch (features/max_batch.py), loaded only when asked for."""
    from features import max_batch
    max_batch.find_max_batch(run, allocate_kv_cache, generate)


# --- The scripts' caches, with the features that change them ---------------------------------

def allocate_paged(run: Run, samples: bool = False):
    """llama3_paged.py's pool. Blocks are shared where requests begin with the same tokens:
    samples of one prompt (--samples; `samples`: a server's requests may ask for n), beams, or
    prompts after one system prompt (the prefix cache). Elsewhere the prefix cache would find next
    to nothing (1% of W2's prompt tokens), and the lesson's block manager runs."""
    args = run.args
    num_blocks, block_size = lesson.pool_size(run, kv_budget_bytes(run))
    cache, max_blocks = kv_cache(run, num_blocks, block_size), math.ceil(args.max_seq_len / block_size)
    prefix_caching = run.system_prompt is not None and not args.no_prefix_cache
    samples = samples or args.samples > 1
    if args.no_sharing or not (samples or args.beam_width > 1 or prefix_caching):
        return cache, lesson.BlockManager(num_blocks, block_size, run.num_sequences, max_blocks,
                                          run.device)
    from features.sharing import SharingBlockManager
    return cache, SharingBlockManager(cache, run.num_sequences, max_blocks, prefix_caching)


def allocate_naive(run: Run):
    """llama3_naive.py's rows: N for a static batch; with --continuous as many as the budget
    holds, and a request waits for a free one."""
    budget, rows = kv_budget_bytes(run), run.num_sequences
    if run.args.continuous:
        rows = min(llama3_naive.requests_that_fit(run, budget), rows)
    llama3_naive.check_rows_fit(run, rows, budget)
    return kv_cache(run, rows, run.args.max_seq_len), lesson.BlockManager(
        rows, run.args.max_seq_len, run.num_sequences, 1, run.device)


SCRIPTS = {  # script -> (the module, its pool's flags, its allocation with features)
    "llama3_paged.py": (lesson, add_paged_feature_arguments, allocate_paged),
    "llama3_naive.py": (llama3_naive, lambda parser: None, allocate_naive),
}


def argument_parser_with_features(script: str, doc: str, add_pool_arguments):
    parser = argument_parser(script, doc)
    add_feature_arguments(parser)
    # The paged and the virtual script's own flags, as their defaults set them, for the other scripts
    # (a parser's defaults win over its flags': these are the same).
    parser.set_defaults(beam_width=1, decode_kernel="flash", cascade="auto", no_prefix_cache=False,
                        no_sharing=False, sync_mapping=False)
    add_pool_arguments(parser)
    return parser


def main(script: str, argv=None) -> None:
    """A script's run with the features its flags ask for: parse, load, allocate the cache,
    generate, report."""
    module, add_pool_arguments, allocate = SCRIPTS[script]
    with one_paragraph_errors(script):
        parser = argument_parser_with_features(script, module.__doc__, add_pool_arguments)
        args = parser.parse_args(argv)
        run = load(args)
        if run.args.beam_width > 1:
            return run_beam_search(run, *allocate(run))
        if run.args.find_max_batch:
            return find_max_batch(run, allocate)
        cache, manager = allocate(run)
        from features.report import report
        report(run, cache, manager, generate(run, cache, manager))


def run_beam_search(run, cache, manager) -> None:
    """--beam-width K (features/beam_search.py), loaded only when asked for: the decoder as the
    flags choose it, and each prompt's budget of new tokens."""
    from features.beam_search import BeamSampler, search_and_report
    sampler = BeamSampler(run.args.beam_width)
    decoder = make_decoder(run, cache, manager, sampler, len(run.prompts) * run.args.beam_width, True)
    engine = CachedPrefixEngine(run.model, cache, manager, sampler, decoder)
    budgets = [r.max_new_tokens for r in make_requests(run)]  # random weights: reply lengths
    search_and_report(run, engine, budgets)


def command_line(script: str, argv: list[str]) -> None:
    """What `python <script> argv` runs (the scripts' `__main__` blocks decide the same way): the
    lesson's main, or with features this file's."""
    pool_arguments = add_pool_arguments if script == "llama3_paged.py" else None
    if needs_features(script, argv, pool_arguments):
        return main(script, argv)
    return SCRIPTS[script][0].main(argv)
