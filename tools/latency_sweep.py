"""The PagedAttention paper's Figure 12, ours: normalized latency against request rate, one curve
per KV cache.

    python tools/latency_sweep.py run --json full.json               # every curve, default rates
    python tools/latency_sweep.py run --gpu-memory-utilization 0.1592 --curves naive-8192,paged \\
        --rates 8,16,32 --rates naive-8192=1,2,3,4 --json 24gb.json  # a 24 GB budget on the H200
    python tools/latency_sweep.py plot full.json 24gb.json -o figure12.png

A point of a curve is one run at one request rate R: the first R x T prompts of
sharegpt_filtered.json (T = --seconds of arrivals, at least --min-requests), arriving as a
Poisson process at R per second (the same arrival times for every curve, drawn with --seed),
served with --continuous, each generating its ShareGPT reply's length; random weights. Its
figure is the mean normalized latency: each request's end-to-end latency (arrival to last
token) over its output tokens (features/arrivals.py). Rates are run from low to high; a curve
stops after its first point above twice --threshold, as every higher rate is only slower.

Two capacities per curve:
- where its mean normalized latency crosses --threshold, read on a straight line between the
  two rates measured around it (the paper reads its figures by eye). The default, 0.05 s/token,
  is several decode steps per token (a step takes 5 to 25 ms here): requests then spend most of
  their time waiting, not computing. It depends on T: past capacity the queue grows for T
  seconds, so a shorter trace crosses at a higher rate (the paper's traces last an hour);
  every curve's crossing shifts alike, so their ratios hold better than the rates themselves.
- saturation: the most requests per second any of its points completed, which past capacity is
  the rate the cache serves at most: beyond it the queue grows without end, whatever T.

The model is loaded once; each curve makes its own cache in the memory the model leaves, as its
script would (`plot` reads what `run` wrote, so curves of several runs share one picture).
`paged-api` serves the paged curve's requests through the Python API (engine/llm_engine.py's
LLMEngine: serve.py's engine, without HTTP), each added as it arrives: beside `paged`, what the
API's engine costs; beside tools/serve_bench.py, what HTTP does.
"""

import argparse
import dataclasses
import gc
import math
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

PROG = "latency_sweep.py"  # its name in messages, however it is started

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c(PROG)  # before torch loads

from plumbing.cli import GPU_MEMORY_UTILIZATION, MODELS, UserError

import torch
from tqdm import tqdm

import llama3_virtual
from engine.request import EngineRequest
from engine.engine_core import EngineCore
from engine.model_runner import greedy
from features.arrivals import latency_report
from plumbing.cli import (HelpFormatter, device, first_paragraph, fraction, gigabytes,
                          one_paragraph_errors, positive_int, refuse_output_over_input, seed,
                          writable_file, write_atomically)
from tools.arguments import finite_number, image_file, json_file
from plumbing.inputs import PROMPTS_FILE, read_records
from plumbing.cli import standard_json
from engine.report import format_seconds, scheduling_report
from engine.config import Config
from engine.loader import choose_attention, load
from engine.build import (allocate_kv_cache, make_requests, make_runner, make_scheduler,
                          model_forward, warm_up)
from engine.llm_engine import LLMEngine
from engine.sampler import SamplingParams

# name: (script, its flags, what the curve is). The paper's baselines are Orca's: Max reserves
# the longest a request may grow, Oracle exactly what each will use. Every request of
# sharegpt_filtered.json fits in 2,048 tokens, prompt and reply: that is the tightest single
# reservation a naive cache can make for them all, so naive-2048 stands in for Oracle.
CURVES = {
    "naive-8192": ("naive", dict(max_seq_len=8192), "naive, 8,192 per request (Orca-Max)"),
    "naive-2048": ("naive", dict(max_seq_len=2048), "naive, 2,048 per request (Oracle-like)"),
    "paged": ("paged", dict(block_size=256), "paged, blocks of 256"),
    "paged-triton": ("paged", dict(attn="triton", block_size=16), "paged, blocks of 16"),
    "virtual": ("virtual", {}, "virtual (vAttention), pages mapped ahead"),
    "paged-mixed": ("paged", dict(block_size=256, max_batched_tokens=2048),
                    "paged, blocks of 256, mixed steps of 2,048 tokens"),
    "paged-mixed-1024": ("paged", dict(block_size=256, max_batched_tokens=1024),
                         "paged, blocks of 256, mixed steps of 1,024 tokens"),
    "paged-api": ("paged", dict(block_size=256),
                  "paged, blocks of 256, through the Python API (serve.py's engine, no HTTP)"),
}
THROUGH_THE_API = {"paged-api"}  # served by engine/llm_engine.py's LLMEngine, request by request
DEFAULT_CURVES = ["naive-8192", "naive-2048", "paged", "paged-triton", "virtual"]
DEFAULT_RATES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
POINT_FIELDS = ["rate", "requests", "wall_seconds", "normalized_latency"]  # what `plot` reads
STOP_FACTOR = 2  # a curve stops after its first point above STOP_FACTOR x the threshold


