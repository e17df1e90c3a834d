"""tools/reading_walk.py: the walk's counts, and the first-call tree of a script's run."""

from tools.reading_walk import script_run, stays, returns, traced


def test_stays_collapse_runs_of_one_file_and_returns_count_files_left_and_entered_again():
    walk = stays(["a", "a", "b", "a", "c", "c", "b"])
    assert walk == ["a", "b", "a", "c", "b"]
    assert returns(walk) == 2  # a, then b, entered again
    assert returns(stays(["a", "b", "c"])) == 0


def test_a_scripts_run_is_read_from_generate_down_to_the_lessons_model():
    calls = traced(script_run())
    order = [(depth, file, function) for depth, (file, function, _) in calls.depth_first()]
    assert order[0] == (0, "engine/build.py", "generate")
    # As the code reads: EngineCore.step schedules, then launches the step on the runner
    step = next(i for i, (_, f, name) in enumerate(order) if (f, name) == ("engine/engine_core.py",
                                                                            "step"))
    below = [(f, name) for depth, f, name in order[step + 1:step + 4]]
    assert below[0] == ("engine/scheduler.py", "schedule")
    files = {f for _, f, _ in order}
    assert {"engine/model_runner.py", "llama3_paged.py", "block_manager.py"} <= files
    assert not any(f.startswith(("tests/", "tools/")) for f in files)
