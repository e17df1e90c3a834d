"""`LLMEngine`, the Python API's engine that takes requests one at a time (vLLM's LLMEngine):
engine/llm.py's `LLM` and serve.py's engine process drive it. It is built where every engine is
(engine/build.py) and steps the same EngineCore, so a served request runs through the same
continuous batching, CUDA graphs and cache as `llama3_paged.py N --continuous`.

More in docs/engine-notes.md.
"""

import dataclasses
import itertools
import random
import time
from collections import deque

import numpy as np
import torch

from block_manager import to_device
from engine.build import allocate_kv_cache, assemble, warm_up
from engine.config import Config
from engine.loader import load
from engine.model_runner import greedy
from engine.request import EngineRequest, Status
from engine.sampler import RowSampler, SamplingParams
from engine.scheduler import RequestTooLarge
from engine.seams import plug
from plumbing.cli import ONE_PROCESS, UserError, torchrun_process


@dataclasses.dataclass(eq=False)
class Sequence:
    """One of a request's n samples: a row of the engine, and what the client has been sent."""

    request: EngineRequest
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


class LLMEngine:
    """Requests in, tokens out, one step at a time (serve.py's engine process calls `step`)."""

    def __init__(self, cache: str = "paged", max_num_seqs: int = 256, argv: list[str] = (),
                 run=None, progress: bool = False, **options):
        """The model and flags from argv and options, or `run`: a model loaded already, with the
        flags it was loaded for (tools/latency_sweep.py's, whose curves share one model).
        progress: say what the start-up's long parts took (serve.py's engine does)."""
        if torchrun_process() is not None:  # each process would serve, none would split
            raise UserError(ONE_PROCESS)
        if run is None:
            args = Config.from_options(cache, {"max_running": max_num_seqs, **options}, argv)
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
        # one `step` returns. Stops: judged here, in _collect.
        self.core = assemble(self.run, self.cache, self.manager, [], self.sampler, max_num_seqs,
                             progress, served=True, graph_sampler=greedy,
                             eager_when=self.sampler.runs_eagerly)
        self.runner, self.scheduler = self.core.runner, self.core.scheduler
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
        requests = [EngineRequest(row, list(prompt_token_ids), max_tokens, arrival_time=arrived,
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
        would compile the layers again, stalling a server when its batch first outgrows the
        graphs' largest: docs/serving-under-load.md)."""
        self.runner.time_next_step()
        while self.core.has_work():  # with overlap, the first step is launched, not recorded
            step = self.core.step()
            if step is not None:
                return self._collect(step.requests)
        return []

    def _collect(self, requests: list[EngineRequest]) -> list[Sequence]:
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
