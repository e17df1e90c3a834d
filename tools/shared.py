"""What the tools share: the three scripts' command lines, the GPU's measured ceilings, and how a
measuring tool ends (its figures to --json, its table printed).

A tool runs the scripts' caches in its own process (the model loaded once), so it sets each run
up as the script's command line would: `parse_script_arguments` parses a command line with that
script's parser. The ceilings are what each tool sets its figures against: the copy bandwidth
and the matmul rate, measured on this GPU, timed with CUDA events after a warm-up, as medians.
"""

import statistics

import torch

import llama3_naive
import llama3_paged
import llama3_virtual
from features import run as features
from plumbing.cli import write_atomically, standard_json

SCRIPTS = {"naive": llama3_naive, "paged": llama3_paged, "virtual": llama3_virtual}


def parse_script_arguments(script: str, argv: list[str]):
    """argv parsed as `python llama3_<script>.py argv` would parse it."""
    name = f"llama3_{script}.py"
    add_pool_arguments = (llama3_virtual.add_layout_arguments if script == "virtual"
                          else features.SCRIPTS[name][1])
    return features.argument_parser_with_features(name, SCRIPTS[script].__doc__,
                                             add_pool_arguments).parse_args(argv)


def allocate_kv_cache(script: str, run):
    """The script's KV cache and block manager, as its command line with features makes them."""
    if script == "virtual":
        return llama3_virtual.allocate_kv_cache(run)
    return features.SCRIPTS[f"llama3_{script}.py"][2](run)


def median_cuda_seconds(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes per second a device-to-device copy moves, counting the read and the write."""
    source = torch.randn(2**29, dtype=torch.bfloat16, device=device)  # 1 GiB
    target = torch.empty_like(source)
    return 2 * source.nbytes / median_cuda_seconds(lambda: target.copy_(source))


def matmul_flops_per_second(device, dtype, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / median_cuda_seconds(lambda: a @ b)


def as_graph(fn):
    """fn recorded as a CUDA graph, as the decode step runs it: its replay launches every kernel
    at once, so that what is timed is the GPU's work, not Python launching the kernels one by one
    (the cascade's dozen small kernels alone take some 200 us eagerly)."""
    fn()  # kernels loaded and chosen before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def write_and_print(result: dict, json_path, print_table) -> None:
    """--json first, if asked for, so that a closed pipe cutting the table short loses nothing."""
    if json_path:
        write_atomically(json_path, lambda path: path.write_text(standard_json(result)))
    print_table(result)
