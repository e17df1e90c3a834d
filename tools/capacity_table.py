"""How many requests fit, lever by lever, all from one path: the engine's --find-max-batch, each
answer confirmed by fresh processes at N (which completes) and N + 1 (which does not).

    python tools/capacity_table.py                          # naive, paged; every lever; 2 budgets
    python tools/capacity_table.py --caches paged --levers bf16 fp8-kv --budgets 24gb
    python tools/capacity_table.py --budgets 24gb --jobs 5  # five rows at once on one GPU
    python tools/capacity_table.py --budgets whole --gpus 4 --jobs 4  # a row on each of 4 GPUs
    python tools/capacity_table.py --budgets 0.004 --upper 8 -- --model tiny --device cpu
                                                            # after --: flags for every run

A row is a cache and a lever: bf16 (none), FP8 K/V (--kv-cache-dtype fp8), FP8 weights (-q fp8)
or both; a column is a budget: 24gb (--gpu-memory-utilization 0.1592, 23.9 GB of an H200's
150), whole (the default utilization) or a number of GB for the KV cache (--kv-budget-gb, the
CPU's). Each run is `python -m engine.run llama3_CACHE.py N --random-weights ...`, the engine's
path, so every figure and ratio comes from the same code; each ratio is against the bf16 row of
the same cache and budget, from this call. A fresh process can fit a request more or less than
the finder's attempts in one process (memory the process holds after the first): the table
gives what fresh processes confirm, and the finder's answer where it differs. Where every prompt
of the data set fits, the table says "at least". The last row of each cache, lesson-loop, is
another path in its own row: the script alone (`python llama3_paged.py N`, the lesson's loop, no
engine), which has no finder: fresh processes search from the engine's bf16 answer, in steps
that double until they pass it, then halve; no ratio stands beside it.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("capacity_table.py")  # before anything slow loads

import argparse
import io
import json
import os
import queue
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from tqdm import tqdm

from plumbing.cli import (GPU_MEMORY_UTILIZATION, OUT_OF_MEMORY, HelpFormatter, UserError,
                          first_paragraph, one_paragraph_errors, positive_int, standard_json,
                          writable_file, write_atomically)
from plumbing.inputs import PROMPTS_FILE, read_records

LESSON_LOOP = "lesson-loop"  # the script alone, not the engine: searched from the engine's bf16
LEVERS = {"bf16": ("bf16", []), "fp8-kv": ("FP8 K/V", ["--kv-cache-dtype", "fp8"]),  # name, flags
          "fp8-weights": ("FP8 weights", ["-q", "fp8"]),
          "both": ("FP8 weights + FP8 K/V", ["-q", "fp8", "--kv-cache-dtype", "fp8"]),
          LESSON_LOOP: ("bf16, the lesson's loop (the script alone)", [])}
BUDGETS = {"24gb": ["--gpu-memory-utilization", "0.1592"], "whole": []}


def budget(text: str) -> str:
    """24gb, whole, or a KV budget in GB (a positive number)."""
    if text in BUDGETS:
        return text
    try:
        if float(text) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected 24gb, whole or a number of GB, got {text!r}")


def budget_flags(name: str) -> list[str]:
    return BUDGETS[name] if name in BUDGETS else ["--kv-budget-gb", name]


class Runs:
    """Fresh processes of one script with one set of flags, through the engine (`python -m
    engine.run`) or, engine=False, the script alone: the finder's answer, and whether a batch of
    n completes."""

    def __init__(self, cache: str, flags: list[str], log, engine: bool = True,
                 gpu: int | None = None):
        """gpu: the one GPU the runs see (CUDA_VISIBLE_DEVICES), where the rows share several."""
        engine_program = ["-m", "engine.run"] if engine else []
        self.command = [sys.executable, *engine_program, f"llama3_{cache}.py"]
        self.flags, self.log = flags, log
        self.env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}

    def run(self, n: int, *more: str) -> int:
        command = [*self.command, str(n), "--random-weights", *self.flags, *more]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=self.env)
        shown = " ".join(["python", *command[1:]])
        self.log.write(f"$ {shown}\n{done.stdout}{done.stderr}exit {done.returncode}\n")
        if done.returncode not in (0, OUT_OF_MEMORY):
            tail = " ".join((done.stderr or done.stdout).split()[-60:])
            raise UserError(f"`{shown}` exited {done.returncode}, neither completing nor out "
                            f"of memory: {tail}")
        return done.returncode

    def found(self, upper: int) -> int:
        """--find-max-batch's answer, at most `upper`: 0 if not even one request fits."""
        with tempfile.TemporaryDirectory() as folder:
            answer = Path(folder) / "found.json"
            if self.run(upper, "--find-max-batch", "--json", str(answer)) == OUT_OF_MEMORY:
                return 0
            return json.loads(answer.read_text())["largest_batch_that_completes"]

    def completes(self, n: int) -> bool:
        return self.run(n) == 0


