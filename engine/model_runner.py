"""The engine's model runner: a step's inputs prepared and the model run over the lesson's parts.

More in docs/engine-notes.md.
"""

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from block_manager import to_device
from engine.attention_metadata import AttentionMetadata, Phase
from engine.scheduler import Step
from engine.request import EngineRequest
from engine.seams import plug
from llama3_paged import packed_passes
from plumbing.inputs import TOKENS_PER_PASS


class ModelForward:
    """The one place the engine calls the model: `model(tokens, positions, kv_cache, batch,
    logits_at)`, eagerly or with its layers compiled (--compile; engine/compiled_layers.py, loaded
    only then: it loads the compiler). Compiled, a prefill pass of fewer than
    COMPILED_FROM_TOKENS tokens or a decode step of fewer than COMPILED_FROM_ROWS rows runs the
    eager kernels (torch.compiler.set_stance): launched from Python, they cost the host less.
    Inside `at_any_length` every pass runs the compiled layers, as CUDA graphs record them."""

    def __init__(self, model, compiled: bool = False):
        self.model, self.compiled, self.any_length = model, compiled, False
        self.shortest = {}  # the shortest pass that runs compiled, by whether it prefills
        if compiled:
            from engine.compiled_layers import (COMPILED_FROM_ROWS, COMPILED_FROM_TOKENS,
                                                compile_layers, compiler_settings)
            compile_layers(model)
            self.shortest = {True: COMPILED_FROM_TOKENS, False: COMPILED_FROM_ROWS}
            self.compiler_settings = compiler_settings

    def __call__(self, tokens, positions, kv_cache, batch, logits_at=None) -> torch.Tensor:
        if not self.compiled:
            return self.model(tokens, positions, kv_cache, batch, logits_at)
        if not self.any_length and len(tokens) < self.shortest[batch.prefills]:
            with torch.compiler.set_stance("force_eager"):
                return self.model(tokens, positions, kv_cache, batch, logits_at)
        with self.compiler_settings():
            return self.model(tokens, positions, kv_cache, batch, logits_at)

    @contextlib.contextmanager
    def at_any_length(self):
        """Inside, every pass runs the compiled layers, however short: CUDA graphs record them
        here (features/cuda_graphs.py, features/prefill_graphs.py)."""
        self.any_length = True
        try:
            yield
        finally:
            self.any_length = False


def greedy(logits, rows, lengths) -> torch.Tensor:
    """The likeliest token, [B, vocab] -> [B]: the sampler of a run that samples nothing. A
    sampler (engine/sampler.py) reads each row and its length, to seed its draw."""
    return logits.argmax(-1)


