"""Blocks shared between requests: reference counts, fork, copy on write, and the prefix cache.

An operating system shares pages after fork(): both processes map the same frames, read-only,
and a process about to write into a shared page first gets its own copy. `SharingBlockManager`
does the same with KV blocks, on top of the plain block manager (block_manager.py).

More in docs/engine-notes.md.
"""

from collections import OrderedDict

import numpy as np

from block_manager import BlockManager
from features.sharing.prefix_cache import PrefixCache


def copy_blocks(cache, sources: list[int], destinations: list[int]) -> None:
    """Each source block's K and V, every layer, into its destination. One copy per block, in
    place: gathering them all first would take as much memory again."""
    if not sources:
        return
    shape = (cache.k.shape[0], *cache.block_shape)  # [n_layers, num_blocks, block_size, H, D]
    for pool in (cache.k, cache.v):
        blocks = pool[:, :cache.num_slots].view(shape)
        for source, destination in zip(sources, destinations):
            blocks[:, destination].copy_(blocks[:, source])


class SharingBlockManager(BlockManager):
    def __init__(self, cache, max_requests: int, max_blocks_per_request: int,
                 prefix_caching: bool):
        super().__init__(cache.num_blocks, cache.block_size, max_requests, max_blocks_per_request,
                         cache.k.device)
        self.cache = cache  # where copies on write are made
        # An ordered dict rather than a queue: the prefix cache takes a block out of the middle.
        self.free_blocks = OrderedDict.fromkeys(range(self.num_blocks))
        self.ref_counts = np.zeros(self.num_blocks, dtype=np.int64)  # requests holding each block
        self.prefix_cache = PrefixCache(self.block_size) if prefix_caching else None
        self.last_lookup = (None, [])  # ((row, tokens, cache version), its cached blocks)
        self.prompt_holders: dict[tuple, int] = {}  # a prompt -> the row of a request holding it
        # What sharing saved, for the report: references taken to blocks computed for another
        # request, copies made; per request at its first admission, the tokens it found cached
        # and whether it forked; per decode step, the slots the requests would hold unshared.
        self.num_shared = self.num_copied = 0
        self.first_cached = np.full(max_requests, -1, dtype=np.int64)
        self.forked = np.zeros(max_requests, dtype=bool)
        self.unshared_slots_at_step: list[int] = []

    def _fork_parent(self, request) -> int | None:
        """The row of a request holding this one's prompt, if this one has generated nothing
        and may read cached tokens."""
        if request.output_tokens or not request.reads_cached_prefix:
            return None
        return self.prompt_holders.get(tuple(request.prompt_tokens))

    def _cached_blocks(self, request) -> list[int]:
        """The blocks of the request's longest cached prefix. Its last token is left out: the
        prefill that computes it needs a slot of the request's own to write. The scheduler asks
        twice per request (how many tokens, how many blocks) and allocate twice more: the last
        answer is kept while the cache and the request are unchanged."""
        if not self.prefix_cache or not request.reads_cached_prefix:
            return []
        question = (request.row, request.num_tokens, self.prefix_cache.version)
        if self.last_lookup[0] != question:
            self.last_lookup = (question, self.prefix_cache.lookup(request.tokens[:-1]))
        return self.last_lookup[1]

    def cached_tokens(self, request) -> int:
        """Tokens that allocate(request) would find cached, not to be computed."""
        if self._fork_parent(request) is not None:
            return len(request.tokens)
        return len(self._cached_blocks(request)) * self.block_size

    def num_blocks_to_allocate(self, request) -> int:
        """Free blocks that allocate(request) would take: cached blocks that no one holds count."""
        if self._fork_parent(request) is not None:
            return 0
        cached = self._cached_blocks(request)
        return self.blocks_needed(len(request.tokens)) - int((self.ref_counts[cached] > 0).sum())

    def allocate(self, request) -> int:
        parent = self._fork_parent(request)
        if parent is not None:
            return self._fork(parent, request)
        tokens, cached = request.tokens, self._cached_blocks(request)
        self._check_free(self.num_blocks_to_allocate(request))
        for block in cached:  # one more holder; a cached block no one held leaves the free pool
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        self.num_shared += len(cached)
        blocks = cached + [self._take_free()
                           for _ in range(self.blocks_needed(len(tokens)) - len(cached))]
        self._hold(request, blocks, len(tokens), len(cached) * self.block_size)
        if self.prefix_cache:  # its full blocks are computed this step: others may take them now
            self.prefix_cache.register(blocks, tokens)
        if not request.output_tokens:
            self.prompt_holders.setdefault(tuple(request.prompt_tokens), request.row)
        return len(cached) * self.block_size

    def _fork(self, parent: int, request) -> int:
        """Share the parent's blocks for every token of the prompt but the last."""
        num_tokens = len(request.prompt_tokens) - 1
        blocks = self.owned_blocks[parent][:self.blocks_needed(num_tokens)]
        self.ref_counts[blocks] += 1
        self.num_shared += len(blocks)
        self.forked[request.row] = True
        self._hold(request, list(blocks), num_tokens, num_tokens)
        return num_tokens

    def _hold(self, request, blocks: list[int], num_tokens: int, cached: int) -> None:
        row = request.row
        self.owned_blocks[row], self.num_tokens[row] = blocks, num_tokens
        self._place(np.full(len(blocks), row), np.arange(len(blocks)), blocks)
        if self.first_cached[row] < 0:
            self.first_cached[row] = cached

    def take_blocks_of(self, rows: list[int], parents: list[int]) -> None:
        """Row rows[i] drops its blocks and holds those of row parents[i] instead, with its token
        count (beam search's children, features/beam_search.py). References are taken first, so
        that no block a row takes is freed when its old holder lets go."""
        old = {row: self.owned_blocks.get(row, []) for row in rows + parents}
        counts = {row: int(self.num_tokens[row]) for row in parents}
        for parent in parents:
            self.ref_counts[old[parent]] += 1
            self.num_shared += len(old[parent])
        for row, parent in zip(rows, parents):
            for block in old[row]:
                self._release(block)
            self._clear(row)
            self.owned_blocks[row], self.num_tokens[row] = list(old[parent]), counts[parent]
            self._place(np.full(len(old[parent]), row), np.arange(len(old[parent])), old[parent])

    def _must_copy(self, rows: np.ndarray) -> list[int]:
        """Rows whose next token goes into a block that is part full and shared. As each copies,
        the count falls; the last holder writes in place."""
        part_full = rows[self.num_tokens[rows] % self.block_size != 0]
        blocks = self.table[part_full, self.num_tokens[part_full] // self.block_size]
        shared = self.ref_counts[blocks] > 1  # most are a request's own: no Python loop for those
        holders_left, must_copy = {}, []
        for row, block in zip(part_full[shared].tolist(), blocks[shared].tolist()):
            holders_left.setdefault(block, int(self.ref_counts[block]))
            if holders_left[block] > 1:
                holders_left[block] -= 1
                must_copy.append(row)
        return must_copy

    def num_blocks_to_append(self, rows: np.ndarray) -> int:
        return super().num_blocks_to_append(rows) + len(self._must_copy(rows))

    def append_token(self, rows: np.ndarray) -> None:
        """Copy on write first: the copy replaces the shared block in the request's list and
        table row, and is made on the GPU before the step writes into it. Then the plain append."""
        must_copy = np.array(self._must_copy(rows), dtype=np.int64)
        self._check_free(self.num_blocks_to_append(rows))
        columns = self.num_tokens[must_copy] // self.block_size
        sources = self.table[must_copy, columns].tolist()
        copies = [self._take_free() for _ in must_copy]
        for row, source, copy in zip(must_copy.tolist(), sources, copies):
            self._release(source)
            self.owned_blocks[row][-1] = copy
        self._place(must_copy, columns, copies)
        copy_blocks(self.cache, sources, copies)
        self.num_copied += len(copies)
        super().append_token(rows)
        self.unshared_slots_at_step.append(self.num_unshared_slots)

    def free(self, request) -> None:
        """Let go of every block; those no one else holds return to the pool. With prefix
        caching, the request's cached tokens key its full blocks, so that they are found again."""
        row = request.row
        blocks = self.owned_blocks.pop(row)
        if self.prefix_cache:
            self.prefix_cache.register(blocks, request.tokens[:self.num_tokens[row]])
        self._clear(row)
        for block in reversed(blocks):  # a prefix's last blocks are reused first, its first last
            self._release(block)
        self.num_tokens[row] = 0
        if self.prompt_holders.get(tuple(request.prompt_tokens)) == row:
            del self.prompt_holders[tuple(request.prompt_tokens)]

    def _take_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        if self.prefix_cache:
            self.prefix_cache.forget(block)  # new tokens will overwrite what it held
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    @property
    def num_unshared_slots(self) -> int:
        """The slots requests would reserve if each held its own blocks: no sharing."""
        return int(-(-self.num_tokens // self.block_size).sum() * self.block_size)
