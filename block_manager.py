"""Who holds which KV blocks: the block manager at the heart of PagedAttention.

An operating system gives a process virtual pages and maps each to any free physical frame, so
memory need not be contiguous and is claimed only when touched. The block manager does the same
for the KV cache: a request's tokens are its virtual pages (token i is in logical block
i // block_size), the pool's blocks are the physical frames, and the block table is the page
table. A request claims a new block only when its last one is full, so at most block_size - 1
slots per request sit reserved but empty, and a finished request gives every block back at once.

Blocks can be shared, as an operating system shares pages after fork(). Each block has a
reference count: the number of requests whose table lists it. Samples of one prompt share its
blocks (`fork`); requests that begin with the same tokens share those full blocks (prefix
caching, engine/prefix_cache.py). A shared block is read by all and written by none: a request
about to write into a shared block that is not full first gets its own copy (copy on write). A
block returns to the pool when its count falls to zero.
"""

from collections import OrderedDict

import numpy as np
import torch

from engine.errors import OutOfBlocks
from engine.prefix_cache import PrefixCache


class BlockManager:
    unit = "blocks"  # what the pool is counted in, for the report

    def __init__(self, num_blocks: int, block_size: int, max_requests: int,
                 max_blocks_per_request: int, device="cpu", share_samples: bool = False,
                 prefix_caching: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        # Blocks no request holds, the ones freed longest ago first (they are reused first). An
        # ordered dict rather than a queue: prefix caching takes a cached block out of the middle.
        self.free_blocks = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int64)  # requests holding each block
        self.owned_blocks: dict[int, list[int]] = {}  # request -> its physical blocks, in order
        # Tokens each request has cached (or is about to, this step): the slots it fills.
        self.num_tokens = np.zeros(max_requests, dtype=np.int64)
        self.last_block = np.zeros(max_requests, dtype=np.int64)  # where its next token may go
        self.share_samples = share_samples  # samples of a prompt fork from its first (scheduler.py)
        self.prefix_cache = PrefixCache(block_size) if prefix_caching else None
        # References taken to blocks computed for another request (forks, prefix hits); copies made.
        self.num_shared = self.num_copied = 0
        # The same table as a padded tensor, for the attention kernel: [max_requests + 1, max_blocks].
        # Unused entries are 0, a valid block the kernel never reads (cache_seqlens stops it).
        # The last row belongs to no request: the padding rows of a CUDA-graph step read it.
        self.block_table = torch.zeros(max_requests + 1, max_blocks_per_request, dtype=torch.int32,
                                       device=device)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_blocks(self, tokens) -> list[int]:
        """The blocks of tokens' longest prefix already in the pool (none without prefix caching)."""
        return self.prefix_cache.lookup(tokens) if self.prefix_cache else []

    def blocks_to_allocate(self, tokens) -> int:
        """Free blocks that allocate(tokens) would take: cached blocks that no one holds count."""
        cached = self.cached_blocks(tokens)
        return self.blocks_needed(len(tokens)) - int((self.ref_counts[cached] > 0).sum())

    def allocate(self, request: int, tokens) -> int:
        """Give a new request the blocks its tokens fill (the last may be part empty), taking
        cached ones where it can. Returns how many of its tokens are cached already."""
        needed = self.blocks_needed(len(tokens))
        if needed > self.block_table.shape[1]:
            raise ValueError(f"{len(tokens)} tokens exceed the table's "
                             f"{self.block_table.shape[1]} blocks per request")
        self._check_free(self.blocks_to_allocate(tokens))
        cached = self.cached_blocks(tokens)
        for block in cached:  # one more holder; a cached block no one held leaves the free pool
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        self.num_shared += len(cached)
        blocks = cached + [self._take_free() for _ in range(needed - len(cached))]
        self.owned_blocks[request] = blocks
        self.num_tokens[request], self.last_block[request] = len(tokens), blocks[-1]
        self._place(np.full(needed, request), np.arange(needed), blocks)
        if self.prefix_cache:  # its full blocks are computed this step: others may take them now
            self.prefix_cache.register(blocks, tokens)
        return len(cached) * self.block_size

    def fork(self, parent: int, child: int) -> None:
        """The child (another sample of the parent's prompt) shares every block of the parent."""
        blocks = self.owned_blocks[parent]
        self.ref_counts[blocks] += 1
        self.num_shared += len(blocks)
        self.owned_blocks[child] = list(blocks)
        self.num_tokens[child], self.last_block[child] = self.num_tokens[parent], blocks[-1]
        self._place(np.full(len(blocks), child), np.arange(len(blocks)), blocks)

    def blocks_to_append(self, requests: np.ndarray) -> int:
        """Free blocks that append_token(requests) would take."""
        return int((self.num_tokens[requests] % self.block_size == 0).sum()) + len(
            self._must_copy(requests))

    def append_token(self, requests: np.ndarray) -> tuple[list[int], list[int]]:
        """Reserve a slot for one more token in each of `requests`. Returns the copies to make
        before the step writes: (source blocks, destination blocks).

        Only a request whose last block is full gets a new one; that is one block per
        `block_size` tokens, so the Python work here is for those few, not for every request."""
        needs_block = requests[self.num_tokens[requests] % self.block_size == 0].tolist()
        must_copy = self._must_copy(requests)
        self._check_free(len(needs_block) + len(must_copy))
        new_blocks = [self._take_free() for _ in needs_block]
        for request, block in zip(needs_block, new_blocks):
            self.owned_blocks[request].append(block)
        # Copy on write: the copy replaces the shared block in the request's list and table row.
        sources = [int(self.last_block[r]) for r in must_copy]
        copies = [self._take_free() for _ in must_copy]
        for request, source, copy in zip(must_copy, sources, copies):
            self._release(source)
            self.owned_blocks[request][-1] = copy
        changed = np.array(needs_block + must_copy, dtype=np.int64)
        if len(changed):
            self.last_block[changed] = new_blocks + copies
            # The column of a new block is the next one; a copy takes the shared block's column.
            self._place(changed, self.num_tokens[changed] // self.block_size, new_blocks + copies)
        self.num_tokens[requests] += 1
        self.num_copied += len(copies)
        return sources, copies

    def _must_copy(self, requests: np.ndarray) -> list[int]:
        """Requests whose next token goes into a block that is part full and shared. As each
        copies, the count falls; the last holder writes in place."""
        shared = requests[(self.num_tokens[requests] % self.block_size != 0)
                          & (self.ref_counts[self.last_block[requests]] > 1)]
        holders_left, must_copy = {}, []
        for request in shared.tolist():
            block = int(self.last_block[request])
            holders_left.setdefault(block, int(self.ref_counts[block]))
            if holders_left[block] > 1:
                holders_left[block] -= 1
                must_copy.append(request)
        return must_copy

    def free(self, request: int, tokens=None) -> None:
        """A finished (or preempted) request lets go of every block it held. With prefix caching,
        `tokens` (its cached ones) key its full blocks, so that they can be found again."""
        blocks = self.owned_blocks.pop(request)
        if self.prefix_cache and tokens is not None:
            self.prefix_cache.register(blocks, tokens[:self.num_tokens[request]])
        self._clear(request, blocks)
        for block in reversed(blocks):  # a prefix's last blocks are reused first, its first last
            self._release(block)
        self.num_tokens[request] = 0

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

    def _place(self, requests: np.ndarray, columns: np.ndarray, blocks: list[int]) -> None:
        """Logical block columns[i] of requests[i] is now physical block blocks[i]. One small
        copy updates every row that changed; the other rows are not touched."""
        self.block_table[torch.from_numpy(requests), torch.from_numpy(columns)] = (
            torch.tensor(blocks, dtype=torch.int32).to(self.block_table.device))

    def _clear(self, request: int, blocks: list[int]) -> None:
        self.block_table[request] = 0

    def slots(self, request: int, start: int, end: int) -> np.ndarray:
        """Flat slot index of positions start..end-1 of a request: block * block_size + offset."""
        positions = np.arange(start, end)
        blocks = np.asarray(self.owned_blocks[request])[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_reserved_slots(self) -> int:
        """Slots in blocks that requests hold, filled or not, each block counted once."""
        return self.num_used_blocks * self.block_size

    @property
    def num_unfilled_slots(self) -> int:
        """Slots reserved but empty: the fragmentation the paper is about. Only a request's last
        block has empty slots, and after append_token no last block is shared (copy on write)."""
        return int((-self.num_tokens % self.block_size).sum())

    @property
    def num_filled_slots(self) -> int:
        """Slots holding a token's K/V (or about to, this step), each counted once."""
        return self.num_reserved_slots - self.num_unfilled_slots

    @property
    def num_unshared_slots(self) -> int:
        """The slots requests would reserve if each held its own blocks: no sharing."""
        return int(-(-self.num_tokens // self.block_size).sum() * self.block_size)

    def _check_free(self, needed: int) -> None:
        if needed > len(self.free_blocks):
            raise OutOfBlocks(needed, len(self.free_blocks), self.num_blocks, self.block_size,
                              self.unit)
