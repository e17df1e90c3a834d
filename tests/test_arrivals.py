"""Requests that arrive over time (features/arrivals.py): none starts before it arrives, the
tokens are those of a static batch, and the latency arithmetic is checked by hand."""

import math

import numpy as np
import pytest
import torch

from block_manager import BlockManager
from conftest import engine_model, tokens
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.request import EngineRequest
from engine.model_runner import greedy
from features.arrivals import latency_report, poisson_arrival_times
from engine.scheduler import Scheduler
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from test_scheduler import MAX_SEQ_LEN, random_prompts, run


def test_poisson_arrivals_have_the_rate_asked_for():
    times = poisson_arrival_times(20_000, rate=4.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.25) < 0.25 * 0.03  # mean gap 1 / rate
    assert abs(gaps.std() - 0.25) < 0.25 * 0.05  # an exponential's deviation equals its mean
    assert (poisson_arrival_times(50, 4.0, seed=1) == times[:50]).all(), "the seed draws the same"
    assert (poisson_arrival_times(5, math.inf, seed=1) == 0).all()


def test_latency_arithmetic_by_hand():
    a = EngineRequest(0, tokens(3), 3, arrival_time=1.0, token_times=[1.5, 1.7, 2.0])
    b = EngineRequest(1, tokens(3), 1, arrival_time=0.0, token_times=[0.4])
    never = EngineRequest(2, tokens(3), 1, arrival_time=3.0)  # no token: not counted
    for r in (a, b):
        r.output_tokens = [7] * len(r.token_times)
    latency = latency_report([a, b, never])
    assert latency["time_to_first_token"]["mean"] == pytest.approx((0.5 + 0.4) / 2)
    assert latency["time_between_tokens"]["mean"] == pytest.approx((0.2 + 0.3) / 2)
    assert latency["time_between_tokens"]["p50"] == pytest.approx(0.25)
    assert latency["end_to_end"]["mean"] == pytest.approx((1.0 + 0.4) / 2)
    assert latency["normalized_seconds_per_token"]["mean"] == pytest.approx((1.0 / 3 + 0.4) / 2)
    assert latency["end_to_end"]["p99"] == pytest.approx(0.4 + 0.99 * 0.6)  # numpy's linear rule


class FakeClock:
    """Time that passes only when the test says: one second per step, and exactly what the
    scheduler asks to sleep."""

    def __init__(self):
        self.time, self.slept = 0.0, []

    def __call__(self):
        return self.time

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.time += seconds


@pytest.mark.parametrize("mixed", [False, True])
def test_no_request_is_admitted_before_it_arrives(mixed):
    arrivals = [0.0, 0.0, 2.5, 2.5, 10.0, 30.0]
    queue = [EngineRequest(r, tokens(5, 10 * r), 3, arrival_time=t) for r, t in enumerate(arrivals)]
    manager = BlockManager(64, 4, len(queue), 8)
    clock = FakeClock()
    scheduler = Scheduler(manager, queue, continuous=True, token_budget=64, mixed=mixed,
                          clock=clock, sleep=clock.sleep)
    while scheduler.has_work():
        step = scheduler.schedule()
        for request, draws in zip(step.requests, step.takes_a_token()):
            assert clock.time >= request.arrival_time, "computed before it arrived"
            if draws:
                request.output_tokens.append(1)
                request.token_times.append(clock.time)
        scheduler.finish([r for r in step.requests if len(r.output_tokens) == r.max_new_tokens])
        clock.time += 1.0  # the step's time
    assert all(r.admitted_at >= r.arrival_time for r in queue)
    # Idle until 10 and until 30: the scheduler slept to each arrival, and not past it.
    assert len(clock.slept) == 2 and all(s > 0 for s in clock.slept)
    assert queue[4].admitted_at == 10.0 and queue[5].admitted_at == 30.0
    assert all(len(r.output_tokens) == 3 for r in queue)


@pytest.fixture(scope="module")
def model():
    return engine_model(11, torch.float32, MAX_SEQ_LEN)


@pytest.mark.parametrize("mixed", [False, True])
def test_arrivals_over_time_give_the_static_batchs_tokens(model, mixed):
    prompts = random_prompts([9, 30, 4, 17, 22, 3], seed=5)
    budgets = [12, 20, 7, 15, 9, 11]
    static, _ = run(model, prompts, budgets, num_blocks=64, block_size=16)
    arrivals = poisson_arrival_times(len(prompts), rate=50.0, seed=0)  # about 0.1 s in all
    cache = EngineKVCache(model.args, 64, 16, torch.float32, "cpu", TorchAttentionAfterPrefix())
    manager = BlockManager(64, 16, len(prompts), math.ceil(MAX_SEQ_LEN / 16))
    requests = [EngineRequest(r, p, b, arrival_time=float(t))
                for r, (p, b, t) in enumerate(zip(prompts, budgets, arrivals))]
    scheduler = Scheduler(manager, requests, continuous=True, token_budget=24 if mixed else 8192,
                          mixed=mixed)
    runner = ModelRunner(model, cache, manager, greedy)
    result = EngineCore(runner, scheduler).generate(progress=False)
    assert result.output_tokens == static.output_tokens
    for r in requests:
        assert r.admitted_at >= r.arrival_time and r.token_times[0] > r.arrival_time
        assert r.token_times == sorted(r.token_times) and len(r.token_times) == r.max_new_tokens


def test_a_long_wait_for_the_next_arrival_is_said_once(capsys):
    queue = [EngineRequest(r, tokens(5, 10 * r), 2, arrival_time=t) for r, t in enumerate([100.0, 300.0])]
    clock = FakeClock()
    scheduler = Scheduler(BlockManager(64, 4, 2, 8), queue, continuous=True, token_budget=64,
                          clock=clock, sleep=clock.sleep)
    while scheduler.has_work():
        step = scheduler.schedule()
        for request in step.requests:
            request.output_tokens.append(1)
        scheduler.finish([r for r in step.requests if len(r.output_tokens) == r.max_new_tokens])
    said = capsys.readouterr().err
    assert "Waiting 100 s for the next request to arrive" in said and said.count("Waiting") == 1
