"""Continuous batching: the same tokens as a static batch, whatever preemption does on the way."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import BlockManager
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.request import EngineRequest
from conftest import engine_model, generate, random_ids
from engine.scheduler import RequestTooLarge, Scheduler
from features.sharing.block_manager import SharingBlockManager

MAX_SEQ_LEN = 640  # room for prompts of two blocks of 256 and their new tokens


@pytest.fixture(scope="module")
def model():
    return engine_model(11, torch.float32, MAX_SEQ_LEN)


def run(model, prompts, budgets, num_blocks, block_size, **scheduling):
    cache = EngineKVCache(model.args, num_blocks, block_size, torch.float32, "cpu", TorchAttentionAfterPrefix())
    manager = BlockManager(num_blocks, block_size, max_requests=len(prompts),
                           max_blocks_per_request=math.ceil(MAX_SEQ_LEN / block_size))
    scheduling.setdefault("chunk_tokens", 8192)
    result = generate(model, cache, manager, prompts, budgets, MAX_SEQ_LEN, **scheduling)
    return result, manager


def feed_one_token(step) -> list:
    """What the engine does with a step's tokens, without a model: one token for each of its
    requests (distinct, so that no two requests' outputs look alike); returns those done."""
    done = []
    for request in step.requests:
        request.output_tokens.append(1000 * (request.row + 1) + len(request.output_tokens))
        if len(request.output_tokens) >= request.max_new_tokens:
            done.append(request)
    return done


def random_prompts(lengths, seed):
    return random_ids(lengths, seed)


def preemption_workload(model, block_size):
    """Prompts that end exactly on a block boundary, one past it, one short of it, and one token;
    their static run; and the smallest pool in which each still fits alone, which forces
    preemption."""
    lengths = [block_size, 2 * block_size, block_size + 1, block_size - 1, 1, 7]
    prompts = random_prompts(lengths, seed=block_size)
    budgets = [40, 25, 33, 9, 50, 30]
    static, _ = run(model, prompts, budgets, num_blocks=64, block_size=block_size)
    needed = max(math.ceil((len(p) + b - 1) / block_size) for p, b in zip(prompts, budgets))
    return prompts, budgets, static, needed


@pytest.mark.parametrize("block_size", [16, 256])
def test_preemption_changes_no_token(model, block_size):
    prompts, budgets, static, needed = preemption_workload(model, block_size)
    continuous, manager = run(model, prompts, budgets, num_blocks=needed, block_size=block_size,
                              continuous=True)
    assert continuous.scheduler.num_preemptions > 0 and continuous.scheduler.num_recomputed_tokens > 0
    assert continuous.output_tokens == static.output_tokens
    assert manager.num_free_blocks == needed and not manager.owned_blocks, "every block back"


def test_a_request_preempted_is_readmitted_at_once_when_blocks_free(model):
    # Two one-block prompts in a two-block pool. At the first decode both cross into a second
    # block: the newer is preempted, the older takes its block and finishes, and the next step
    # readmits the preempted one, which recomputes its prompt and its first token.
    prompts, budgets = random_prompts([4, 4], seed=5), [2, 5]  # 1 grows to 8 tokens: 2 blocks
    manager = BlockManager(2, 4, max_requests=2, max_blocks_per_request=8)
    requests = [EngineRequest(r, p, b) for r, (p, b) in enumerate(zip(prompts, budgets))]
    scheduler = Scheduler(manager, requests, continuous=True, token_budget=64)
    steps = []
    while scheduler.has_work():
        step = scheduler.schedule()
        steps.append(("prefill" if step.kind != "decode" else "decode", step.rows.tolist()))
        scheduler.finish(feed_one_token(step))
    assert steps[:3] == [("prefill", [0, 1]), ("decode", [0]), ("prefill", [1])]
    assert scheduler.num_preemptions == 1 and scheduler.num_recomputed_tokens == 4
    static, _ = run(model, prompts, budgets, num_blocks=8, block_size=4)
    continuous, _ = run(model, prompts, budgets, num_blocks=2, block_size=4, continuous=True)
    assert continuous.output_tokens == static.output_tokens and continuous.scheduler.num_preemptions == 1


def test_the_queue_drains_and_running_never_exceeds_max_running(model):
    prompts = random_prompts([9, 30, 4, 17, 12, 22, 5, 8], seed=7)
    budgets = [12, 3, 20, 8, 15, 6, 10, 18]
    static, _ = run(model, prompts, budgets, num_blocks=64, block_size=8)
    capped, manager = run(model, prompts, budgets, num_blocks=64, block_size=8, continuous=True,
                          max_running=3)
    assert capped.output_tokens == static.output_tokens
    assert capped.most_running == 3 and max(s.running_requests for s in capped.timeline) == 3
    assert all(s.running_requests + s.waiting_requests <= 8 for s in capped.timeline)
    assert manager.num_free_blocks == 64


def test_a_request_larger_than_the_whole_pool_is_refused_up_front(model):
    prompts = random_prompts([20, 5], seed=8)
    with pytest.raises(RequestTooLarge) as refused:  # 20 + 30 - 1 tokens need 7 blocks of 8; there are 6
        run(model, prompts, [30, 5], num_blocks=6, block_size=8, continuous=True)
    assert (refused.value.request.row, refused.value.blocks, refused.value.num_blocks) == (0, 7, 6)


def test_naive_continuous_runs_one_max_length_block_per_request_and_never_preempts(model):
    prompts = random_prompts([9, 30, 4, 17, 12], seed=9)
    budgets = [12, 3, 20, 8, 15]
    static, _ = run(model, prompts, budgets, num_blocks=5, block_size=MAX_SEQ_LEN)
    orca_max, _ = run(model, prompts, budgets, num_blocks=2, block_size=MAX_SEQ_LEN,
                      continuous=True)
    assert orca_max.output_tokens == static.output_tokens
    assert orca_max.scheduler.num_preemptions == 0 and orca_max.most_running == 2
    # A request never outgrows its block, so no block is held back as headroom: 10 of 10 run.
    many, _ = run(model, random_prompts([5] * 12, seed=10), [3] * 12, num_blocks=10,
                  block_size=MAX_SEQ_LEN, continuous=True)
    assert many.most_running == 10


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=12),
       st.sampled_from([1, 4, 16]), st.integers(0, 30), st.sampled_from([None, 1, 3]),
       st.sampled_from([8, 64]), st.sampled_from([1, 2, 3]), st.booleans(), st.integers(0, 20))
