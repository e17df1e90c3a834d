"""Overlapped steps (engine/model_runner.py, `overlap`): scheduling one step behind gives the tokens of the core
loop, which records every step before it schedules the next: in static and continuous batches,
under preemption, with stop tokens (a request runs one step too many, whose token is thrown
away), with shared blocks and with pages mapped ahead; and every block comes back."""

import math
import time
from types import SimpleNamespace

import pytest
import torch
from engine.run import command_line

from block_manager import BlockManager
from conftest import engine_model, forward_modes, generate
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.engine_core import EngineCore
from engine.model_runner import ModelForward, StepTimer
from features.virtual.mapping_ahead import BackgroundMapper
from engine.config import parse_script_arguments
from features.sharing.block_manager import SharingBlockManager
from engine.build import make_runner
from test_mapping_ahead import CheckedManager, FakePageTable
from test_scheduler import MAX_SEQ_LEN, random_prompts

PROMPT_LENGTHS = [5, 12, 3, 9, 14, 7, 1, 20, 16, 4]
BUDGETS = [30, 4, 40, 17, 9, 33, 25, 12, 21, 1]
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model():
    return engine_model(11, torch.float32, MAX_SEQ_LEN)


def make_manager(kind: str, cache, num_blocks: int, num_requests: int):
    width = math.ceil(MAX_SEQ_LEN / BLOCK_SIZE)
    if kind == "sharing":
        return SharingBlockManager(cache, num_requests, width, prefix_caching=True)
    if kind == "mapping ahead":
        return CheckedManager(num_blocks, BLOCK_SIZE, num_requests, width,
                              BackgroundMapper(FakePageTable(max_sleep_seconds=2e-4)))
    return BlockManager(num_blocks, BLOCK_SIZE, num_requests, width)


def run(model, prompts, num_blocks, kind="paged", **scheduling):
    # Mapping ahead's slots are in virtual rows: the cache holds every row's every page as blocks
    # (tests/test_mapping_ahead.py's run), of which num_blocks are mapped at a time.
    rows = len(prompts) + 1 if kind == "mapping ahead" else 0
    cache = EngineKVCache(model.args, max(num_blocks, rows * math.ceil(MAX_SEQ_LEN / BLOCK_SIZE)),
                    BLOCK_SIZE, torch.float32, "cpu", TorchAttentionAfterPrefix())
    manager = make_manager(kind, cache, num_blocks, len(prompts))
    result = generate(model, cache, manager, prompts, BUDGETS[:len(prompts)], MAX_SEQ_LEN,
                      chunk_tokens=8192, **scheduling)
    if kind == "mapping ahead":
        manager.close()
    held = num_blocks - manager.num_free_blocks - getattr(manager, "num_idle_pages", 0)
    cached = len(getattr(getattr(manager, "prefix_cache", None), "block_of", {}))
    assert not manager.owned_blocks and held <= cached, "every block back"
    return result


def stop_tokens(model, prompts) -> set[int]:
    """Tokens that some requests draw partway through (the 3rd of request 0, the 6th of 3, the 2nd
    of 7), so that those stop there."""
    free = run(model, prompts, num_blocks=200).output_tokens
    return {free[0][2], free[3][5], free[7][1]}


@pytest.mark.parametrize("kind, num_blocks, scheduling, with_stops", [
    ("paged", 200, {}, True),  # one static batch
    ("paged", 200, {"continuous": True, "max_running": 4}, True),  # the queue fills freed rows
    ("paged", 14, {"continuous": True}, False),  # a tight pool: preemption and recompute
    ("paged", 14, {"continuous": True}, True),
    ("sharing", 200, {"continuous": True, "max_running": 5}, True),  # blocks from the prefix cache
    ("mapping ahead", 14, {"continuous": True}, True),  # pages reused, taken back, unmapped
])
def test_overlapped_steps_give_the_core_loops_tokens(model, kind, num_blocks, scheduling,
                                                     with_stops):
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    if kind == "sharing":  # prompts that begin alike, so that blocks are shared
        prompts = [prompts[7][:12] + p for p in prompts]
    stops = stop_tokens(model, prompts) if with_stops else set()
    core = run(model, prompts, num_blocks, kind, stop_ids=stops, **scheduling)
    overlapped = run(model, prompts, num_blocks, kind, stop_ids=stops, overlap=True, **scheduling)
    assert overlapped.output_tokens == core.output_tokens
    if with_stops:  # some requests stopped early, and not one token after a stop was kept
        assert sum(map(len, core.output_tokens)) < sum(BUDGETS)
        assert not stops & {t for out in overlapped.output_tokens for t in out}
    if num_blocks < 100:
        assert overlapped.scheduler.num_preemptions > 0
    if kind == "sharing":
        assert core.num_prefilled_tokens < sum(len(r.prompt_tokens) for r in core.requests), "blocks were found cached"
    assert len(overlapped.timeline) >= len(core.timeline)  # a stopped request may run one more step


