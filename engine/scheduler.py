"""The engine's one scheduler: who runs at each step, and which of their tokens it computes.

The lesson's Scheduler (llama3_paged.py) admits every request at the first step. This one does
that too, and what a server needs, each chosen once from the flags; a class of the engine's own
(not the lesson's, nor a chain of subclasses), returning the engine's own Step.

More in docs/engine-notes.md.
"""

import sys
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from engine.request import EngineRequest, Status
from engine.swap import HostBlocks
from plumbing.inputs import TOKENS_PER_PASS

# Share of the pool that admission leaves free for the running requests to grow into (vLLM's
# default is 1%; README, "Serving a stream", measures both).
WATERMARK = 0.1
SAY_WAITS_OVER_SECONDS = 5.0


@dataclass
class Step:
    """What one forward pass computes. "prefill": requests just admitted, each from its first
    uncached token; "decode": one new token for each running request; "mixed": a prefill pass
    whose first num_decoding requests compute just their last token (a decode, read through the
    block table as a one-token chunk after a cached prefix) and which computes each request's
    tokens up to ends[i] only. A request whose chunk stops short of its prompt takes no token."""
    kind: str
    requests: list[EngineRequest]  # in admission order
    rows: np.ndarray  # [B] their rows
    positions: np.ndarray | None = None  # decode: [B] the position each new token takes
    num_cached: np.ndarray | None = None  # prefill, mixed: [B] tokens in the cache already
    ends: np.ndarray | None = None  # mixed: [B] each request's tokens computed after the step
    num_decoding: int = 0  # mixed: how many of the first requests decode

    def takes_a_token(self) -> np.ndarray:
        """Which of the step's requests take their next token now: [B] booleans."""
        if self.kind != "mixed":
            return np.ones(len(self.requests), dtype=bool)
        return self.ends == np.array([r.num_tokens for r in self.requests])


class RequestTooLarge(Exception):
    """A request that could not finish even alone in the whole pool: it would wait forever."""

    def __init__(self, request, largest_tokens: int, blocks: int, manager):
        self.request, self.largest_tokens, self.blocks = request, largest_tokens, blocks
        self.num_blocks, self.block_size = manager.num_blocks, manager.block_size
        super().__init__(f"request {request.row} can grow to {largest_tokens} tokens, "
                         f"{blocks} blocks, more than the pool's {manager.num_blocks}")


