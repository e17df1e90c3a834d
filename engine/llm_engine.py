"""The one place an engine with features is assembled from the lesson's parts, and `LLMEngine`,
the Python API's engine that takes requests one at a time (vLLM's LLMEngine).

From the flags (engine/config.py's Config) and a pool (engine/pools.py), `make_scheduler` and
`make_engine` choose the engine's parts and the features' that plug into them.
Everything that runs requests builds through them: the scripts' feature runs (`generate`, which
engine/run.py calls), tools/bench.py and tools/latency_sweep.py, and `LLMEngine`, which
engine/llm.py's `LLM` and serve.py's engine process drive. So a served request runs through
the same continuous batching, CUDA graphs and cache as `llama3_paged.py N --continuous`.

What serving adds to the scripts' runs:
- Rows come back. A script's request r owns row r of the block table for the whole run; a server
  sees requests without end. Here a request takes a free row when it is added and gives it back
  when it finishes or is aborted, as its blocks go back to the free list.
- A request's n samples (and any requests with the same prompt) share the prompt's blocks in the
  paged cache: the samples after the first fork (features/sharing/block_manager.py), as
  `--samples` does.
- Each request samples with its own parameters (engine/sampler.py's `RowSampler`), and ends at
  its own stop strings, at end-of-text unless `ignore_eos`, or at `max_tokens`. The first two are
  checked here, on the host, between steps. On CUDA steps overlap (engine/engine_core.py) as in the
  scripts' runs: the next step is in flight when a request is found to end, so the engine lets it
  go (`let_go`) and throws away the token that step draws for it, as it does for a stop token.
"""

import dataclasses
import functools
import gc
import itertools
import math
import random
import time
from collections import deque

import numpy as np
import torch

from block_manager import to_device
from engine.engine_core import EngineCore
from engine.model_runner import ModelForward, ModelRunner, SamplingDecoder, greedy
from engine.scheduler import RequestTooLarge, Scheduler
from engine.seams import plug
from engine.request import ServedRequest, Status
from engine.swap import HostBlocks
from engine.config import Config
from engine.loader import load
from engine import pools
from engine.pools import allocate_naive, allocate_paged, decodes_with_graphs
from engine.sampler import RowSampler, SamplingParams, make_sampler
from plumbing import inputs
from plumbing.cli import (GB, OUT_OF_MEMORY, UserError, check_host_memory, format_bytes,
                          torchrun_process)
from plumbing.inputs import Run

SWAP_SPACE_GB = 4.0  # host memory for swapped K/V unless --swap-space says otherwise


def allocate_kv_cache(run: Run, served: bool = False):
    """The pool and block manager of the run's script, llama3_<cache>.py: where the three
    differ. The virtual script is imported for its own runs only: the others never touch CUDA's
    virtual memory. served: a served engine's, whose requests may ask for n samples."""
    if run.args.cache == "virtual":
        allocate_virtual = plug("virtual memory", "allocate_kv_cache")
        if run.kv_cache_dtype is None:
            return allocate_virtual(run)
        from engine.fp8_virtual_cache import FP8VirtualKVCache  # where the two combine
        return allocate_virtual(run, functools.partial(FP8VirtualKVCache, split_heads=run.split))
    return allocate_naive(run) if run.args.cache == "naive" else allocate_paged(run, served)


def make_requests(run: Run) -> list[ServedRequest]:
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
    return plug("arrivals")(n, args.request_rate, args.seed).tolist()


def make_scheduler(run, cache, manager, requests: list[ServedRequest],
                   served: bool = False) -> Scheduler:
    """Static batching, or with --continuous a stream with preemption (recomputing, or swapping
    with --preemption swap), in mixed steps with --max-batched-tokens. served: LLMEngine's, whose
    paged pool shares blocks for a request's n samples."""
    args = run.args
    shares_blocks = pools.shares_blocks(run, served)
    if args.continuous and args.max_batched_tokens and shares_blocks:
        raise UserError("--max-batched-tokens does not combine with shared blocks yet "
                        "(--samples above 1, or a system prompt's prefix cache): add "
                        "--no-sharing, or drop --max-batched-tokens.")
    swaps = args.continuous and args.preemption == "swap"
    host = host_blocks(run, cache, shares_blocks) if swaps else None
    try:
        scheduler = Scheduler(manager, requests, args.continuous, args.max_running,
                              args.max_batched_tokens or inputs.TOKENS_PER_PASS,
                              mixed=bool(args.continuous and args.max_batched_tokens), host=host,
                              shares_blocks=shares_blocks)
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
              "8B takes about a minute on a machine's first run (H200), cached after; "
              "--no-compile skips it")
    return ModelForward(run.model, compiled=bool(run.args.compile))


