"""Prefill after cached tokens: a prompt whose first tokens are in the pool already computes only
the rest.

The lesson (llama3_paged.py) prefills every prompt of its static batch from the first token.
Features make prompts that begin cached: a fork shares its parent's blocks and a prompt finds its
system prompt's blocks (features/sharing.py), a swapped request comes back with its K/V
(features/swapping.py), a mixed step computes a prompt in chunks (features/mixed_steps.py). Such
a prompt packs only its new tokens, and its attention reads every token, cached and new, from
the pool through the block table: flash-attn's varlen kernel takes the block table too, and the
reference gathers the prompt's blocks as decode does.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from block_manager import to_device
from features.request_state import ClockedScheduler, ServedRequest, Status
from llama3_paged import (Decoder, Engine, FlashAttention, Generation, KVCache, KVSnapshot,
                          PrefillBatch, Step, TorchAttention, packed_passes)


@dataclass
class CachedPrefillBatch(PrefillBatch):
    block_table: torch.Tensor = None  # [B, max_blocks] int32: each prompt's blocks
    cu_seqlens_k: torch.Tensor = None  # [B + 1] int32: prompt r's tokens, cached and new
    cu_seqlens_k_host: list[int] = None
    max_seqlen_k: int = 0


@dataclass
class ServedSnapshot(KVSnapshot):
    waiting_requests: int = 0  # admitted later: arrivals, preempted requests, a capped batch
    seconds: float = 0.0  # the step's time (features/timed_engine.py: on the GPU)


@dataclass
class ServedGeneration(Generation):
    num_prefilled_tokens: int = 0  # tokens computed by prefill passes: cached ones are not
    most_running: int = 0  # the most requests running at once
    scheduler: object = None  # who ran when: preemptions, swaps (the scheduler)

    @property
    def output_tokens(self) -> list[list[int]]:
        return [r.output_tokens for r in self.requests]

    @property
    def num_generated_tokens(self) -> int:
        return sum(map(len, self.output_tokens))


@dataclass
class CachedPrefillStep(Step):
    num_cached: np.ndarray = None  # [B] tokens of each in the cache already: the pass skips them


class KVCacheAfterPrefix(KVCache):
    def attend_with(self, backend) -> None:
        """Attention through `backend` from now on: the seam where features/cascade.py puts its
        two-part attention around the backend chosen at start-up, once a system prompt's blocks
        are known."""
        self.attention_backend = backend

    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor:
        if not isinstance(batch, CachedPrefillBatch):
            return super().attention(layer, q, k, v, batch)
        self.k[layer].index_copy_(0, batch.slot_mapping, k)
        self.v[layer].index_copy_(0, batch.slot_mapping, v)
        return self.attention_backend.prefill_after_prefix(q, *self.blocks(layer), batch)


class FlashAttentionAfterPrefix(FlashAttention):
    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch: CachedPrefillBatch):
        # The causal mask is aligned to each prompt's end: new tokens see all before them.
        return self.varlen(q, key_blocks, value_blocks, batch.cu_seqlens, batch.cu_seqlens_k,
                           batch.max_seqlen, batch.max_seqlen_k, causal=True,
                           block_table=batch.block_table)


class TorchAttentionAfterPrefix(TorchAttention):
    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch: CachedPrefillBatch):
        out = torch.empty_like(q)
        for r in range(len(batch.cu_seqlens_host) - 1):
            out[slice(*batch.cu_seqlens_host[r:r + 2])] = attend_after_prefix(
                r, q, key_blocks, value_blocks, batch)
        return out


def attend_after_prefix(r: int, q, key_blocks, value_blocks, batch) -> torch.Tensor:
    """Prompt r's new tokens, its every key and value read from its blocks (the reference)."""
    start, end = batch.cu_seqlens_host[r:r + 2]
    n_k = batch.cu_seqlens_k_host[r + 1] - batch.cu_seqlens_k_host[r]
    table = batch.block_table[r, :math.ceil(n_k / key_blocks.shape[1])]
    k, v = (blocks[table].flatten(0, 1)[:n_k] for blocks in (key_blocks, value_blocks))
    return attend(q[start:end], k, v)


def attend(q, k, v) -> torch.Tensor:
    """A prompt's n_q newest tokens over all its n_k: query i, at position n_k - n_q + i, sees the
    keys up to it. q: [n_q, n_heads, d]; k, v: [n_k, n_kv_heads, d]."""
    n_q, n_k = len(q), len(k)
    positions = torch.arange(n_k, device=q.device)
    sees = positions <= positions[n_k - n_q:, None]  # [n_q, n_k]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=sees, enable_gqa=True).transpose(0, 1)


