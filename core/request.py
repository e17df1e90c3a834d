"""A request, and who runs when: the static batch.

A `Request` owns one sequence's state: its prompt, the tokens generated so far, its row of the
block table and its status. The block manager knows it by its row; `slots` and the table are
indexed by it.

The `Scheduler` here is static batching, the original experiment's: every request is admitted
at the first step, and running out of blocks there is an error. Each step is then a prefill of
the requests just admitted, or a decode of one token for every running request.
features/continuous.py extends it to a stream: a queue, admission as blocks free up, preemption.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    row: int  # its row of the block table, and its number: requests are 0 .. N-1
    prompt_tokens: list[int]
    max_new_tokens: int  # it stops after this many, at a stop token, or at max_seq_len
    output_tokens: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    admitted_at: float | None = None  # seconds from the start to its first admission
    arrival_time: float = 0.0  # seconds from the start; features/arrivals.py spreads them out
    token_times: list[float] = field(default_factory=list)  # when each output token reached the host

    @property
    def tokens(self) -> list[int]:
        """Everything the cache must hold for it to go on: its prompt and what it generated."""
        return self.prompt_tokens + self.output_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """tokens[start:end], without copying the rest (a step computes a few of many)."""
        past_prompt = lambda i: max(i - len(self.prompt_tokens), 0)
        return self.prompt_tokens[start:end] + self.output_tokens[past_prompt(start):past_prompt(end)]


@dataclass
class Step:
    is_prefill: bool
    requests: list[Request]  # the requests this step computes, in admission order
    rows: np.ndarray  # [B] their rows
    # Prefill: tokens of each found in the cache already, which the pass skips. [B]
    # Decode: the position each one's newest token takes. [B]
    num_cached: np.ndarray | None = None
    positions: np.ndarray | None = None
    # A mixed step (features/mixed_steps.py) is a prefill whose first num_decoding requests
    # compute just their newest token, and which computes each request's tokens up to ends[i]
    # only ([B]; None: all of them). One that stops short of its tokens draws no token yet.
    ends: np.ndarray | None = None
    num_decoding: int = 0

    @property
    def decodes(self) -> bool:
        """Whether the step decodes a token for running requests (a decode or a mixed step)."""
        return not self.is_prefill or self.num_decoding > 0

    def draws(self) -> np.ndarray:
        """Which of the step's requests draw their next token now: [B] booleans."""
        if self.ends is None:
            return np.ones(len(self.requests), dtype=bool)
        return self.ends == np.array([r.num_tokens for r in self.requests])


class Scheduler:
    def __init__(self, manager, requests: list[Request]):
        self.manager = manager
        self.waiting = deque(requests)
        self.running: list[Request] = []  # admission order: the newest is last
        self.rows = np.zeros(0, dtype=np.int64)  # [len(running)] their rows, for the manager
        self.most_running, self.start = 0, time.perf_counter()
        self.clock = time.perf_counter  # tests give a fake one

    def now(self) -> float:
        """Seconds since the scheduler was made."""
        return self.clock() - self.start

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> Step:
        """The next step: a prefill of every request while any waits, then decode steps."""
        if self.waiting:
            admitted = list(self.waiting)
            self.waiting.clear()
            step = self._admit(admitted)  # raises OutOfBlocks if the batch does not fit
            if len(step.requests):
                return step
        return self._decode()

    def finish(self, requests: list[Request]) -> None:
        """Requests that are done let go of every block at once."""
        for request in requests:
            request.status = Status.FINISHED
            self.manager.free(request)
            i = self.running.index(request)  # a search in C: no Python loop over the batch
            self.running = self.running[:i] + self.running[i + 1:]
            self.rows = np.delete(self.rows, i)

    def _admit(self, requests: list[Request]) -> Step:
        """Give each request its blocks, and a prefill step for those with slots to fill. One whose
        reserved slots are all cached already (features/sharing.py makes such forks: every token
        but the newest) joins the decode batch directly, which computes its newest token."""
        prefill, num_cached = [], []
        for request in requests:
            cached = self._allocate(request)
            request.status = Status.RUNNING
            if request.admitted_at is None:
                request.admitted_at = self.now()
            if self.manager.num_tokens[request.row] > cached:
                prefill.append(request)
                num_cached.append(cached)
        self._set_running(self.running + requests)
        self.most_running = max(self.most_running, len(self.running))
        rows = np.array([r.row for r in prefill], dtype=np.int64)
        return Step(True, prefill, rows, num_cached=np.array(num_cached, dtype=np.int64))

    def _allocate(self, request) -> int:
        """The request's blocks; how many of its tokens they hold already (features/swapping.py
        brings back a preempted request's K/V here)."""
        return self.manager.allocate(request)

    def _decode(self) -> Step:
        positions = self.manager.num_tokens[self.rows].copy()  # the cache holds all but the newest
        self.manager.append_token(self.rows)  # static: raises OutOfBlocks when out
        return Step(False, self.running, self.rows, positions=positions)

    def _set_running(self, running: list[Request]) -> None:
        self.running = running
        self.rows = np.array([r.row for r in running], dtype=np.int64)
