"""Virtual batched Llama 3 decoding: each request's KV cache is one contiguous row of virtual
memory, with physical pages mapped in as it grows (vAttention's idea).

    python llama3_virtual.py 49 --random-weights

As in the naive script, every request gets a row of max_seq_len tokens up front, but as address
space only, which costs nothing. Physical 2 MB pages, as many as the KV budget holds, are created
once; the page manager maps one under a row when the request's next token would cross into an
unmapped page, and unmaps them all when it finishes. The attention kernel is the ordinary
non-paged one: the rows are contiguous, so it needs no block table. Needs CUDA, flash-attn and
the cuda-python package.
"""

from plumbing.cli import exit_quietly_on_ctrl_c

SCRIPT = "llama3_virtual.py"
exit_quietly_on_ctrl_c(SCRIPT)  # first, so that Ctrl-C while torch loads ends in one line too

from features.page_manager import PageManager
from features.virtual_kv_cache import LAYOUTS, VirtualKVCache
from features.virtual_memory import DriverOutOfMemory
from plumbing.cli import (OUT_OF_MEMORY, UserError, argument_parser, format_bytes,
                          one_paragraph_errors)
from plumbing.report import report
from plumbing.setup import find_max_batch, generate, importable, kv_budget_bytes, load


def add_layout_arguments(parser):
    parser.add_argument("--layout", choices=LAYOUTS, default=LAYOUTS[0],
                        help="per-token: all layers of a token side by side, a 2 MB page holds 16 "
                             "tokens; per-layer (vAttention's): a tensor per layer, a page holds "
                             "1,024 tokens of one layer")
    return parser


def require_cuda_and_flash_attn(setup) -> None:
    if setup.device.type != "cuda" or setup.attention.name != "flash":
        raise UserError("llama3_virtual.py maps GPU memory and attends with flash-attn's non-paged "
                        "kernel: it needs --device cuda and flash-attn (--attn flash or auto).")
    if not importable("cuda.bindings"):
        raise UserError("llama3_virtual.py maps GPU memory with CUDA's virtual memory API, which "
                        "Python reaches through the cuda-python package: `pip install cuda-python`.")


def allocate_kv_cache(setup):
    """A row of address space for every request, reserved up front at no cost, and physical pages,
    as many as memory holds, to be mapped under the rows as requests grow."""
    args = setup.args
    try:
        cache = VirtualKVCache(setup.model.args, setup.num_sequences, args.max_seq_len,
                               setup.dtype, setup.device, setup.attention, args.layout)
        page_bytes = cache.tokens_per_page * setup.kv_bytes_per_token  # a page in every tensor
        num_pages = int(kv_budget_bytes(setup) // page_bytes)
        if num_pages == 0:
            raise UserError(f"Not one page of {format_bytes(page_bytes)} fits in the KV budget. "
                            f"Raise --kv-budget-gb or --gpu-memory-utilization.", OUT_OF_MEMORY)
        cache.create_pages(num_pages)
    except DriverOutOfMemory as e:
        raise UserError(f"Out of GPU memory in {e.call}: the KV pages did not fit beside the "
                        f"weights. Lower --kv-budget-gb or --gpu-memory-utilization.",
                        OUT_OF_MEMORY) from e
    # The block table never changes: row r lists the virtual pages of row r; the MMU does the rest.
    manager = PageManager(num_pages, cache.tokens_per_page, setup.num_sequences,
                          cache.pages_per_row, mapper=cache, device=setup.device)
    return cache, manager


def main(argv=None) -> None:
    with one_paragraph_errors(SCRIPT):
        args = add_layout_arguments(argument_parser(SCRIPT, __doc__)).parse_args(argv)
        setup = load(args)  # the model and the first N prompts
        require_cuda_and_flash_attn(setup)
        if setup.args.find_max_batch: return find_max_batch(setup, allocate_kv_cache)
        cache, manager = allocate_kv_cache(setup)  # where the three scripts differ
        generation = generate(setup, cache, manager)
        report(setup, cache, manager, generation)
        memory = cache.memory  # the work the page table costs: driver calls on the host
        print(f"Page mapping: {memory.num_maps:,} pages mapped and {memory.num_unmaps:,} unmapped "
              f"in {memory.seconds_mapping:.2f} s of driver calls, "
              f"{memory.seconds_mapping / max(generation.decode_steps, 1) * 1e3:.2f} ms per "
              f"decode step")


if __name__ == "__main__":
    main()