def test_scheduler_invariants_hold_under_any_workload(requests, block_size, spare_blocks,
                                                      max_running, chunk_tokens, samples, share,
                                                      shared_prefix):
    """Driven without a model: a prefill or decode step gives each of its requests one token.
    With `share`, each prompt's `samples` fork and prompts beginning with the same
    `shared_prefix` tokens share those blocks."""
    prompts = [[7] * min(shared_prefix, p) + [100 + i] * (p - min(shared_prefix, p))
               for i, (p, _) in enumerate(requests) for _ in range(samples)]
    limits = [g for _, g in requests for _ in range(samples)]
    n = len(prompts)
    largest = max(math.ceil((p + g - 1) / block_size) for p, g in requests)
    num_blocks, max_blocks = largest + spare_blocks, largest
    manager = (SharingBlockManager(FakeCache(num_blocks, block_size), n, max_blocks, True) if share
               else BlockManager(num_blocks, block_size, n, max_blocks))
    queue = [EngineRequest(r, p, g) for r, (p, g) in enumerate(zip(prompts, limits))]
    scheduler = Scheduler(manager, queue, True, max_running, chunk_tokens, shares_blocks=share)
    finished: set[int] = set()
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        step = scheduler.schedule()
        done = feed_one_token(step)
        scheduler.finish(done)
        finished |= {r.row for r in done}
        running, waiting = set(scheduler.rows.tolist()), {r.row for r in scheduler.waiting}
        assert running == {r.row for r in scheduler.running}
        assert len(running) + len(waiting) + len(finished) == n
        assert not (running & waiting or running & finished or waiting & finished)
        assert len(running) <= (max_running or n)
        held = [b for blocks in manager.owned_blocks.values() for b in blocks]
        if share:
            counts = np.bincount(held, minlength=manager.num_blocks) if held else 0
            assert (manager.ref_counts == counts).all(), "a reference count that is not its holders"
        else:
            assert len(held) == len(set(held)), "a block held twice"
        assert set(manager.owned_blocks) == running, "only running requests hold blocks"
        for r in scheduler.running:  # the cache holds every token of a running request but its newest
            assert manager.num_tokens[r.row] == len(r.tokens) - 1
            assert len(manager.owned_blocks[r.row]) == math.ceil(manager.num_tokens[r.row] / block_size)
    assert not scheduler.has_work(), "the queue drains"
    assert all(len(r.output_tokens) == r.max_new_tokens for r in queue)
    assert manager.num_free_blocks == manager.num_blocks
    if share:
        assert (manager.ref_counts == 0).all()


class FakeCache:
    """A KV cache of one layer, head and value per slot: what SharingBlockManager copies."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_shape, self.num_slots = (num_blocks, block_size, 1, 1), num_blocks * block_size
        self.k, self.v = (torch.zeros(1, self.num_slots, 1, 1) for _ in range(2))


def test_naive_continuous_fills_every_free_slot_while_requests_wait(model):
    # Short prompts, far below a quarter of a prefill chunk: a paged pool would wait to gather
    # more before a prefill step, but a naive request never grows into the free memory, so a
    # free max-length block is taken at once.
    prompts = random_prompts([5, 7, 4, 9, 6, 3, 8, 5, 6, 4], seed=12)
    budgets = [3, 9, 4, 12, 5, 7, 3, 10, 6, 8]
    static, _ = run(model, prompts, budgets, num_blocks=10, block_size=MAX_SEQ_LEN)
    orca_max, _ = run(model, prompts, budgets, num_blocks=3, block_size=MAX_SEQ_LEN,
                      continuous=True)
    assert orca_max.output_tokens == static.output_tokens
    waiting_steps = [s for s in orca_max.timeline if s.waiting_requests]
    assert waiting_steps and all(s.running_requests == 3 for s in waiting_steps)