class CachingScheduler(ClockedScheduler):
    """Admission that counts what the block manager found cached for each request."""

    def _admit(self, requests: list[ServedRequest]) -> CachedPrefillStep:
        """Each request's blocks, and a prefill of those with slots to fill. One whose slots are
        all cached but the last token's (a fork, features/sharing.py) joins the decode batch
        directly, which computes that token."""
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
        return CachedPrefillStep("prefill", prefill, rows,
                                 num_cached=np.array(num_cached, dtype=np.int64))

    def _allocate(self, request: ServedRequest) -> int:
        """The request's blocks; how many of its tokens they hold already (features/swapping.py
        brings back a preempted request's K/V here)."""
        return self.manager.allocate(request)


def greedy(logits, rows, lengths) -> torch.Tensor:
    """The likeliest token, [B, vocab] -> [B]: the sampler of a run that samples nothing. A
    sampler (features/sampling.py) reads each row and its length, to seed its draw."""
    return logits.argmax(-1)


class SamplingDecoder(Decoder):
    """The lesson's decode step with the next tokens chosen by `sampler` (greedy, sampled,
    beams), inside the step, so that CUDA graphs record it too."""

    def __init__(self, model, cache, block_table, sampler=greedy):
        super().__init__(model, cache, block_table)
        self.sampler = sampler

    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        logits = self.logits(tokens, positions, rows, slots, max_cache_seqlen)  # [B, vocab]
        return self.sampler(logits, rows, positions + 1)  # [B]


class CachedPrefixEngine(Engine):
    """The lesson's loop, and the parts features choose: how tokens are drawn (`sampler`,
    features/sampling.py) and how a decode step runs (`decoder`: features/cuda_graphs.py's
    graphs, features/cascade.py's two-part attention)."""

    def __init__(self, model, cache, manager, sampler=greedy, decoder=None):
        super().__init__(model, cache, manager)
        self.sampler = sampler
        self.decoder = decoder or SamplingDecoder(model, cache, manager.block_table, sampler)
        self.num_prefilled = 0  # tokens computed by prefill passes, over every run

    def generate(self, scheduler, stop_ids=frozenset(), progress=True) -> ServedGeneration:
        prefilled_before = self.num_prefilled
        scheduler.start_clock()
        g = super().generate(scheduler, stop_ids, progress)
        return ServedGeneration(**vars(g), num_prefilled_tokens=self.num_prefilled - prefilled_before,
                                most_running=scheduler.most_running, scheduler=scheduler)

    def note_the_cache(self, scheduler) -> None:
        self.timeline.append(ServedSnapshot(
            len(self.timeline), len(scheduler.running), self.manager.num_reserved_slots,
            self.manager.num_unfilled_slots, waiting_requests=len(scheduler.waiting)))

    def prefill(self, step: CachedPrefillStep) -> torch.Tensor:
        """Each request's tokens from its first uncached one on."""
        return self.prefill_from(step, [r.tokens[int(start):]
                                        for r, start in zip(step.requests, step.num_cached)])

    def prefill_from(self, step: CachedPrefillStep, new: list[list[int]]) -> torch.Tensor:
        """new[i]: the tokens of request i computed here, from position step.num_cached[i]."""
        self.num_prefilled += sum(map(len, new))
        return torch.cat([self._prefill_pass(step.rows[p], [new[i] for i in p], step.num_cached[p])
                          for p in packed_passes(list(map(len, new)), self.tokens_per_pass)])

    def _prefill_pass(self, rows: np.ndarray, new_tokens: list[list[int]], starts: np.ndarray):
        """One forward pass over new_tokens[i], request rows[i]'s tokens from position starts[i]."""
        on_device = lambda a, dtype=torch.long: to_device(a, self.device, dtype)
        new = np.array([len(t) for t in new_tokens])
        lengths = starts + new  # each one's tokens, cached and new
        if not starts.any():  # the lesson's pass, with this run's sampler
            return self.sampler(self.prefill_logits(rows, new_tokens), on_device(rows),
                                on_device(lengths))
        cu_seqlens, cu_seqlens_k = (np.concatenate([[0], np.cumsum(n)]) for n in (new, lengths))
        # [T]: token j of the pass is at position starts[s] + (j - cu_seqlens[s]) of its request s
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1] - starts, new)
        slots = self.manager.slots(np.repeat(rows, new), positions)
        batch = CachedPrefillBatch(
            on_device(slots), on_device(cu_seqlens, torch.int32), cu_seqlens.tolist(),
            int(new.max()), self.manager.block_table[on_device(rows)],
            on_device(cu_seqlens_k, torch.int32), cu_seqlens_k.tolist(), int(lengths.max()))
        logits = self.model(on_device(np.concatenate(new_tokens)), on_device(positions), self.cache,
                            batch, logits_at=on_device(cu_seqlens[1:] - 1))
        return self.sampler(logits, on_device(rows), on_device(lengths))  # [B]