def confirmed(runs: Runs, found: int, upper: int) -> tuple[int, list[list]]:
    """The largest n that completes in a fresh process while n + 1 does not (or n is the upper
    bound), searched from `found` (the finder's answer, or another path's): steps of 1, 2, 4 ...
    away from it until the answer is passed, then halving the gap. Returns n and each check
    made, as [n, completes]."""
    checks = []

    def completes(n: int) -> bool:
        checks.append([n, runs.completes(n)])
        return checks[-1][1]
    # as features/max_batch.py's search: `fits` completes (0 trivially), `fails` does not
    fits, fails = 0, upper + 1
    start = min(found, upper)
    if start > 0:
        fits, fails = (start, fails) if completes(start) else (fits, start)
    step = 1
    while fails == upper + 1 and fits < upper:  # up from an n that completes
        probe = min(fits + step, upper)
        fits, fails = (probe, fails) if completes(probe) else (fits, probe)
        step *= 2
    while fits == 0 and fails > 1:  # down from an n that does not
        probe = max(fails - step, 1)
        fits, fails = (probe, fails) if completes(probe) else (fits, probe)
        step *= 2
    while fails - fits > 1:
        middle = (fits + fails) // 2
        fits, fails = (middle, fails) if completes(middle) else (fits, middle)
    return fits, checks


def measure_row(entry: tuple[str, str, str], upper: int, extra: list[str],
                start: int | None = None, gpu: int | None = None) -> tuple[dict, str]:
    """One row: the finder (or, for the lesson's loop, `start`: the engine's answer), then fresh
    processes around its answer, on `gpu` if given. Returns the row, and its runs' output for
    the log."""
    b, c, lever = entry
    log, began = io.StringIO(), time.perf_counter()
    runs = Runs(c, [*budget_flags(b), *LEVERS[lever][1], *extra], log, lever != LESSON_LOOP, gpu)
    found = start if lever == LESSON_LOOP else runs.found(upper)
    n, checks = confirmed(runs, found, upper)
    return {"budget": b, "cache": c, "lever": lever, "found": found, "requests": n,
            "at_least": n == upper, "checks": checks,
            "seconds": time.perf_counter() - began}, log.getvalue()


def measure(a, extra: list[str]) -> dict:
    """Every row, --jobs at a time: each run's budget counts its own process's memory (what it
    allocated, plumbing/inputs.py's kv_budget_bytes), so rows that share the GPU should find
    what they would alone as long as their shares fit it together. The lesson's loop rows come
    last, each searched from its cache and budget's bf16 answer."""
    entries = [(b, c, lever) for b in a.budgets for c in a.caches for lever in a.levers]
    engine_rows = [e for e in entries if e[2] != LESSON_LOOP]
    loop_rows = [e for e in entries if e[2] == LESSON_LOOP]
    finished = {}

    def table() -> dict:  # every finished row, in the table's order
        return {"flags": extra, "upper": a.upper, "complete": len(finished) == len(entries),
                "rows": [finished[e] for e in entries if e in finished]}

    def keep(row: dict) -> None:
        finished[row["budget"], row["cache"], row["lever"]] = row
        if a.json:
            so_far = table()
            write_atomically(a.json, lambda path: path.write_text(standard_json(so_far)))
    with (tqdm(total=len(entries), desc="capacity", unit="row", file=sys.stderr) as bar,
          open(a.log or os.devnull, "w") as log):
        measure_rows(engine_rows, a, extra, bar, log, keep)
        starts = [finished[b, c, "bf16"]["requests"] for b, c, _ in loop_rows]
        measure_rows(loop_rows, a, extra, bar, log, keep, starts)
    return table()


def measure_rows(entries: list, a, extra: list[str], bar, log, keep,
                 starts: list | None = None) -> None:
    """measure_row of each entry, --jobs at a time. As each row ends, its runs go to the log
    together, its answer to the terminal, and the row to `keep`: a run stopped part way (a time
    limit) keeps every row it finished. With --gpus G, the rows at once go round the G GPUs: a
    row takes a GPU's place from `places` and gives it back as it ends."""
    places = queue.SimpleQueue()  # which GPU each of --jobs rows at once runs on (None: as given)
    for j in range(a.jobs):
        places.put(j % a.gpus if a.gpus > 1 else None)

    def measure_on_a_gpu(entry, start):
        gpu = places.get()
        try:
            return measure_row(entry, a.upper, extra, start, gpu)
        finally:
            places.put(gpu)
    with ThreadPoolExecutor(a.jobs) as pool:
        futures = [pool.submit(measure_on_a_gpu, entry, start)
                   for entry, start in zip(entries, starts or [None] * len(entries))]
        for future in as_completed(futures):
            row, runs = future.result()
            start = "searched from" if row["lever"] == LESSON_LOOP else "the finder said"
            heading = (f"{row['cache']}, {LEVERS[row['lever']][0]}, {row['budget']}: "
                       f"{row['requests']:,} ({start} {row['found']:,}), {row['seconds']:.0f} s")
            log.write(f"## {heading}\n{runs}")
            log.flush()
            bar.write(heading, file=sys.stdout)
            bar.update()
            keep(row)


