"""tools/steps_by_batch.py: a bench run's decode steps summed over ranges of batch sizes."""

import json

import pytest

from tools import steps_by_batch

# Four decode steps as tools/bench.py's --json keeps them: GPU seconds, batch, floor.
RUN = {"output_tokens_per_second": 1234.0, "decode_seconds": 0.07,
       "step_seconds": [0.030, 0.020, 0.010, 0.005],
       "step_running_requests": [600, 550, 300, 10],
       "step_floor_seconds": [0.010, 0.010, 0.005, 0.005]}


def test_steps_are_summed_in_each_range_and_empty_ranges_left_out():
    ranges = steps_by_batch.steps_by_batch(RUN, [256, 512, 1024])
    assert [(r["first"], r["last"], r["steps"]) for r in ranges] == [(0, 256, 1), (256, 512, 1),
                                                                     (512, 1024, 2)]
    assert ranges[2]["seconds"] == pytest.approx(0.050)
    assert ranges[2]["floor_seconds"] == pytest.approx(0.020)


def test_the_last_range_ends_at_the_largest_batch(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(RUN))
    steps_by_batch.main([str(path), "--edges", "512"])
    out = capsys.readouterr().out
    assert "batch     1 to   512:     2 steps,   0.01 s on the GPU, floor   0.01 s (1.50x)" in out
    assert "batch   513 to   600:     2 steps,   0.05 s on the GPU, floor   0.02 s (2.50x)" in out


def test_a_json_without_steps_is_refused_in_one_paragraph(tmp_path, capsys):
    path = tmp_path / "nano.json"
    path.write_text(json.dumps({"output_tokens_per_second": 1.0}))
    with pytest.raises(SystemExit) as e:
        steps_by_batch.main([str(path)])
    err = capsys.readouterr().err
    assert e.value.code != 0 and "no decode steps' seconds" in err and "Traceback" not in err
