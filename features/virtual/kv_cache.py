"""The KV cache of llama3_virtual.py: every request's K and V in one contiguous virtual row.

vAttention's answer to fragmentation (Prabhu et al., 2024): reserve each request a row for the
maximum length up front, as the naive cache does, but as address space only, and put physical
pages behind it as the request grows (page_manager.py decides when). The attention kernel is
flash-attn's ordinary, non-paged one: rows, `cache_seqlens` and `cache_batch_idx` (which row each
request is), no block table.

Two layouts of the rows (--layout):
- per-layer (vAttention's): a tensor per layer for K and one for V, [rows, row_tokens, n_kv_heads,
  head_dim]. A 2 MB page holds 1,024 tokens of one layer's K: a request maps a page in each of the
  64 tensors at once, and may leave 1,023 slots empty in each.
- per-token: one tensor [rows, row_tokens, n_layers, 2, n_kv_heads, head_dim], all layers of a
  token side by side. A 2 MB page holds 16 tokens of every layer: at most 15 slots empty, as
  paged blocks of 16. Each layer's K is a strided view whose tokens are 128 KiB apart, which
  flash-attn reads as long as the last dimension is contiguous.

Row 0 belongs to no request (request r lives in row r + 1): its first page stays mapped, for
the padding rows of a CUDA-graph step (their K/V go to its first slot, the spare slot), for the
table rows no request holds (the page manager points them here, so a graph's warm-up step reads
mapped memory), and because torch takes a tensor over a range only where its first page is
mapped.
"""

import sys

import torch

from llama3_paged import PrefillBatch
from features.virtual.memory import VirtualMemory

LAYOUTS = ["per-token", "per-layer"]


class VirtualKVCache:
    def __init__(self, args, max_requests: int, max_seq_len: int, dtype, device, attention,
                 layout: str, compiled: bool = False):
        """compiled: the layers around this cache are compiled (engine/compiled_layers.py), and
        its attention is left out of their graphs."""
        from flash_attn import flash_attn_with_kvcache
        self.decode_kernel, self.attention_backend = flash_attn_with_kvcache, attention
        self.memory = VirtualMemory(device)
        n_layers, shape = args.n_layers, (args.n_kv_heads, args.head_dim)
        per_token = layout == "per-token"
        token_bytes = (2 * n_layers if per_token else 1) * args.n_kv_heads * args.head_dim * dtype.itemsize
        self.tokens_per_page = self.memory.page_bytes // token_bytes  # 16 or 1,024 for 8B
        self.block_size = self.tokens_per_page  # the page manager's blocks are pages
        self.pages_per_row = -(-max_seq_len // self.tokens_per_page)
        self.row_tokens = self.pages_per_row * self.tokens_per_page
        self.token_bytes, rows = token_bytes, max_requests + 1
        range_bytes = rows * self.row_tokens * token_bytes
        self.ranges = [self.memory.reserve(range_bytes) for _ in range(1 if per_token else 2 * n_layers)]
        self._map([self._new_page_set()], row=0, first_page=0)  # the spare row's, for good
        self.spare_slot = 0
        tensors = [self.memory.tensor(r, range_bytes, dtype) for r in self.ranges]
        if per_token:  # [rows, row_tokens, n_layers, 2, n_kv_heads, head_dim]
            kv = tensors[0].view(rows, self.row_tokens, n_layers, 2, *shape)
            self.k = [kv[:, :, layer, 0] for layer in range(n_layers)]  # [rows, row_tokens, H, D]
            self.v = [kv[:, :, layer, 1] for layer in range(n_layers)]
        else:  # K of layer 0, V of layer 0, K of layer 1, ...: each [rows, row_tokens, H, D]
            views = [t.view(rows, self.row_tokens, *shape) for t in tensors]
            self.k, self.v = views[0::2], views[1::2]
        self.page_sets = []  # the pool: the page manager's block i is page_sets[i]
        self._rows_batch = self._rows = None  # the last decode batch's rows (_rows_of)
        if compiled:
            self.attention = torch.compiler.disable(self.attention)

    def _new_page_set(self) -> list:
        """One physical page for each range: what a request maps to grow by tokens_per_page."""
        return [self.memory.create_page() for _ in self.ranges]

    def create_pages(self, num_pages: int) -> None:
        """The physical pool, created up front: running out is then a count, not a CUDA error."""
        self.page_sets = [self._new_page_set() for _ in range(num_pages)]

    def map(self, page_sets: list[int], row: int, first_page: int) -> None:
        """Put page sets page_sets[0], [1], ... of the pool under pages first_page, first_page + 1,
        ... of virtual row `row` (1 or more: row 0 is the spare row)."""
        self._map([self.page_sets[s] for s in page_sets], row, first_page)

    def _map(self, page_sets: list[list], row: int, first_page: int) -> None:
        offset = (row * self.row_tokens + first_page * self.tokens_per_page) * self.token_bytes
        for i, start in enumerate(self.ranges):  # one run of pages in each range
            self.memory.map(start + offset, [pages[i] for pages in page_sets])

    def unmap(self, row: int, first_page: int, num_pages: int) -> None:
        """Take pages first_page .. first_page + num_pages - 1 out from under virtual row `row`,
        in every range."""
        offset = (row * self.row_tokens + first_page * self.tokens_per_page) * self.token_bytes
        for start in self.ranges:
            self.memory.unmap(start + offset, num_pages)

    @property
    def nbytes(self) -> int:
        """Physical memory: every page created, the spare row's included."""
        return (len(self.page_sets) + 1) * len(self.ranges) * self.memory.page_bytes

    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor:
        """Store this batch's k, v (`[T, n_kv_heads, head_dim]`) in their slots, then attend."""
        self.k[layer].flatten(0, 1).index_copy_(0, batch.slot_mapping, k)  # row * row_tokens + position
        self.v[layer].flatten(0, 1).index_copy_(0, batch.slot_mapping, v)
        if isinstance(batch, PrefillBatch):
            return self.attention_backend.prefill(q, k, v, batch)
        out = self.decode_kernel(q[:, None], self.k[layer], self.v[layer],  # q: [B, 1, n_heads, d]
                                 cache_seqlens=batch.cache_seqlens,
                                 cache_batch_idx=self._rows_of(batch),
                                 causal=True)
        return out[:, 0]

    def _rows_of(self, batch) -> torch.Tensor:
        """Which row each request of a decode batch is, [B] int32, read off its block table once
        per step rather than once per layer (two small kernels less in each)."""
        if self._rows_batch is not batch:
            self._rows_batch = batch
            self._rows = (batch.block_table[:, 0] // self.pages_per_row).int()
        return self._rows

    def __del__(self):
        # At exit the driver goes with the process, and frees everything itself.
        if getattr(self, "memory", None) is not None and not sys.is_finalizing():
            self.memory.close()
