"""Who owns which KV blocks: the block manager at the heart of PagedAttention.

An operating system gives a process virtual pages and maps each to any free physical frame, so
memory need not be contiguous and is claimed only when touched. The block manager does the same
for the KV cache: a request's tokens are its virtual pages (token i is in logical block
i // block_size), the pool's blocks are the physical frames, and the block table is the page
table. A request claims a new block only when its last one is full, so at most block_size - 1
slots per request sit reserved but empty, and a finished request gives every block back at once.
"""

from collections import deque

import numpy as np
import torch

from engine.errors import OutOfBlocks


class BlockManager:
    unit = "blocks"  # what the pool is counted in, for the report

    def __init__(self, num_blocks: int, block_size: int, max_requests: int,
                 max_blocks_per_request: int, device="cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = deque(range(num_blocks))  # FIFO: the blocks freed longest ago go first
        self.owned_blocks: dict[int, list[int]] = {}  # request -> its physical blocks, in order
        # Tokens each request has cached (or is about to, this step): the slots it fills.
        self.num_tokens = np.zeros(max_requests, dtype=np.int64)
        # The same table as a padded tensor, for the attention kernel: [max_requests + 1, max_blocks].
        # Unused entries are 0, a valid block the kernel never reads (cache_seqlens stops it).
        # The last row belongs to no request: the padding rows of a CUDA-graph step read it.
        self.block_table = torch.zeros(max_requests + 1, max_blocks_per_request, dtype=torch.int32,
                                       device=device)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_prompt_tokens: int) -> bool:
        return self.blocks_needed(num_prompt_tokens) <= len(self.free_blocks)

    def allocate(self, request: int, num_prompt_tokens: int) -> None:
        """Give a new request the blocks its prompt fills; the last one may be part empty."""
        needed = self.blocks_needed(num_prompt_tokens)
        if needed > self.block_table.shape[1]:
            raise ValueError(f"{num_prompt_tokens} tokens exceed the table's "
                             f"{self.block_table.shape[1]} blocks per request")
        self._check_free(needed)
        blocks = [self.free_blocks.popleft() for _ in range(needed)]
        self.owned_blocks[request] = blocks
        self.num_tokens[request] = num_prompt_tokens
        self._place(np.full(needed, request), np.arange(needed), blocks)

    def append_token(self, requests: np.ndarray) -> None:
        """Reserve a slot for one more token in each of `requests`.

        Only a request whose last block is full gets a new one; that is one block per
        `block_size` tokens, so the Python work here is for those few, not for every request."""
        needs_block = requests[self.num_tokens[requests] % self.block_size == 0]
        self._check_free(len(needs_block))
        if len(needs_block):
            new_blocks = [self.free_blocks.popleft() for _ in needs_block]
            for request, block in zip(needs_block.tolist(), new_blocks):
                self.owned_blocks[request].append(block)
            self._place(needs_block, self.num_tokens[needs_block] // self.block_size, new_blocks)
        self.num_tokens[requests] += 1

    def free(self, request: int) -> None:
        """A finished request returns every block it held."""
        blocks = self.owned_blocks.pop(request)
        self._clear(request, blocks)
        self.free_blocks.extend(blocks)
        self.num_tokens[request] = 0

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
        """Slots in blocks that requests own, filled or not."""
        return self.num_used_blocks * self.block_size

    @property
    def num_filled_slots(self) -> int:
        """Slots holding a token's K/V (or about to, this step)."""
        return int(self.num_tokens.sum())

    @property
    def num_unfilled_slots(self) -> int:
        """Slots reserved by a request but empty: the fragmentation the paper is about."""
        return self.num_reserved_slots - self.num_filled_slots

    def _check_free(self, needed: int) -> None:
        if needed > len(self.free_blocks):
            raise OutOfBlocks(needed, len(self.free_blocks), self.num_blocks, self.block_size,
                              self.unit)
