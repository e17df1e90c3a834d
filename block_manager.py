"""Who holds which KV blocks: the block manager at the heart of PagedAttention.

An operating system gives a process virtual pages and maps each to any free physical frame, so
memory need not be contiguous and is claimed only when touched. The block manager does the same
for the KV cache: a request's tokens are its virtual pages (token i is in logical block
i // block_size), the pool's blocks are the physical frames, and the block table is the page
table. A request claims a new block only when its last one is full, so at most block_size - 1
slots per request sit reserved but empty, and a finished request gives every block back at once.

The methods come in pairs, named by the scheduler's questions: `num_blocks_to_allocate` /
`allocate` for a request joining, `num_blocks_to_append` / `append_token` for a decode step,
then `free`.
`slots` is the one translation from a token's position to its place in the pool, for prefill
and decode alike.
"""

from collections import deque

import numpy as np
import torch


def to_device(array: np.ndarray, device, dtype=None) -> torch.Tensor:
    """A host array on the device, without making the host wait: a copy from pinned memory is
    queued like a kernel; one from ordinary memory waits for all that is queued before it."""
    tensor = torch.from_numpy(array)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, dtype, non_blocking=True)


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than asked for. Nothing was allocated."""

    unit = "blocks"

    def __init__(self, needed: int, free: int, total: int, block_size: int):
        self.needed, self.free, self.total, self.block_size = needed, free, total, block_size
        super().__init__(f"needed {needed} {self.unit} of {block_size} tokens, {free} of {total} "
                         f"free")


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, max_requests: int,
                 max_blocks_per_request: int, device="cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = deque(range(num_blocks))  # no request holds them; the oldest go first
        self.owned_blocks: dict[int, list[int]] = {}  # request row -> its physical blocks, in order
        # Tokens each request has cached (or is about to, this step): the slots it fills.
        self.num_tokens = np.zeros(max_requests, dtype=np.int64)
        # The block table, [max_requests, max_blocks_per_request]: row r lists request r's blocks
        # in order. Unused entries are 0, a valid block the kernel never reads (cache_seqlens
        # stops it). A copy on the host for `slots`, one on the device for the attention kernel.
        self.table = np.zeros((max_requests, max_blocks_per_request), dtype=np.int64)
        self.block_table = torch.zeros(self.table.shape, dtype=torch.int32, device=device)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_to_allocate(self, request) -> int:
        """Free blocks that allocate(request) would take."""
        return self.blocks_needed(len(request.tokens))

    def allocate(self, request) -> int:
        """Give a request joining the batch the blocks its tokens fill (the last may be part
        empty). Returns how many of its tokens are cached already: none, here."""
        needed = self.blocks_needed(len(request.tokens))
        if needed > self.table.shape[1]:
            raise ValueError(f"{len(request.tokens)} tokens exceed the table's "
                             f"{self.table.shape[1]} blocks per request")
        self._check_free(needed)
        blocks = [self._take_free() for _ in range(needed)]
        self.owned_blocks[request.row] = blocks
        self.num_tokens[request.row] = len(request.tokens)
        self._place(np.full(needed, request.row), np.arange(needed), blocks)
        return 0

    def num_blocks_to_append(self, rows: np.ndarray) -> int:
        """Free blocks that append_token(rows) would take."""
        return int((self.num_tokens[rows] % self.block_size == 0).sum())

    def append_token(self, rows: np.ndarray) -> None:
        """Reserve a slot for one more token in each of the requests in `rows` ([B]).

        Only a request whose last block is full gets a new one; that is one block per
        `block_size` tokens, so the Python work here is for those few, not for every request."""
        needs_block = rows[self.num_tokens[rows] % self.block_size == 0]
        self._check_free(len(needs_block))
        new_blocks = [self._take_free() for _ in needs_block]
        for row, block in zip(needs_block.tolist(), new_blocks):
            self.owned_blocks[row].append(block)
        # The column of a new block is the next one: the block that position num_tokens opens.
        self._place(needs_block, self.num_tokens[needs_block] // self.block_size, new_blocks)
        self.num_tokens[rows] += 1

    def free(self, request) -> None:
        """A finished (or preempted) request lets go of every block it held."""
        blocks = self.owned_blocks.pop(request.row)
        self._clear(request.row)
        self.free_blocks.extend(blocks)
        self.num_tokens[request.row] = 0

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Where the K/V of the token at positions[i] of request rows[i] goes: the block that holds
        that position, at the offset within it. A slot s is offset s % block_size of block
        s // block_size of the pool. [T] for [T] rows and positions."""
        blocks = self.table[rows, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _take_free(self) -> int:
        return self.free_blocks.popleft()

    def _place(self, rows: np.ndarray, columns: np.ndarray, blocks: list[int]) -> None:
        """Logical block columns[i] of request rows[i] is now physical block blocks[i]. One small
        copy updates every row of the device's table that changed; the others are not touched."""
        if len(blocks) == 0:
            return
        self.table[rows, columns] = blocks
        entries = rows * self.table.shape[1] + columns  # where they are in the flattened table
        device = self.block_table.device
        self.block_table.view(-1)[to_device(entries, device)] = to_device(
            np.asarray(blocks, dtype=np.int32), device)

    def _clear(self, row: int) -> None:
        self.table[row] = 0
        self.block_table[row] = 0

    def _check_free(self, needed: int) -> None:
        if needed > self.num_free_blocks:
            raise OutOfBlocks(needed, self.num_free_blocks, self.num_blocks, self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_reserved_slots(self) -> int:
        """Slots in blocks that requests hold, filled or not."""
        return self.num_used_blocks * self.block_size

    @property
    def num_unfilled_slots(self) -> int:
        """Slots reserved but empty: the fragmentation the paper is about. Only a request's last
        block has empty slots."""
        return int((-self.num_tokens % self.block_size).sum())
