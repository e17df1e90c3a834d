"""Continuous batching with preemption: a stream of requests on top of the block manager.

The static scheduler (llama3_paged.py) admits every request at the first step. This one keeps a
first-come-first-served queue, and each step either prefills requests it has just admitted or
decodes one token for every running request, never both:

- Admission. The request at the head of the queue joins as soon as the blocks its tokens fill are
  free, keeping a watermark of blocks spare (vLLM's name for it) so that a request admitted now is
  not preempted a few steps later. At most `max_running` requests run at once, and one prefill
  step takes from a quarter of `chunk_tokens` to all of it. Only the head may join: first come,
  first served.
- Arrivals. A request joins no sooner than its `arrival_time` (features/arrivals.py spreads them
  over time; by default every request is there at the start). With nothing running and nothing
  arrived, the scheduler sleeps until the next arrival.
- Preemption. A decode step gives every running request a slot for its next token. If that needs
  more new blocks than are free, the most recently admitted request is preempted: all its blocks
  go back to the pool (all or nothing, as in the PagedAttention paper, section 4.5) and it returns
  to the head of the queue. Readmitted, it is recomputed: its prompt and every token it had
  generated are prefilled again, and it continues exactly where it stopped.
"""

import sys
import time

from features.cached_prefix import CachingScheduler
from features.request_state import Status
from llama3_paged import Step

# Share of the pool that admission leaves free for the running requests to grow into (vLLM's
# default is 1%; README, "Serving a stream", measures both).
WATERMARK = 0.1
SAY_WAITS_OVER_SECONDS = 5.0


class RequestTooLarge(Exception):
    """A request that could not finish even alone in the whole pool: it would wait forever."""

    def __init__(self, request, largest_tokens: int, blocks: int, manager):
        self.request, self.largest_tokens, self.blocks = request, largest_tokens, blocks
        self.num_blocks, self.block_size = manager.num_blocks, manager.block_size
        super().__init__(f"request {request.row} can grow to {largest_tokens} tokens, "
                         f"{blocks} blocks, more than the pool's {manager.num_blocks}")


class ContinuousScheduler(CachingScheduler):
    def __init__(self, manager, requests: list, max_running: int | None, chunk_tokens: int):
        super().__init__(manager, requests)
        self.max_running, self.chunk_tokens = max_running or len(requests), chunk_tokens
        # Headroom is for growing into new blocks: a request of one max-length block (the naive
        # cache) never needs another, so its pool keeps none.
        self.grows = manager.table.shape[1] > 1
        self.watermark_blocks = int(WATERMARK * manager.num_blocks) if self.grows else 0
        self.sleep = time.sleep  # tests give a fake one, with a fake clock
        self.said_wait = False
        for request in requests:
            self.refuse_if_larger_than_the_pool(request)

    def schedule(self) -> Step:
        """A prefill of newly admitted requests if any can join, else a decode of all running."""
        self._wait_for_an_arrival()
        joining = self._head_that_fits()
        if joining:
            for _ in joining:
                self.waiting.popleft()
            step = self._admit(joining)
            if len(step.requests):
                return step
        while self.manager.num_blocks_to_append(self.rows) > self.manager.num_free_blocks:
            self._preempt_newest()
        return self._decode()

    def _head_that_fits(self) -> list:
        """The longest head of the queue that can join now. A prefill step reads every weight, as
        a decode step does: one for a few short prompts costs nearly a decode step and adds
        little. So while others run, admission waits until it can take a quarter of a chunk, or
        every request that has arrived, or (the naive cache, whose requests never grow) until no
        other request could take a free block: waiting would leave it idle."""
        joining, tokens, blocks, now = [], 0, 0, self.now()
        for request in self.waiting:
            if request.arrival_time > now:
                break  # the queue is in order of arrival: no one behind has arrived either
            n = len(request.tokens) - self._cached_tokens(request)
            # The watermark's blocks stay free, unless nothing else runs or joins: then the head
            # request always gets in, and alone it fits (the constructor made sure).
            spare = self.watermark_blocks if joining or self.running else 0
            blocks += self.manager.num_blocks_to_allocate(request)
            if (len(self.running) + len(joining) == self.max_running
                    or joining and tokens + n > self.chunk_tokens
                    or blocks + spare > self.manager.num_free_blocks):
                break
            joining.append(request)
            tokens += n
        left_behind = len(joining) < len(self.waiting) and self.waiting[len(joining)].arrival_time <= now
        waits = self.grows and left_behind
        if self.running and waits and tokens < self.chunk_tokens // 4:
            return []
        return joining

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

    def _cached_tokens(self, request) -> int:
        """Tokens of the request that admission would find cached (features/sharing.py finds
        some; with prefix caching this may overcount a request admitted just before)."""
        cached_tokens = getattr(self.manager, "cached_tokens", None)
        return cached_tokens(request) if cached_tokens else 0

    def _preempt_newest(self) -> None:
        victim = self.running[-1]
        self.num_preemptions += 1
        self._keep(victim)
        self.manager.free(victim)  # with prefix caching, its full blocks stay findable
        victim.status = Status.WAITING
        self.running, self.rows = self.running[:-1], self.rows[:-1]
        self.waiting.appendleft(victim)

    def _keep(self, victim) -> None:
        """What is kept of a preempted request's K/V: nothing, here; its tokens are recomputed
        when it returns. (features/swapping.py copies them to host memory instead.)"""
        self.num_recomputed_tokens += int(self.manager.num_tokens[victim.row])

    def refuse_if_larger_than_the_pool(self, request) -> None:
        """RequestTooLarge for a request that could never finish, even alone in the pool: asked
        of every request as it is queued (features/llm_engine.py's add_request too)."""
        # The most a request caches: its prompt and every generated token but the last.
        largest = len(request.prompt_tokens) + request.max_new_tokens - 1
        blocks = self.manager.blocks_needed(largest)
        if blocks > self.manager.num_blocks:
            raise RequestTooLarge(request, largest, blocks, self.manager)
