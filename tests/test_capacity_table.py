"""tools/capacity_table.py: the finder's answer confirmed by fresh processes at N and N + 1."""

import json
import math
import time

import pytest

from tools import capacity_table


class KnownCapacity:
    """Stands in for fresh processes of a script whose largest batch is known."""

    def __init__(self, capacity: int):
        self.capacity, self.runs = capacity, 0

    def completes(self, n: int) -> bool:
        self.runs += 1
        return n <= self.capacity


@pytest.mark.parametrize("capacity, found, confirmed, runs", [
    (7, 7, 7, 2),  # the finder was right: 7 completes, 8 does not
    (7, 5, 7, 4),  # a request or two low (memory the finder's process held): up to 7
    (7, 9, 7, 4),  # too high: 8 fails too, 6 completes, then 7 between them
    (0, 0, 0, 1),  # not even one: 1 fails
    (30, 7, 20, 5),  # past the upper bound: 8, 10, 14, then 20, "at least 20"
])
def test_the_table_gives_what_fresh_processes_confirm(capacity, found, confirmed, runs):
    processes = KnownCapacity(capacity)
    n, checks = capacity_table.confirmed(processes, found, upper=20)
    assert n == confirmed and processes.runs == runs == len(checks)
    assert [n, True] in checks or n == 0
    assert [n + 1, False] in checks or n == 20


@pytest.mark.parametrize("capacity, start", [(2_715, 2_900), (2_715, 144), (144, 2_715)])
def test_a_start_far_from_the_answer_costs_runs_as_the_log_of_the_distance(capacity, start):
    # The lesson's loop is searched from the engine's answer, which can be a few hundred off.
    processes = KnownCapacity(capacity)
    n, checks = capacity_table.confirmed(processes, start, upper=4_000)
    assert n == capacity and [n, True] in checks and [n + 1, False] in checks
    assert len(checks) <= 2 * math.log2(abs(capacity - start)) + 3


def test_each_ratio_is_against_the_bf16_row_of_its_cache_and_budget(capsys):
    row = lambda cache, lever, n, found=None: {"budget": "24gb", "cache": cache, "lever": lever,
                                                "requests": n, "found": found or n,
                                                "at_least": False}
    capacity_table.print_table({"flags": [], "rows": [
        row("naive", "bf16", 6), row("naive", "fp8-kv", 12), row("paged", "bf16", 144),
        row("paged", "fp8-weights", 322, found=321)]})
    out = capsys.readouterr().out
    assert "| naive | FP8 K/V | 12 (2.00x) |" in out
    assert "| paged | FP8 weights | 322 (2.24x); the finder said 321 |" in out


class FakeRuns(KnownCapacity):
    """Runs of a script whose capacity is known per lever (the script alone, engine=False, fits
    fewer), each writing a line to the log; the bf16 row's finder waits, so that rows measured
    at once finish out of order."""

    CAPACITY = {"bf16": 5, "fp8-kv": 11, "fp8-weights": 8, "both": 17}
    LESSON_LOOP = 4

    def __init__(self, cache: str, flags: list[str], log, engine: bool, gpu=None):
        lever = next(name for name, (_, lever_flags) in reversed(capacity_table.LEVERS.items())
                     if name in self.CAPACITY and all(f in flags for f in lever_flags))
        lever = lever if engine else "loop"
        super().__init__(self.CAPACITY[lever] if engine else self.LESSON_LOOP)
        self.lever, self.log, self.gpu = lever, log, gpu

    def found(self, upper: int) -> int:
        assert self.lever != "loop", "the lesson's loop has no finder"
        if self.lever == "bf16":
            time.sleep(0.2)
        self.log.write(f"{self.lever} found\n")
        return self.capacity - 1  # low by one: a fresh process confirms one more

    def completes(self, n: int) -> bool:
        self.log.write(f"{self.lever} {n}\n")
        return super().completes(n)


@pytest.mark.parametrize("jobs", [1, 4])
def test_rows_measured_at_once_keep_the_tables_order_and_each_rows_log_together(
        tmp_path, monkeypatch, capsys, jobs):
    monkeypatch.setattr(capacity_table, "Runs", FakeRuns)
    a = capacity_table.parse_arguments(["--caches", "paged", "--budgets", "24gb", "--jobs",
                                        str(jobs), "--upper", "30", "--log",
                                        str(tmp_path / "log")])
    result = capacity_table.measure(a, [])
    assert [(r["lever"], r["requests"], r["found"]) for r in result["rows"]] == [
        *((lever, n, n - 1) for lever, n in FakeRuns.CAPACITY.items()),
        ("lesson-loop", 4, 5)]  # searched from the engine's bf16 answer: 5 fails, 4 completes
    rows = (tmp_path / "log").read_text().split("## ")[1:]  # in the order they ended
    if jobs > 1:  # bf16's finder waits: the rows measured beside it end first
        assert rows[0].startswith("paged, FP8") and rows[3].startswith("paged, bf16, 24gb: 5")
    for row in rows:  # each row's runs together, under its heading
        runs = row.split("\n", 1)[1].split()
        assert len(set(runs[::2])) == 1 and len(runs) >= 4
    assert rows[-1].split("\n", 1)[1].split() == ["loop", "5", "loop", "4"]
    capacity_table.print_table(result)
    out = capsys.readouterr().out
    assert "paged, bf16, 24gb: 5 (the finder said 4)" in out  # as the row ended
    assert "| paged | bf16, the lesson's loop (the script alone) | 4 |" in out


