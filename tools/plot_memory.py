"""Draw where each run's KV memory went, decode step by decode step.

    python llama3_naive.py 49 --random-weights --json naive.json
    python llama3_paged.py 49 --random-weights --json paged.json
    python tools/plot_memory.py naive.json paged.json -o kv_memory.png

One panel per run: the KV bytes reserved by live requests against the bytes filled with tokens,
the unfilled gap between them (fragmentation) shaded, the pool allocated up front dashed, and the step where
the cache held the most tokens marked, as the report's Fragmented Memory line reads it.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

GB = 1e9


def draw(ax, run: dict) -> None:
    timeline, memory = run["timeline"], run["memory"]
    steps = [s["step"] for s in timeline]
    reserved = [s["reserved_bytes"] / GB for s in timeline]
    filled = [s["filled_bytes"] / GB for s in timeline]
    ax.axhline(memory["kv_pool_bytes"] / GB, color="gray", linestyle="--", linewidth=1,
               label=f"KV pool allocated up front ({memory['kv_pool_bytes'] / GB:.1f} GB)")
    ax.plot(steps, reserved, color="tab:red", label="reserved by live requests")
    ax.plot(steps, filled, color="tab:blue", label="filled with tokens")
    ax.fill_between(steps, filled, reserved, color="tab:red", alpha=0.25, label="unfilled")
    peak = memory["at_fullest_step"]
    ax.plot([peak["step"]], [peak["filled_bytes"] / GB], "ko")
    ax.annotate(f"fullest step {peak['step']}: {peak['filled_bytes'] / GB:.1f} GB filled,\n"
                f"{peak['unfilled_bytes'] / GB:.1f} GB unfilled ({peak['unfilled_percent_of_reserved']:.0f}% "
                f"of reserved)", (peak["step"], peak["filled_bytes"] / GB),
                textcoords="axes fraction", xytext=(0.3, 0.6), fontsize=8,
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9},
                arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set_ylim(bottom=0)
    arguments = run["arguments"]
    ax.set_title(f"{run['script']} {arguments['num_requests']}: Fragmented Memory "
                 f"{memory['fragmented_bytes'] / GB:.2f} GB ({memory['fragmented_percent_of_device']:.2f}%)",
                 fontsize=10)
    ax.set_xlabel("decode step")
    ax.legend(fontsize=8, loc="upper right")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="--json files of llama3_naive.py / llama3_paged.py")
    p.add_argument("-o", "--output", type=Path, default=Path("kv_memory.png"), help="PNG to write")
    args = p.parse_args()
    runs = [json.loads(path.read_text()) for path in args.runs]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), sharey=True, squeeze=False)
    for ax, run in zip(axes[0], runs):
        draw(ax, run)
    axes[0][0].set_ylabel("KV cache (GB)")
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"Wrote {args.output} ({args.output.stat().st_size / 1e3:.0f} KB)")


if __name__ == "__main__":
    main()
