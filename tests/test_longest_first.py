"""Decode rows longest first (features/longest_first.py): the same step reordered, and the same
tokens as the batch's own order, in static and continuous batches, under preemption, overlapped,
with shared blocks and with mixed steps."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from block_manager import BlockManager
import features.longest_first
from engine.config import parse_script_arguments
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.model_runner import ModelForward
from features.longest_first import longest_first
from engine.build import make_runner
from engine.scheduler import Step
from test_overlap import run
from test_scheduler import MAX_SEQ_LEN, random_prompts
from conftest import engine_model

PROMPT_LENGTHS = [5, 12, 3, 9, 14, 7, 1, 20, 16, 4]


@pytest.fixture(scope="module")
def model():
    return engine_model(5, torch.float32, MAX_SEQ_LEN)


def test_a_step_is_reordered_longest_first_and_stays_aligned():
    requests = ["a", "b", "c", "d"]
    step = Step("decode", requests, np.array([10, 11, 12, 13]), positions=np.array([3, 9, 9, 1]))
    sorted_step = longest_first(step)
    assert sorted_step.requests == ["b", "c", "a", "d"]  # ties keep their order
    assert sorted_step.rows.tolist() == [11, 12, 10, 13]
    assert sorted_step.positions.tolist() == [9, 9, 3, 1]
    assert step.requests == requests and step.rows.tolist() == [10, 11, 12, 13]  # not changed


@pytest.mark.parametrize("kind, num_blocks, scheduling", [
    ("paged", 200, {}),  # one static batch
    ("paged", 14, {"continuous": True}),  # preemption
    ("paged", 14, {"continuous": True, "overlap": True}),
    ("sharing", 200, {"continuous": True, "max_running": 5, "overlap": True}),
    ("paged", 200, {"continuous": True, "max_batched_tokens": 16}),  # decode rows in mixed steps
])
def test_rows_longest_first_give_the_batch_orders_tokens(model, monkeypatch, kind, num_blocks,
                                                         scheduling):
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    if kind == "sharing":
        prompts = [prompts[7][:12] + p for p in prompts]
    in_order = run(model, prompts, num_blocks, kind, **scheduling)
    reordered = []

    def spied(step):
        sorted_step = longest_first(step)
        assert (np.diff(sorted_step.positions) <= 0).all()
        reordered.append(sorted_step.rows.tolist() != step.rows.tolist())
        return sorted_step
    monkeypatch.setattr(features.longest_first, "longest_first", spied)  # where plug finds it
    longest = run(model, prompts, num_blocks, kind, longest_first=True, **scheduling)
    assert longest.output_tokens == in_order.output_tokens
    assert any(reordered), "some decode step's rows changed order"


@pytest.mark.parametrize("device, expected", [("cpu", False), ("cuda", True)])
def test_rows_are_longest_first_on_cuda(model, device, expected):
    config = parse_script_arguments("naive", ["1", "--random-weights", "--eager", "--no-overlap"])
    setup = SimpleNamespace(args=config, device=torch.device(device), model=model)  # eager: no
                                                                          # graphs of a CPU model
    cache = EngineKVCache(model.args, 4, 4, torch.float32, "cpu", TorchAttentionAfterPrefix())
    engine = make_runner(setup, ModelForward(model), cache, BlockManager(4, 4, 1, 4), None, 1)
    assert (engine.sort_rows is not None) is expected