def print_table(result: dict) -> None:
    rows = result["rows"]
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    cell = {(r["budget"], r["cache"], r["lever"]): r for r in rows}
    print(f"Requests that complete, confirmed by fresh processes at N and N + 1 (random weights; "
          f"flags {' '.join(result['flags']) or 'none'} beside each budget's and lever's):\n")
    print("| cache | lever | " + " | ".join(budgets) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for c, lever in dict.fromkeys((r["cache"], r["lever"]) for r in rows):
        cells = []
        for b in budgets:
            r, base = cell.get((b, c, lever)), cell.get((b, c, "bf16"))
            if r is None:
                cells.append("")
                continue
            text = f"{'at least ' if r['at_least'] else ''}{r['requests']:,}"
            if lever not in ("bf16", LESSON_LOOP) and base and base["requests"]:
                text += f" ({r['requests'] / base['requests']:.2f}x)"
            if r["found"] != r["requests"] and lever != LESSON_LOOP:
                text += f"; the finder said {r['found']:,}"
            cells.append(text)
        print(f"| {c} | {LEVERS[lever][0]} | " + " | ".join(cells) + " |")


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog="capacity_table.py", description=first_paragraph(__doc__),
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=HelpFormatter)
    p.add_argument("--caches", nargs="+", choices=["naive", "paged"], default=["naive", "paged"])
    p.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS),
                   metavar="LEVER", help=f"{', '.join(LEVERS)} (default: all)")
    p.add_argument("--budgets", nargs="+", type=budget, default=["24gb", "whole"],
                   help="24gb, whole, or GB of KV cache (default: 24gb whole)")
    p.add_argument("--upper", type=positive_int,
                   help="the largest batch tried (default: every prompt of the data set)")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write every figure here")
    p.add_argument("--log", type=writable_file, metavar="PATH", help="every run's output, here")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="rows measured at once: their budgets must fit the GPUs together")
    p.add_argument("--gpus", type=positive_int, default=1,
                   help="GPUs to spread the rows at once over, each run on one (default: 1)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: flags for every run")
    a = p.parse_args(argv)
    a.flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    return a


def check_lesson_loop(a) -> None:
    """The lesson's loop row is searched from the engine's bf16 row, and runs the script alone:
    only with flags the lesson takes (another would hand the run to the engine)."""
    if "bf16" not in a.levers:
        raise UserError("The lesson's loop is searched from the engine's bf16 answer: add bf16 "
                        "to --levers.")
    from plumbing.cli import add_pool_arguments, needs_features
    for c in a.caches:
        for b in a.budgets:
            argv = ["1", "--random-weights", *budget_flags(b), *a.flags]
            if needs_features(f"llama3_{c}.py", argv, add_pool_arguments if c == "paged" else None):
                raise UserError(f"The lesson's loop takes no engine flag, and `{' '.join(a.flags)}`"
                                f" holds one: leave lesson-loop out of --levers, or those flags.")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("capacity_table.py"):
        prompts = len(read_records(PROMPTS_FILE))  # no run can ask for more
        a.upper = a.upper or prompts
        if a.upper > prompts:
            raise UserError(f"--upper {a.upper:,}: the data set holds {prompts:,} prompts.")
        if LESSON_LOOP in a.levers:
            check_lesson_loop(a)
        per_gpu = -(-a.jobs // a.gpus)  # rows at once on the busiest GPU
        if per_gpu > 1 and "whole" in a.budgets:
            raise UserError(f"--jobs {a.jobs} over --gpus {a.gpus} with the whole GPU's budget: "
                            f"each run takes {GPU_MEMORY_UTILIZATION:.0%} of its GPU, so two "
                            f"would not fit on one at once. Measure the whole GPU with --jobs "
                            f"{a.gpus}{' or fewer' if a.gpus > 1 else ''}, a row on each GPU.")
        shares = [float(BUDGETS[b][1]) for b in a.budgets if b == "24gb"]
        if shares and per_gpu * max(shares) > GPU_MEMORY_UTILIZATION:
            fit = int(GPU_MEMORY_UTILIZATION // max(shares)) * a.gpus
            raise UserError(f"--jobs {a.jobs} runs of {max(shares):.1%} of a GPU each, over "
                            f"--gpus {a.gpus}, would take more than {GPU_MEMORY_UTILIZATION:.0%} "
                            f"of one together: use --jobs {fit} or fewer.")
        print_table(measure(a, a.flags))  # --json is written as each row ends


if __name__ == "__main__":
    main()