def curve_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CURVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: curves are {', '.join(CURVES)}")
    return names


def rate_list(text: str) -> tuple[str | None, list[float]]:
    """R1,R2,... for every curve, or CURVE=R1,R2,... for one."""
    curve, _, numbers = text.rpartition("=")
    if curve and curve not in CURVES:
        raise argparse.ArgumentTypeError(f"{text!r}: {curve} is no curve; curves are "
                                         f"{', '.join(CURVES)}")
    try:
        rates = [float(r) for r in numbers.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(0 < r < math.inf for r in rates) or rates != sorted(set(rates)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected rising request rates per second, "
                                         f"e.g. 1,2,4 or naive-8192=1,2,4")
    return curve or None, rates


def rates_of(name: str, a) -> list[float]:
    """The curve's own --rates if given, else those given for all, else the defaults."""
    given = dict(a.rates or [])
    return given.get(name) or given.get(None) or DEFAULT_RATES


def sweep_json(text: str) -> dict:
    """A `run --json` file, read and checked before anything is drawn (exit 2)."""
    sweep = json_file(text)
    number = finite_number  # where `plot` draws them or divides by them
    rate_ok = lambda r: (isinstance(r, dict) and (r.get("rate") is None or number(r.get("rate")))
                         and isinstance(r.get("at_least"), bool))
    point_ok = lambda p: (isinstance(p, dict) and all(number(p.get(k)) for k in POINT_FIELDS)
                          and isinstance(p.get("latency"), dict)
                          and isinstance(p["latency"].get("time_between_tokens"), dict)
                          and number(p["latency"]["time_between_tokens"].get("p99")))
    curve_ok = lambda c: (isinstance(c, dict) and isinstance(c.get("description"), str)
                          and all(rate_ok(c.get(k)) for k in ("capacity", "saturation"))
                          and isinstance(c.get("points"), list) and c["points"]
                          and all(point_ok(p) for p in c["points"]))
    if not (isinstance(sweep, dict) and isinstance(sweep.get("curves"), dict) and sweep["curves"]
            and set(sweep["curves"]) <= set(CURVES)
            and all(isinstance(sweep.get(k), str) for k in ("device", "model", "memory"))
            and all(number(sweep.get(k)) and sweep[k] > 0 for k in ("seconds", "threshold"))
            and all(curve_ok(c) for c in sweep["curves"].values())):
        raise argparse.ArgumentTypeError(f"{text} is not the --json of latency_sweep.py run (its "
                                         f"curves, each one of {', '.join(CURVES)}, their points "
                                         f"and capacities, as `run` writes them)")
    sweep["path"] = text
    return sweep


MAX_SECONDS = 1e6  # of arrivals per point: R x T requests must stay a count


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=first_paragraph(__doc__),
                                formatter_class=HelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="measure the curves", formatter_class=HelpFormatter)
    run.add_argument("--curves", type=curve_list, default=DEFAULT_CURVES,
                     help="comma-separated curves (default: all but the mixed and API ones)")
    run.add_argument("--rates", type=rate_list, action="append", metavar="[CURVE=]R1,R2,...",
                     help="requests per second, rising, for all curves or CURVE; repeatable")
    run.add_argument("--seconds", type=float, default=20.0, metavar="T",
                     help="arrivals last about T seconds at each rate: R x T requests")
    run.add_argument("--min-requests", type=positive_int, default=20,
                     help="at least this many requests per point (the low rates')")
    run.add_argument("--max-new-tokens", type=positive_int, default=2048,
                     help="most tokens a request generates")
    run.add_argument("--threshold", type=float, default=0.05, metavar="S",
                     help="mean normalized latency (s/token) that defines capacity")
    run.add_argument("--model", choices=MODELS, default="8b",
                     help="random weights of these shapes")
    run.add_argument("--device", type=device,
                     default="cuda" if torch.cuda.is_available() else "cpu", help="cuda:N, or cpu (with --model tiny: runs, no figure)")
    run.add_argument("--gpu-memory-utilization", type=fraction,
                     help="share of the GPU for weights, activations and K/V (default: 0.9)")
    run.add_argument("--kv-budget-gb", type=gigabytes, help="instead of --gpu-memory-utilization")
    run.add_argument("--seed", type=seed, default=0, help="of the weights and the arrivals")
    run.add_argument("--json", type=writable_file, metavar="PATH", required=True,
                     help="write every point here (for `plot`)")
    plot = commands.add_parser("plot", help="draw the curves of one or more runs",
                               formatter_class=HelpFormatter)
    plot.add_argument("sweeps", nargs="+", type=sweep_json, help="`run --json` files")
    plot.add_argument("-o", "--output", type=image_file, default="figure12.png",
                      help="the picture (.png, .pdf or .svg)")
    a = p.parse_args(argv)
    if a.command == "run" and not 0 < a.seconds <= MAX_SECONDS:
        p.error(f"--seconds {a.seconds}: expected a positive number of seconds, at most "
                f"{MAX_SECONDS:,.0f} (a few days of arrivals)")
    if a.command == "run" and not 0 < a.threshold < math.inf:
        p.error(f"--threshold {a.threshold}: expected a positive number of seconds per token")
    return a


