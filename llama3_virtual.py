"""Virtual batched Llama 3 decoding: each request's KV cache is one contiguous row of virtual
memory, with physical pages mapped in as it grows (vAttention's idea).

    python llama3_virtual.py 49 --random-weights

Read it after llama3_paged.py: the model, the loop and the report are the lesson's, imported.
As in the naive script, each request gets a row of max_seq_len tokens up front, but as address
space only, which costs nothing; the loop maps 2 MB pages, created once, under a row as its
request grows, and unmaps them when it ends (virtual_pages.py). flash-attn's non-paged kernel
reads the contiguous rows. --layout per-token: a page holds 16 tokens of every layer of Llama 3
8B, as a paged block; per-layer (vAttention's): 1,024 tokens of one layer's K or V. The engine
(any feature's flag) maps pages ahead on a thread. Needs CUDA, flash-attn and cuda-python.
"""

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends in one line, exit 130
    from plumbing.interrupt import exit_quietly_on_ctrl_c
    exit_quietly_on_ctrl_c("llama3_virtual.py")

import sys

import llama3_paged as lesson
from plumbing import cli
from plumbing.inputs import kv_budget_bytes
from virtual_pages import PageManager, VirtualMemory

SCRIPT, LAYOUTS = "llama3_virtual.py", ["per-token", "per-layer"]