def make_engine(run, forward: ModelForward, cache, manager, sampler, largest_batch: int,
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
    if pools.caches_prefix(run) and run.args.cascade != "off":  # a system prompt, cached
        cascade = plug("cascade attention", "cascade_for")(run, cache, manager)  # before the graphs record attention
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
        logprob_graphs = plug("decode graphs")(recorded, largest_batch, eager_when, pool=graphs.pool)
    every_row = -1 if run.args.logprobs is None else run.args.logprobs
    return plug("log-probabilities", "Logprobs")(len(table), LogprobDecoder(forward, cache, table, sampler, width),
                    logprob_graphs, every_row)


def generate(run, cache, manager, progress: bool = True):
    """Every request of the run through `cache`, with the parts the flags choose: what the
    scripts call."""
    args, requests = run.args, make_requests(run)
    sampler = make_sampler(args)
    scheduler = make_scheduler(run, cache, manager, requests)
    largest_batch = min(len(requests), args.max_running or len(requests))
    stop_ids = set() if args.random_weights else run.tokenizer.stop_ids
    runner = make_engine(run, model_forward(run, progress), cache, manager, sampler, largest_batch,
                         progress, arrivals=not math.isinf(args.request_rate))
    return EngineCore(runner, scheduler, stop_ids).generate(progress)


def make_beam_engine(run, cache, manager) -> ModelRunner:
    """--beam-width K: the engine the flags choose, drawing K beams per prompt (a search is one
    static batch, run by features/beam_search.py's own loop: no overlap, no mixed steps)."""
    sampler = plug("beam search")(run.args.beam_width)
    return make_engine(run, model_forward(run, progress=True), cache, manager, sampler,
                       len(run.prompts) * run.args.beam_width, progress=True)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One of a request's n samples: a row of the engine, and what the client has been sent."""

    request: ServedRequest
    request_id: str
    index: int
    params: SamplingParams
    text: str = ""  # the answer so far, each character whole
    num_sent_tokens: int = 0
    num_text_tokens: int = 0  # the tokens `text` decodes: up to the last whole character
    finish_reason: str | None = None

    @property
    def sendable_text(self) -> str:
        """What a stream may show now. While the request runs, its last len(stop) - 1
        characters wait: the next token may complete a stop string they begin, and a stop
        string is never shown (vLLM holds them back too)."""
        held = max(map(len, self.params.stop), default=1) - 1
        if self.finish_reason is not None or not held:
            return self.text
        return self.text[:max(len(self.text) - held, 0)]


class QueueFull(Exception):
    """Every row is taken: serve.py answers 503 with Retry-After."""


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
    # that every full pass of the garbage collector walks again: on an H200 such a pass took
    # 0.29 s inside a timed run of W (docs/fp8.md). Collected once now and kept out of later
    # passes (gc.freeze; vLLM does the same). Unfrozen first, so that an engine built after
    # another collects what the first one left behind.
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class LLMEngine:
    """Requests in, tokens out, one step at a time (serve.py's engine process calls `step`)."""

    def __init__(self, cache: str = "paged", max_num_seqs: int = 256, argv: list[str] = (),
                 run=None, progress: bool = False, **options):
        """The model and flags from argv and options, or `run`: a model loaded already, with the
        flags it was loaded for (tools/latency_sweep.py's, whose curves share one model).
        progress: say what the start-up's long parts took (serve.py's engine does)."""
        if torchrun_process() is not None:  # each process would serve, none would split
            raise UserError("The Python API and serve.py run in one process for now, not under "
                            "torchrun: run them without it.")
        if run is None:
            args = Config.from_options(cache, {"max_running": max_num_seqs, **options}, argv)
            if cache == "virtual":  # as its script does: from the flags, before loading
                import llama3_virtual
                llama3_virtual.require_cuda_and_flash_attn(args)
            run = load(args)
        elif run.args.max_running is None:  # the scripts' "all at once": here, every row
            run = dataclasses.replace(run, args=dataclasses.replace(run.args,
                                                                    max_running=max_num_seqs))
        self.run = dataclasses.replace(run, num_sequences=max_num_seqs)
        self.cache, self.manager = allocate_kv_cache(self.run, served=True)
        self.sampler = RowSampler(max_num_seqs, self.run.device, run.model.args.vocab_size,
                                  run.args.max_seq_len)
        # Greedy decode steps may be CUDA graphs; a step with a sampling row runs eagerly, with
        # the per-row sampler (a graph would have recorded one path for every row forever).
        # Chosen as each step is launched, which with overlapped steps is a step ahead of the
        # one `step` returns.
        self.runner = make_engine(self.run, model_forward(self.run, progress), self.cache,
                                  self.manager, self.sampler, max_num_seqs, progress,
                                  arrivals=True,  # a client's, or the server's
                                  graph_sampler=greedy, eager_when=self.sampler.runs_eagerly,
                                  served=True)
        self.scheduler = make_scheduler(self.run, self.cache, self.manager, [], served=True)
        self.core = EngineCore(self.runner, self.scheduler)  # stops: judged here, in _collect
        self.runner.serve(max_num_seqs)
        self.free_rows = deque(range(max_num_seqs))
        self.sequences: dict[int, Sequence] = {}  # by row
        self.tokenizer, self.max_seq_len = self.run.tokenizer, self.context_the_pool_holds()
        self.stop_ids = self.tokenizer.stop_ids
        self.num_prompt_tokens = self.num_generated_tokens = self.num_finished = 0
        self._ids = itertools.count()
        if self.run.args.compile:
            start = time.perf_counter()
            self.warm_up()
            if progress:
                print(f"Warmed up in {time.perf_counter() - start:.1f} s: prefill passes compiled "
                      f"before the first request", flush=True)

    def context_the_pool_holds(self) -> int:
        """--max-seq-len, or, where the whole KV pool holds less for one request, the longest
        request it holds, said in one line (vLLM fits its max_model_len to the KV cache at
        start-up): a request without max_tokens gets what is left of this context, and is never
        refused for the default."""
        asked = self.run.args.max_seq_len
        # A request caches every token but its last: the whole pool at most (its blocks or
        # pages of block_size tokens; a naive row is one block), and one token more.
        holds = self.manager.num_blocks * self.manager.block_size + 1
        if holds >= asked:
            return asked
        print(f"The KV pool holds {holds:,} tokens of one request, fewer than --max-seq-len "
              f"{asked:,}: serving a context of {holds:,} tokens (give the pool more memory to "
              f"serve more).", flush=True)
        return holds

    def _context(self) -> str:
        """The context a request must fit, and where it comes from, for a refusal's message."""
        source = ("--max-seq-len" if self.max_seq_len == self.run.args.max_seq_len
                  else "what the KV pool holds of one request")
        return f"{self.max_seq_len:,} tokens ({source})"

    def warm_up(self) -> None:
        """A few requests, run to their end and forgotten. Compiled layers compile for prefill on
        the first ones (tens of seconds; decode compiled as its CUDA graphs were captured), which
        would otherwise fall on the first clients' time to first token."""
        def run_pass(prompts):
            for prompt in prompts:  # added together: one prefill pass
                self.add_request(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))
            while self.has_unfinished():
                self.step()
        warm_up(run_pass, self.run.args.compile, self.cache, self.manager, self.max_seq_len, 8)
        self.num_prompt_tokens = self.num_generated_tokens = self.num_finished = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.run.kv_bytes_per_token

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request's n samples; raises ValueError for one that cannot run, QueueFull
        when there are not n free rows. arrival_time: when it arrived on the scheduler's clock
        (a replayed trace's time; by default now), from which its latencies count."""
        params.check()
        prompt_token_ids = self.truncated(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if not prompt_token_ids or len(prompt_token_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids):,} tokens; it must have "
                             f"1 to {self.max_seq_len - 1:,}: the context is {self._context()}")
        if max(prompt_token_ids) >= self.run.model.args.vocab_size or min(prompt_token_ids) < 0:
            raise ValueError("a prompt token id is outside the vocabulary")
        vocab_size = self.run.model.args.vocab_size
        if any(t >= vocab_size for t in params.logit_bias or {}):
            raise ValueError(f"a logit_bias token id is outside the vocabulary of {vocab_size:,}")
        asked = [k for k in (params.logprobs, params.prompt_logprobs) if k is not None]
        if asked and (not self.runner.logprobs or max(asked) > self.run.args.max_logprobs):
            raise ValueError(f"logprobs and prompt_logprobs may ask for at most "
                             f"{self.run.args.max_logprobs} top tokens here (--max-logprobs)")
        if params.n > len(self.free_rows):
            if params.n > len(self.sampler.samples):
                raise ValueError(f"n = {params.n} is more than the {len(self.sampler.samples)} "
                                 f"sequences the engine runs at once (--max-num-seqs)")
            raise QueueFull(f"{len(self.sequences)} sequences queued or running; no free row")
        # vLLM's server's rule, here for the Python API too: what cannot fit is refused, not cut
        room = self.max_seq_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"max_tokens is too large: {max_tokens:,}. The context is "
                             f"{self._context()} and the prompt has {len(prompt_token_ids):,} "
                             f"({max_tokens:,} > {self.max_seq_len:,} - "
                             f"{len(prompt_token_ids):,}).")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        arrived = self.scheduler.now() if arrival_time is None else arrival_time
        rows = [self.free_rows.popleft() for _ in range(params.n)]
        # A request that scores its prompt computes all of it (vLLM skips its prefix cache too)
        requests = [ServedRequest(row, list(prompt_token_ids), max_tokens, arrival_time=arrived,
                                  reads_cached_prefix=params.prompt_logprobs is None)
                    for row in rows]
        try:
            self.scheduler.refuse_if_larger_than_the_pool(requests[0])  # its samples are alike
            last_token = to_device(np.array(prompt_token_ids[-1:]), self.run.device)  # [1]
            for index, request in enumerate(requests):
                self.sampler.set_row(request.row, params, index, seed, prompt_token_ids,
                                     self.held_back_by_min_tokens(params))
                if self.runner.logprobs:
                    self.runner.logprobs.set_row(request.row, params.logprobs,
                                                 params.prompt_logprobs)
                self.runner.set_last_token(request.row, last_token[0])
                self.sequences[request.row] = Sequence(request, request_id, index, params)
        except BaseException as e:  # the request leaves no trace: its rows are free again
            for row in rows:
                self._release_row(row)
            if isinstance(e, RequestTooLarge):
                raise ValueError(f"the prompt and max_tokens can grow to {e.largest_tokens:,} "
                                 f"tokens, {e.blocks:,} KV blocks of {e.block_size:,}: more than "
                                 f"the whole pool's {e.num_blocks:,}. Lower max_tokens.") from e
            raise
        for request in requests:  # last: queued, it runs
            self.scheduler.add_request(request)
        self.num_prompt_tokens += len(prompt_token_ids)  # once: its samples share it
        return request_id

    def held_back_by_min_tokens(self, params: SamplingParams) -> set[int]:
        """The tokens that would end the answer (vLLM's min-tokens processor holds back the
        same): end of text, unless ignore_eos, and the request's stop tokens in the vocabulary."""
        ends = set() if params.ignore_eos else set(self.stop_ids)
        return ends | {t for t in params.stop_token_ids if t < self.run.model.args.vocab_size}

    def truncated(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: as many as the context takes
        with one to generate), as vLLM cuts it: from the left."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        return prompt_token_ids[-(self.max_seq_len - 1 if k == -1 else k):]

    def abort(self, request_id: str) -> None:
        """End a request's samples now: their blocks and rows are free at once."""
        for sequence in [s for s in self.sequences.values() if s.request_id == request_id]:
            self._end(sequence, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that changed (new tokens or finished). In
        inference mode, as the scripts' Engine.generate runs and the CUDA graphs were captured:
        no autograd, and compiled layers meet the mode they were compiled in (a step in another
        would compile the layers again: on an H200 a server at 64 requests/s stalled so when
        its batch first outgrew the graphs' 512 rows)."""
        self.runner.time_next_step()
        while self.core.has_work():  # with overlap, the first step is launched, not recorded
            step = self.core.step()
            if step is not None:
                return self._collect(step.requests)
        return []

    def _collect(self, requests: list[ServedRequest]) -> list[Sequence]:
        """The step's requests that took a token or finished: stop tokens and strings, text."""
        changed = []
        for request in requests:
            sequence = self.sequences.get(request.row)
            if sequence is None or sequence.request is not request or (
                    len(request.output_tokens) == sequence.num_sent_tokens
                    and request.status != Status.FINISHED):
                continue  # aborted already, or a prompt computed only in part
            changed.append(sequence)
            self.num_generated_tokens += len(request.output_tokens) - sequence.num_sent_tokens
            params = sequence.params
            # A stop token (end of text, unless ignore_eos, or one of stop_token_ids) ends the
            # answer and stays in its token ids, scored and counted, but not in its text unless
            # include_stop_str_in_output: vLLM's "recorded but not rendered". lm-eval sums an
            # echoed continuation's log-probabilities, its last token included.
            stopped = bool(request.output_tokens) and (
                request.output_tokens[-1] in params.stop_token_ids
                or request.output_tokens[-1] in self.stop_ids and not params.ignore_eos)
            if stopped:
                self._end(sequence, "stop")
            rendered = len(request.output_tokens) - (
                stopped and not params.include_stop_str_in_output)
            # Only the new tokens are decoded: from the last whole character on, the bytes start
            # a character afresh. One cut between tokens ends in U+FFFD: it waits for the rest.
            tail = self.tokenizer.decode(request.output_tokens[sequence.num_text_tokens:rendered],
                                         skip_special_tokens=params.skip_special_tokens)
            text = sequence.text
            if not tail.endswith("\ufffd") or request.status == Status.FINISHED or stopped:
                text, sequence.num_text_tokens = text + tail, rendered
            look_from = max(len(sequence.text) - max(map(len, params.stop), default=0), 0)
            found = [(i, len(s)) for s in params.stop  # after min_tokens, as vLLM looks
                     if len(request.output_tokens) > params.min_tokens
                     and (i := text.find(s, look_from)) >= 0]
            if found:  # the first stop string in the text ends it, kept if the request asks
                stop_at, length = min(found)
                text = text[:stop_at + (length if params.include_stop_str_in_output else 0)]
                self._end(sequence, "stop")
            sequence.text, sequence.num_sent_tokens = text, len(request.output_tokens)
            if sequence.finish_reason is None and request.status == Status.FINISHED:
                sequence.finish_reason = "length"
                self._release(sequence)
        return changed

    def _end(self, sequence: Sequence, reason: str) -> None:
        if sequence.finish_reason is not None:
            return
        sequence.finish_reason, request = reason, sequence.request
        if request.status == Status.RUNNING:
            self.core.let_go(request)
        elif request in self.scheduler.waiting:
            self.scheduler.drop(request)
        self._release(sequence)

    def _release(self, sequence: Sequence) -> None:
        self._release_row(sequence.request.row)
        self.num_finished += 1

    def _release_row(self, row: int) -> None:
        self.sequences.pop(row, None)
        self.sampler.release(row)
        if self.runner.logprobs:
            self.runner.logprobs.release(row)
        self.free_rows.append(row)

    def logprobs_of(self, sequence: Sequence, start: int = 0) -> list[dict] | None:
        """The sample's tokens' log-probabilities as vLLM gives them, from token `start` on: for
        each token a dict of token id -> Logprob, the chosen token and the `logprobs`
        likeliest; None if not asked."""
        k, request = sequence.params.logprobs, sequence.request
        if k is None:
            return None
        as_vllm_logprobs = plug("log-probabilities", "as_vllm_logprobs")
        rows = request.logprobs[start:len(request.output_tokens)]
        return [as_vllm_logprobs(row, k, self.tokenizer) for row in rows]

    def prompt_logprobs_of(self, sequence: Sequence) -> list[dict | None] | None:
        """The prompt's as vLLM gives them: None for its first token (nothing before it), then a
        dict as `logprobs_of`'s for each; None if not asked."""
        k, request = sequence.params.prompt_logprobs, sequence.request
        if k is None:
            return None
        as_vllm_logprobs = plug("log-probabilities", "as_vllm_logprobs")
        return [None] + [as_vllm_logprobs(request.prompt_logprobs[i], k, self.tokenizer)
                         for i in range(1, len(request.prompt_tokens))]