def requests_at(rate: float, a) -> int:
    return max(a.min_requests, round(rate * a.seconds))


def curve_arguments(name: str, num_requests: int, a) -> Config:
    """The curve's run, as its script's flags would set it up."""
    script, options, _ = CURVES[name]
    return Config.from_options(script, dict(
        random_weights=True, model=a.model, device=str(a.device), continuous=True,
        max_new_tokens=a.max_new_tokens, seed=a.seed, kv_budget_gb=a.kv_budget_gb,
        gpu_memory_utilization=a.gpu_memory_utilization) | options, num_requests=num_requests)


def run_curve(base, name: str, a, bar, save) -> dict:
    """Every rate of one curve, from low to high, through one cache; save(curve) after each
    point, so that a run cut short keeps what it measured."""
    script = CURVES[name][0]
    args = curve_arguments(name, base.args.num_requests, a)
    setup = dataclasses.replace(base, args=args, attention=choose_attention(args.attn, base.device))
    if script == "virtual":
        llama3_virtual.require_cuda_and_flash_attn(args)
    if name in THROUGH_THE_API:
        engine = LLMEngine(script, len(setup.prompts), run=setup)  # a row for every request
        engine.warm_up()
        cache, manager = engine.cache, engine.manager
        serve = lambda rate, n: run_point_through_the_api(engine, setup, rate, n)
    else:
        cache, manager = allocate_kv_cache(setup, served=True)  # as a served engine's pool
        # Each running request holds a block (a page) at least: that bounds the batch.
        largest_batch = min(len(setup.prompts), manager.num_blocks)
        runner = make_runner(setup, model_forward(setup), cache, manager, greedy, largest_batch,
                             arrivals=True)
        warm_up_engine(runner, setup, cache, manager)
        serve = lambda rate, n: run_point(runner, setup, cache, manager, rate, n)
    try:
        curve = {"description": f"{CURVES[name][2]}; attention: {setup.attention.name}",
                 "kv_cache_bytes": cache.nbytes, "points": []}
        rates = rates_of(name, a)
        for i, rate in enumerate(rates):
            bar.set_postfix_str(f"{name} at {rate:g}/s")
            points = curve["points"]
            points.append(serve(rate, requests_at(rate, a)))
            curve |= {"capacity": capacity(points, a.threshold), "saturation": saturation(points)}
            save(curve)
            bar.update()
            if points[-1]["normalized_latency"] > STOP_FACTOR * a.threshold:
                bar.update(len(rates) - i - 1)  # the rates skipped
                break
        return curve
    finally:
        if hasattr(manager, "close"):  # the virtual cache's mapping thread
            manager.close()


