"""Draw where each run's KV memory went, decode step by decode step.

    python llama3_naive.py 49 --random-weights --json naive.json
    python llama3_paged.py 49 --random-weights --json paged.json
    python tools/plot_memory.py naive.json paged.json -o kv_memory.png

One panel per run: the KV bytes reserved by running requests against the bytes filled with
tokens, the unfilled gap between them (fragmentation) shaded, the pool allocated up front dashed,
and the step where the cache held the most tokens marked, as the report's Fragmented Memory line
reads it. On a second axis, the requests running and (with --continuous) waiting at each step.

Where requests arrived over time (--request-rate), a second row draws each run's timeline in
seconds: how many requests had arrived, had their first token and were complete. The gap
between the arrivals and the first tokens is the queue; between first tokens and completions,
the requests being served.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("plot_memory.py")  # before matplotlib loads

from plumbing.cli import (GB, HelpFormatter, first_paragraph, format_bytes, one_paragraph_errors,
                          refuse_output_over_input, write_atomically)
from tools.arguments import finite_number, image_file, json_file

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

TIMELINE_FIELDS = ["step", "reserved_bytes", "filled_bytes", "running_requests", "waiting_requests"]
MEMORY_FIELDS = ["kv_pool_bytes", "fragmented_bytes", "fragmented_percent_of_device"]
FULLEST_FIELDS = ["step", "filled_bytes", "unfilled_bytes", "unfilled_percent_of_reserved"]


def run_json(text: str) -> dict:
    """A run's --json, read and checked before anything is drawn (an argparse type: exit 2)."""
    run = json_file(text)
    if isinstance(run, dict) and "largest_batch_that_completes" in run:
        raise argparse.ArgumentTypeError(f"{text} is a --find-max-batch result, which has no "
                                         f"timeline; plot the --json of a single run")
    number = finite_number
    numbers = lambda record, fields: isinstance(record, dict) and all(
        number(record.get(f)) for f in fields)
    requests = run.get("requests", []) if isinstance(run, dict) else None
    times_ok = lambda r: (isinstance(r, dict) and number(r.get("arrival_seconds", 0.0))
                          and isinstance(r.get("token_seconds", []), list)
                          and all(number(t) for t in r.get("token_seconds", [])))
    if not (isinstance(run, dict) and isinstance(run.get("timeline"), list)
            and numbers(run.get("memory"), MEMORY_FIELDS)
            and all(numbers(s, TIMELINE_FIELDS) for s in run["timeline"])
            and isinstance(run.get("arguments", {}), dict)
            and isinstance(run.get("script", ""), str)
            and isinstance(requests, list) and all(times_ok(r) for r in requests)):
        raise argparse.ArgumentTypeError(f"{text} is not the --json of a run of llama3_naive.py "
                                         f"or llama3_paged.py")
    if not run["timeline"] or not numbers(run["memory"].get("at_fullest_step"), FULLEST_FIELDS):
        raise argparse.ArgumentTypeError(f"{text}: that run made no decode step, so there is "
                                         f"nothing to draw")
    why = meaningless(run)
    if why:
        raise argparse.ArgumentTypeError(f"{text} is not the --json of a run: {why}")
    return run | {"source": Path(text)}  # where it came from, so that no output overwrites it


YEAR_SECONDS = 3.2e7  # a run's times lie within a year of its start
MAX_BYTES = 1e15  # a petabyte: beyond any machine's memory (the flags' MAX_GB)


def meaningless(run: dict) -> str | None:
    """What no run writes, though every value has the right type: the first such thing found."""
    memory, fullest = run["memory"], run["memory"]["at_fullest_step"]
    whole = lambda v: isinstance(v, int) and v >= 0
    if memory["kv_pool_bytes"] <= 0 or memory["fragmented_bytes"] < 0:
        return "its KV pool or its Fragmented Memory is not a positive size"
    sizes = [memory["kv_pool_bytes"], memory["fragmented_bytes"], fullest["filled_bytes"],
             fullest["unfilled_bytes"], *(p[f] for p in run["timeline"]
                                          for f in ("reserved_bytes", "filled_bytes"))]
    if max(sizes) > MAX_BYTES:
        return f"a size of {max(sizes):.3g} bytes, beyond any machine's ({MAX_BYTES:.0e})"
    if not (0 <= memory["fragmented_percent_of_device"] <= 100
            and 0 <= fullest["unfilled_percent_of_reserved"] <= 100):
        return "a percentage lies outside 0 to 100"
    for point in run["timeline"]:
        seconds = point.get("seconds", 0.0)  # the step's GPU time
        if not (finite_number(seconds) and 0 <= seconds <= YEAR_SECONDS):
            return f"step {point['step']}'s time is not a number of seconds from 0 to a year"
        if not all(whole(point[f]) for f in ("step", "running_requests", "waiting_requests")):
            return f"a step or a count of requests is not a whole number of at least 0: {point}"
        if not 0 <= point["filled_bytes"] <= point["reserved_bytes"]:
            return f"step {point['step']} has more filled than reserved, or a negative size"
    if not whole(fullest["step"]) or min(fullest["filled_bytes"], fullest["unfilled_bytes"]) < 0:
        return "its fullest step is negative or holds a negative size"
    for request in run["requests"]:
        times = [request.get("arrival_seconds", 0.0), *request.get("token_seconds", [])]
        if not all(0 <= t <= YEAR_SECONDS for t in times):
            return f"a request's times lie outside 0 to {YEAR_SECONDS:.1e} seconds"
    return None


