"""Sharing blocks: forked samples and cached prefixes change memory, never tokens."""

import math

import pytest
import torch

from block_manager import BlockManager
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from conftest import engine_model, generate, random_ids
from features.sharing.block_manager import SharingBlockManager
from engine.sampler import sampler

MAX_SEQ_LEN = 160


@pytest.fixture(scope="module")
def model():
    return engine_model(21, torch.float32, MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def model64():
    """Sampling turns any rounding difference into another token; float64 leaves none that
    matters, so runs that compute the same values in another order must draw the same tokens."""
    return engine_model(22, torch.float64, MAX_SEQ_LEN)


def run(model, prompts, budgets, block_size=8, num_blocks=256, samples=1, share=False,
        prefix_caching=False, sampler=None, **scheduling):
    """Each prompt's `samples` sequences, as the scripts lay them out: r*K .. r*K + K-1."""
    dtype = model.output.weight.dtype
    cache = EngineKVCache(model.args, num_blocks, block_size, dtype, "cpu", TorchAttentionAfterPrefix())
    sequences = [p for p in prompts for _ in range(samples)]
    max_blocks = math.ceil(MAX_SEQ_LEN / block_size)
    sharing = share or prefix_caching
    manager = (SharingBlockManager(cache, len(sequences), max_blocks, prefix_caching) if sharing
               else BlockManager(num_blocks, block_size, len(sequences), max_blocks))
    scheduling.setdefault("chunk_tokens", 8192)
    result = generate(model, cache, manager, sequences, [b for b in budgets for _ in range(samples)],
                      MAX_SEQ_LEN, sampler=sampler, **scheduling)
    assert manager.num_free_blocks == num_blocks and not manager.owned_blocks, "every block back"
    if sharing:
        assert (manager.ref_counts == 0).all()
    n = len(sequences)
    result.num_preemptions = getattr(result.scheduler, "num_preemptions", 0)
    result.forked = manager.forked[:n].tolist() if sharing else [False] * n
    result.first_cached_tokens = manager.first_cached[:n].tolist() if sharing else [0] * n
    result.num_copied_blocks = manager.num_copied if sharing else 0
    result.unshared_slots = manager.unshared_slots_at_step if sharing else None
    return result


def random_prompts(lengths, seed, prefix=()):
    return random_ids(lengths, seed, prefix)


# Around blocks of 8: exactly one and two blocks, one past, one short, one token.
LENGTHS = [8, 16, 9, 7, 1, 21]


def test_k_greedy_samples_equal_the_single_greedy_output(model):
    prompts, budgets = random_prompts(LENGTHS, seed=1), [12, 5, 9, 16, 7, 10]
    single = run(model, prompts, budgets)
    forked = run(model, prompts, budgets, samples=3, share=True)
    for r, expected in enumerate(single.output_tokens):
        assert forked.output_tokens[3 * r:3 * r + 3] == [expected] * 3
    assert sum(forked.forked) == 2 * len(prompts), "two of each prompt's three samples forked"
    assert forked.num_prefilled_tokens == single.num_prefilled_tokens, "each prompt computed once"
    # Copy on write: a sample forked from a prompt of n tokens computes token n - 1 itself, in
    # a block the three samples hold, unless that token opens a block (n % 8 == 1): of those
    # that write into it, all but the last holder copy it first.
    assert forked.num_copied_blocks == 2 * sum(n % 8 != 1 for n in LENGTHS)


def test_forked_samples_hold_less_memory_than_copies_of_the_prompt(model):
    prompts = random_prompts([40, 33, 64], seed=2)
    budgets = [6, 6, 6]
    shared = run(model, prompts, budgets, samples=4, share=True)
    unshared = run(model, prompts, budgets, samples=4)
    assert shared.output_tokens == unshared.output_tokens
    # At the second decode step the first sample holds its prompt and two new tokens, the three
    # forked one step behind it, one new token. The blocks before the forks' own first write
    # (token n - 1) are held once; every block from there on, by its sample alone.
    second = shared.timeline[1]
    shared_blocks = sum((len(p) - 1) // 8 for p in prompts)
    own = sum(math.ceil((len(p) + 2) / 8) + 3 * math.ceil((len(p) + 1) / 8) - 4 * ((len(p) - 1) // 8)
              for p in prompts)
    assert second.reserved_slots == 8 * (shared_blocks + own) < shared.unshared_slots[1]
    unshared_at_second = sum(8 * (math.ceil((len(p) + 2) / 8) + 3 * math.ceil((len(p) + 1) / 8))
                             for p in prompts)
    assert shared.unshared_slots[1] == unshared_at_second


@pytest.mark.parametrize("block_size", [4, 8])
def test_prefix_caching_on_and_off_give_identical_tokens(model, block_size):
    system = random_prompts([21], seed=3)[0]  # 21 tokens: 5 blocks of 4, or 2 of 8, then a part
    prompts = random_prompts([5, 12, 1, 30, 8, 17], seed=4, prefix=system)
    budgets = [9, 4, 12, 7, 10, 5]
    # One request per prefill step: each one finds the system prompt cached by those before.
    off = run(model, prompts, budgets, block_size, continuous=True, max_running=2)
    on = run(model, prompts, budgets, block_size, continuous=True, max_running=2,
             prefix_caching=True)
    assert on.output_tokens == off.output_tokens
    cached_per_request = (len(system) // block_size) * block_size  # its full blocks only
    assert on.first_cached_tokens == [0] + [cached_per_request] * (len(prompts) - 1)
    assert on.num_prefilled_tokens == off.num_prefilled_tokens - 5 * cached_per_request


def test_a_prompt_cached_whole_computes_its_last_block_again(model):
    # Two blocks exactly, asked twice: the second request needs the logits of its last token,
    # and a slot of its own for that token's K/V, so it takes only the first block from the
    # cache and computes the second (vLLM does the same).
    prompt = random_prompts([16], seed=5)[0]
    budgets = [11, 11]
    alone = run(model, [prompt], budgets[:1])
    twice = run(model, [prompt, prompt], budgets, continuous=True, max_running=1,
                prefix_caching=True)
    assert twice.output_tokens == [alone.output_tokens[0]] * 2
    assert twice.first_cached_tokens == [0, 8]
    assert twice.num_prefilled_tokens == 16 + 8


def test_a_preempted_request_comes_back_to_its_cached_blocks(model):
    # Prompts of two blocks that grow by 20 tokens in a pool of 9 blocks of 8: preemption is
    # forced, and the victim's full blocks stay cached in the free pool while it waits.
    prompts, budgets = random_prompts([16, 16, 16], seed=6), [20, 20, 20]
    static = run(model, prompts, budgets)
    kw = dict(num_blocks=9, continuous=True)
    without = run(model, prompts, budgets, **kw)
    cached = run(model, prompts, budgets, prefix_caching=True, **kw)
    assert without.num_preemptions > 0 and cached.num_preemptions > 0
    assert cached.output_tokens == without.output_tokens == static.output_tokens
    assert cached.first_cached_tokens == [0, 0, 0], "distinct prompts: no hit on first admission"
    assert cached.num_prefilled_tokens < without.num_prefilled_tokens  # readmissions found blocks


def test_sampling_with_the_same_seed_is_the_same_with_and_without_sharing(model64):
    system = random_prompts([13], seed=7)[0]
    prompts = random_prompts([3, 9, 20, 11], seed=8, prefix=system)
    budgets = [15, 9, 12, 14]
    drawing = sampler(temperature=1.0, top_p=0.9, seed=1234)
    shared = run(model64, prompts, budgets, samples=3, share=True, prefix_caching=True,
                 sampler=drawing, continuous=True, max_running=5)
    unshared = run(model64, prompts, budgets, samples=3, sampler=drawing)
    assert shared.num_copied_blocks > 0 and sum(shared.first_cached_tokens) > 0
    assert shared.output_tokens == unshared.output_tokens
    # Not the same tokens for every sample: each draws its own, and another seed draws others.
    assert len({tuple(t) for t in shared.output_tokens[:3]}) == 3
    reseeded = run(model64, prompts, budgets, samples=3, sampler=sampler(1.0, 0.9, seed=1235))
    assert reseeded.output_tokens != shared.output_tokens


def test_preemption_with_forked_samples_changes_no_sampled_token(model64):
    prompts, budgets = random_prompts([12, 19], seed=9), [25, 25]
    drawing = sampler(temperature=0.8, top_p=0.95, seed=5)
    ample = run(model64, prompts, budgets, samples=3, share=True, sampler=drawing)
    tight = run(model64, prompts, budgets, samples=3, share=True, prefix_caching=True,
                sampler=drawing, num_blocks=14, continuous=True)
    assert tight.num_preemptions > 0
    assert tight.output_tokens == ample.output_tokens
