"""The one place an engine is assembled from the lesson's parts: from a loaded run (engine/
loader.py), the pool its flags ask for and its block manager, the scheduler, and the model runner
with the features the flags turn on (each reached through engine/seams.py), which an EngineCore
(engine/engine_core.py) drives. The scripts' feature runs (`generate`), engine/llm_engine.py's
LLMEngine, tools/bench.py and tools/latency_sweep.py all build here.
"""

import contextlib
import functools
import gc
import math
import time

import torch

import llama3_naive
import llama3_paged as lesson
from engine.engine_core import EngineCore
from engine.kv_cache import EngineKVCache
from engine.model_runner import ModelForward, ModelRunner, SamplingDecoder
from engine.request import EngineRequest
from engine.sampler import GREEDY_BELOW, ROWS_AT_ONCE, make_sampler
from engine.scheduler import RequestTooLarge, Scheduler
from engine.seams import plug
from engine.swap import HostBlocks
from plumbing import inputs
from plumbing.cli import GB, OUT_OF_MEMORY, UserError, check_host_memory, format_bytes
from plumbing.inputs import Run

SWAP_SPACE_GB = 4.0  # host memory for swapped K/V unless --swap-space says otherwise


def kv_budget_bytes(run: Run) -> float:
    budget = inputs.kv_budget_bytes(run, sampling_peak_bytes(run))
    if run.split:  # every process of a split model sizes the same pool
        budget = plug("tensor parallelism", "least_over_processes")(budget)
    return budget


def sampling_peak_bytes(run) -> int:
    """Sampling's own memory (softmax, sort, sums), measured on one batch of rows."""
    if run.args.temperature < GREEDY_BELOW or run.device.type != "cuda":
        return 0  # greedy: an argmax; on the CPU the KV budget is a fixed share (no peak to read)
    sampler = make_sampler(run.args)
    rows = min(run.num_sequences, ROWS_AT_ONCE)
    logits = torch.zeros(rows, run.model.args.vocab_size, dtype=run.dtype, device=run.device)
    ids = torch.arange(rows, device=run.device)
    torch.cuda.reset_peak_memory_stats(run.device)
    before = torch.cuda.memory_allocated(run.device)
    sampler(logits, ids, ids)
    return torch.cuda.max_memory_allocated(run.device) - before


def kv_cache(run: Run, num_blocks: int, block_size: int) -> lesson.KVCache:
    """The engine's pool (engine/kv_cache.py); with CUDA graphs, one spare slot more, for the
    graphs' padding rows."""
    with inputs.checked_kv_allocation(run, num_blocks, block_size):
        if run.kv_cache_dtype is not None:
            return plug("FP8 K/V")(run.model.args, num_blocks, block_size, run.dtype, run.device,
                              run.attention, group=run.group)
        return EngineKVCache(run.model.args, num_blocks, block_size, run.dtype, run.device,
                             run.attention, spare_slot=decodes_with_graphs(run))


def decodes_with_graphs(run: Run) -> bool:
    """CUDA graphs where they can run: on CUDA, with an attention that reads its lengths on the
    GPU, unless --eager."""
    return run.device.type == "cuda" and not run.args.eager and run.attention.name != "torch"


def shares_blocks(run: Run, served: bool = False) -> bool:
    """Whether the run's pool shares blocks where requests begin with the same tokens (paged,
    unless --no-sharing): samples of one prompt (--samples; `served`: a served request may ask
    for n), beams, or prompts after one system prompt (the prefix cache). Elsewhere the prefix
    cache would find next to nothing (1% of W2's prompt tokens), and the lesson's block manager
    runs. The engine asks this of the flags, not of the manager's class."""
    args = run.args
    return (args.cache == "paged" and not args.no_sharing
            and (served or args.samples > 1 or args.beam_width > 1 or caches_prefix(run)))


def caches_prefix(run: Run) -> bool:
    """Whether later prompts find a system prompt's blocks in the pool
    (features/sharing/prefix_cache.py)."""
    args = run.args
    return (args.cache == "paged" and not args.no_sharing
            and run.system_prompt is not None and not args.no_prefix_cache)