def draw(ax, run: dict, scale: float) -> None:
    """One run's panel, its bytes drawn in units of `scale` bytes."""
    timeline, memory = run["timeline"], run["memory"]
    steps = [s["step"] for s in timeline]
    reserved = [s["reserved_bytes"] / scale for s in timeline]
    filled = [s["filled_bytes"] / scale for s in timeline]
    ax.axhline(memory["kv_pool_bytes"] / scale, color="gray", linestyle="--", linewidth=1,
               label=f"KV pool allocated up front ({format_bytes(memory['kv_pool_bytes'])})")
    ax.plot(steps, reserved, color="tab:red", label="reserved by running requests")
    ax.plot(steps, filled, color="tab:blue", label="filled with tokens")
    ax.fill_between(steps, filled, reserved, color="tab:red", alpha=0.25, label="unfilled")
    peak = memory["at_fullest_step"]
    ax.plot([peak["step"]], [peak["filled_bytes"] / scale], "ko")
    ax.annotate(f"fullest step {peak['step']}: {format_bytes(peak['filled_bytes'])} filled,\n"
                f"{format_bytes(peak['unfilled_bytes'])} unfilled "
                f"({peak['unfilled_percent_of_reserved']:.0f}% of reserved)",
                (peak["step"], peak["filled_bytes"] / scale),
                textcoords="axes fraction", xytext=(0.3, 0.6), fontsize=8,
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9},
                arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set_ylim(bottom=0)
    arguments = run.get("arguments", {})
    mode = " --continuous" if arguments.get("continuous") else ""
    ax.set_title(f"{run.get('script', '?')} {arguments.get('num_requests', '')}{mode}: "
                 f"Fragmented Memory {format_bytes(memory['fragmented_bytes'])} "
                 f"({memory['fragmented_percent_of_device']:.2f}%)", fontsize=10)
    ax.set_xlabel("decode step")
    counts = ax.twinx()  # requests, not bytes
    counts.plot(steps, [s["running_requests"] for s in timeline], color="tab:green",
                linewidth=0.8, label="running requests")
    counts.plot(steps, [s["waiting_requests"] for s in timeline], color="tab:purple",
                linewidth=0.8, linestyle=":", label="waiting requests")
    counts.set_ylim(bottom=0)
    counts.set_ylabel("requests", fontsize=8)
    lines = ax.get_legend_handles_labels(), counts.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8, loc="upper right")


def arrived_over_time(run: dict) -> bool:
    """Whether the run's requests arrived over time (--request-rate), not all at the start."""
    requests = run.get("requests")
    return (isinstance(requests, list) and bool(requests)
            and all(isinstance(r, dict) and isinstance(r.get("arrival_seconds"), (int, float))
                    and isinstance(r.get("token_seconds"), list) for r in requests)
            and any(r["arrival_seconds"] > 0 for r in requests))


def draw_arrivals(ax, run: dict) -> None:
    """Cumulative counts against seconds: requests arrived, given their first token, complete."""
    requests = [r for r in run["requests"] if r["token_seconds"]]
    for label, times, color in (
            ("arrived", [r["arrival_seconds"] for r in run["requests"]], "tab:gray"),
            ("first token", [r["token_seconds"][0] for r in requests], "tab:orange"),
            ("complete", [r["token_seconds"][-1] for r in requests], "tab:green")):
        times = sorted(times)
        ax.step(times, range(1, len(times) + 1), where="post", color=color, label=label)
    ax.set_xlabel("seconds from the start")
    ax.set_ylabel("requests", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("runs", nargs="+", type=run_json,
                   help="--json files of llama3_naive.py / llama3_paged.py")
    p.add_argument("-o", "--output", type=image_file, default="kv_memory.png",
                   help="picture to write; its suffix names the format: .png, .pdf or .svg")
    args = p.parse_args(argv)
    runs = args.runs
    with one_paragraph_errors("plot_memory.py"):
        refuse_output_over_input(args.output, [run["source"] for run in runs], "-o")
    timelines = any(arrived_over_time(run) for run in runs)
    fig, axes = plt.subplots(1 + timelines, len(runs), figsize=(6 * len(runs), 4.5 * (1 + timelines)),
                             squeeze=False)
    # One unit for the shared axis: GB, or MB where every pool is under a GB (the CPU's).
    scale, unit = (GB, "GB") if max(r["memory"]["kv_pool_bytes"] for r in runs) >= GB else (1e6, "MB")
    for ax, run in zip(axes[0], runs):
        draw(ax, run, scale)
        ax.sharey(axes[0][0])  # one scale of bytes for every run
    for ax, run in zip(axes[1] if timelines else [], runs):
        if arrived_over_time(run):
            draw_arrivals(ax, run)
        else:
            ax.set_axis_off()  # all at the start: nothing to draw over time
    axes[0][0].set_ylabel(f"KV cache ({unit})")
    fig.tight_layout()
    with one_paragraph_errors("plot_memory.py"):
        write_atomically(args.output, lambda path: fig.savefig(path, dpi=100))
        print(f"Wrote {args.output} ({args.output.stat().st_size / 1e3:.0f} KB)")


if __name__ == "__main__":
    main()