class Scheduler:
    def __init__(self, manager, requests: list[EngineRequest], continuous: bool = False,
                 max_running: int | None = None, token_budget: int = TOKENS_PER_PASS,
                 mixed: bool = False, host: HostBlocks | None = None, shares_blocks: bool = False,
                 clock=time.perf_counter, sleep=time.sleep):
        """`clock` and `sleep`: the tests give fake ones, which arrivals wait on."""
        if mixed and shares_blocks:
            raise ValueError("mixed steps do not share blocks yet (see the module's docstring)")
        self.manager, self.waiting = manager, deque(requests)
        self.running: list[EngineRequest] = []  # admission order: the newest is last
        self.rows = np.zeros(0, dtype=np.int64)  # [len(running)] their rows, for the manager
        self.continuous, self.mixed, self.host = continuous, mixed, host
        self.max_running, self.budget = max_running or len(requests), token_budget
        self.cached_tokens = manager.cached_tokens if shares_blocks else lambda request: 0
        # Headroom is for growing into new blocks: a request of one max-length block (the naive
        # cache) never needs another, so its pool keeps none.
        self.grows = manager.table.shape[1] > 1
        self.watermark_blocks = int(WATERMARK * manager.num_blocks) if self.grows else 0
        self.clock, self.sleep, self.start = clock, sleep, clock()
        self.most_running = self.num_preemptions = self.num_recomputed_tokens = 0
        self.num_swapped, self.said_wait = 0, False
        self.prefilling: dict[EngineRequest, int] = {}  # mixed: prompt computed in part -> tokens
        self.swapped: dict[EngineRequest, list[int]] = {}  # -> its blocks in host memory
        for request in requests if continuous else []:
            self.refuse_if_larger_than_the_pool(request)

    def now(self) -> float:
        """Seconds since the scheduler was made, or since generation began (start_clock)."""
        return self.clock() - self.start

    def start_clock(self) -> None:
        """Time 0 of arrivals and latencies, and of the count of requests running at once: set
        when generation begins, so that set-up done after the scheduler was made (a host pool to
        swap to, CUDA graphs, compiling) is not counted as the requests' wait."""
        self.start, self.most_running = self.clock(), len(self.running)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request that arrives while others run (engine/llm_engine.py's LLMEngine),
        once refuse_if_larger_than_the_pool has let it."""
        self.waiting.append(request)

    def refuse_if_larger_than_the_pool(self, request) -> None:
        """RequestTooLarge for a request that could never finish, even alone in the pool."""
        # The most a request caches: its prompt and every generated token but the last.
        largest = len(request.prompt_tokens) + request.max_new_tokens - 1
        blocks = self.manager.blocks_needed(largest)
        if blocks > self.manager.num_blocks:
            raise RequestTooLarge(request, largest, blocks, self.manager)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> Step:
        if not self.continuous:  # the static batch: all admitted at the first step
            if self.waiting:
                joining = list(self.waiting)
                self.waiting.clear()
                return self._admit(joining)
            return self._decode()
        self._wait_for_an_arrival()
        step = self._mixed_step() if self.mixed else self._prefill_or_decode()
        if self.host:
            self.host.flush()  # the K/V copies of its preemptions and returns, before it runs
        return step

    def finish(self, requests: list[EngineRequest]) -> None:
        """Requests that are done give every block back at once."""
        for request in requests:
            request.status = Status.FINISHED
            self.manager.free(request)
            i = self.running.index(request)  # a search in C: no Python loop over the batch
            self.running = self.running[:i] + self.running[i + 1:]
            self.rows = np.delete(self.rows, i)

    def drop(self, request: EngineRequest) -> None:
        """End a request that waits (an abort; a stop token drawn as it was preempted): it leaves
        the queue, and the host blocks it was swapped to are free again."""
        self.waiting.remove(request)
        host = self.swapped.pop(request, None)
        if host is not None:
            self.host.release(host)
        request.status = Status.FINISHED

    def _prefill_or_decode(self) -> Step:
        """A prefill of newly admitted requests if any can join, else a decode of all running."""
        joining = self._head_that_fits()
        if joining:
            for _ in joining:
                self.waiting.popleft()
            step = self._admit(joining)
            if len(step.requests):
                return step
        self._make_room_to_decode()
        return self._decode()

    def _mixed_step(self) -> Step:
        """A token for every running request past its prompt, and prompt chunks up to the budget."""
        decoding = self._make_room_to_decode()
        rows = self.rows[decoding]  # [D]
        requests = (self.running if decoding.all()
                    else [self.running[i] for i in np.flatnonzero(decoding)])
        positions = self.manager.num_tokens[rows].copy()  # the cache holds all but the last
        self.manager.append_token(rows)
        chunks = self._prompt_chunks(self.budget - len(rows))  # [(request, start, end)]
        if not chunks and not len(rows):  # only requests back from the host pool: they decode
            return self._mixed_step()
        if not chunks:
            return Step("decode", requests, rows, positions=positions)
        starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
        ends = np.array([end for _, _, end in chunks], dtype=np.int64)
        return Step("mixed", requests + [r for r, _, _ in chunks],
                         np.concatenate([rows, [r.row for r, _, _ in chunks]]).astype(np.int64),
                         num_cached=np.concatenate([positions, starts]),
                         ends=np.concatenate([positions + 1, ends]), num_decoding=len(rows))

    def _admit(self, requests: list[EngineRequest]) -> Step:
        """Each request's blocks, and a prefill of those with slots to fill (a fork, or a request
        back from the host pool, has none: it joins the decode batch directly)."""
        prefill, num_cached = [], []
        for request in requests:
            cached = self._allocate(request)
            request.status = Status.RUNNING
            if request.admitted_at is None:
                request.admitted_at = self.now()
            if self.manager.num_tokens[request.row] > cached:
                prefill.append(request)
                num_cached.append(cached)
        self.running = self.running + requests
        self.rows = np.concatenate([self.rows, np.array([r.row for r in requests], dtype=np.int64)])
        self.most_running = max(self.most_running, len(self.running))
        rows = np.array([r.row for r in prefill], dtype=np.int64)
        return Step("prefill", prefill, rows, num_cached=np.array(num_cached, dtype=np.int64))

    def _allocate(self, request: EngineRequest) -> int:
        """The request's blocks; how many of its tokens they hold already. One back from the host
        pool takes blocks for all its tokens but the last (whose K/V its next decode step
        computes, as before it left) and gets its K/V back: nothing to prefill."""
        host = self.swapped.pop(request, None)
        if host is None:
            return self.manager.allocate(request)
        self.manager.allocate(SimpleNamespace(row=request.row, tokens=request.tokens[:-1]))
        self.host.copy_in(host, self.manager.owned_blocks[request.row])
        return request.num_tokens - 1

    def _head_that_fits(self) -> list[EngineRequest]:
        """The longest head of the queue that can join now. A prefill step reads every weight, as
        a decode step does: one for a few short prompts costs nearly a decode step and adds
        little. So while others run, admission waits until it can take a quarter of the budget,
        or every request that has arrived, or (the naive cache, whose requests never grow) until
        no other request could take a free block: waiting would leave it idle."""
        joining, tokens, blocks, now = [], 0, 0, self.now()
        for request in self.waiting:
            if request.arrival_time > now:
                break  # the queue is in order of arrival: no one behind has arrived either
            n = len(request.tokens) - self.cached_tokens(request)
            # The watermark's blocks stay free, unless nothing else runs or joins: then the head
            # request always gets in, and alone it fits (refuse_if_larger_than_the_pool).
            spare = self.watermark_blocks if joining or self.running else 0
            blocks += self.manager.num_blocks_to_allocate(request)
            if (len(self.running) + len(joining) == self.max_running
                    or joining and tokens + n > self.budget
                    or blocks + spare > self.manager.num_free_blocks):
                break
            joining.append(request)
            tokens += n
        left_behind = (len(joining) < len(self.waiting)
                       and self.waiting[len(joining)].arrival_time <= now)
        if self.running and self.grows and left_behind and tokens < self.budget // 4:
            return []
        return joining

    def _prompt_chunks(self, budget: int) -> list[tuple[EngineRequest, int, int]]:
        """Up to `budget` prompt tokens: chunks of requests prefilling, then of those joining."""
        chunks = []
        for request, computed in self.prefilling.items():  # in admission order
            if budget <= 0:
                break
            end = min(request.num_tokens, computed + budget)
            chunks.append((request, computed, end))
            budget -= end - computed
        while budget > 0 and self._head_joins():
            request = self.waiting.popleft()
            if len(self._admit([request]).requests):  # else back from the host pool: it decodes
                end = min(request.num_tokens, budget)
                chunks.append((request, 0, end))
                budget -= end
        for request, _, end in chunks:  # what the step will have computed
            self.prefilling[request] = end
            if end == request.num_tokens:
                del self.prefilling[request]
        return chunks

    def _head_joins(self) -> bool:
        """Whether the head of the queue can be admitted into a mixed step now (no waiting for a
        quarter of the budget: a few prompt tokens ride along with a decode step almost free)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        if self.waiting[0].arrival_time > self.now():
            return False
        spare = self.watermark_blocks if self.running else 0
        needed = self.manager.num_blocks_to_allocate(self.waiting[0])
        return needed + spare <= self.manager.num_free_blocks

    def _wait_for_an_arrival(self) -> None:
        """With nothing to run, sleep until the head of the queue arrives: no core spins. A wait
        of more than a few seconds is said once, so a slow --request-rate does not look hung."""
        wait = self.waiting[0].arrival_time - self.now() if self.waiting else 0.0
        if not self.running and wait > SAY_WAITS_OVER_SECONDS and not self.said_wait:
            print(f"Waiting {wait:,.0f} s for the next request to arrive (--request-rate).",
                  file=sys.stderr, flush=True)
            self.said_wait = True
        while not self.running and self.waiting and self.waiting[0].arrival_time > self.now():
            self.sleep(max(self.waiting[0].arrival_time - self.now(), 0.0))

    def _decode(self) -> Step:
        """One token for every running request: a slot each (a new block at a block's end)."""
        positions = self.manager.num_tokens[self.rows].copy()  # the cache holds all but the last
        self.manager.append_token(self.rows)
        return Step("decode", self.running, self.rows, positions=positions)

    def _make_room_to_decode(self) -> np.ndarray:
        """Preempt the newest requests until every running request past its prompt has room for
        its next token. Returns which running requests decode: [len(running)] booleans."""
        while True:
            decoding = ~np.isin(self.rows, [r.row for r in self.prefilling])
            needed = self.manager.num_blocks_to_append(self.rows[decoding])
            if needed <= self.manager.num_free_blocks:
                return decoding
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        victim = self.running[-1]
        computed = self.prefilling.pop(victim, None)  # mixed: its prompt, computed in part
        self.num_preemptions += 1
        if computed is None and self._swap_out(victim):
            self.num_swapped += 1
        else:  # recomputed when it returns: what it had computed is lost
            lost = int(self.manager.num_tokens[victim.row]) if computed is None else computed
            self.num_recomputed_tokens += lost
        self.manager.free(victim)  # with prefix caching, its full blocks stay findable
        victim.status = Status.WAITING
        self.running, self.rows = self.running[:-1], self.rows[:-1]
        self.waiting.appendleft(victim)

    def _swap_out(self, victim: EngineRequest) -> bool:
        """Queue a copy of a decoding victim's K/V to the host pool, if swapping and it fits."""
        decoding = self.manager.num_tokens[victim.row] == victim.num_tokens - 1
        if self.host is None or not decoding:
            return False
        host = self.host.copy_out(self.manager.owned_blocks[victim.row])
        if host is not None:
            self.swapped[victim] = host
        return host is not None
