"""The scripts' runs with features: parse the flags, load, allocate the script's cache, generate
through engine/llm_engine.py's engine, report.

llama3_paged.py is the lesson: a static batch, greedy, decoded kernel by kernel, on every device.
A script hands its command line here when it names a flag the lesson does not define. The engine
built here runs three features by default on CUDA: decode steps replayed as CUDA graphs
(features/cuda_graphs.py; --eager turns them off), compiled layers (engine/compiled_layers.py;
--no-compile) and steps scheduled while the GPU computes the one before (engine/engine_core.py;
--no-overlap); llama3_virtual.py's pages are mapped ahead on a thread (features/virtual/).
"""

if __name__ == "__main__":  # first of all, as the scripts: Ctrl-C ends in one line, exit 130
    from plumbing.interrupt import exit_quietly_on_ctrl_c
    exit_quietly_on_ctrl_c("engine.run")

import sys

import llama3_naive
import llama3_paged as lesson
from engine.config import Config, cache_of, parser_with_features
from engine.loader import load
from engine.build import (allocate_kv_cache, generate, make_beam_runner, make_requests,
                          shares_blocks)
from engine.report import report
from engine.seams import plug
from plumbing import inputs
from plumbing.cli import (DRIVER_ERROR, OUT_OF_MEMORY, UserError, add_pool_arguments,
                          needs_features, one_paragraph_errors)
from plumbing.inputs import Run


def main(script: str, argv=None) -> None:
    """A script's run with the features its flags ask for: parse, load, allocate the cache,
    generate, report."""
    kind = cache_of(script)  # paged, naive or virtual
    with one_paragraph_errors(script):
        config = Config.from_args(parser_with_features(kind).parse_args(argv))
        run = load(config)
        if run.args.beam_width > 1:
            return run_beam_search(run, *allocate_kv_cache(run))
        if run.args.find_max_batch:
            return find_max_batch(run)
        if kind == "virtual":
            return run_virtual(run)
        cache, manager = allocate_kv_cache(run)
        refuse_a_static_batch_the_pool_cannot_hold(run, manager)
        report(run, cache, manager, generate(run, cache, manager))


def refuse_a_static_batch_the_pool_cannot_hold(run: Run, manager) -> None:
    """Without --continuous every sequence is admitted at once, and each takes a block of its
    own by its first decode step (a shared prompt's samples too: each writes its own next
    token). More sequences than blocks cannot run: said now, not after minutes of prefill."""
    sequences = run.args.num_requests * run.args.samples
    if (run.args.continuous or sequences <= manager.num_blocks
            or max(inputs.new_token_budgets(run)) <= 1):  # no decode step, no block of its own
        return
    n = run.args.num_requests
    raise UserError(f"{n:,} request{'s' * (n != 1)} x --samples {run.args.samples:,} = "
                    f"{sequences:,} sequences, all admitted at once (no --continuous), each need "
                    f"a KV block of their own, and the pool has {manager.num_blocks:,}. Use fewer "
                    f"requests or --samples, --continuous (which queues them), or a larger pool "
                    f"(--kv-budget-gb; on a GPU, --gpu-memory-utilization).", OUT_OF_MEMORY)


def run_virtual(run: Run) -> None:
    """llama3_virtual.py's run: a driver call that fails on the mapping thread ends it in one
    paragraph, as one in the loop does (virtual_pages.py's DriverError); the thread stops with
    the run."""
    MappingFailed = plug("pages mapped ahead", "MappingFailed")
    manager = None  # a driver call may fail at start-up, while the rows are mapped
    try:
        cache, manager = allocate_kv_cache(run)  # where the three scripts differ
        generation = generate(run, cache, manager)
        report(run, cache, manager, generation)
        print(plug("virtual memory", "mapping_report")(cache, manager, len(generation.timeline)))
    except MappingFailed as e:
        raise UserError(f"A driver call mapping a KV page on the background thread failed ({e}), "
                        f"so the run cannot go on: its next tokens would be written to unmapped "
                        f"memory. Check the GPU (nvidia-smi); --sync-mapping makes every driver "
                        f"call in the loop, where the failing one is easier to follow.",
                        DRIVER_ERROR) from e
    finally:
        if manager is not None:
            manager.close()  # the mapping thread, if one runs


def run_beam_search(run, cache, manager) -> None:
    """--beam-width K (features/beam_search.py), loaded only when asked for: its engine, and each
    prompt's budget of new tokens."""
    search_and_report = plug("beam search", "search_and_report")
    budgets = [r.max_new_tokens for r in make_requests(run)]  # random weights: reply lengths
    search_and_report(run, make_beam_runner(run, cache, manager), budgets, shares_blocks(run))


def find_max_batch(run: Run) -> None:
    """--find-max-batch (features/max_batch.py), loaded only when asked for."""
    plug("largest batch")(run, allocate_kv_cache, generate)


def command_line(script: str, argv: list[str]) -> None:
    """What `python <script> argv` runs (the scripts' `__main__` blocks decide the same way): the
    lesson's main (or a contrast's), or with features this file's."""
    kind = cache_of(script)
    if kind == "virtual":  # imported for its own runs only
        import llama3_virtual as script_file
        pool_arguments = script_file.add_layout_arguments
    else:
        script_file = lesson if kind == "paged" else llama3_naive
        pool_arguments = add_pool_arguments if kind == "paged" else None
    if needs_features(script, argv, pool_arguments):
        return main(script, argv)
    return script_file.main(argv)


if __name__ == "__main__":  # python -m engine.run llama3_paged.py 49 --continuous ...
    if len(sys.argv) < 2 or sys.argv[1] not in ("llama3_paged.py", "llama3_naive.py",
                                                 "llama3_virtual.py"):
        sys.exit("usage: python -m engine.run {llama3_paged.py,llama3_naive.py,"
                 "llama3_virtual.py} N [flags]: a script's run with features (--help lists them)")
    main(sys.argv[1], sys.argv[2:])
