"""A benchmark run's decode steps grouped by batch size: their GPU time against their floor.

    python tools/bench.py paged --workload W2 -q fp8 --json run.json
    python tools/steps_by_batch.py run.json --edges 256,512,600,1024

A run's median step says little when its batch swings from 2,000 rows to one, as W2's does, and
the steps of different sizes run differently: CUDA graphs replay them up to the largest graph
(features/cuda_graphs.py), larger ones are launched from Python, and below COMPILED_FROM_ROWS
those run eagerly (engine/compiled_layers.py). tools/bench.py's --json keeps every decode step's
GPU seconds (CUDA events), its batch and its floor; this sums them over each range of batches,
for one run or several of the same workload side by side.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

import argparse

from plumbing.cli import HelpFormatter, UserError, first_paragraph, one_paragraph_errors
from tools.arguments import json_file, positive_int_list


def steps_by_batch(run: dict, edges: list[int]) -> list[dict]:
    """run: tools/bench.py's --json. One entry per range of batches that holds a step: its bounds
    (first < batch <= last), how many steps, their GPU seconds and their floor's seconds."""
    if not isinstance(run, dict) or "step_seconds" not in run:
        raise UserError("The JSON holds no decode steps' seconds: give it the --json that "
                        "tools/bench.py writes.")
    bounds = [0, *sorted(set(edges)), max(run["step_running_requests"], default=0)]
    ranges = []
    for first, last in zip(bounds, bounds[1:]):
        steps = [i for i, batch in enumerate(run["step_running_requests"]) if first < batch <= last]
        if steps:
            ranges.append({"first": first, "last": last, "steps": len(steps),
                           "seconds": sum(run["step_seconds"][i] for i in steps),
                           "floor_seconds": sum(run["step_floor_seconds"][i] for i in steps)})
    return ranges


def named_json(text: str) -> tuple[str, dict]:
    """A JSON file's name and contents, for an argparse type."""
    return text, json_file(text)


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog="steps_by_batch.py", description=first_paragraph(__doc__),
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=HelpFormatter)
    p.add_argument("runs", type=named_json, nargs="+", metavar="JSON",
                   help="tools/bench.py's --json, one or more")
    p.add_argument("--edges", type=positive_int_list, default=[256, 512, 1024],
                   help="batch sizes that end a range (default: 256,512,1024)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("steps_by_batch.py"):
        for name, run in a.runs:
            ranges = steps_by_batch(run, a.edges)
            print(f"{name}: {run['output_tokens_per_second']:,.0f} output tokens/s, decode "
                  f"{run['decode_seconds']:.2f} s in {len(run['step_seconds']):,} steps")
            for r in ranges:
                print(f"  batch {r['first'] + 1:>5,} to {r['last']:>5,}: {r['steps']:>5,} steps, "
                      f"{r['seconds']:6.2f} s on the GPU, floor {r['floor_seconds']:6.2f} s "
                      f"({r['seconds'] / r['floor_seconds']:.2f}x)")


if __name__ == "__main__":
    main()
