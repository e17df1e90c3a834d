"""What a served request carries beyond the lesson's: where it is in its life, and when.

The lesson's static batch admits every request at once and never sends one back, so its
Request is a prompt, a budget and the tokens so far. Served requests need more: continuous
batching sends a running request back to the queue when blocks run out (its Status), arrivals
spread requests over time, and the latency report measures from when each arrived to when each
of its tokens reached the host (features/arrivals.py); the report counts the queue's waits.
"""

import time
from dataclasses import dataclass, field
from enum import Enum

from llama3_paged import Request, Scheduler, append_tokens


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class ServedRequest(Request):
    status: Status = Status.WAITING
    arrival_time: float = 0.0  # seconds from the start: when it asked to run
    admitted_at: float | None = None  # when it first got blocks
    token_times: list[float] = field(default_factory=list)  # when each new token reached the host

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)


class ClockedScheduler(Scheduler):
    """The lesson's scheduler with a clock, each request's status, the most requests that ran at
    once, and what preemption cost: none in a static batch (features/continuous.py and
    swapping.py count theirs), so that the report asks every scheduler the same."""

    def __init__(self, manager, requests: list[ServedRequest]):
        super().__init__(manager, requests)
        self.most_running, self.start = 0, time.perf_counter()
        self.num_preemptions = self.num_recomputed_tokens = self.num_swapped = 0
        self.clock = time.perf_counter  # tests give a fake one

    def now(self) -> float:
        """Seconds since the scheduler was made, or since generation began (start_clock)."""
        return self.clock() - self.start

    def start_clock(self) -> None:
        """Time 0 of arrivals and latencies: set when generation begins, so that set-up done after
        the scheduler was made (a host pool to swap to, CUDA graphs, compiling) is not counted
        as the requests' wait."""
        self.start = self.clock()

    def finish(self, requests: list[ServedRequest]) -> None:
        for request in requests:
            request.status = Status.FINISHED
        super().finish(requests)


def append_tokens_at(requests: list[ServedRequest], new_tokens, stop_ids, now: float) -> list:
    """The lesson's append_tokens, noting when each appended token reached the host (`now`)."""
    before = [len(r.output_tokens) for r in requests]
    done = append_tokens(requests, new_tokens, stop_ids)
    for request, count in zip(requests, before):
        if len(request.output_tokens) > count:
            request.token_times.append(now)
    return done
