"""Mixed steps (engine/scheduler.py, `mixed`): the tokens of a static batch, whatever chunking and
preemption do on the way, and a token budget that no step exceeds."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import BlockManager
from conftest import engine_model, tokens
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.request import EngineRequest
from engine.model_runner import greedy
from engine.scheduler import Scheduler
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from features.sharing.block_manager import SharingBlockManager
from test_scheduler import MAX_SEQ_LEN, FakeCache, preemption_workload


@pytest.fixture(scope="module")
def model():
    return engine_model(11, torch.float32, MAX_SEQ_LEN)


def run_mixed(model, prompts, budgets, num_blocks, block_size, max_batched_tokens, max_running=None):
    """Like test_scheduler.run, through the mixed scheduler; also returns every step."""
    cache = EngineKVCache(model.args, num_blocks, block_size, torch.float32, "cpu", TorchAttentionAfterPrefix())
    manager = BlockManager(num_blocks, block_size, len(prompts), math.ceil(MAX_SEQ_LEN / block_size))
    requests = [EngineRequest(r, p, min(b, MAX_SEQ_LEN - len(p)))
                for r, (p, b) in enumerate(zip(prompts, budgets))]
    scheduler = StepRecorder(manager, requests, True, max_running, max_batched_tokens, mixed=True)
    runner = ModelRunner(model, cache, manager, greedy)
    return EngineCore(runner, scheduler).generate(progress=False), manager, scheduler.steps


class StepRecorder(Scheduler):
    """The mixed scheduler, keeping a copy of what each step computes: (decoding, chunks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []

    def schedule(self):
        step = super().schedule()
        chunks = []
        if step.kind != "decode":
            chunks = [(r.row, int(s), int(e)) for r, s, e in zip(
                step.requests[step.num_decoding:], step.num_cached[step.num_decoding:],
                step.ends[step.num_decoding:])]
        self.steps.append((step.num_decoding if step.kind != "decode" else len(step.requests), chunks))
        return step


@pytest.mark.parametrize("block_size", [16, 256])
def test_mixed_steps_give_the_static_batchs_tokens_with_chunks_and_preemption(model, block_size):
    prompts, budgets, static, needed = preemption_workload(model, block_size)
    budget = block_size // 2 + 3  # less than the longest prompts: they are chunked across steps
    mixed, manager, steps = run_mixed(model, prompts, budgets, needed, block_size, budget)
    assert mixed.output_tokens == static.output_tokens
    assert mixed.scheduler.num_preemptions > 0
    assert any(decoding and chunks for decoding, chunks in steps), "no step mixed the two"
    assert any(end - start == budget for _, chunks in steps for _, start, end in chunks[:1]), \
        "no prompt was chunked"
    for decoding, chunks in steps:
        assert not chunks or decoding + sum(e - s for _, s, e in chunks) <= budget
    assert manager.num_free_blocks == needed and not manager.owned_blocks, "every block back"


def test_mixed_steps_refuse_a_block_manager_that_shares_blocks():
    manager = SharingBlockManager(FakeCache(8, 4), 2, 4, True)
    with pytest.raises(ValueError, match="do not share blocks"):
        Scheduler(manager, [EngineRequest(0, tokens(3), 2)], True, None, 8, mixed=True,
                  shares_blocks=True)


def test_the_worked_example_of_the_readme(model):
    # Budget 8; A: 3 prompt tokens and 4 new; B: a 10-token prompt arriving behind it.
    prompts, budgets = [tokens(3, 1), tokens(10, 50)], [4, 3]
    result, _, steps = run_mixed(model, prompts, budgets, num_blocks=8, block_size=4,
                                 max_batched_tokens=8)
    assert steps[:4] == [
        (0, [(0, 0, 3), (1, 0, 5)]),  # A's prompt and B's first 5: A draws its first token
        (1, [(1, 5, 10)]),  # A decodes (1 token) beside B's last 5: both draw a token
        (2, []),  # nothing left to prefill: a plain decode step of A and B
        (2, []),
    ]
    assert [len(t) for t in result.output_tokens] == [4, 3]


def feed(step) -> list:
    """What the engine does with a step's tokens, without a model: one token for each request
    that draws one; returns those done."""
    done = []
    for request, draws in zip(step.requests, step.takes_a_token()):
        if draws:
            request.output_tokens.append(1000 * (request.row + 1) + len(request.output_tokens))
            if len(request.output_tokens) >= request.max_new_tokens:
                done.append(request)
    return done


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=12),
       st.sampled_from([1, 4, 16]), st.integers(0, 30), st.sampled_from([None, 1, 3]),
       st.sampled_from([1, 5, 64]))
def test_mixed_scheduler_invariants_hold_under_any_workload(requests, block_size, spare_blocks,
                                                            max_running, budget):
    prompts = [[100 + i] * p for i, (p, _) in enumerate(requests)]
    limits = [g for _, g in requests]
    n = len(prompts)
    largest = max(math.ceil((p + g - 1) / block_size) for p, g in requests)
    num_blocks = largest + spare_blocks
    manager = BlockManager(num_blocks, block_size, n, largest)
    queue = [EngineRequest(r, p, g) for r, (p, g) in enumerate(zip(prompts, limits))]
    scheduler = Scheduler(manager, queue, True, max_running, budget, mixed=True)
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        step = scheduler.schedule()
        if step.kind != "decode":
            computed = (step.ends - step.num_cached).sum()
            assert computed <= max(budget, step.num_decoding), "over the token budget"
            assert (step.ends[:step.num_decoding] - step.num_cached[:step.num_decoding] == 1).all()
        scheduler.finish(feed(step))
        assert len(scheduler.running) <= (max_running or n)
        assert set(manager.owned_blocks) == {r.row for r in scheduler.running}
        for r in scheduler.running:
            computed = scheduler.prefilling.get(r)
            if computed is None:  # decoding: the cache holds every token but its newest
                assert manager.num_tokens[r.row] == r.num_tokens - 1
            else:  # prefilling: blocks for all its tokens, some of them computed
                assert 0 <= computed < r.num_tokens == manager.num_tokens[r.row]
    assert not scheduler.has_work(), "the queue drains"
    assert all(len(r.output_tokens) == r.max_new_tokens for r in queue)
    assert manager.num_free_blocks == manager.num_blocks
    assert np.all(manager.num_tokens == 0)