def warm_up_engine(runner, setup, cache, manager) -> None:
    """Kernels chosen and compiled before anything is timed, on prompts no point uses."""
    def run_pass(prompts):
        requests = [EngineRequest(r, prompt, 8) for r, prompt in enumerate(prompts)]
        EngineCore(runner, make_scheduler(setup, cache, manager, requests)).generate(False)
    warm_up(run_pass, setup.args.compile, cache, manager, setup.args.max_seq_len, 8)


def run_point(runner, setup, cache, manager, rate: float, num_requests: int) -> dict:
    """The first num_requests prompts arriving at `rate`, as `llama3_<script>.py num_requests
    --continuous --request-rate rate` would serve them."""
    point = arriving_at(setup, rate, num_requests)
    start = time.perf_counter()
    scheduler = make_scheduler(point, cache, manager, make_requests(point))
    result = EngineCore(runner, scheduler).generate(progress=False)
    return point_record(point, start, result.requests, result.num_generated_tokens,
                        result.most_running, scheduling_report(result, True)["preemptions"])


def run_point_through_the_api(engine, setup, rate: float, num_requests: int) -> dict:
    """run_point's requests through engine/llm_engine.py's LLMEngine, as serve.py's engine process
    drives it: each added when it arrives (between steps), greedy, ignoring end-of-text, with
    its arrival time, then `step` until all are done."""
    point = arriving_at(setup, rate, num_requests)
    arriving = deque(make_requests(point))  # in order of arrival
    scheduler, served = engine.scheduler, []
    generated_before = engine.num_generated_tokens
    preempted_before = scheduler.num_preemptions
    scheduler.start_clock()  # time 0 of this point's arrivals and of its most running
    start = time.perf_counter()
    while arriving or engine.has_unfinished():
        while arriving and arriving[0].arrival_time <= scheduler.now():
            r = arriving.popleft()
            params = SamplingParams(max_tokens=r.max_new_tokens, temperature=0, ignore_eos=True)
            request_id = engine.add_request(r.prompt_tokens, params, arrival_time=r.arrival_time)
            served += [s.request for s in engine.sequences.values() if s.request_id == request_id]
        if not engine.has_unfinished():
            time.sleep(max(arriving[0].arrival_time - scheduler.now(), 0.0))
            continue
        engine.step()
    return point_record(point, start, served, engine.num_generated_tokens - generated_before,
                        scheduler.most_running,
                        scheduler.num_preemptions - preempted_before)


def arriving_at(setup, rate: float, num_requests: int):
    """A point's run: the first num_requests prompts, arriving at `rate`."""
    args = dataclasses.replace(setup.args, request_rate=rate)
    return dataclasses.replace(setup, args=args, prompts=setup.prompts[:num_requests])


def point_record(point, start: float, requests: list, generated: int, most_running: int,
                 preemptions: int) -> dict:
    """What a point measured, once its last token is in (`start`: its perf_counter start)."""
    if point.device.type == "cuda":
        torch.cuda.synchronize(point.device)
    wall = time.perf_counter() - start
    latency = latency_report(requests)
    return {"rate": point.args.request_rate, "requests": len(point.prompts), "wall_seconds": wall,
            "output_tokens": generated, "output_tokens_per_second": generated / wall,
            "most_running": most_running, "preemptions": preemptions,
            "normalized_latency": latency["normalized_seconds_per_token"]["mean"],
            "latency": latency}


def capacity(points: list[dict], threshold: float) -> dict:
    """Where the mean normalized latency crosses `threshold`, on a straight line between the
    last rate under it and the first above. None where no point is under it; a lower bound (the
    highest rate run) where none is above."""
    below = [p for p in points if p["normalized_latency"] <= threshold]
    above = [p for p in points if p["normalized_latency"] > threshold]
    if not below:
        return {"rate": None, "at_least": False}
    low = max(below, key=lambda p: p["rate"])
    high = min((p for p in above if p["rate"] > low["rate"]), key=lambda p: p["rate"], default=None)
    if high is None:
        return {"rate": low["rate"], "at_least": True}
    share = (threshold - low["normalized_latency"]) / (high["normalized_latency"] - low["normalized_latency"])
    return {"rate": low["rate"] + share * (high["rate"] - low["rate"]), "at_least": False}


