"""Virtual batched Llama 3 decoding: each request's KV cache is one contiguous row of virtual
memory, with physical pages mapped in as it grows (vAttention's idea).

    python llama3_virtual.py 49 --random-weights

As in the naive script, every request gets a row of max_seq_len tokens up front, but as address
space only, which costs nothing. Physical 2 MB pages, as many as the KV budget holds, are created
once; a page is mapped under a row before the request's next token crosses into it. The
attention kernel is the ordinary non-paged one: the rows are contiguous, so it needs no block
table. Needs CUDA, flash-attn and the cuda-python package.

By default a background thread maps the pages a few steps ahead, a finished request's pages
stay mapped for the next request in its row, and half the pool is mapped under the empty rows at
start-up (features/virtual/mapping_ahead.py, vAttention's way).
--sync-mapping maps in the loop when a page is needed and unmaps when a request finishes
(features/virtual/page_manager.py): simpler to read, and the driver calls are then on the
critical path.
--kv-cache-dtype fp8 stores K and V in 8 bits and decodes with the Triton kernel
(features/fp8/virtual.py).

Its run is engine/run.py's `main` and `run_virtual`: the flags, the model, this file's
`allocate_kv_cache` (where the three scripts differ), generate, the report, `mapping_report`.
"""

SCRIPT = "llama3_virtual.py"

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends in one line, exit 130
    from plumbing.interrupt import exit_quietly_on_ctrl_c
    exit_quietly_on_ctrl_c(SCRIPT)

import sys

from features.virtual.mapping_ahead import BackgroundMapper, MappingAheadManager, mapping_seconds
from features.virtual.page_manager import PageManager
from features.virtual.kv_cache import LAYOUTS, VirtualKVCache
from features.virtual.memory import DriverOutOfMemory
from engine.pools import kv_budget_bytes
from plumbing.cli import OUT_OF_MEMORY, UserError, format_bytes, hand_to_the_engine, importable


def add_layout_arguments(parser):
    parser.add_argument("--layout", choices=LAYOUTS, default=LAYOUTS[0],
                        help="per-token: layers side by side; per-layer: vAttention's")
    parser.add_argument("--sync-mapping", action="store_true",
                        help="map pages in the loop and unmap them at the end, not ahead on a thread")
    return parser


def require_cuda_and_flash_attn(args) -> None:
    """Checked from the flags, before minutes of loading the model."""
    if (args.device.type != "cuda" or args.attn not in ("auto", "flash")
            or not importable("flash_attn")):
        raise UserError("llama3_virtual.py maps GPU memory and attends with flash-attn (its "
                        "non-paged kernel, or with --kv-cache-dtype fp8 its prefill beside the "
                        "Triton decode): it needs --device cuda and flash-attn (--attn flash or "
                        "auto).")
    if not importable("cuda.bindings"):
        raise UserError("llama3_virtual.py maps GPU memory with CUDA's virtual memory API, which "
                        "Python reaches through the cuda-python package: `pip install cuda-python`.")


def allocate_kv_cache(run):
    """A row of address space for every request, reserved up front at no cost, and physical pages,
    as many as memory holds, to be mapped under the rows as requests grow."""
    args = run.args
    cache_class = VirtualKVCache
    if run.kv_cache_dtype is not None:  # --kv-cache-dtype fp8
        from features.fp8.virtual import FP8VirtualKVCache as cache_class
    try:
        cache = cache_class(run.model.args, run.num_sequences, args.max_seq_len,
                            run.dtype, run.device, run.attention, args.layout,
                            compiled=bool(args.compile))
        page_bytes = cache.tokens_per_page * run.kv_bytes_per_token  # a page in every tensor
        num_pages = int(kv_budget_bytes(run) // page_bytes)
        if num_pages == 0:
            raise UserError(f"Not one page of {format_bytes(page_bytes)} fits in the KV budget. "
                            f"Raise --kv-budget-gb or --gpu-memory-utilization.", OUT_OF_MEMORY)
        cache.create_pages(num_pages)
    except DriverOutOfMemory as e:
        raise UserError(f"Out of GPU memory in {e.call}: the KV pages did not fit beside the "
                        f"weights. Lower --kv-budget-gb or --gpu-memory-utilization.",
                        OUT_OF_MEMORY) from e
    # The block table lists the virtual pages of each request's row; the MMU does the rest.
    sizes = (num_pages, cache.tokens_per_page, run.num_sequences, cache.pages_per_row)
    # --find-max-batch makes a cache per attempt; it counts requests, not time: map in the loop.
    if args.sync_mapping or args.find_max_batch:
        return cache, PageManager(*sizes, mapper=cache, device=run.device)
    mapper = BackgroundMapper(cache, on_start=cache.memory.make_current)
    manager = MappingAheadManager(*sizes, mapper=mapper, device=run.device)
    seconds = manager.map_empty_rows()
    print(f"Start-up: {manager.num_idle_pages:,} pages mapped under {len(manager.idle_rows):,} empty "
          f"rows in {seconds:.2f} s, before the first request; {len(manager.free_blocks):,} left "
          f"mapped nowhere.")
    cache.memory.count_from_here()  # the report counts the run's driver calls, not these
    return cache, manager


def mapping_report(cache, manager, decode_steps: int) -> str:
    """The work the page table costs: driver calls on the host, in the loop or beside it."""
    memory, steps, seconds = cache.memory, max(decode_steps, 1), mapping_seconds(cache, manager)
    line = (f"Page mapping: {memory.num_maps:,} pages mapped and {memory.num_unmaps:,} unmapped "
            f"in {memory.seconds_mapping:.2f} s of driver calls, ")
    if isinstance(manager, PageManager):
        return line + (f"in the loop (--sync-mapping): {seconds['in_the_loop'] / steps * 1e3:.3f} "
                       f"ms per decode step on the critical path")
    return line + (f"ahead, on a background thread ({seconds['off_critical_path'] / steps * 1e3:.3f} "
                   f"ms per decode step). The loop waited for it {seconds['growth'] / steps * 1e3:.3f} "
                   f"ms per decode step for growing requests' pages, and "
                   f"{seconds['admission'] * 1e3:,.1f} ms in all for admitted prompts'; the "
                   f"look-ahead ran dry for {manager.lookahead_ran_dry:,} pages; "
                   f"{manager.num_idle_pages:,} pages were left mapped under idle rows at the end.")


if __name__ == "__main__":  # its runs are all the engine's (python -m engine.run)
    hand_to_the_engine(SCRIPT, sys.argv[1:])
