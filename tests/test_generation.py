"""The generation loop: naive and paged caches give the same tokens, at every block boundary."""

import math

import numpy as np
import pytest
import torch

from engine.kv_cache import EngineKVCache
from engine.model_runner import SamplingDecoder
from engine.request import EngineRequest
from llama3_paged import TorchAttention
from block_manager import BlockManager
from conftest import engine_model, generate, random_ids, request
from block_manager import OutOfBlocks
from llama3_paged import Engine
from llama3_paged import Scheduler
from llama3_paged import KVCache

MAX_SEQ_LEN = 96


@pytest.fixture(scope="module")
def model():
    return engine_model(3, torch.float32, MAX_SEQ_LEN)


def run(model, prompts, budgets, num_blocks, block_size, stop_ids=frozenset(), chunk_tokens=64):
    cache = EngineKVCache(model.args, num_blocks, block_size, torch.float32, "cpu",
                          TorchAttention())
    manager = BlockManager(num_blocks, block_size, max_requests=len(prompts),
                           max_blocks_per_request=math.ceil(MAX_SEQ_LEN / block_size))
    result = generate(model, cache, manager, prompts, budgets, MAX_SEQ_LEN, stop_ids,
                      chunk_tokens=chunk_tokens)
    return result, manager


def naive(model, prompts, budgets, **kw):
    return run(model, prompts, budgets, num_blocks=len(prompts), block_size=MAX_SEQ_LEN, **kw)


def random_prompts(lengths, seed=0):
    return random_ids(lengths, seed)


# Around the block size of 8: exactly one block, exactly three, one past, one short, one token.
LENGTHS = [8, 24, 9, 7, 1, 40, 16, 15, 33]


def test_paged_and_naive_generate_the_same_tokens(model):
    prompts = random_prompts(LENGTHS)
    budgets = [5, 17, 9, 1, 30, 12, 8, 16, 20]  # several requests cross block boundaries mid-decode
    paged, manager = run(model, prompts, budgets, num_blocks=64, block_size=8)
    reference, _ = naive(model, prompts, budgets)
    assert paged.output_tokens == reference.output_tokens
    assert [len(t) for t in paged.output_tokens] == budgets
    assert manager.num_free_blocks == 64, "every block comes back when requests finish"


def test_blocks_freed_mid_run_are_reused_without_changing_tokens(model):
    prompts = random_prompts([8, 8, 8, 8], seed=1)
    budgets = [1, 2, 30, 30]  # the short ones free their blocks early; the long ones take them
    paged, _ = run(model, prompts, budgets, num_blocks=2 * 4 + 4, block_size=8)
    reference, _ = naive(model, prompts, budgets)
    assert paged.output_tokens == reference.output_tokens


def test_every_request_finishing_on_the_same_step(model):
    prompts = random_prompts([5, 12, 8], seed=2)
    # Cached at the end: 10, 17 and 13 tokens = 3 + 5 + 4 blocks of 4, exactly the pool.
    paged, manager = run(model, prompts, [6, 6, 6], num_blocks=12, block_size=4)
    assert [len(t) for t in paged.output_tokens] == [6, 6, 6]
    assert len(paged.timeline) == 5 and manager.num_free_blocks == 12


def test_a_stop_token_ends_a_request_and_is_not_returned(model):
    prompts = random_prompts([10, 11], seed=4)
    free_run, _ = naive(model, prompts, [12, 12])
    stop = free_run.output_tokens[0][3]
    stopped, _ = naive(model, prompts, [12, 12], stop_ids={stop})
    assert stopped.output_tokens[0] == free_run.output_tokens[0][:3]


def test_requests_stop_at_max_seq_len(model):
    prompts = random_prompts([MAX_SEQ_LEN - 3], seed=5)
    result, _ = run(model, prompts, [50], num_blocks=16, block_size=8)
    assert len(result.output_tokens[0]) == 3


def test_a_pool_too_small_for_decoding_raises_out_of_blocks(model):
    prompts = random_prompts([8, 8], seed=6)
    with pytest.raises(OutOfBlocks):
        run(model, prompts, [20, 20], num_blocks=3, block_size=8)


