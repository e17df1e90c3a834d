"""vAttention's page manager: physical pages mapped under each request's contiguous virtual row.

It is the block manager (block_manager.py) with one difference in where a block goes. There, a
new block's number is written into the block table and the attention kernel follows the table.
Here request r's logical page j is always page (r + 1) * pages_per_row + j of the virtual rows, so
that its tokens are contiguous, whichever physical page is taken from the pool. That page is
*mapped* at that address, and the GPU's MMU translates the address to wherever the physical page
is, as an operating system's page table does for a process. Freeing unmaps the request's pages,
which return to the pool. The table only says which virtual row each request is: a row that no
request holds lists zeros, the cache's spare row, whose first page is always mapped, so a CUDA
graph's warm-up step may read any row. Counting, admission and preemption are the block manager's and the scheduler's, unchanged,
with pages of tokens_per_page tokens for blocks.
"""

import numpy as np

from block_manager import BlockManager, OutOfBlocks
from engine.swap import consecutive_runs


class OutOfPages(OutOfBlocks):
    unit = "pages"


class PageManager(BlockManager):

    def __init__(self, num_pages: int, tokens_per_page: int, max_requests: int,
                 pages_per_row: int, mapper, device="cpu"):
        super().__init__(num_pages, tokens_per_page, max_requests, pages_per_row, device)
        self.mapper, self.pages_per_row = mapper, pages_per_row
        self.row_tokens = pages_per_row * tokens_per_page

    def watch_queue(self, waiting) -> None:
        """Pages are mapped as requests need them, never ahead for the queue's prompts
        (features/virtual/mapping_ahead.py's manager does that)."""

    def close(self) -> None:
        """No thread maps beside the loop: nothing to end (the mapping-ahead manager's has one)."""

    def _place(self, rows: np.ndarray, columns: np.ndarray, pages: list[int]) -> None:
        # Request r lives in virtual row r + 1 (row 0 is the cache's spare row).
        for start, end in consecutive_runs(rows, columns):  # a prompt's pages: one run
            self.mapper.map(pages[start:end], int(rows[start]) + 1, int(columns[start]))
        super()._place(rows, columns, ((rows + 1) * self.pages_per_row + columns).tolist())

    def free(self, request) -> None:
        self.mapper.unmap(request.row + 1, 0, len(self.owned_blocks[request.row]))
        super().free(request)  # its row of the table back to the spare row

    def _check_free(self, needed: int) -> None:
        if needed > self.num_free_blocks:
            raise OutOfPages(needed, self.num_free_blocks, self.num_blocks, self.block_size)

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Position p of request r is slot p of its row: contiguous, whatever pages are under it."""
        return (rows + 1) * self.row_tokens + positions
