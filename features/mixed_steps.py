"""Mixed steps under a token budget: decode and prefill in one forward pass (--mixed-steps).

With features/continuous.py each step either prefills or decodes, so every prefill step stalls
all running requests for the time of a forward pass over the new prompts. Sarathi-Serve
(Agrawal et al., OSDI 2024) and vLLM V1's scheduler mix the two instead. Each step here:

1. takes one token for every running request whose prompt is computed (its last token, as a
   decode step would), preempting the newest request while their new blocks do not fit;
2. fills the rest of a budget of `max_batched_tokens` with prompt chunks: first of requests
   partly prefilled, then of requests admitted from the head of the queue (the watermark and
   `max_running` as in continuous.py). A long prompt is split across steps.

The engine runs such a step as one prefill pass over the packed tokens: a decode row is a
one-token chunk after a cached prefix, read through the block table like any other. A chunk
that does not end its prompt draws no token. A step with no chunk to add is an ordinary decode
step, and keeps its CUDA graph.

A request admitted takes the blocks of all its tokens at once, so a prompt being chunked never
waits for a block; `prefilling` counts how many of its tokens are computed so far. Those blocks
are written over several steps, which block sharing (features/sharing.py) does not know yet: it
lists a prompt's full blocks in the prefix cache when they are allocated, and a request
preempted halfway through its prompt would leave blocks there that were never written. So mixed
steps run on the plain block manager only, for now.
"""

from dataclasses import dataclass

import numpy as np
import torch

from block_manager import to_device
from features.continuous import ContinuousScheduler
from features.timed_engine import TimedEngine
from features.cached_prefix import CachedPrefillStep
from llama3_paged import Request, Step


@dataclass
class MixedStep(CachedPrefillStep):
    """A prefill pass whose first num_decoding requests compute just their last token (a decode,
    read through the block table as a one-token chunk after a cached prefix), and which computes
    each request's tokens up to ends[i] only ([B]). A request whose chunk stops short of its
    prompt takes no token yet."""

    ends: np.ndarray | None = None
    num_decoding: int = 0

    def takes_a_token(self) -> np.ndarray:
        """Which of the step's requests take their next token now: [B] booleans."""
        return self.ends == np.array([r.num_tokens for r in self.requests])


def tokens_between(request: Request, start: int, end: int) -> list[int]:
    """request.tokens[start:end], without copying the rest (a step computes a few of many)."""
    past_prompt = lambda i: max(i - len(request.prompt_tokens), 0)
    return (request.prompt_tokens[start:end]
            + request.output_tokens[past_prompt(start):past_prompt(end)])


class MixedEngine(TimedEngine):
    def prefill(self, step: MixedStep) -> torch.Tensor:
        """Each request's tokens from num_cached to its end in this step."""
        new = [tokens_between(r, int(start), int(end))
               for r, start, end in zip(step.requests, step.num_cached, step.ends)]
        tokens = self.prefill_from(step, new)
        self.num_prefilled -= step.num_decoding  # a decode row is no prompt token
        return tokens

    def taking_tokens(self, step, rows, next_tokens):
        if not isinstance(step, MixedStep) or step.takes_a_token().all():
            return step.requests, rows, next_tokens
        takes = step.takes_a_token()
        taking = to_device(np.flatnonzero(takes), self.device)
        return [r for r, t in zip(step.requests, takes) if t], rows[taking], next_tokens[taking]


class MixedScheduler(ContinuousScheduler):
    def __init__(self, manager, requests: list, max_running: int | None, max_batched_tokens: int):
        if hasattr(manager, "cached_tokens"):
            raise ValueError("mixed steps do not share blocks yet (see the module's docstring)")
        super().__init__(manager, requests, max_running, chunk_tokens=max_batched_tokens)
        self.budget = max_batched_tokens
        self.prefilling: dict[Request, int] = {}  # running requests still prefilling -> tokens computed

    def schedule(self) -> Step:
        self._wait_for_an_arrival()
        decoding = self._make_room_to_decode()
        rows = self.rows[decoding]  # [D]
        requests = self.running if decoding.all() else [self.running[i] for i in np.flatnonzero(decoding)]
        positions = self.manager.num_tokens[rows].copy()  # the cache holds all but the last
        self.manager.append_token(rows)
        chunks = self._prompt_chunks(self.budget - len(rows))  # [(request, start, end)]
        if not chunks:
            return Step("decode", requests, rows, positions=positions)
        starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
        ends = np.array([end for _, _, end in chunks], dtype=np.int64)
        return MixedStep("mixed", requests + [r for r, _, _ in chunks],
                         np.concatenate([rows, [r.row for r, _, _ in chunks]]).astype(np.int64),
                         num_cached=np.concatenate([positions, starts]),
                         ends=np.concatenate([positions + 1, ends]), num_decoding=len(rows))

    def _make_room_to_decode(self) -> np.ndarray:
        """Preempt the newest requests until every running request past its prompt has room for
        its next token. Returns which running requests decode: [len(running)] booleans."""
        while True:
            decoding = np.ones(len(self.running), dtype=bool)
            if self.prefilling:
                decoding = ~np.isin(self.rows, [r.row for r in self.prefilling])
            if self.manager.num_blocks_to_append(self.rows[decoding]) <= self.manager.num_free_blocks:
                return decoding
            self._preempt_newest()

    def _prompt_chunks(self, budget: int) -> list[tuple[Request, int, int]]:
        """Up to `budget` prompt tokens: chunks of the requests prefilling, then of those that join."""
        chunks = []
        for request, computed in self.prefilling.items():  # in admission order
            if budget <= 0:
                break
            end = min(request.num_tokens, computed + budget)
            chunks.append((request, computed, end))
            budget -= end - computed
        while budget > 0 and self._head_joins():
            request = self.waiting.popleft()
            self._admit([request])  # its blocks
            end = min(request.num_tokens, budget)
            chunks.append((request, 0, end))
            budget -= end
        for request, _, end in chunks:  # what the step will have computed
            self.prefilling[request] = end
            if end == request.num_tokens:
                del self.prefilling[request]
        return chunks

    def _head_joins(self) -> bool:
        """Whether the head of the queue can be admitted now (no waiting for a full chunk here:
        a few prompt tokens ride along with a decode step almost for free)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        if self.waiting[0].arrival_time > self.now():
            return False
        spare = self.watermark_blocks if self.running else 0
        needed = self.manager.num_blocks_to_allocate(self.waiting[0])
        return needed + spare <= self.manager.num_free_blocks

    def _preempt_newest(self) -> None:
        victim = self.running[-1]
        computed = self.prefilling.pop(victim, None)
        if computed is not None:  # its blocks are all reserved, but only `computed` tokens are lost
            self.num_recomputed_tokens -= int(self.manager.num_tokens[victim.row]) - computed
        super()._preempt_newest()