def test_a_request_preempted_while_its_stop_token_is_in_flight_leaves_the_queue(model,
                                                                                 monkeypatch):
    # Every prompt's fifth new token stops it. In a pool of 11 blocks one request is preempted
    # while the step that draws its stop token is in flight: it must leave the queue, not return.
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    free = run(model, prompts, num_blocks=200).output_tokens
    stops = {out[4] for out in free if len(out) > 4}
    left_the_queue = []
    record = EngineCore._record

    def counted(self, launched):
        waiting = set(self.scheduler.waiting)
        record(self, launched)
        left_the_queue.extend(r for r in waiting if r.status.value == "finished")
    monkeypatch.setattr(EngineCore, "_record", counted)
    core = run(model, prompts, 11, stop_ids=stops, continuous=True)
    overlapped = run(model, prompts, 11, stop_ids=stops, continuous=True, overlap=True)
    assert overlapped.output_tokens == core.output_tokens
    assert len(left_the_queue) == 1 and left_the_queue[0] not in overlapped.scheduler.waiting
    assert all(r.status.value == "finished" for r in overlapped.requests)


def test_the_engines_runs_run_the_model_in_inference_mode(model, monkeypatch):
    """As CUDA graphs were captured and compiled layers compiled: a pass in another mode would
    compile the layers again, inside the timed run."""
    modes = forward_modes(model, monkeypatch)
    run(model, random_prompts(PROMPT_LENGTHS[:3], seed=1), num_blocks=200, continuous=True)
    assert modes and all(modes)


def test_the_gpu_idle_time_is_the_time_between_steps():
    timer = StepTimer("cpu")
    timer.start(decodes=False)
    timer.stop()
    time.sleep(0.05)  # the host's work between two steps, which nothing overlaps on the CPU
    timer.start(decodes=True)
    timer.stop()
    assert 0.05 <= timer.idle_seconds() < 0.5
    assert len(timer.seconds()) == 2 and timer.decodes == [False, True]


def test_runs_that_read_the_host_in_flight_stay_on_the_core_loop():
    def why_not(cache, *flags):
        return parse_script_arguments(cache, ["2", "--random-weights", *flags]).why_not_overlapped()
    assert why_not("virtual", "--continuous") is None
    assert "mixed steps" in why_not("paged", "--continuous", "--max-batched-tokens", "64")
    assert "swapping" in why_not("paged", "--continuous", "--preemption", "swap")
    assert "--sync-mapping" in why_not("virtual", "--continuous", "--sync-mapping")
    assert "--find-max-batch" in why_not("virtual", "--find-max-batch")  # maps in the loop
    assert why_not("paged", "--find-max-batch") is None


@pytest.mark.parametrize("flags, reason", [
    (["--max-batched-tokens", "64"], "mixed steps"),
    (["--preemption", "swap"], "swapping"),
])
def test_an_overlap_the_run_cannot_have_is_refused_before_the_model_loads(flags, reason, capsys):
    with pytest.raises(SystemExit) as exit:
        command_line("llama3_paged.py", ["2", "--random-weights", "--model", "tiny", "--device", "cpu",
                           "--continuous", "--overlap", *flags])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and reason in err and "Drop --overlap" in err
    assert "Random weights" not in out  # printed as the model is built: it never was


@pytest.mark.parametrize("overlap, device, expected", [
    (None, "cpu", False),  # nothing runs ahead on the CPU: one step after the other
    (True, "cpu", True),
    (False, "cpu", False),
])
def test_the_flag_chooses_the_loop(model, overlap, device, expected):
    flag = {None: [], True: ["--overlap"], False: ["--no-overlap"]}[overlap]
    config = parse_script_arguments("naive", ["1", "--random-weights", "--eager", *flag])
    setup = SimpleNamespace(args=config, device=torch.device(device), model=model)
    cache = EngineKVCache(model.args, 4, 4, torch.float32, "cpu", TorchAttentionAfterPrefix())
    engine = make_runner(setup, ModelForward(model), cache, BlockManager(4, 4, 1, 4), None, 1)
    assert engine.overlap == expected