def allocate_paged(run: Run, samples: bool = False):
    """llama3_paged.py's pool, its blocks shared where `shares_blocks` says (`samples`: a
    server's requests may ask for n)."""
    args = run.args
    num_blocks, block_size = lesson.pool_size(run, kv_budget_bytes(run))
    cache = kv_cache(run, num_blocks, block_size)
    max_blocks = math.ceil(args.max_seq_len / block_size)
    if not shares_blocks(run, served=samples):
        return cache, lesson.BlockManager(num_blocks, block_size, run.num_sequences, max_blocks,
                                          run.device)
    return cache, plug("sharing blocks")(cache, run.num_sequences, max_blocks, caches_prefix(run))


def allocate_naive(run: Run):
    """llama3_naive.py's rows: N for a static batch; with --continuous as many as the budget
    holds, and a request waits for a free one."""
    budget, rows = kv_budget_bytes(run), run.num_sequences
    if run.args.continuous:
        rows = min(llama3_naive.requests_that_fit(run, budget), rows)
    llama3_naive.check_rows_fit(run, rows, budget)
    return kv_cache(run, rows, run.args.max_seq_len), lesson.BlockManager(
        rows, run.args.max_seq_len, run.num_sequences, 1, run.device)


def allocate_kv_cache(run: Run, served: bool = False):
    """The pool and block manager of the run's script, llama3_<cache>.py: where the three
    differ. The virtual script is imported for its own runs only: the others never touch CUDA's
    virtual memory. served: a served engine's, whose requests may ask for n samples.

    Each sizes its pool by the activations' peak, measured here with the layers eager, as a
    fresh process measures it before its layers compile: a --find-max-batch attempt after the
    first finds them compiled in place, where the fused SwiGLU holds one [pass tokens, ffn_dim]
    tensor fewer, and would size a larger pool than `llama3_X.py N` then gets (docs/memory.md)."""
    # Only where layers compile: set_stance loads the compiler, which a plain CPU run never needs
    with (torch.compiler.set_stance("force_eager") if run.args.compile
          else contextlib.nullcontext()):
        if run.args.cache == "virtual":
            allocate_virtual = plug("virtual memory", "allocate_kv_cache")
            if run.kv_cache_dtype is None:
                return allocate_virtual(run)
            from engine.fp8_virtual_cache import FP8VirtualKVCache  # where the two combine
            return allocate_virtual(run, functools.partial(FP8VirtualKVCache, group=run.group))
        return allocate_naive(run) if run.args.cache == "naive" else allocate_paged(run, served)


def make_requests(run: Run) -> list[EngineRequest]:
    """One request per sequence: with --samples K, prompt i yields requests i*K .. i*K + K-1,
    each with the prompt's budget of new tokens (plumbing/inputs.new_token_budgets)."""
    args, requests = run.args, []
    arrivals = arrival_times(args, len(run.prompts))
    for prompt, arrival, budget in zip(run.prompts, arrivals, inputs.new_token_budgets(run)):
        requests += [EngineRequest(len(requests) + k, prompt.prompt_tokens, budget,
                                    arrival_time=float(arrival)) for k in range(args.samples)]
    return requests


def arrival_times(args, n: int) -> list[float]:
    """When each of n prompts arrives, in seconds from the start: all at once unless
    --request-rate."""
    if math.isinf(args.request_rate):
        return [0.0] * n
    return plug("arrivals")(n, args.request_rate, args.seed).tolist()


