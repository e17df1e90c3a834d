"""features/sharing/block_manager.py's block manager: reference counts, forks, copy on write, the
prefix cache, driven through the core's interface (allocate, append_token, free) on a
one-value-per-slot cache."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import OutOfBlocks
from conftest import tokens
from engine.request import EngineRequest
from llama3_paged import Request
from features.sharing.block_manager import SharingBlockManager


class SlotCache:
    """A KV cache of one layer, head and value per slot: copies on write are made for real."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_shape, self.num_slots = (num_blocks, block_size, 1, 1), num_blocks * block_size
        self.k, self.v = (torch.zeros(1, self.num_slots, 1, 1) for _ in range(2))


def manager(num_blocks, block_size, max_requests, prefix_caching=False):
    return SharingBlockManager(SlotCache(num_blocks, block_size), max_requests, 64, prefix_caching)


def test_a_fork_shares_the_prompt_and_its_first_write_into_a_shared_part_full_block_copies_it():
    m = manager(8, 4, 3)
    prompt = tokens(7)
    a, b, c = (EngineRequest(r, prompt, 5) for r in range(3))
    assert m.allocate(a) == 0  # blocks 0 (full) and 1 (3 of 4 slots)
    assert m.allocate(b) == m.allocate(c) == 6, "forks: every token but the newest is cached"
    assert m.owned_blocks == {0: [0, 1], 1: [0, 1], 2: [0, 1]} and m.num_used_blocks == 2
    assert m.ref_counts[[0, 1]].tolist() == [3, 3] and m.forked[:3].tolist() == [False, True, True]
    m.cache.k[0, 4:7, 0, 0] = torch.tensor([4.0, 5.0, 6.0])  # the prompt's K in block 1
    m.append_token(np.array([0, 1, 2]))  # a writes position 7; b and c position 6
    # Two of the three copy block 1; the last holder writes into it in place.
    assert m.num_copied == 2 and m.ref_counts[0] == 3 and m.ref_counts[1] == 1
    copies = [m.owned_blocks[r][1] for r in range(3) if m.owned_blocks[r][1] != 1]
    for copy in copies:
        assert m.cache.k[0, copy * 4:copy * 4 + 3, 0, 0].tolist() == [4.0, 5.0, 6.0]
    assert m.block_table[:3, :2].tolist() == [m.owned_blocks[r] for r in range(3)]
    for r in (a, b, c):
        m.free(r)
    assert m.num_free_blocks == 8 and (m.ref_counts == 0).all()


def test_a_fork_of_a_prompt_of_whole_blocks_opens_a_new_block_and_copies_nothing():
    m = manager(8, 4, 2)
    prompt = tokens(9)  # the newest token, 8, opens block 2: the fork shares blocks 0 and 1
    m.allocate(EngineRequest(0, prompt, 5))
    m.allocate(EngineRequest(1, prompt, 5))
    assert m.owned_blocks[1] == [0, 1] and m.num_tokens[1] == 8
    m.append_token(np.array([1]))
    assert m.num_copied == 0 and m.owned_blocks[1][:2] == [0, 1] and m.owned_blocks[1][2] != 2


def test_a_cached_prefix_is_found_only_after_the_same_tokens():
    m = manager(16, 4, 4, prefix_caching=True)
    a, b, c = tokens(4), tokens(4, first=100), tokens(4, first=200)
    assert m.allocate(EngineRequest(0, a + b + [7], 1)) == 0  # nothing cached yet
    assert m.allocate(EngineRequest(1, a + b + [9, 9], 1)) == 8  # both full blocks found
    assert m.owned_blocks[1][:2] == m.owned_blocks[0][:2]
    assert m.allocate(EngineRequest(2, c + b, 1)) == 0, "block b after another prefix holds other K and V"
    assert m.allocate(EngineRequest(3, a + c, 1)) == 4  # the prefix a; its newest token is computed
    assert m.owned_blocks[3][0] == m.owned_blocks[0][0] and m.ref_counts[m.owned_blocks[0][0]] == 3