class VirtualKVCache:
    """Row 0 is no request's (request r's is row r + 1): its first page stays mapped, for the
    table's rows no request holds and for torch (a tensor over a range needs its first page)."""

    def __init__(self, args, max_requests: int, max_seq_len: int, dtype, device, attention,
                 layout: str):
        from flash_attn import flash_attn_with_kvcache
        self.decode_kernel, self.attention_backend = flash_attn_with_kvcache, attention
        self.memory = VirtualMemory(device)
        n_layers, H, D = args.n_layers, args.n_kv_heads, args.head_dim
        num_ranges = 1 if layout == "per-token" else 2 * n_layers  # per-layer: each K, each V
        self.token_bytes = 2 * n_layers // num_ranges * H * D * dtype.itemsize  # in one range
        self.tokens_per_page = self.block_size = self.memory.page_bytes // self.token_bytes
        self.pages_per_row = -(-max_seq_len // self.tokens_per_page)
        self.row_tokens, rows = self.pages_per_row * self.tokens_per_page, max_requests + 1
        range_bytes = rows * self.row_tokens * self.token_bytes
        self.ranges = [self.memory.reserve(range_bytes) for _ in range(num_ranges)]
        self._map([self._new_pages()], row=0, first_page=0)  # the spare row's, for good
        self.spare_slot, self.page_sets = 0, []  # the page manager's page i is page_sets[i]
        tensors = [self.memory.tensor(r, range_bytes, dtype) for r in self.ranges]
        if num_ranges == 1:  # per-token: [rows, row_tokens, n_layers, 2, H, D]
            kv = tensors[0].view(rows, self.row_tokens, n_layers, 2, H, D)
            self.k, self.v = ([kv[:, :, layer, i] for layer in range(n_layers)] for i in (0, 1))
        else:  # K of layer 0, V of layer 0, K of layer 1, ...
            views = [t.view(rows, self.row_tokens, H, D) for t in tensors]
            self.k, self.v = views[0::2], views[1::2]  # each layer's [rows, row_tokens, H, D]

    def _new_pages(self) -> list:  # a page in each range: what a row grows by tokens_per_page
        return [self.memory.create_page() for _ in self.ranges]

    def create_pages(self, num_pages: int) -> None:
        """The physical pool, created up front: running out is then a count, not a CUDA error."""
        self.page_sets = [self._new_pages() for _ in range(num_pages)]

    def map(self, page_sets: list[int], row: int, first_page: int) -> None:
        """Pool pages page_sets[0], [1], ... under pages first_page, first_page + 1, ... of row."""
        self._map([self.page_sets[s] for s in page_sets], row, first_page)

    def _map(self, page_sets: list[list], row: int, first_page: int) -> None:
        offset = (row * self.row_tokens + first_page * self.tokens_per_page) * self.token_bytes
        for i, start in enumerate(self.ranges):  # one run of pages in each range
            self.memory.map(start + offset, [pages[i] for pages in page_sets])

    def unmap(self, row: int, first_page: int, num_pages: int) -> None:
        offset = (row * self.row_tokens + first_page * self.tokens_per_page) * self.token_bytes
        for start in self.ranges:
            self.memory.unmap(start + offset, num_pages)

    @property
    def nbytes(self) -> int:
        """Physical memory: every page created, the spare row's included."""
        return (len(self.page_sets) + 1) * len(self.ranges) * self.memory.page_bytes

    def attention(self, layer: int, q, k, v, batch):
        """Store this batch's k, v ([T, n_kv_heads, head_dim]) in their slots, then attend."""
        self.k[layer].flatten(0, 1).index_copy_(0, batch.slot_mapping, k)  # row * row_tokens + p
        self.v[layer].flatten(0, 1).index_copy_(0, batch.slot_mapping, v)
        if isinstance(batch, lesson.PrefillBatch):
            return self.attention_backend.prefill(q, k, v, batch)
        return self.decode_kernel(q[:, None], self.k[layer], self.v[layer],  # q: [B, 1, H, D]
                                  cache_seqlens=batch.cache_seqlens,
                                  cache_batch_idx=self.rows_of(batch), causal=True)[:, 0]

    def rows_of(self, batch):
        """[B] int32: each request's row, read off its first page in the block table."""
        return (batch.block_table[:, 0] // self.pages_per_row).int()

    def __del__(self):  # at exit the driver goes with the process, and frees everything itself
        if getattr(self, "memory", None) is not None and not sys.is_finalizing():
            self.memory.close()


def add_layout_arguments(parser):
    parser.add_argument("--layout", choices=LAYOUTS, default=LAYOUTS[0],
                        help="per-token: layers side by side; per-layer: vAttention's")


def require_cuda_and_flash_attn(args) -> None:
    """Checked from the flags, before minutes of loading the model."""
    if (args.device.type != "cuda" or args.attn not in ("auto", "flash")
            or not all(map(cli.importable, ["flash_attn", "cuda.bindings"]))):
        raise cli.UserError(f"{SCRIPT} maps GPU memory with CUDA's virtual memory API and attends "
                            f"with flash-attn: it needs --device cuda, flash-attn (--attn flash or "
                            f"auto) and cuda-python (`pip install flash-attn cuda-python`).")


def allocate_kv_cache(run, cache_class=VirtualKVCache, manager_class=PageManager, **options):
    """A row of address space for every request, reserved up front at no cost, and physical pages,
    as many as memory holds, to be mapped under the rows as requests grow. The engine passes its
    own classes (features/virtual/kv_cache.py)."""
    cache = cache_class(run.model.args, run.num_sequences, run.args.max_seq_len, run.dtype,
                        run.device, run.attention, run.args.layout, **options)
    page_bytes = cache.tokens_per_page * run.kv_bytes_per_token  # a page in every tensor
    num_pages = int(kv_budget_bytes(run) // page_bytes)
    if num_pages == 0:
        raise cli.UserError(f"Not one page of {cli.format_bytes(page_bytes)} fits in the KV "
                            f"budget. Raise --kv-budget-gb or --gpu-memory-utilization.",
                            cli.OUT_OF_MEMORY)
    cache.create_pages(num_pages)
    # The block table lists the virtual pages of each request's row; the MMU does the rest.
    return cache, manager_class(num_pages, cache.tokens_per_page, run.num_sequences,
                                cache.pages_per_row, mapper=cache, device=run.device)


def report(run, cache: VirtualKVCache, manager: PageManager, generation) -> None:
    """The lesson's report, and what the page table cost: driver calls in the loop."""
    lesson.report(run, cache, manager, generation)
    print(f"Page mapping: {cache.memory.num_maps:,} pages mapped and {cache.memory.num_unmaps:,} "
          f"unmapped in {cache.memory.seconds_mapping:.2f} s of driver calls, in the loop")


def main(argv=None) -> None:
    with cli.one_paragraph_errors(SCRIPT):  # from the flags, before minutes of loading
        require_cuda_and_flash_attn(cli.argument_parser(SCRIPT, __doc__, add_layout_arguments)
                                    .parse_args(argv))
    lesson.main(argv, SCRIPT, __doc__, add_layout_arguments, allocate_kv_cache, report)


if __name__ == "__main__":  # a feature's flag: the engine's program (python -m engine.run)
    if cli.needs_features(SCRIPT, sys.argv[1:], add_layout_arguments):
        cli.hand_to_the_engine(SCRIPT, sys.argv[1:])
    else:
        main()
