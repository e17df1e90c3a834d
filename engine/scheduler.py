"""Who waits, who runs, who is preempted: continuous batching on top of the block manager.

Requests wait in a first-come-first-served queue. Each step the scheduler either prefills requests
it has just admitted or decodes one token for every running request, never both:

- Admission. The request at the head of the queue joins as soon as the blocks its tokens fill are
  free, keeping a watermark of blocks spare (vLLM's name for it) so that a request admitted now is
  not preempted a few steps later. At most `max_running` requests run at once, and one prefill
  step takes from a quarter of `chunk_tokens` to all of it. Only the head may join: first come,
  first served.
- Preemption. A decode step gives every running request a slot for its next token. If that needs
  more new blocks than are free, the most recently admitted request is preempted: all its blocks
  go back to the pool (all or nothing, as in the PagedAttention paper, section 4.5) and it returns
  to the head of the queue. Readmitted, it is recomputed: its prompt and every token it had
  generated are prefilled again, and it continues exactly where it stopped.
- Sharing. The K samples of a prompt (--samples) are K requests. When the first is admitted, the
  others that join with it fork from it: they hold its blocks, take no new one, and are not
  prefilled. With prefix caching a request's tokens already in the pool are not computed again,
  which also makes a preempted request's recomputation cheap while its blocks stay cached.

Without --continuous the same loop runs static batching: every request is admitted at the first
step, where running out of blocks is an error, and none is ever preempted.
"""

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.errors import OUT_OF_MEMORY, UserError

# Share of the pool that admission leaves free for the running requests to grow into. vLLM's
# default is 1%; on W2 (README, "Serving a stream") 1% preempted 124 times and 10% 13 times, at
# the same speed: a request admitted into the last free blocks soon needs another.
WATERMARK = 0.1


@dataclass
class Step:
    is_prefill: bool
    requests: np.ndarray  # [B] the requests this step runs, in admission order
    positions: np.ndarray | None = None  # [B] decode: the position each one's newest token takes
    # Prefill: the request whose prompt each one's first token comes from: itself, or for a
    # sample forked from its prompt's first sample, that one. [B]
    sources: np.ndarray | None = None
    num_cached: np.ndarray | None = None  # [B] prefill: tokens of each found in the prefix cache
    copies: tuple[list[int], list[int]] = ([], [])  # decode: blocks to copy first (copy on write)


