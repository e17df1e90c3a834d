"""Steps queued on the device, timed with CUDA events: the loop every feature run takes.

The lesson's loop (llama3_paged.py's Engine) copies each request's last token to the device at
every decode step and waits for the step's tokens before anything else. Here:

- each request's last token stays on the device (`last_tokens`, by row), where the next step
  reads it, so a step's inputs never wait for the host (features/overlap.py needs that);
- a step is *launched* (its forward pass, its tokens stored as last tokens and copied to pinned
  host memory, a CUDA event after them) and later *waited for*: overlap.py puts the next step's
  launch in between;
- each step's GPU time is read from CUDA events once at the end, so timing adds no sync, and the
  time between steps is time the GPU waited for the host.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch

from block_manager import to_device
from features.cached_prefix import CachedPrefixEngine, ServedGeneration, greedy
from features.longest_first import longest_first
from features.request_state import append_tokens_at
from llama3_paged import Step


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


@dataclass
class TimedGeneration(ServedGeneration):
    gpu_idle_seconds: float = 0.0  # the GPU's time between one step's end and the next's start
    num_steps: int = 0  # prefill, decode and mixed
    prefill_gpu_seconds: float = 0.0  # the prefill steps' time on the GPU


class TimedEngine(CachedPrefixEngine):

    def __init__(self, model, cache, manager, sampler=greedy, decoder=None,
                 longest_first: bool = False, tokens_per_pass: int | None = None):
        """longest_first: decode steps' rows longest first, so that the attention kernel's last
        wave is short (features/longest_first.py; on CUDA). tokens_per_pass: a prefill pass's
        size, if not the lesson's."""
        super().__init__(model, cache, manager, sampler, decoder)
        self.decode_longest_first = longest_first
        self.tokens_per_pass = tokens_per_pass or self.tokens_per_pass

    def capture_prefill_graphs(self) -> None:
        """Short prefill passes replayed as CUDA graphs (features/prefill_graphs.py), for
        requests that arrive over time: most of their passes are a prompt or two."""
        from features.prefill_graphs import GraphPrefill
        self.prefill_logits = GraphPrefill(self).logits

    def serve(self, num_rows: int) -> None:
        """Steps without `generate`'s run (features/llm_engine.py's LLMEngine adds requests one
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

    def generate(self, scheduler, stop_ids=frozenset(), progress: bool = True) -> TimedGeneration:
        # Each request's last token, by row, on the device: its next decode step's input.
        self.last_tokens = torch.zeros(len(self.manager.num_tokens), dtype=torch.long,
                                       device=self.device)
        rows = np.array([r.row for r in scheduler.waiting], dtype=np.int64)
        last = np.array([r.tokens[-1] for r in scheduler.waiting], dtype=np.int64)
        self.last_tokens[to_device(rows, self.device)] = to_device(last, self.device)
        self.timer = StepTimer(self.device)
        g = super().generate(scheduler, stop_ids, progress)
        gpu_seconds = self.timer.seconds()
        decoding = [s for s, decodes in zip(gpu_seconds, self.timer.decodes) if decodes]
        for snapshot, step_seconds in zip(self.timeline, decoding):
            snapshot.seconds = step_seconds
        return TimedGeneration(**vars(g), gpu_idle_seconds=self.timer.idle_seconds(),
                               num_steps=len(gpu_seconds),
                               prefill_gpu_seconds=sum(gpu_seconds) - sum(decoding))

    def steps(self, scheduler, stop_ids):
        """One step after the other: launch it, wait for its tokens, append them."""
        while scheduler.has_work():
            in_flight = self.launch(scheduler.schedule(), scheduler)
            scheduler.finish(append_tokens_at(in_flight.requests, self.wait_for_tokens(in_flight),
                                              stop_ids, scheduler.now()))
            yield in_flight.step

    def let_go(self, request, scheduler) -> None:
        """The host ends a running request between steps (features/llm_engine.py: an abort, a stop
        string). Here no step is in flight: its blocks are free at once."""
        scheduler.finish([request])

    def launch(self, step, scheduler) -> StepInFlight:
        """Queue one step on the device: its forward pass, its tokens stored as the requests'
        last tokens, and their copy to the host."""
        if step.kind != "prefill":
            self.note_the_cache(scheduler)
        if step.kind == "decode" and self.decode_longest_first:
            step = longest_first(step)
        self.timer.start(step.kind != "prefill")
        rows = to_device(step.rows, self.device)  # [B]
        next_tokens = (self.decode(step, self.last_tokens[rows]) if step.kind == "decode"
                       else self.prefill(step))  # a prefill, or a mixed step's pass
        requests, rows, next_tokens = self.taking_tokens(step, rows, next_tokens)
        self.last_tokens[rows] = next_tokens  # where the next step reads them
        on_gpu = self.device.type == "cuda"
        tokens = torch.empty(len(requests), dtype=torch.long, pin_memory=on_gpu)
        tokens.copy_(next_tokens, non_blocking=True)  # [B] to the host, queued with the rest
        self.timer.stop()
        done = torch.cuda.Event() if on_gpu else None
        if done:
            done.record()
        return StepInFlight(step, requests, tokens, done)

    def taking_tokens(self, step, rows, next_tokens):
        """The step's requests that take a new token, their rows and tokens: all of them here
        (features/mixed_steps.py leaves out prompts it computes only in part)."""
        return step.requests, rows, next_tokens

    def wait_for_tokens(self, in_flight: StepInFlight) -> np.ndarray:
        """The step's tokens on the host ([B]): the wait for the GPU, once per step."""
        if in_flight.done:
            in_flight.done.synchronize()
        return in_flight.tokens.numpy()