def saturation(points: list[dict]) -> dict:
    """The most requests per second a point completed (its requests over its wall time, from
    the first arrival to the last token). Past capacity the queue holds requests throughout,
    and that is the rate the cache serves at most; a lower bound if no point got that far
    (none had its requests wait a second on average for their first token)."""
    best = max(points, key=lambda p: p["requests"] / p["wall_seconds"])
    queued = any(p["latency"]["time_to_first_token"]["mean"] > 1.0 for p in points)
    return {"rate": best["requests"] / best["wall_seconds"], "at_least": not queued}


def memory_label(a) -> str:
    """The memory the run had: for weights, activations and KV cache, or for KV alone."""
    if a.kv_budget_gb:
        return f"--kv-budget-gb {a.kv_budget_gb:g}"
    if a.device.type == "cuda":
        total = torch.cuda.get_device_properties(a.device).total_memory
        share = a.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
        return (f"--gpu-memory-utilization {share:g}: {share * total / 1e9:.1f} of "
                f"{total / 1e9:.1f} GB")
    return "the CPU's KV budget"


def run(a) -> dict:
    most = max(requests_at(rate, a) for name in a.curves for rate in rates_of(name, a))
    available = len(read_records(PROMPTS_FILE))
    if most > available:
        raise UserError(f"The highest rate for {a.seconds:g} s of arrivals needs {most:,} prompts, "
                        f"and {PROMPTS_FILE.name} has {available:,}: lower --seconds or the "
                        f"highest of --rates.")
    base = load(curve_arguments("paged", most, a))  # the model, read by every curve
    sweep = {"device": (torch.cuda.get_device_name(a.device) if a.device.type == "cuda"
                        else "CPU"),
             "memory": memory_label(a),
             "model": f"{a.model}, random weights", "seconds": a.seconds, "seed": a.seed,
             "threshold": a.threshold, "curves": {}}
    with tqdm(total=sum(len(rates_of(n, a)) for n in a.curves), unit="point", desc="sweep") as bar:
        for name in a.curves:
            def save(curve, name=name):
                sweep["curves"][name] = curve
                write_atomically(a.json, lambda path: path.write_text(
                    standard_json(sweep)))
            run_curve(base, name, a, bar, save)
            gc.collect()  # the curve's cache is gone with its frame: give its memory back
            if base.device.type == "cuda":
                torch.cuda.empty_cache()  # the next curve's budget is measured from what is free
    return sweep


def merged(sweeps: list[dict]) -> list[dict]:
    """Sweeps of the same memory, trace and threshold as one, their curves together (a figure's
    curves may come from several runs). A curve run twice keeps the points of both, the later
    run's where both ran a rate, and its capacity is read again from them all."""
    panels = {}
    for sweep in sweeps:
        key = tuple(sweep.get(k) for k in ("device", "model", "memory", "seconds", "threshold"))
        panel = panels.setdefault(key, sweep | {"curves": {}})
        for name, curve in sweep["curves"].items():
            earlier = panel["curves"].get(name, {"points": []})["points"]
            by_rate = {p["rate"]: p for p in earlier + curve["points"]}
            points = [by_rate[rate] for rate in sorted(by_rate)]
            panel["curves"][name] = curve | {"points": points}
            if earlier:
                panel["curves"][name] |= {"capacity": capacity(points, sweep["threshold"]),
                                          "saturation": saturation(points)}
    return list(panels.values())


def format_latency(seconds: float | None) -> str:
    return "-" if seconds is None else format_seconds(seconds)


def ratios(capacity: dict, naive: dict) -> str:
    """", 2.5x naive-8192": a capacity against each naive curve's ({name: capacity}), where that
    one is measured; where only this one is a lower bound, so is the ratio."""
    text = ""
    for name, base in naive.items():
        if capacity["rate"] and base["rate"] and not base["at_least"]:
            text += (f", {'at least ' if capacity['at_least'] else ''}"
                     f"{capacity['rate'] / base['rate']:.1f}x {name}")
    return text


