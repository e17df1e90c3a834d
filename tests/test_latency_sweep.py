"""tools/latency_sweep.py: the capacity arithmetic by hand, and a sweep of the tiny model on the
CPU held to the prompts file (every request generated its reply's length) and to its arrival
times (no point ended before its last request arrived)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import latency_sweep
from latency_sweep import capacity, merged, saturation
from plumbing.inputs import load_prompts, load_tokenizer

MAX_NEW_TOKENS, SECONDS, MIN_REQUESTS = 6, 0.1, 4


def point(rate, latency, requests=10, wall=1.0, first_token=0.1):
    return {"rate": rate, "normalized_latency": latency, "requests": requests,
            "wall_seconds": wall, "latency": {"time_to_first_token": {"mean": first_token}}}


def test_capacity_is_where_the_latency_crosses_the_threshold():
    points = [point(10, 0.01), point(20, 0.02), point(30, 0.08), point(40, 0.2)]
    assert capacity(points, 0.05) == {"rate": pytest.approx(25.0), "at_least": False}  # 20 + 10 x 0.5
    assert capacity(points, 0.5) == {"rate": 40, "at_least": True}  # never crossed: a lower bound
    assert capacity(points, 0.001)["rate"] is None  # crossed before the lowest rate run
    assert capacity(points[2:], 0.1) == {"rate": pytest.approx(30 + 10 * 0.02 / 0.12),
                                         "at_least": False}


def test_saturation_is_the_most_requests_a_point_completed_per_second():
    unqueued = [point(10, 0.01, requests=10, wall=2.0), point(20, 0.02, requests=20, wall=2.5)]
    assert saturation(unqueued) == {"rate": 8.0, "at_least": True}  # no queue yet: a lower bound
    queued = unqueued + [point(40, 0.1, requests=40, wall=5.0, first_token=3.0)]
    assert saturation(queued) == {"rate": 8.0, "at_least": False}


def test_sweeps_of_the_same_memory_share_a_panel():
    same = {"device": "GPU", "model": "8b", "memory": "24 GB", "seconds": 10, "threshold": 0.05}
    a = same | {"curves": {"naive-8192": {"points": []}}}
    b = same | {"curves": {"paged": {"points": []}}}
    c = same | {"memory": "135 GB", "curves": {"paged": {"points": []}}}
    panels = merged([a, b, c])
    assert [sorted(p["curves"]) for p in panels] == [["naive-8192", "paged"], ["paged"]]


def test_a_curve_run_twice_keeps_both_runs_points_and_reads_its_capacity_again():
    same = {"device": "GPU", "model": "8b", "memory": "24 GB", "seconds": 10, "threshold": 0.05}
    first = same | {"curves": {"naive": {"points": [point(2, 0.01), point(8, 0.03)]}}}
    second = same | {"curves": {"naive": {"points": [point(8, 0.04), point(12, 0.09)]}}}
    [panel] = merged([first, second])
    curve = panel["curves"]["naive"]
    assert [(p["rate"], p["normalized_latency"]) for p in curve["points"]] == [
        (2, 0.01), (8, 0.04), (12, 0.09)]  # the later run's point at 8/s
    assert curve["capacity"] == {"rate": pytest.approx(8.8), "at_least": False}  # 8 + 4 x 0.01 / 0.05


def expected_output_tokens(num_requests: int) -> int:
    """What the scripts generate with --random-weights: each reply's length, at least 1, at most
    --max-new-tokens (every prompt here is far from --max-seq-len)."""
    prompts = load_prompts(num_requests, load_tokenizer())
    return sum(min(max(p.num_reply_tokens, 1), MAX_NEW_TOKENS) for p in prompts)


def sweep(tmp_path, *flags) -> dict:
    out = tmp_path / "sweep.json"
    latency_sweep.main(["run", "--model", "tiny", "--device", "cpu", "--seconds", str(SECONDS),
                        "--min-requests", str(MIN_REQUESTS), "--max-new-tokens",
                        str(MAX_NEW_TOKENS), "--json", str(out), *flags])
    return json.loads(out.read_text())


def test_a_cpu_sweep_serves_every_request_after_it_arrives_and_plots(tmp_path, capsys):
    result = sweep(tmp_path, "--curves", "naive-2048,paged,paged-api", "--rates", "60",
                   "--rates", "paged=20,80", "--threshold", "10")
    assert list(result["curves"]) == ["naive-2048", "paged", "paged-api"]
    # paged-api: the same requests added one by one to the Python API's engine as they arrive
    for name, rates in (("naive-2048", [60]), ("paged", [20, 80]), ("paged-api", [60])):
        points = result["curves"][name]["points"]
        assert [p["rate"] for p in points] == rates
        for p in points:
            n = max(MIN_REQUESTS, round(p["rate"] * SECONDS))
            assert p["requests"] == n
            assert p["output_tokens"] == expected_output_tokens(n)
            gaps = np.random.default_rng(0).exponential(1 / p["rate"], n)  # the --seed 0 draw
            assert p["wall_seconds"] >= gaps[1:].sum(), "the point ended before its last arrival"
            assert p["normalized_latency"] > 0
    assert "Capacity" in capsys.readouterr().out
    picture = tmp_path / "figure.png"
    latency_sweep.main(["plot", str(tmp_path / "sweep.json"), "-o", str(picture)])
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as e:  # the picture must not overwrite its input
        latency_sweep.main(["plot", str(picture.with_name("sweep.json")), "-o",
                            str(picture.with_name("sweep.json"))])
    assert e.value.code == 2
    assert json.loads((tmp_path / "sweep.json").read_text())["curves"]


def test_a_curve_stops_after_its_first_point_past_twice_the_threshold(tmp_path):
    result = sweep(tmp_path, "--curves", "paged", "--rates", "40,80,160", "--threshold", "1e-6")
    assert [p["rate"] for p in result["curves"]["paged"]["points"]] == [40]


@pytest.mark.parametrize("flags", [["--rates", "4,2"], ["--rates", "fast=1,2"],
                                   ["--curves", "orca"], ["--seconds", "0"], ["--seconds", "1e308"]])
def test_bad_arguments_exit_2(tmp_path, flags):
    with pytest.raises(SystemExit) as e:
        latency_sweep.parse_arguments(["run", "--json", str(tmp_path / "x.json"), *flags])
    assert e.value.code == 2


def test_the_virtual_curve_without_flash_attn_on_a_gpu_is_refused_in_one_paragraph(monkeypatch):
    """On a GPU the check read `attn` from the loaded run, which has none: an AttributeError
    instead of the paragraph (on the CPU the device alone refused it first)."""
    import dataclasses
    import torch
    from plumbing.cli import UserError
    a = latency_sweep.parse_arguments(["run", "--curves", "virtual", "--model", "tiny",
                                       "--device", "cpu", "--json", "/dev/null"])
    loaded = latency_sweep.load(latency_sweep.curve_arguments("paged", 20, a))
    base = dataclasses.replace(loaded, device=torch.device("cuda"))
    parse = latency_sweep.curve_arguments
    def on_a_gpu(*args):  # what the parser gives on a CUDA machine
        return dataclasses.replace(parse(*args), device=torch.device("cuda"))
    monkeypatch.setattr(latency_sweep, "curve_arguments", on_a_gpu)
    monkeypatch.setattr(latency_sweep.llama3_virtual.cli, "importable", lambda name: False)
    with pytest.raises(UserError, match="needs --device cuda, flash-attn"):
        latency_sweep.run_curve(base, "virtual", a, None, None)