def test_a_freed_block_keeps_its_tokens_findable_until_it_is_reused():
    m = manager(3, 4, 3, prefix_caching=True)
    first = EngineRequest(0, tokens(8), 1)
    m.allocate(first)
    m.free(first)
    assert m.num_free_blocks == 3
    again = EngineRequest(1, tokens(8) + [5], 1)
    assert m.allocate(again) == 8 and m.num_free_blocks == 0  # both taken back
    m.free(again)
    # The free pool hands out the blocks freed longest ago first; new tokens drop their keys.
    m.allocate(EngineRequest(2, tokens(12, first=50), 1))
    assert m.cached_tokens(EngineRequest(0, tokens(8) + [5], 1)) == 0


ops_strategy = st.lists(st.tuples(st.sampled_from(["admit", "fork", "append", "free"]),
                                  st.integers(0, 5), st.lists(st.integers(0, 2), min_size=1,
                                                              max_size=14)), max_size=50)


@settings(max_examples=300, deadline=None)
@given(ops_strategy, st.sampled_from([1, 2, 4]), st.integers(2, 10))
def test_sharing_invariants_hold_and_no_write_reaches_a_shared_block(ops, block_size, num_blocks):
    """A shadow of the pool: what each slot holds, as the prefix of tokens whose K/V it is, kept
    in the cache itself (a slot's value is the prefix's id). A request must always find its own
    prefixes in its blocks, whoever else holds them."""
    m = manager(num_blocks, block_size, 6, prefix_caching=True)
    ids: dict[tuple, float] = {}
    held: dict[int, Request] = {}
    pool = m.cache.k[0, :, 0, 0]

    def write(r, position):
        block = m.owned_blocks[r][position // block_size]
        assert m.ref_counts[block] == 1, "a write into a block that another request holds"
        prefix = tuple(held[r].tokens[:position + 1])
        pool[block * block_size + position % block_size] = ids.setdefault(prefix, len(ids) + 1)

    for op, row, new in ops:
        try:
            if op in ("admit", "fork") and row not in held:
                prompt = held[min(held)].prompt_tokens if op == "fork" and held else new
                request = EngineRequest(row, list(prompt), 100)
                cached = m.allocate(request)
                held[row] = request
                for position in range(cached, int(m.num_tokens[row])):
                    write(row, position)
            elif op == "append" and held:
                live = np.array(sorted(held), dtype=np.int64)
                m.append_token(live)
                for r in live.tolist():  # the newest token: the fork's last, or a new output
                    if len(held[r].tokens) < m.num_tokens[r]:
                        held[r].output_tokens.append(new[r % len(new)])
                    write(r, int(m.num_tokens[r]) - 1)
            elif op == "free" and row in held:
                m.free(held.pop(row))
        except OutOfBlocks:
            pass  # must leave the manager consistent, checked next
        holders = [b for blocks in m.owned_blocks.values() for b in blocks]
        counts = np.bincount(holders, minlength=num_blocks) if holders else np.zeros(num_blocks)
        assert (m.ref_counts == counts).all() and (m.ref_counts >= 0).all()
        assert set(m.free_blocks) == set(np.flatnonzero(counts == 0).tolist())
        assert set(m.owned_blocks) == set(held)
        for r, blocks in m.owned_blocks.items():
            n = int(m.num_tokens[r])
            assert len(blocks) == m.blocks_needed(n) and m.block_table[r, :len(blocks)].tolist() == blocks
            for p in range(n):  # every token's K/V, computed after its own prefix
                slot = blocks[p // block_size] * block_size + p % block_size
                assert pool[slot] == ids.get(tuple(held[r].tokens[:p + 1])), "a slot holds another prefix"
    for r in list(held):
        m.free(held.pop(r))
    assert m.num_free_blocks == num_blocks and (m.ref_counts == 0).all()