def print_tables(sweeps: list[dict]) -> None:
    """Per sweep: mean normalized latency by rate and curve, each curve's capacity and its ratio
    to the naive curves', and where paged ran both ways, p99 time between tokens with and
    without mixed steps."""
    for sweep in sweeps:
        curves, threshold = sweep["curves"], sweep["threshold"]
        rates = sorted({p["rate"] for c in curves.values() for p in c["points"]})
        at = lambda name, rate: next((p for p in curves[name]["points"] if p["rate"] == rate), None)
        print(f"\nMean normalized latency per output token; {sweep['device']}, {sweep['model']}, "
              f"{sweep['memory']}, arrivals over {sweep['seconds']:g} s per rate")
        print(f"{'rate':>8} " + " ".join(f"{name:>13}" for name in curves))
        for rate in rates:
            cells = [format_latency(at(name, rate) and at(name, rate)["normalized_latency"])
                     for name in curves]
            print(f"{rate:>6g}/s " + " ".join(f"{cell:>13}" for cell in cells))
        print(f"Capacity, requests/s: where the mean crosses {format_seconds(threshold)}/token; "
              f"saturation, the most a point completed. Against each naive curve:")
        naive = [n for n in ("naive-8192", "naive-2048") if n in curves]
        for name, curve in curves.items():
            crossing, most = curve["capacity"], curve["saturation"]
            text = ("below the lowest rate run" if crossing["rate"] is None else
                    f"{'at least ' if crossing['at_least'] else ''}{crossing['rate']:.1f}")
            text += ratios(crossing, {n: curves[n]["capacity"] for n in naive if n != name})
            text += f"; saturation {'at least ' if most['at_least'] else ''}{most['rate']:.1f}"
            text += ratios(most, {n: curves[n]["saturation"] for n in naive if n != name})
            print(f"  {name:<13} {text} ({curve['description']})")
        mixed_curves = [n for n in curves if n.startswith("paged-mixed") and "paged" in curves]
        for mixed_name in mixed_curves:
            print(f"p99 time between tokens, prefill-first steps against {mixed_name}:")
            for rate in rates:
                first, mixed = at("paged", rate), at(mixed_name, rate)
                if first and mixed:
                    f, m = (p["latency"]["time_between_tokens"]["p99"] for p in (first, mixed))
                    print(f"  {rate:>6g}/s  {format_seconds(f)} against {format_seconds(m)} "
                          f"({m / f:.2f}x)")


def plot(sweeps: list[dict], output: Path) -> None:
    """One panel per sweep (per memory): a curve per cache, the threshold dashed."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4.5), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        for name, curve in sweep["curves"].items():
            points = sorted(curve["points"], key=lambda p: p["rate"])
            ax.plot([p["rate"] for p in points], [p["normalized_latency"] for p in points],
                    marker="o", markersize=3, label=curve["description"],
                    color=f"C{list(CURVES).index(name)}")  # a curve's color in every panel
        ax.axhline(sweep["threshold"], color="gray", linestyle="--", linewidth=0.8,
                   label=f"threshold, {sweep['threshold']:g} s/token")
        highest = max(p["normalized_latency"] for c in sweep["curves"].values() for p in c["points"])
        # The paper's view: the flat part and where each curve turns steep, not how far it goes.
        ax.set_ylim(0, min(max(2 * sweep["threshold"], 1.1 * highest), 4 * sweep["threshold"]))
        ax.set_xlim(left=0)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_title(f"{sweep['device']}, {sweep['model']}\n{sweep['memory']}; "
                     f"arrivals over {sweep['seconds']:g} s per rate", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    write_atomically(output, lambda path: fig.savefig(path, dpi=100, format=output.suffix[1:]))
    print(f"Wrote {output} ({output.stat().st_size / 1e3:.0f} KB)")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors(PROG):
        if a.command == "plot":
            refuse_output_over_input(a.output, [s["path"] for s in a.sweeps], "-o")
            panels = merged(a.sweeps)
            print_tables(panels)
            return plot(panels, a.output)
        refuse_output_over_input(a.json, [PROMPTS_FILE], "--json")
        print_tables([run(a)])


if __name__ == "__main__":
    main()
