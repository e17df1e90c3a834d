"""Does a GPU at its power cap run the same kernels slower? One decode step's matmuls of Llama 3 8B,
replayed back to back, then with the GPU left idle after each step.

    python tools/power_cap.py                      # batch 256; idle 0 and 2.5 ms; twice each
    python tools/power_cap.py --idle-ms 0,1,2.5,5 --seconds 10

The side-by-side profile (docs/speed.md) showed the same cuBLAS and flash-attn kernels taking
5-10% longer in our runs than in nano-vllm's. Our overlapped steps leave the GPU no idle time;
nano-vllm's host leaves it idle some 10 us per token between steps, 2.5 ms a step at batch 256.
This takes both engines out: the step here is only the 32 layers' four projections (the lesson's
layers with random bf16 weights, two alternating so that no layer finds the last one's weights in
L2), timed with CUDA events; --idle-ms is how long the host waits after each step before launching the next.
While each case runs, nvidia-smi is sampled for the SM clock and the power draw (medians; if
nvidia-smi is not on the PATH the times are printed alone).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("power_cap.py")  # before torch loads

import torch
from tqdm import tqdm

from plumbing.cli import (HelpFormatter, UserError, first_paragraph, one_paragraph_errors,
                          positive_int, writable_file)
from tools.arguments import milliseconds_list
from llama3_paged import TransformerBlock
from plumbing.inputs import PRESETS
from tools.shared import ClockSampler, write_and_print


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--batch", type=positive_int, default=256, help="tokens in the decode step")
    p.add_argument("--idle-ms", type=milliseconds_list, default=[0.0, 2.5],
                   help="the host's wait after each step, one case each")
    p.add_argument("--seconds", type=positive_int, default=8, help="how long each case runs")
    p.add_argument("--repeats", type=positive_int, default=2, help="the cases, this many rounds")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write the figures here")
    return p.parse_args(argv)


def decode_step_matmuls(batch: int, device):
    """A function that launches one decode step's projections (wqkv, wo, w_gate_up, w_down of
    every layer): the lesson's own layers, two of them alternating, with random weights."""
    args = PRESETS["8b"]
    with torch.device(device):
        blocks = [TransformerBlock(args, i, torch.bfloat16) for i in range(2)]
    projections = [[m for m in b.modules() if isinstance(m, torch.nn.Linear)] for b in blocks]
    for linear in projections[0] + projections[1]:
        torch.nn.init.normal_(linear.weight, std=linear.in_features ** -0.5)
    inputs = {p.in_features: torch.randn(batch, p.in_features, device=device, dtype=torch.bfloat16)
              for p in projections[0]}  # x [batch, in_features] of each projection

    def step():
        with torch.no_grad():
            for layer in range(args.n_layers):
                for linear in projections[layer % 2]:
                    linear(inputs[linear.in_features])
    return step


def run_case(step, idle_ms: float, seconds: int) -> dict:
    """Steps for `seconds`, each followed by idle_ms of host waiting; the first quarter, while the
    clock settles, is not counted."""
    events = []
    sampler = ClockSampler()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        if idle_ms:
            stop.synchronize()  # the GPU has nothing left to run...
            time.sleep(idle_ms / 1e3)  # ...while the host waits, as between nano-vllm's steps
        events.append((start, stop))
    torch.cuda.synchronize()
    clocks = sampler.stop()
    counted = events[len(events) // 4:]
    return {"idle_ms": idle_ms, "steps": len(counted),
            "median_step_ms": statistics.median(a.elapsed_time(b) for a, b in counted)} | clocks


def print_table(result: dict) -> None:
    print(f"One decode step's matmuls, Llama 3 8B, batch {result['batch']}, bf16, "
          f"{result['device']}:")
    print(f"  {'idle after each step':>21}  {'median step':>12}  {'SM clock':>9}  {'power':>6}")
    for c in result["cases"]:
        clock = f"{c['sm_clock_mhz']:,.0f} MHz" if "sm_clock_mhz" in c else "?"
        power = f"{c['power_watts']:.0f} W" if "power_watts" in c else "?"
        print(f"  {c['idle_ms']:>18.1f} ms  {c['median_step_ms']:>9.3f} ms  {clock:>9}  {power:>6}")


def main(argv=None) -> None:
    args = parse_arguments(argv)
    with one_paragraph_errors("power_cap.py"):
        if not torch.cuda.is_available():
            raise UserError("needs a CUDA GPU: it measures one under load.")
        step = decode_step_matmuls(args.batch, "cuda")
        for _ in range(20):  # cuBLAS chooses its kernels, the clock leaves idle
            step()
        torch.cuda.synchronize()
        plan = [idle for _ in range(args.repeats) for idle in args.idle_ms]
        cases = [run_case(step, idle, args.seconds)
                 for idle in tqdm(plan, desc=f"cases of {args.seconds} s", unit="case")]
        write_and_print({"device": torch.cuda.get_device_name(), "batch": args.batch,
                         "cases": cases}, args.json, print_table)


if __name__ == "__main__":
    main()