def make_scheduler(run, cache, manager, requests: list[EngineRequest],
                   served: bool = False) -> Scheduler:
    """Static batching, or with --continuous a stream with preemption (recomputing, or swapping
    with --preemption swap), in mixed steps with --max-batched-tokens. served: LLMEngine's, whose
    paged pool shares blocks for a request's n samples."""
    args = run.args
    shared = shares_blocks(run, served)
    if args.continuous and args.max_batched_tokens and shared:
        raise UserError("--max-batched-tokens does not combine with shared blocks yet "
                        "(--samples above 1, or a system prompt's prefix cache): add "
                        "--no-sharing, or drop --max-batched-tokens.")
    swaps = args.continuous and args.preemption == "swap"
    host = host_blocks(run, cache, shared) if swaps else None
    try:
        scheduler = Scheduler(manager, requests, args.continuous, args.max_running,
                              args.max_batched_tokens or inputs.TOKENS_PER_PASS,
                              mixed=bool(args.continuous and args.max_batched_tokens), host=host,
                              shares_blocks=shared)
    except RequestTooLarge as e:
        prompt = len(e.request.prompt_tokens)
        raise UserError(
            f"Request {e.request.row} can grow to {e.largest_tokens:,} tokens ({prompt:,} prompt + "
            f"{e.request.max_new_tokens:,} new), {e.blocks:,} blocks of {e.block_size:,}: more "
            f"than the whole pool of {e.num_blocks:,}, so it could never finish. Give the KV "
            f"cache more memory (--kv-budget-gb, --gpu-memory-utilization) or lower "
            f"--max-new-tokens.", OUT_OF_MEMORY) from e
    if args.cache == "virtual":  # its page managers may map the next prompts' pages ahead
        manager.watch_queue(scheduler.waiting)  # (features/virtual/mapping_ahead.py)
    return scheduler


def host_blocks(run, cache, shares_blocks: bool) -> HostBlocks:
    """--preemption swap: a pool of host blocks of --swap-space, checked before it is made."""
    if run.args.cache == "virtual" or shares_blocks:  # the virtual rows are no blocks to copy
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
    return HostBlocks(cache, swap_blocks)


def model_forward(run, progress: bool = False) -> ModelForward:
    """The model as the engine calls it: its layers compiled unless --no-compile or --eager (on
    CUDA)."""
    if run.args.compile and progress:
        print("Compiling the layers' small kernels (torch.compile) on their first step: "
              "8B takes about a minute on a machine's first run, cached after; "
              "--no-compile skips it")
    return ModelForward(run.model, compiled=bool(run.args.compile))


def make_runner(run, forward: ModelForward, cache, manager, sampler, largest_batch: int,
                progress: bool = False, arrivals: bool = False, graph_sampler=None,
                eager_when=lambda rows: False, served: bool = False) -> ModelRunner:
    """The engine's loop, with the parts the flags choose: decode steps of up to `largest_batch`
    rows as CUDA graphs where they can run (CUDA, an attention that reads its lengths on the
    GPU; not --eager), a cascade with a cached system prompt (--cascade, the paged script's),
    steps overlapped (--overlap, the default on CUDA) where the run allows it. With `arrivals`
    (requests come over time, so most prefill passes are a prompt or two), short prefill passes
    as CUDA graphs too: a static batch's prompts are packed into long passes, which a graph would
    not speed up. graph_sampler, eager_when: what the graphs record, if not `sampler`, and the
    rows they leave to the kernels launched from Python (LLMEngine's: the graphs decode
    greedily, and a step with a row that samples runs eagerly). served: rows may ask for
    log-probabilities (up to --max-logprobs), as a script's every row does with --logprobs."""
    cascade = None
    if caches_prefix(run) and run.args.cascade != "off":  # a system prompt, cached
        # before the graphs record attention
        cascade = plug("cascade attention", "cascade_for")(run, cache, manager)
    graphs = None
    if decodes_with_graphs(run):
        start = time.perf_counter()
        recorded = SamplingDecoder(forward, cache, manager.block_table, graph_sampler or sampler)
        graphs = plug("decode graphs")(recorded, largest_batch, eager_when)
        if progress:
            print(f"Captured {len(graphs.buckets)} CUDA graphs of a decode step, batch 1 to "
                  f"{graphs.buckets[-1]}, in {time.perf_counter() - start:.1f} s")
    logprobs = None
    if run.args.logprobs is not None or served and run.args.max_logprobs:
        logprobs = make_logprobs(run, forward, cache, manager, graph_sampler or sampler, sampler,
                                 graphs, largest_batch, eager_when)
    overlap = run.args.overlap
    if overlap is None:
        overlap = run.device.type == "cuda"
    if overlap:  # an explicit --overlap the run cannot have was refused in Config
        overlap = run.args.why_not_overlapped() is None
    # The attention kernel's programs, longest first: its last wave short (longest_first.py).
    engine = ModelRunner(forward, cache, manager, sampler, graphs, cascade, overlap=overlap,
                         longest_first=run.device.type == "cuda", logprobs=logprobs)
    if arrivals and decodes_with_graphs(run):
        if plug("prefill graphs", "supports_prefill_graphs")(cache):
            buckets = plug("prefill graphs", "BUCKETS")
            start = time.perf_counter()
            engine.capture_prefill_graphs()
            if progress:
                print(f"Captured {len(buckets)} CUDA graphs of a prefill pass, {buckets[0]} to "
                      f"{buckets[-1]:,} tokens, in {time.perf_counter() - start:.1f} s")
    return engine