def test_rows_at_once_over_several_gpus_each_have_a_gpu_of_their_own(tmp_path, monkeypatch):
    running, seen = [], []  # the GPU of each row running now; of every run

    class OnGPUs(FakeRuns):
        def completes(self, n: int) -> bool:
            running.append(self.gpu)
            seen.append(sorted(running))
            time.sleep(0.05)  # long enough for the rows beside it to start
            running.remove(self.gpu)
            return super().completes(n)
    monkeypatch.setattr(capacity_table, "Runs", OnGPUs)
    a = capacity_table.parse_arguments(["--caches", "paged", "--budgets", "whole", "--gpus", "2",
                                        "--jobs", "2", "--upper", "30"])
    result = capacity_table.measure(a, [])
    assert [r["requests"] for r in result["rows"]] == [*FakeRuns.CAPACITY.values(), 4]
    assert all(len(set(gpus)) == len(gpus) for gpus in seen)  # never two rows on one GPU
    assert [0, 1] in seen and {g for gpus in seen for g in gpus} == {0, 1}


def test_a_run_stopped_part_way_keeps_the_rows_it_finished(tmp_path, monkeypatch, capsys):
    class StoppedAtFP8Weights(FakeRuns):
        def found(self, upper: int) -> int:
            if self.lever == "fp8-weights":
                raise KeyboardInterrupt  # as a time limit's signal would
            return super().found(upper)
    monkeypatch.setattr(capacity_table, "Runs", StoppedAtFP8Weights)
    a = capacity_table.parse_arguments(["--caches", "paged", "--budgets", "24gb", "--upper",
                                        "30", "--log", str(tmp_path / "log"), "--json",
                                        str(tmp_path / "t.json")])
    with pytest.raises(KeyboardInterrupt):
        capacity_table.measure(a, [])
    assert [row.split(":")[0] for row in (tmp_path / "log").read_text().split("## ")[1:]] == [
        "paged, bf16, 24gb", "paged, FP8 K/V, 24gb"]
    out = capsys.readouterr().out
    assert "paged, bf16, 24gb: 5" in out and "paged, FP8 K/V, 24gb: 11" in out
    kept = json.loads((tmp_path / "t.json").read_text())
    assert not kept["complete"] and [(r["lever"], r["requests"]) for r in kept["rows"]] == [
        ("bf16", 5), ("fp8-kv", 11)]


def test_what_cannot_be_measured_as_asked_is_refused_in_one_paragraph(capsys):
    for flags, advice in ((["--budgets", "whole", "--jobs", "2"], "with --jobs 1,"),
                          (["--budgets", "whole", "--gpus", "2", "--jobs", "3"],
                           "with --jobs 2 or fewer"),
                          (["--budgets", "24gb", "--jobs", "6"], "--jobs 5 or fewer"),
                          (["--budgets", "24gb", "--gpus", "2", "--jobs", "11"],
                           "--jobs 10 or fewer"),
                          (["--levers", "fp8-kv", "lesson-loop"], "add bf16 to --levers"),
                          (["--", "--no-compile"], "takes no engine flag")):
        with pytest.raises(SystemExit) as e:
            capacity_table.main(flags)
        assert e.value.code == 2 and advice in capsys.readouterr().err


@pytest.mark.slow
def test_the_naive_caches_limits_are_its_budget_over_max_seq_len_slots(tmp_path, capsys):
    # The naive cache reserves --max-seq-len slots per request: an 8.00 MB budget holds 3
    # requests of 1,024 tokens x 2 KiB (float32 on the CPU), and 15 of 512 bytes (float8 K/V),
    # through the engine or, bf16, the script's own loop alike.
    capacity_table.main(["--caches", "naive", "--levers", "bf16", "fp8-kv", "lesson-loop",
                         "--budgets", "0.008",
                         "--upper", "20", "--json", str(tmp_path / "t.json"), "--", "--model",
                         "tiny", "--device", "cpu", "--max-seq-len", "1024",
                         "--max-new-tokens", "8"])
    budget, slots = 0.008e9, 1024
    assert 3 == int(budget // (slots * 2048)) and 15 == int(budget // (slots * 512))
    out = capsys.readouterr().out
    assert "| naive | bf16 | 3 |" in out and "| naive | FP8 K/V | 15 (5.00x) |" in out
    assert "| naive | bf16, the lesson's loop (the script alone) | 3 |" in out  # the same budget
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["complete"] and [r["requests"] for r in written["rows"]] == [3, 15, 3]