class Scheduler:
    def __init__(self, manager, prompt_lens: np.ndarray, max_new_tokens: np.ndarray,
                 continuous: bool, max_running: int | None, chunk_tokens: int,
                 sequence_tokens, samples: int = 1):
        """Requests are sequences: with `samples` K, requests r*K .. r*K + K-1 are samples of
        one prompt. `sequence_tokens(r)`: the tokens of request r so far, prompt and outputs."""
        self.manager, self.prompt_lens, self.sequence_tokens = manager, prompt_lens, sequence_tokens
        self.continuous, self.chunk_tokens, self.samples = continuous, chunk_tokens, samples
        self.max_running = max_running or len(prompt_lens)
        # Headroom is for growing into new blocks: a request of one max-length block (the naive
        # cache) never needs another, so its pool keeps none.
        grows = manager.block_table.shape[1] > 1
        self.watermark_blocks = int(WATERMARK * manager.num_blocks) if continuous and grows else 0
        self.waiting = deque(range(len(prompt_lens)))
        self.running = np.zeros(0, dtype=np.int64)  # admission order: the newest is last
        self.num_preemptions = self.num_recomputed_tokens = self.most_running = 0
        self.start, self.admitted_at = time.perf_counter(), np.full(len(prompt_lens), np.nan)
        # At each request's first admission: prompt tokens found in the prefix cache; forked.
        self.first_cached = np.zeros(len(prompt_lens), dtype=np.int64)
        self.forked = np.zeros(len(prompt_lens), dtype=bool)
        if continuous:  # a request that cannot finish alone in the pool would wait forever
            self._refuse_requests_larger_than_the_pool(max_new_tokens)

    def has_work(self) -> bool:
        return bool(self.waiting) or len(self.running) > 0

    def schedule(self, num_generated: np.ndarray) -> Step:
        """The next step: a prefill of newly admitted requests if any can join, else a decode of
        every running one. `num_generated`: [N] tokens each request has generated so far."""
        step = self._admit(num_generated)
        return step if step is not None else self._decode()

    def finish(self, requests: np.ndarray) -> None:
        """Requests that are done let go of every block at once."""
        for r in requests.tolist():
            self.manager.free(r, self.sequence_tokens(r))
        self.running = self.running[~np.isin(self.running, requests)]

    def _admit(self, num_generated: np.ndarray) -> Step | None:
        admitted, tokens = self._head_that_fits(num_generated)
        # A prefill step reads every weight, as a decode step does: one for a few short prompts
        # costs nearly a decode step and adds little. While others run, admission waits until
        # it can take a quarter of a chunk, or the rest of the queue.
        if not admitted or (self.continuous and len(self.running) and len(admitted) < len(self.waiting)
                            and tokens < self.chunk_tokens // 4):
            return None
        requests = np.array([r for r, _ in admitted], dtype=np.int64)
        sources, num_cached = requests.copy(), np.zeros(len(admitted), dtype=np.int64)
        for i, (r, parent) in enumerate(admitted):
            if parent is not None:  # shares every block of its prompt's first sample
                self.manager.fork(parent, r)
                sources[i] = parent
            else:  # recomputed: a preempted request prefills its prompt + generated
                num_cached[i] = self.manager.allocate(r, self.sequence_tokens(r))
            self.waiting.popleft()  # static: allocate raised OutOfBlocks if the batch does not fit
            if np.isnan(self.admitted_at[r]):
                self.admitted_at[r] = time.perf_counter() - self.start
                self.first_cached[r], self.forked[r] = num_cached[i], parent is not None
        self.running = np.concatenate([self.running, requests])
        self.most_running = max(self.most_running, len(self.running))
        return Step(is_prefill=True, requests=requests, sources=sources, num_cached=num_cached)

    def _fork_parent(self, r: int, joining: set, num_generated: np.ndarray) -> int | None:
        """The first sample of r's prompt, if r can share its blocks instead of prefilling: both
        start from the prompt alone, and that one joins in this same step."""
        parent = r - r % self.samples
        if (self.manager.share_samples and parent != r and num_generated[r] == 0
                and num_generated[parent] == 0 and parent in joining):
            return parent
        return None

    def _head_that_fits(self, num_generated: np.ndarray) -> tuple[list, int]:
        """The longest head of the queue that can join now (all of it in static mode), as
        (request, the request it forks from or None), and the tokens its prefill computes."""
        admitted, joining, tokens, blocks = [], set(), 0, 0
        for r in self.waiting:
            parent = self._fork_parent(r, joining, num_generated)
            if not self.continuous:
                admitted.append((r, parent))
                joining.add(r)
                continue
            # A fork takes no block now, and prefills nothing. (With prefix caching this
            # estimate may overcount: a request admitted just before may cache what r needs.)
            sequence = self.sequence_tokens(r) if parent is None else []
            cached = len(self.manager.cached_blocks(sequence)) * self.manager.block_size
            n = len(sequence) - cached
            # The watermark's blocks stay free, unless nothing else runs or joins: then the head
            # request always gets in, and alone it fits (the constructor made sure).
            spare = self.watermark_blocks if admitted or len(self.running) else 0
            blocks += self.manager.blocks_to_allocate(sequence) if sequence else 0
            if (len(self.running) + len(admitted) == self.max_running
                    or admitted and tokens + n > self.chunk_tokens
                    or blocks + spare > self.manager.num_free_blocks):
                break
            admitted.append((r, parent))
            joining.add(r)
            tokens += n
        return admitted, tokens

    def _decode(self) -> Step:
        # A request whose last block is full needs a new one, and one about to write into a
        # shared block a copy of it.
        while self.continuous and (self.manager.blocks_to_append(self.running)
                                   > self.manager.num_free_blocks):
            self._preempt_newest()
        positions = self.manager.num_tokens[self.running].copy()
        copies = self.manager.append_token(self.running)  # static: raises OutOfBlocks when out
        return Step(is_prefill=False, requests=self.running, positions=positions, copies=copies)

    def _preempt_newest(self) -> None:
        victim, self.running = int(self.running[-1]), self.running[:-1]
        self.num_preemptions += 1
        self.num_recomputed_tokens += int(self.manager.num_tokens[victim])
        self.manager.free(victim, self.sequence_tokens(victim))  # with prefix caching, its
        self.waiting.appendleft(victim)  # full blocks stay findable until they are reused

    def _refuse_requests_larger_than_the_pool(self, max_new_tokens: np.ndarray) -> None:
        # The most a request caches: its prompt and every generated token but the last.
        largest = self.prompt_lens + max_new_tokens - 1
        blocks = -(-largest // self.manager.block_size)
        r = int(np.argmax(blocks))
        if blocks[r] > self.manager.num_blocks:
            raise UserError(
                f"Request {r} can grow to {largest[r]:,} tokens ({self.prompt_lens[r]:,} prompt + "
                f"{max_new_tokens[r]:,} new), {blocks[r]:,} blocks of {self.manager.block_size:,}: "
                f"more than the whole pool of {self.manager.num_blocks:,}, so it could never "
                f"finish. Give the KV cache more memory (--kv-budget-gb, "
                f"--gpu-memory-utilization) or lower --max-new-tokens.", OUT_OF_MEMORY)