def make_logprobs(run, forward, cache, manager, graph_sampler, sampler, graphs, largest_batch,
                  eager_when):
    """The decode step that gives log-probabilities (features/logprobs/), eager and, where the
    plain step has CUDA graphs, as graphs of its own in their memory pool."""
    LogprobDecoder = plug("log-probabilities")
    table, width = manager.block_table, run.args.max_logprobs
    logprob_graphs = None
    if graphs is not None:
        recorded = LogprobDecoder(forward, cache, table, graph_sampler, width)
        logprob_graphs = plug("decode graphs")(recorded, largest_batch, eager_when,
                                               pool=graphs.pool)
    every_row = -1 if run.args.logprobs is None else run.args.logprobs
    eager = LogprobDecoder(forward, cache, table, sampler, width)
    return plug("log-probabilities", "Logprobs")(len(table), eager, logprob_graphs, every_row)


def assemble(run, cache, manager, requests: list[EngineRequest], sampler, largest_batch: int,
             progress: bool = False, served: bool = False, stop_ids=frozenset(),
             graph_sampler=None, eager_when=lambda rows: False) -> EngineCore:
    """The engine over the run's pool, as every engine run builds it (a script's, `generate`;
    a served one, LLMEngine): the scheduler of `requests`, checked against the pool before any
    graph is captured, the model runner, and the loop that drives the two. served: requests
    come one at a time, with sampling parameters of their own (see make_runner)."""
    scheduler = make_scheduler(run, cache, manager, requests, served)
    arrivals = served or not math.isinf(run.args.request_rate)  # most prefill passes are short
    runner = make_runner(run, model_forward(run, progress), cache, manager, sampler, largest_batch,
                         progress, arrivals, graph_sampler, eager_when, served)
    return EngineCore(runner, scheduler, stop_ids)


def generate(run, cache, manager, progress: bool = True):
    """Every request of the run through `cache`, with the parts the flags choose: what the
    scripts call."""
    args, requests = run.args, make_requests(run)
    largest_batch = min(len(requests), args.max_running or len(requests))
    stop_ids = set() if args.random_weights else run.tokenizer.stop_ids
    return assemble(run, cache, manager, requests, make_sampler(args), largest_batch, progress,
                    stop_ids=stop_ids).generate(progress)


def make_beam_runner(run, cache, manager) -> ModelRunner:
    """--beam-width K: the engine the flags choose, drawing K beams per prompt (a search is one
    static batch, run by features/beam_search.py's own loop: no overlap, no mixed steps)."""
    sampler = plug("beam search")(run.args.beam_width)
    return make_runner(run, model_forward(run, progress=True), cache, manager, sampler,
                       len(run.prompts) * run.args.beam_width, progress=True)


def warm_up(run_pass, compiled: bool, cache, manager, max_seq_len: int, new_tokens: int) -> None:
    """Each of warm_up_prompts' passes through `run_pass(prompts)`, which runs them to their end.
    Then an FP8 cache forgets the scales the first of them set: a token repeated is not the data
    they are for (features/fp8/cache.py)."""
    from engine.compiled_layers import warm_up_prompts  # here: it loads the compiler
    for prompts in warm_up_prompts(compiled, manager, max_seq_len, new_tokens):
        run_pass(prompts)
    if cache.k[0].dtype == torch.float8_e4m3fn:  # an FP8 cache, paged or virtual
        cache.forget_scales()
    # Compiling and capturing leave half a million long-lived objects (graphs, guards, kernels)
    # that every full pass of the garbage collector walks again, inside timed runs (docs/fp8.md).
    # Collected once now and kept out of later passes (gc.freeze; vLLM does the same). Unfrozen
    # first, so that an engine built after another collects what the first one left behind.
    gc.unfreeze()
    gc.collect()
    gc.freeze()
