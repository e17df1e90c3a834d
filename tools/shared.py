"""What the tools share: the GPU's measured ceilings, and how a measuring tool ends (its figures
to --json, its table printed).

A tool runs the scripts' caches in its own process (the model loaded once), set up as the
script's command line would set them up (engine/config.py's `Config.from_options`,
engine/llm_engine.py's `allocate_kv_cache`). The ceilings are what each tool sets its figures against: the copy bandwidth
and the matmul rate, measured on this GPU, timed with CUDA events after a warm-up, as medians.
"""

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # a module the tools import, not a program: say so, and what it holds
    try:
        print(f"tools/shared.py is imported by the tools, not run.\n\n{__doc__}", flush=True)
    except BrokenPipeError:  # `| head` read what it wanted: nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.cli import write_atomically, standard_json


SAMPLE_MS = 100  # nvidia-smi's sampling period


class ClockSampler:
    """nvidia-smi in the background: SM clock (MHz) and power (W) every SAMPLE_MS, of torch's GPU
    (named by its UUID: nvidia-smi's numbers ignore CUDA_VISIBLE_DEVICES). A GPU at its power cap
    lowers its clock, and the same kernels run longer (docs/speed.md): what a run's figure meets
    is said beside it. Without nvidia-smi on the PATH, stop() says nothing."""

    def __init__(self):
        self.process = None
        if shutil.which("nvidia-smi"):
            self.process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"-lms={SAMPLE_MS}", f"--id=GPU-{torch.cuda.get_device_properties().uuid}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> dict:
        """The medians, and the clock that a tenth of the samples were below."""
        if self.process is None:
            return {}
        self.process.terminate()
        out, _ = self.process.communicate()
        samples = []
        for line in out.splitlines():
            try:
                clock, power = (float(x) for x in line.split(","))
            except ValueError:  # a half-written last line, or "[N/A]"
                continue
            samples.append((clock, power))
        if not samples:
            return {}
        clocks = sorted(s[0] for s in samples)
        return {"sm_clock_mhz": statistics.median(clocks),
                "sm_clock_tenth_mhz": clocks[len(clocks) // 10],
                "power_watts": statistics.median(s[1] for s in samples), "samples": len(samples)}


def clock_line(clocks: dict) -> str:
    """ClockSampler's figures in a report's words, or why there are none."""
    if not clocks:
        return "not sampled (no nvidia-smi)"
    return (f"SM {clocks['sm_clock_mhz']:,.0f} MHz median, a tenth of the time below "
            f"{clocks['sm_clock_tenth_mhz']:,.0f}; power {clocks['power_watts']:.0f} W median "
            f"({clocks['samples']:,} samples of nvidia-smi, every {SAMPLE_MS} ms)")


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
    """The rate of an n x n x n matmul; for float8, torch._scaled_mm with a scale per row, as
    features/fp8/weights.py calls it (--quantization fp8)."""
    if dtype == torch.float8_e4m3fn:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        scale_a, scale_b = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
        return 2 * n**3 / median_cuda_seconds(lambda: torch._scaled_mm(
            a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16))
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


def collective_seconds_per_step(model_args, rows: int, dtype, device) -> dict:
    """A decode step's collectives under tensor parallelism (features/tensor_parallel.py), over
    NCCL: an all-reduce of [rows, dim] after each layer's attention and its feed-forward, then
    the gather of the logits, [rows, vocab / n] from each of the n processes. Replayed as a CUDA
    graph, as the decode step runs them, beside their floor: the bytes each process sends at the
    link's bus bandwidth, measured with all-reduces of 256 MiB. (NCCL's convention: an
    all-reduce sends 2 (n - 1) / n of its tensor per process, a gather (n - 1) / n of the whole.)"""
    import torch.distributed as dist
    n = dist.get_world_size()
    big = torch.zeros(2**27, dtype=torch.bfloat16, device=device)  # 256 MiB
    bus_bandwidth = 2 * (n - 1) / n * big.nbytes / median_cuda_seconds(
        lambda: dist.all_reduce(big), repeats=10)
    del big
    hidden = torch.zeros(rows, model_args.dim, dtype=dtype, device=device)
    part = torch.zeros(rows, model_args.vocab_size // n, dtype=dtype, device=device)
    parts = [torch.empty_like(part) for _ in range(n)]
    all_reduces = 2 * model_args.n_layers

    def collectives():
        for _ in range(all_reduces):
            dist.all_reduce(hidden)
        dist.all_gather(parts, part)
    seconds = median_cuda_seconds(as_graph(collectives))
    sent = all_reduces * 2 * (n - 1) / n * hidden.nbytes + (n - 1) * part.nbytes
    return {"processes": n, "rows": rows, "all_reduces": all_reduces,
            "bus_bandwidth_bytes_per_second": bus_bandwidth, "bytes_sent": sent,
            "seconds": seconds, "floor_seconds": sent / bus_bandwidth}


def write_profile(path, engine: str, workload: str, profile: dict) -> None:
    """A --profile JSON (tools/kernel_profile.py reads it)."""
    record = {"engine": engine, "workload": workload, "device": torch.cuda.get_device_name(),
              "profile": profile}
    text = standard_json(record)
    write_atomically(path, lambda p: p.write_text(text))


def write_and_print(result: dict, json_path, print_table) -> None:
    """--json first, if asked for, so that a closed pipe cutting the table short loses nothing."""
    if json_path:
        write_atomically(json_path, lambda path: path.write_text(standard_json(result)))
    print_table(result)