class SamplingDecoder:
    """One decode step of B rows: the model reads each row's blocks through the block table,
    then `sampler` (greedy, sampled, beams) chooses the next tokens, inside the step, so that
    CUDA graphs record it whole."""

    def __init__(self, model, cache, block_table, sampler=greedy):
        self.model, self.cache, self.block_table, self.sampler = model, cache, block_table, sampler

    def logits(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        """tokens, positions, rows, slots: [B] on the device. Returns [B, vocab]."""
        batch = AttentionMetadata(Phase.DECODE, slots, block_table=self.block_table[rows],
                                  cache_seqlens=(positions + 1).int(),  # their rows' lengths
                                  max_cache_seqlen=max_cache_seqlen)
        return self.model(tokens, positions, self.cache, batch)

    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        logits = self.logits(tokens, positions, rows, slots, max_cache_seqlen)  # [B, vocab]
        return self.sampler(logits, rows, positions + 1)  # [B]

    def step(self, tokens, positions, rows, slots) -> torch.Tensor:
        """The same, with positions, rows and slots host arrays (one copy to the device)."""
        inputs = to_device(np.stack([positions, rows, slots]), self.block_table.device)  # [3, B]
        return self.decode(tokens, *inputs, int(positions.max()) + 1)


class StepTimer:
    """Each step's GPU time from CUDA events, read once at the end so that timing adds no sync;
    wall time on the CPU. The time between one step's end and the next one's start is time the
    GPU had nothing to do: it waited for the host."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.starts, self.stops, self.decodes = [], [], []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, decodes: bool) -> None:
        self.starts.append(self._now())
        self.decodes.append(decodes)

    def stop(self) -> None:
        self.stops.append(self._now())

    def _between(self, starts, stops) -> list[float]:
        if not self.cuda:
            return [stop - start for start, stop in zip(starts, stops)]
        torch.cuda.synchronize()
        return [start.elapsed_time(stop) / 1000 for start, stop in zip(starts, stops)]

    def seconds(self) -> list[float]:
        """Each step's GPU time, in order; `decodes` says which decoded."""
        return self._between(self.starts, self.stops)

    def idle_seconds(self) -> float:
        """The GPU's time between steps, in all (on the CPU, the host's: nothing runs ahead)."""
        return sum(self._between(self.stops[:-1], self.starts[1:]))


@dataclass
class StepInFlight:
    """A step queued on the device. Its tokens reach `tokens` on the host once `done` has passed
    (a CUDA event; on the CPU they are there already)."""

    step: Step
    requests: list  # the requests that take a new token: all but a mixed step's partial prompts
    tokens: torch.Tensor  # [len(requests)]
    done: object = None
    logprobs: torch.Tensor | None = None  # [len(requests), 3 + 2k]: features/logprobs/'s rows
    prompt_logprobs: list = ()  # (request, its first prompt token scored, [n, 3 + 2k]) each


@dataclass
class EngineSnapshot:
    """The cache at one decode step, in slots (times kv_bytes_per_token: bytes)."""
    step: int
    running_requests: int
    reserved_slots: int  # slots in blocks owned by running requests
    unfilled_slots: int  # of those, slots holding no token: the fragmentation
    waiting_requests: int = 0  # admitted later: arrivals, preempted requests, a capped batch
    seconds: float = 0.0  # the step's time on the GPU

    @property
    def filled_slots(self) -> int:
        return self.reserved_slots - self.unfilled_slots


@dataclass
class EngineGeneration:
    """What a run of the engine gives back: its requests, each with its output tokens, and how
    the time and the cache went."""
    requests: list  # in order, each with its output_tokens
    prefill_seconds: float
    decode_seconds: float
    timeline: list[EngineSnapshot]  # one per decode or mixed step
    num_prefilled_tokens: int = 0  # tokens computed by prefill passes: cached ones are not
    most_running: int = 0  # the most requests running at once
    scheduler: object = None  # who ran when: preemptions, swaps (the scheduler)
    gpu_idle_seconds: float = 0.0  # the GPU's time between one step's end and the next's start
    num_steps: int = 0  # prefill, decode and mixed
    prefill_gpu_seconds: float = 0.0  # the prefill steps' time on the GPU

    @property
    def fullest(self) -> EngineSnapshot:
        """The step at which the cache held the most tokens."""
        return max(self.timeline, key=lambda s: s.filled_slots,
                   default=EngineSnapshot(0, 0, 0, 0))

    @property
    def output_tokens(self) -> list[list[int]]:
        return [r.output_tokens for r in self.requests]

    @property
    def num_generated_tokens(self) -> int:
        return sum(map(len, self.output_tokens))


def tokens_between(request: EngineRequest, start: int, end: int) -> list[int]:
    """request.tokens[start:end], without copying the rest (a step computes a few of many)."""
    past_prompt = lambda i: max(i - len(request.prompt_tokens), 0)
    return (request.prompt_tokens[start:end]
            + request.output_tokens[past_prompt(start):past_prompt(end)])


class ModelRunner:
    """Prepares and runs one step over the lesson's parts: it holds the model, the pool and its
    block manager, and subclasses none of the lesson's loop (a change there cannot change this)."""

    def __init__(self, model, cache, manager, sampler=greedy, graphs=None, cascade=None,
                 overlap: bool = False, longest_first: bool = False,
                 tokens_per_pass: int | None = None, logprobs=None):
        """model: the lesson's Llama, or the ModelForward that calls it (compiled layers).
        sampler: how tokens are drawn (engine/sampler.py, features/beam_search.py). graphs:
        decode steps as CUDA graphs (features/cuda_graphs.py's GraphDecoder; short prefill passes as
        graphs come with `capture_prefill_graphs`). cascade: the two-part attention of a cached
        system prompt (features/cascade/attention.py's CascadeAttention), already in the cache.
        longest_first: decode steps' rows longest first, so that the attention kernel's last wave is
        short (features/longest_first.py; on CUDA). tokens_per_pass: a prefill pass's size, if not
        the lesson's. logprobs: the rows that ask for log-probabilities, and the decode step that
        gives them, eager and as graphs (features/logprobs/'s Logprobs); None: no row can."""
        self.model, self.cache, self.manager = model, cache, manager
        self.device = manager.block_table.device
        self.tokens_per_pass = tokens_per_pass or TOKENS_PER_PASS
        self.timeline: list[EngineSnapshot] = []  # one per decode or mixed step
        self.sampler, self.overlap = sampler, overlap
        # looked up once here, not at every decode step
        self.sort_rows = plug("longest first") if longest_first else None
        self.eager = SamplingDecoder(model, cache, manager.block_table, sampler)
        self.graphs, self.cascade, self.prefill_graphs = graphs, cascade, None
        self.num_prefilled = 0  # tokens computed by prefill passes, over every run
        self.logprobs, self.prompt_parts = logprobs, []  # this step's prompt log-probabilities

    def capture_prefill_graphs(self) -> None:
        """Short prefill passes replayed as CUDA graphs (features/prefill_graphs.py), for
        requests that arrive over time: most of their passes are a prompt or two."""
        self.prefill_graphs = plug("prefill graphs")(self)

    def decode(self, step: Step, last_tokens: torch.Tensor, logprobs: bool) -> torch.Tensor:
        slots = self.manager.slots(step.rows, step.positions)  # [B]: as prefill finds them
        return self.decode_rows(last_tokens, step.positions, step.rows, slots, logprobs)

    def decode_rows(self, tokens, positions, rows, slots, logprobs: bool = False) -> torch.Tensor:
        """The one place a decode step runs (tokens on the device; positions, rows, slots on the
        host): a CUDA graph where one replays the batch, else kernel by kernel; with a cascade,
        kernel by kernel and without it when the rows do not all share its prefix. [B] tokens,
        or with `logprobs` [B, 3 + 2k] rows of features/logprobs/'s, the token first."""
        eager, graphs = ((self.logprobs.eager, self.logprobs.graphs) if logprobs
                         else (self.eager, self.graphs))
        if self.cascade is not None and not self.cascade.shared_by(rows):
            with self.cascade.set_aside():
                return eager.step(tokens, positions, rows, slots)
        if graphs is not None and graphs.replays(rows):
            return graphs.step(tokens, positions, rows, slots)
        return eager.step(tokens, positions, rows, slots)

    def prefill_logits(self, rows: np.ndarray, prompts: list[list[int]]) -> torch.Tensor:
        """One pass over whole prompts, nothing cached before them: [B, vocab], the logits at
        each one's last token. A CUDA graph where one replays the pass."""
        if self.prefill_graphs is not None and self.prefill_graphs.replays(prompts):
            return self.prefill_graphs.logits(rows, prompts)
        on_device = lambda a, dtype=torch.long: to_device(a, self.device, dtype)
        lengths = np.array([len(p) for p in prompts])
        cu_seqlens, positions, slots = self._pass_slots(rows, lengths, np.zeros_like(lengths))
        batch = AttentionMetadata(Phase.PREFILL, on_device(slots),
                                  on_device(cu_seqlens, torch.int32), cu_seqlens.tolist(),
                                  int(lengths.max()))
        return self.model(on_device(np.concatenate(prompts)), on_device(positions), self.cache,
                          batch, logits_at=on_device(cu_seqlens[1:] - 1))  # [B, vocab]

    def _pass_slots(self, rows: np.ndarray, new: np.ndarray, starts: np.ndarray):
        """Where a pass's tokens go: new[i] tokens of request rows[i], from position starts[i].
        Returns cu_seqlens ([B + 1], the requests' bounds in the pass), positions and slots ([T]:
        token j of the pass is at position starts[s] + (j - cu_seqlens[s]) of its request s)."""
        cu_seqlens = np.concatenate([[0], np.cumsum(new)])
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1] - starts, new)
        return cu_seqlens, positions, self.manager.slots(np.repeat(rows, new), positions)

    def serve(self, num_rows: int) -> None:
        """Steps without `generate`'s run (engine/llm_engine.py's LLMEngine adds requests one
        at a time and steps itself): each row's last token, set by `set_last_token`, and a
        timeline that keeps only the latest snapshot, as a server runs forever."""
        self.last_tokens = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self.timeline = []

    def set_last_token(self, row: int, token: torch.Tensor) -> None:
        """A served request's last prompt token ([] on the device): its first step's input."""
        self.last_tokens[row] = token

    def time_next_step(self) -> None:
        """A served step's own events, not a run's; the snapshots before the latest go."""
        self.timer = StepTimer(self.device)
        del self.timeline[:-1]

    def start_run(self, requests: list[EngineRequest]) -> None:
        """A script's run (engine/engine_core.py's generate): each request's last token, by row,
        on the device (its next decode step's input), and a fresh timer and timeline."""
        self.last_tokens = torch.zeros(len(self.manager.num_tokens), dtype=torch.long,
                                       device=self.device)
        rows = np.array([r.row for r in requests], dtype=np.int64)
        last = np.array([r.tokens[-1] for r in requests], dtype=np.int64)
        self.last_tokens[to_device(rows, self.device)] = to_device(last, self.device)
        self.timer, self.timeline = StepTimer(self.device), []

    def generation(self, requests, prefill_seconds: float, decode_seconds: float,
                   num_prefilled_tokens: int, scheduler) -> EngineGeneration:
        """What the run gave, with each step's GPU time read from its events (one sync)."""
        gpu_seconds = self.timer.seconds()
        decoding = [s for s, decodes in zip(gpu_seconds, self.timer.decodes) if decodes]
        for snapshot, step_seconds in zip(self.timeline, decoding):
            snapshot.seconds = step_seconds
        return EngineGeneration(
            requests, prefill_seconds, decode_seconds, self.timeline,
            num_prefilled_tokens=num_prefilled_tokens, most_running=scheduler.most_running,
            scheduler=scheduler, gpu_idle_seconds=self.timer.idle_seconds(),
            num_steps=len(gpu_seconds), prefill_gpu_seconds=sum(gpu_seconds) - sum(decoding))

    def launch(self, step, scheduler) -> StepInFlight:
        """Queue one step on the device: its forward pass, its tokens stored as the requests'
        last tokens, and their copy to the host."""
        if step.kind != "prefill":
            self.note_the_cache(scheduler)
        if step.kind == "decode" and self.sort_rows is not None:
            step = self.sort_rows(step)
        self.timer.start(step.kind != "prefill")
        rows = to_device(step.rows, self.device)  # [B]
        logprobs = self.logprobs is not None and self.logprobs.any(step.rows)
        chosen = (self.decode(step, self.last_tokens[rows], logprobs) if step.kind == "decode"
                  else self.prefill(step, logprobs))  # a prefill, or a mixed step's pass
        requests, rows, chosen = self._taking_tokens(step, rows, chosen)
        next_tokens = chosen[:, 0].long() if logprobs else chosen  # [B]
        self.last_tokens[rows] = next_tokens  # where the next step reads them
        tokens = self._to_host(next_tokens)  # [B], queued with the rest
        scored = self._to_host(chosen) if logprobs else None
        prompt_parts = [(r, first, self._to_host(part)) for r, first, part in self.prompt_parts]
        self.prompt_parts = []
        self.timer.stop()
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done:
            done.record()
        return StepInFlight(step, requests, tokens, done, scored, prompt_parts)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy to pinned host memory, queued behind the step: there once its event passes."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.device.type == "cuda")
        return host.copy_(tensor, non_blocking=True)

    def wait_for_tokens(self, in_flight: StepInFlight) -> np.ndarray:
        """The step's tokens on the host ([B]): the wait for the GPU, once per step."""
        if in_flight.done:
            in_flight.done.synchronize()
        return in_flight.tokens.numpy()

    def note_the_cache(self, scheduler) -> None:
        self.timeline.append(EngineSnapshot(
            len(self.timeline), len(scheduler.running), self.manager.num_reserved_slots,
            self.manager.num_unfilled_slots, waiting_requests=len(scheduler.waiting)))

    def prefill(self, step: Step, logprobs: bool = False) -> torch.Tensor:
        """Each request's tokens from its first uncached one on, or in a mixed step up to its
        end there (a decode row is no prompt token)."""
        if step.kind != "mixed":
            return self.prefill_from(step, [r.tokens[int(start):]
                                            for r, start in zip(step.requests, step.num_cached)],
                                     logprobs)
        new = [tokens_between(r, int(start), int(end))
               for r, start, end in zip(step.requests, step.num_cached, step.ends)]
        tokens = self.prefill_from(step, new, logprobs)
        self.num_prefilled -= step.num_decoding
        return tokens

    def prefill_from(self, step: Step, new: list[list[int]],
                     logprobs: bool = False) -> torch.Tensor:
        """new[i]: the tokens of request i computed here, from position step.num_cached[i]."""
        self.num_prefilled += sum(map(len, new))
        return torch.cat([self._prefill_pass([step.requests[i] for i in p], step.rows[p],
                                             [new[i] for i in p], step.num_cached[p], logprobs)
                          for p in packed_passes(list(map(len, new)), self.tokens_per_pass)])

    def _prefill_pass(self, requests: list, rows: np.ndarray, new_tokens: list[list[int]],
                      starts: np.ndarray, logprobs: bool):
        """One forward pass over new_tokens[i], request rows[i]'s tokens from position starts[i]:
        [B] tokens, or with `logprobs` [B, 3 + 2k] rows (features/logprobs/'s)."""
        on_device = lambda a, dtype=torch.long: to_device(a, self.device, dtype)
        new = np.array([len(t) for t in new_tokens])
        lengths = starts + new  # each one's tokens, cached and new
        scores_prompts = self.logprobs is not None and self.logprobs.any_prompt(rows)
        if not starts.any() and not scores_prompts:  # the lesson's pass, with this run's sampler
            return self._choose(self.prefill_logits(rows, new_tokens), rows, lengths, logprobs)
        cu_seqlens, positions, slots = self._pass_slots(rows, new, starts)
        cu_seqlens_k = np.concatenate([[0], np.cumsum(lengths)])
        batch = AttentionMetadata(  # nothing cached before the prompts (scored whole): a prefill
            Phase.AFTER_PREFIX if starts.any() else Phase.PREFILL, on_device(slots),
            on_device(cu_seqlens, torch.int32), cu_seqlens.tolist(), int(new.max()),
            block_table=self.manager.block_table[on_device(rows)],
            cu_seqlens_k=on_device(cu_seqlens_k, torch.int32),
            cu_seqlens_k_host=cu_seqlens_k.tolist(), max_seqlen_k=int(lengths.max()))
        last = cu_seqlens[1:] - 1  # [B]: each one's last token, whose logits choose the next
        if not scores_prompts:
            logits = self.model(on_device(np.concatenate(new_tokens)), on_device(positions),
                                self.cache, batch, logits_at=on_device(last))
            return self._choose(logits, rows, lengths, logprobs)
        # The logits at every token of a request that scores its prompt, at the last of others
        scored = self.logprobs.prompt_k[rows] >= 0  # [B]
        at = [np.arange(a, b) if s else np.array([b - 1])
              for a, b, s in zip(cu_seqlens[:-1], cu_seqlens[1:], scored)]
        logits = self.model(on_device(np.concatenate(new_tokens)), on_device(positions), self.cache,
                            batch, logits_at=on_device(np.concatenate(at)))  # [sum of at, vocab]
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in at])])
        for i in np.flatnonzero(scored):  # prompt token p + 1 scored by the logits at p
            prompt = requests[i].prompt_tokens
            count = max(min(new[i], len(prompt) - 1 - starts[i]), 0)
            if count:
                first = int(starts[i]) + 1
                self.prompt_parts.append((requests[i], first, self.logprobs.of(
                    logits[offsets[i]:offsets[i] + count],
                    on_device(np.array(prompt[first:first + count])))))
        return self._choose(logits[on_device(offsets[1:] - 1)], rows, lengths, logprobs)

    def _choose(self, logits, rows: np.ndarray, lengths: np.ndarray, logprobs: bool):
        """The sampler's tokens ([B]) from logits at each request's last token, or with
        `logprobs` features/logprobs/'s rows for them ([B, 3 + 2k], the token first)."""
        on_device = lambda a: to_device(a, self.device, torch.long)
        tokens = self.sampler(logits, on_device(rows), on_device(lengths))  # [B]
        return self.logprobs.of(logits, tokens) if logprobs else tokens

    def _taking_tokens(self, step, rows, next_tokens):
        """The step's requests that take a new token, their rows and tokens: all but a mixed
        step's prompts computed only in part."""
        if step.kind != "mixed" or step.takes_a_token().all():
            return step.requests, rows, next_tokens
        takes = step.takes_a_token()
        taking = to_device(np.flatnonzero(takes), self.device)
        return [r for r, t in zip(step.requests, takes) if t], rows[taking], next_tokens[taking]
