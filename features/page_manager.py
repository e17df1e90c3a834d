"""vAttention's page manager: physical pages mapped under each request's contiguous virtual row.

It is the block manager (block_manager.py) with one difference in where a block goes. There, a
new block is written into the block table and the attention kernel follows the table. Here the
table never changes: request r's logical page j is always page r * pages_per_row + j of the
virtual rows, so that its tokens are contiguous. A new page is instead *mapped* at that address,
and the GPU's MMU translates the address to wherever the physical page is, as an operating
system's page table does for a process. Freeing unmaps the request's pages, which return to the
pool. Counting, admission and preemption are the block manager's and the scheduler's, unchanged,
with pages of tokens_per_page tokens for blocks.
"""

import numpy as np
import torch

from block_manager import BlockManager


class PageManager(BlockManager):
    unit = "pages"

    def __init__(self, num_pages: int, tokens_per_page: int, max_requests: int,
                 pages_per_row: int, mapper, device="cpu"):
        super().__init__(num_pages, tokens_per_page, max_requests, pages_per_row, device)
        self.mapper, self.row_tokens = mapper, pages_per_row * tokens_per_page
        # The fixed table: request r lives in virtual row r + 1 (row 0 is the cache's spare row)
        # and its table row lists that row's pages.
        rows = torch.arange(1, max_requests + 1)
        self.block_table.copy_(rows[:, None] * pages_per_row + torch.arange(pages_per_row))

    def _place(self, rows: np.ndarray, columns: np.ndarray, pages: list[int]) -> None:
        for row, column, page in zip(rows.tolist(), columns.tolist(), pages):
            self.mapper.map(page, row, column)

    def _clear(self, row: int, pages: list[int]) -> None:
        self.mapper.unmap(row, len(pages))

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Position p of request r is slot p of its row: contiguous, whatever pages are under it."""
        return (rows + 1) * self.row_tokens + positions
