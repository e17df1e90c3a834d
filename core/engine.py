"""The generation loop: admit, prefill, decode one token per step, retire.

Each step the scheduler (request.py) says who runs. A prefill step computes the prompts of the
requests just admitted, packed into one sequence; a decode step feeds every running request its
newest token (features/mixed_steps.py's steps do both in one prefill pass). Either way the block
manager's `slots` says where each new token's K and V go.

Host work per decode step does not grow with layers x requests: block bookkeeping touches only
requests that cross a block boundary. Each request's newest token stays on the device, where the
next step reads it; the only GPU-to-CPU copy is the sampled tokens, once per step. Here the host
waits for them before it schedules the next step; features/overlap.py schedules step t+1 while
the GPU runs step t.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from core.kv_cache import DecodeBatch, PrefillBatch, to_device
from core.request import Step

PREFILL_CHUNK_TOKENS = 8192  # tokens per prefill pass: big enough for full-speed matmuls,
                             # small enough that activations stay a small share of memory


@dataclass
class KVSnapshot:
    """The cache at one decode step, in slots (multiply by kv_bytes_per_token for bytes), as the
    block manager counts them."""

    step: int
    running_requests: int
    waiting_requests: int
    reserved_slots: int  # slots in blocks owned by running requests
    unfilled_slots: int  # of those, slots holding no token: the fragmentation
    seconds: float = 0.0  # the step's time on the GPU (CUDA events), or wall time on the CPU

    @property
    def filled_slots(self) -> int:
        return self.reserved_slots - self.unfilled_slots


@dataclass
class Generation:
    requests: list  # every Request, in order, with its output_tokens (stop token excluded)
    num_prefilled_tokens: int  # tokens computed by prefill passes
    prefill_seconds: float  # wall time of the prefill steps
    decode_seconds: float  # wall time of the decode steps
    timeline: list[KVSnapshot] = field(default_factory=list)  # one per decode step
    most_running: int = 0  # the largest number of requests running at once
    scheduler: object = None  # who ran when, for the report
    gpu_idle_seconds: float = 0.0  # the GPU's time between one step's end and the next's start
    num_steps: int = 0  # prefill, decode and mixed
    prefill_gpu_seconds: float = 0.0  # the prefill steps' time on the GPU (CUDA events)

    @property
    def output_tokens(self) -> list[list[int]]:
        return [r.output_tokens for r in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_tokens) for r in self.requests)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(r.output_tokens) for r in self.requests)

    @property
    def decode_steps(self) -> int:
        return len(self.timeline)

    @property
    def fullest(self) -> KVSnapshot:
        """The step at which the cache held the most tokens."""
        return max(self.timeline, key=lambda s: s.filled_slots)


def greedy(logits, rows, positions) -> torch.Tensor:
    """The most likely next token of each row: [B, vocab] -> [B]. features/sampling.py samples."""
    return logits.argmax(-1)


def packed_chunks(sizes: list[int], chunk_tokens: int):
    """Consecutive ranges of items whose sizes add up to at most chunk_tokens (one at least)."""
    start = 0
    while start < len(sizes):
        end, total = start + 1, sizes[start]
        while end < len(sizes) and total + sizes[end] <= chunk_tokens:
            total, end = total + sizes[end], end + 1
        yield range(start, end)
        start = end


class EagerDecoder:
    """One decode step, run from Python kernel by kernel: the readable path, and the one --eager
    takes. features/cuda_graphs.py replays the same `decode` as CUDA graphs."""

    def __init__(self, model, cache, block_table, sampler=greedy):
        self.model, self.cache, self.block_table, self.sampler = model, cache, block_table, sampler

    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        """One token for each of B requests: tokens, positions, rows, slots are [B] on device."""
        batch = DecodeBatch(slot_mapping=slots,
                            block_table=self.block_table[rows],  # [B, max_blocks]: their rows
                            cache_seqlens=(positions + 1).int(), max_cache_seqlen=max_cache_seqlen)
        logits = self.model(tokens, positions, self.cache, batch)  # [B, vocab]
        return self.sampler(logits, rows, positions + 1)  # [B]

    def step(self, tokens, positions, rows, slots) -> torch.Tensor:
        """The same with tokens on the device and the rest host arrays ([B] each): the next
        tokens, [B] on device."""
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
class Launched:
    """A step queued on the device. Its tokens reach `tokens` on the host once `ready` has passed
    (a CUDA event; on the CPU they are there already)."""

    step: Step
    drawing: list  # the requests that draw a token: all but a mixed step's partial chunks
    tokens: torch.Tensor  # [len(drawing)]
    ready: object = None


class Engine:
    chunk_tokens = PREFILL_CHUNK_TOKENS

    def __init__(self, model, cache, manager, sampler=greedy, decoder=None):
        self.model, self.cache, self.manager, self.sampler = model, cache, manager, sampler
        self.decoder = decoder or EagerDecoder(model, cache, manager.block_table, sampler)
        self.device = manager.block_table.device
        self.num_prefilled = 0  # tokens computed by prefill passes, over every run

    @torch.inference_mode()
    def generate(self, scheduler, stop_ids=frozenset(), progress: bool = True) -> Generation:
        """Run every request waiting in `scheduler` to the end. A request stops at a token in
        `stop_ids` (not returned) or after its max_new_tokens, then leaves the batch and gives its
        blocks back."""
        requests = list(scheduler.waiting)
        # Each request's newest token, by row, on the device: its next decode step's input.
        self.newest = torch.zeros(len(self.manager.num_tokens), dtype=torch.long, device=self.device)
        rows = np.array([r.row for r in requests], dtype=np.int64)
        last = np.array([r.tokens[-1] for r in requests], dtype=np.int64)
        self.newest[to_device(rows, self.device)] = to_device(last, self.device)
        self.timeline, self.timer = [], StepTimer(self.device)
        prefilled_before = self.num_prefilled
        seconds = {"prefill": 0.0, "decode": 0.0}  # wall time of each kind of step
        # A context, so that the bar is gone before an error message (out of blocks) is printed.
        with tqdm(desc="decode", unit="step", total=steps_left(scheduler), disable=not progress,
                  leave=False) as bar:
            start = time.perf_counter()
            for step in self.steps(scheduler, stop_ids):
                now = time.perf_counter()
                seconds["decode" if step.decodes else "prefill"] += now - start
                start = now
                if step.decodes:
                    bar.update()
                    if bar.n >= bar.total:  # requests from the queue: more steps to come
                        bar.total = bar.n + steps_left(scheduler)
                    bar.set_postfix(running=len(scheduler.running), waiting=len(scheduler.waiting),
                                    blocks=self.manager.num_used_blocks, refresh=False)
        gpu_seconds = self.timer.seconds()
        decoding = [s for s, decodes in zip(gpu_seconds, self.timer.decodes) if decodes]
        for snapshot, step_seconds in zip(self.timeline, decoding):
            snapshot.seconds = step_seconds
        prefill_gpu = sum(gpu_seconds) - sum(decoding)
        return Generation(requests, self.num_prefilled - prefilled_before, seconds["prefill"],
                          seconds["decode"], self.timeline, scheduler.most_running, scheduler,
                          self.timer.idle_seconds(), len(gpu_seconds), prefill_gpu)

    def steps(self, scheduler, stop_ids):
        """One step after the other: schedule it, compute it, wait for its tokens and record
        them, then the next. Yields each step once its tokens are recorded."""
        while scheduler.has_work():
            step = scheduler.schedule()
            launched = self.launch(step, scheduler)
            scheduler.finish(record(launched.drawing, self.collect(launched), stop_ids,
                                    scheduler.now()))
            yield step

    def launch(self, step, scheduler) -> Launched:
        """Queue one step on the device: its forward pass, its sampled tokens stored as the
        drawing requests' newest, and their copy to the host."""
        if step.decodes:  # note the cache as the step finds it
            self.timeline.append(KVSnapshot(len(self.timeline), len(scheduler.running),
                                            len(scheduler.waiting), self.manager.num_reserved_slots,
                                            self.manager.num_unfilled_slots))
        self.timer.start(step.decodes)
        rows = to_device(step.rows, self.device)  # [B]
        next_tokens = self.prefill(step) if step.is_prefill else self.decode(step, rows)
        draws = step.draws()  # every request, but the partial chunks of a mixed step
        drawing = step.requests
        if not draws.all():
            drawing = [r for r, d in zip(step.requests, draws) if d]
            drawn = to_device(np.flatnonzero(draws), self.device)
            rows, next_tokens = rows[drawn], next_tokens[drawn]
        self.newest[rows] = next_tokens  # where the next step reads them
        on_gpu = self.device.type == "cuda"
        tokens = torch.empty(len(drawing), dtype=torch.long, pin_memory=on_gpu)
        tokens.copy_(next_tokens, non_blocking=True)  # [D] to the host, queued with the rest
        self.timer.stop()
        ready = torch.cuda.Event() if on_gpu else None
        if ready:
            ready.record()
        return Launched(step, drawing, tokens, ready)

    def collect(self, launched: Launched) -> np.ndarray:
        """The step's tokens on the host ([D]): the wait for the GPU, once per step."""
        if launched.ready:
            launched.ready.synchronize()
        return launched.tokens.numpy()

    def decode(self, step, rows: torch.Tensor) -> torch.Tensor:
        """One token for every running request (`rows`, [B] on device): its newest token at
        step.positions, its K/V written where the block manager's slots say. Returns the next
        tokens, [B] on device."""
        slots = self.manager.slots(step.rows, step.positions)  # [B]: the same translation as prefill
        return self.decoder.step(self.newest[rows], step.positions, step.rows, slots)

    def prefill(self, step) -> torch.Tensor:
        """Compute the uncached tokens of every request in a prefill step, packed into chunks of
        about chunk_tokens, writing each token's K/V into its slot. Returns each request's next
        token, [B] on device."""
        ends = step.ends if step.ends is not None else [r.num_tokens for r in step.requests]
        new = [r.tokens_between(int(start), int(end))  # [start, end): what this pass computes
               for r, start, end in zip(step.requests, step.num_cached, ends)]
        self.num_prefilled += sum(map(len, new)) - step.num_decoding
        return torch.cat([self._prefill_chunk(step.rows[chunk], [new[i] for i in chunk],
                                              step.num_cached[chunk])
                          for chunk in packed_chunks(list(map(len, new)), self.chunk_tokens)])

    def _prefill_chunk(self, rows: np.ndarray, new_tokens: list[list[int]], starts: np.ndarray):
        """One forward pass over new_tokens[i], the tokens of request rows[i] from position
        starts[i] on (those before are cached)."""
        on_device = lambda a, dtype=torch.long: to_device(a, self.device, dtype)
        new = np.array([len(t) for t in new_tokens])  # the tokens computed here
        lengths = starts + new  # each one's tokens, cached and new
        cu_seqlens = np.concatenate([[0], np.cumsum(new)])
        # [T]: token j of the pass is at position starts[s] + (j - cu_seqlens[s]) of its request s
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1] - starts, new)
        slots = self.manager.slots(np.repeat(rows, new), positions)  # as decode finds them
        batch = PrefillBatch(slot_mapping=on_device(slots),
                             cu_seqlens=on_device(cu_seqlens, torch.int32),
                             cu_seqlens_host=cu_seqlens.tolist(), max_seqlen=int(new.max()))
        if starts.any():  # attention must read the cached tokens too, through the block table
            cu_seqlens_k = np.concatenate([[0], np.cumsum(lengths)])
            batch.block_table = self.manager.block_table[on_device(rows)]
            batch.cu_seqlens_k = on_device(cu_seqlens_k, torch.int32)
            batch.cu_seqlens_k_host, batch.max_seqlen_k = cu_seqlens_k.tolist(), int(lengths.max())
        tokens = on_device(np.concatenate(new_tokens))  # [T]
        last_token_rows, positions = on_device(cu_seqlens[1:] - 1), on_device(positions)
        rows_on_device, next_positions = on_device(rows), on_device(lengths)
        logits = self.model(tokens, positions, self.cache, batch, logits_at=last_token_rows)
        return self.sampler(logits, rows_on_device, next_positions)  # [B, vocab] -> [B]


def steps_left(scheduler) -> int:
    """Decode steps until the longest request still to run could end, for the progress bar: all
    of them in a static batch, the fewest there can be with a queue."""
    pending = [*scheduler.running, *scheduler.waiting]
    return max((r.max_new_tokens - len(r.output_tokens) for r in pending), default=0)


def record(requests: list, new_tokens: np.ndarray, stop_ids, now: float = 0.0) -> list:
    """Append each request's new token, which reached the host at `now` (seconds from the start);
    return those that are done: a stop token (not kept) or their last allowed token."""
    done = []
    for request, token in zip(requests, new_tokens.tolist()):
        if token in stop_ids:
            done.append(request)
            continue
        request.output_tokens.append(token)
        request.token_times.append(now)
        if len(request.output_tokens) >= request.max_new_tokens:
            done.append(request)
    return done