def test_timeline_matches_the_owned_blocks(model):
    prompts = random_prompts([3, 9, 17], seed=7)
    result, _ = run(model, prompts, [4, 10, 7], num_blocks=16, block_size=4)
    lengths = np.array([3, 9, 17])
    for s in result.timeline:  # at step k, live requests hold prompt + k + 1 tokens
        live = [r for r, b in enumerate([4, 10, 7]) if b > s.step + 1]
        filled = sum(lengths[r] + s.step + 1 for r in live)
        assert s.running_requests == len(live) and s.filled_slots == filled
        assert s.reserved_slots == sum(math.ceil((lengths[r] + s.step + 1) / 4) * 4 for r in live)


def cached_keys_after_prefill_and_one_decode(model, prompts, num_blocks, block_size):
    """Each request's K at positions 0..n, read from the pool at manager.slots(row, position),
    after a prefill and one decode step of the core engine."""
    cache = KVCache(model.args, num_blocks, block_size, torch.float32, "cpu", TorchAttention())
    manager = BlockManager(num_blocks, block_size, len(prompts), math.ceil(MAX_SEQ_LEN / block_size))
    requests = [EngineRequest(r, p, 5) for r, p in enumerate(prompts)]
    scheduler, engine = Scheduler(manager, requests), Engine(model, cache, manager)
    with torch.inference_mode():
        first = engine.prefill(scheduler.schedule())
        step = scheduler.schedule()
        slots = manager.slots(step.rows, step.positions)
        engine.decoder.step(first, step.positions, step.rows, slots)
    return [cache.k[:, manager.slots(np.full(len(p) + 1, r), np.arange(len(p) + 1))]
            for r, p in enumerate(prompts)]


def test_prefill_and_decode_write_each_token_where_slots_says(model):
    """One translation from position to slot serves both passes: the paged pool, read through
    slots, holds what the naive layout holds, for prompt tokens (prefill) and the next (decode)."""
    prompts = random_prompts([6, 3, 8], seed=8)
    paged = cached_keys_after_prefill_and_one_decode(model, prompts, num_blocks=8, block_size=4)
    naive = cached_keys_after_prefill_and_one_decode(model, prompts, 3, MAX_SEQ_LEN)
    for p, n in zip(paged, naive):
        torch.testing.assert_close(p, n)
        assert p.abs().sum() > 0


def test_padding_rows_write_only_the_spare_slot_and_change_no_answer(model):
    # CUDA graphs pad a batch up to a fixed size with rows that write the spare slot.
    cache = EngineKVCache(model.args, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu",
                          attention=TorchAttention(), spare_slot=True)
    manager = BlockManager(8, 4, max_requests=2, max_blocks_per_request=4)
    torch.manual_seed(8)
    cache.k.normal_(), cache.v.normal_()  # stand-ins for the tokens cached so far
    manager.allocate(request(0, 7)), manager.allocate(request(1, 4))  # the newest at 6 and 3
    decoder = SamplingDecoder(model, cache, manager.block_table)  # the one CUDA graphs record
    rows, positions = np.array([0, 1]), np.array([6, 3])
    fed = torch.tensor([11, 12])  # the newest tokens, on the device
    before = cache.k.clone()
    with torch.inference_mode():
        plain = decoder.step(fed, positions, rows, manager.slots(rows, positions))
        written = cache.k.clone()
        cache.k.copy_(before)
        spare = np.full(2, cache.spare_slot)
        padded = decoder.step(fed.repeat(2), np.concatenate([positions, [0, 0]]),
                              np.tile(rows, 2),
                              np.concatenate([manager.slots(rows, positions), spare]))
    assert padded[:2].tolist() == plain.tolist()
    spare = cache.spare_slot
    torch.testing.assert_close(cache.k[:, :spare], written[:, :spare])
    assert not torch.equal(cache.k[:, spare], before[:, spare]), "padding wrote to the spare slot"
