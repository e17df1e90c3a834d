"""The block manager's bookkeeping: unit tests for the edges, a property test for the invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import BlockManager
from conftest import tokens
from engine.errors import OutOfBlocks


def manager(num_blocks=8, block_size=4, max_requests=4, max_blocks=6):
    return BlockManager(num_blocks, block_size, max_requests, max_blocks)


def check_invariants(m: BlockManager):
    owned = [b for blocks in m.owned_blocks.values() for b in blocks]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert set(owned).isdisjoint(m.free_blocks), "a block is both owned and free"
    assert len(owned) + len(m.free_blocks) == m.num_blocks
    table = m.block_table.numpy()
    assert ((0 <= table) & (table < m.num_blocks)).all(), "a table entry points outside the pool"
    for request, blocks in m.owned_blocks.items():
        assert table[request, :len(blocks)].tolist() == blocks
        assert len(blocks) == m.blocks_needed(int(m.num_tokens[request]))


def test_a_prompt_that_exactly_fills_blocks_takes_no_extra_block():
    m = manager()
    m.allocate(0, tokens(4))  # one full block
    m.allocate(1, tokens(8))  # two full blocks
    assert m.owned_blocks == {0: [0], 1: [1, 2]} and m.num_unfilled_slots == 0


def test_the_token_after_a_full_block_opens_a_new_one():
    m = manager()
    m.allocate(0, tokens(4))
    m.append_token(np.array([0]))  # position 4: block 0 is full
    assert m.owned_blocks[0] == [0, 1] and m.num_unfilled_slots == 3
    m.append_token(np.array([0]))  # position 5: fits in block 1
    assert m.owned_blocks[0] == [0, 1] and m.num_unfilled_slots == 2
    check_invariants(m)


def test_freeing_a_sequence_returns_every_block():
    m = manager()
    m.allocate(0, tokens(9))
    m.allocate(1, tokens(3))
    m.free(0)
    assert m.num_free_blocks == 8 - 1 and 0 not in m.owned_blocks
    assert m.block_table[0].tolist() == [0] * 6
    check_invariants(m)


def test_freed_blocks_are_reused():
    m = manager(num_blocks=2)
    m.allocate(0, tokens(8))
    assert m.blocks_to_allocate(tokens(1)) > m.num_free_blocks
    m.free(0)
    assert m.blocks_to_allocate(tokens(8)) <= m.num_free_blocks
    m.allocate(1, tokens(8))
    assert sorted(m.owned_blocks[1]) == [0, 1]


def test_running_out_raises_with_the_numbers_and_changes_nothing():
    m = manager(num_blocks=3)
    m.allocate(0, tokens(4))
    m.allocate(1, tokens(8))
    before = (dict(m.owned_blocks), m.num_tokens.copy(), m.block_table.clone())
    with pytest.raises(OutOfBlocks) as e:
        m.append_token(np.array([0, 1]))  # both need a block, none is free
    assert (e.value.needed, e.value.free, e.value.total, e.value.block_size) == (2, 0, 3, 4)
    assert m.owned_blocks == before[0] and (m.num_tokens == before[1]).all()
    assert (m.block_table == before[2]).all()
    with pytest.raises(OutOfBlocks):
        m.allocate(2, tokens(1))
    check_invariants(m)


def test_slots_follow_the_block_table():
    m = manager()
    m.allocate(0, tokens(2))
    m.allocate(1, tokens(6))  # blocks 1, 2
    assert m.slots(1, 0, 6).tolist() == [4, 5, 6, 7, 8, 9]
    m.free(0)
    m.append_token(np.array([1]))
    m.append_token(np.array([1]))
    m.append_token(np.array([1]))  # position 8 opens a block: the first free one, block 3
    assert m.owned_blocks[1] == [1, 2, 3] and m.slots(1, 7, 9).tolist() == [11, 12]


operations = st.lists(st.tuples(st.sampled_from(["admit", "append", "free"]),
                                st.integers(0, 5), st.integers(1, 20)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(operations, st.sampled_from([1, 3, 4, 16]), st.integers(1, 24))
def test_invariants_hold_under_any_sequence_of_operations(ops, block_size, num_blocks):
    m = BlockManager(num_blocks, block_size, max_requests=6, max_blocks_per_request=64)
    for op, request, count in ops:
        try:
            if op == "admit" and request not in m.owned_blocks:
                m.allocate(request, tokens(count))
            elif op == "append":
                live = np.array(sorted(m.owned_blocks), dtype=np.int64)
                for _ in range(count % 5):
                    m.append_token(live)
            elif op == "free" and request in m.owned_blocks:
                m.free(request)
        except OutOfBlocks:
            pass  # must leave the manager consistent, checked next
        check_invariants(m)
    for request in list(m.owned_blocks):
        m.free(request)
    assert m.num_free_blocks == num_blocks and m.num_filled_slots == 0
    assert (m.block_table == 0).all()


# Sharing: reference counts, copy on write, prefix caching.

def test_a_fork_shares_every_block_and_the_first_write_into_a_shared_part_full_block_copies_it():
    m = BlockManager(8, 4, max_requests=3, max_blocks_per_request=4)
    m.allocate(0, tokens(6))  # blocks 0 (full) and 1 (2 of 4 slots)
    m.fork(0, 1), m.fork(0, 2)
    assert m.owned_blocks == {0: [0, 1], 1: [0, 1], 2: [0, 1]} and m.num_used_blocks == 2
    assert m.ref_counts[[0, 1]].tolist() == [3, 3]
    sources, copies = m.append_token(np.array([0, 1, 2]))
    # Two of the three copy block 1; the last holder writes into it in place.
    assert sources == [1, 1] and len(copies) == 2
    assert sorted(m.owned_blocks[r][1] for r in range(3)) == sorted([1] + copies)
    assert m.ref_counts[0] == 3 and m.ref_counts[1] == 1 and (m.ref_counts[copies] == 1).all()
    assert m.block_table[:3, :2].tolist() == [m.owned_blocks[r] for r in range(3)]
    for r in range(3):
        m.free(r)
    assert m.num_free_blocks == 8 and (m.ref_counts == 0).all()


def test_forked_requests_that_cross_into_a_new_block_copy_nothing():
    m = BlockManager(8, 4, max_requests=2, max_blocks_per_request=4)
    m.allocate(0, tokens(8))  # two full blocks: shared for good
    m.fork(0, 1)
    sources, _ = m.append_token(np.array([0, 1]))
    assert sources == [] and m.owned_blocks[0][:2] == m.owned_blocks[1][:2]
    assert m.owned_blocks[0][2] != m.owned_blocks[1][2]


def test_a_cached_prefix_is_found_only_after_the_same_tokens():
    m = BlockManager(16, 4, max_requests=4, max_blocks_per_request=4, prefix_caching=True)
    a, b, c = tokens(4), tokens(4, first=100), tokens(4, first=200)
    assert m.allocate(0, a + b + [7]) == 0  # nothing cached yet
    assert m.allocate(1, a + b + [9, 9]) == 8  # both full blocks found
    assert m.owned_blocks[1][:2] == m.owned_blocks[0][:2]
    assert m.allocate(2, c + b) == 0, "block b after another prefix holds other K and V"
    assert m.allocate(3, a + c) == 4  # the prefix a only
    assert m.owned_blocks[3][0] == m.owned_blocks[0][0] and m.ref_counts[m.owned_blocks[0][0]] == 3


def test_a_freed_block_keeps_its_tokens_findable_until_it_is_reused():
    m = BlockManager(3, 4, max_requests=3, max_blocks_per_request=3, prefix_caching=True)
    m.allocate(0, tokens(8))
    m.free(0, tokens(8))
    assert m.num_free_blocks == 3
    assert m.allocate(1, tokens(8) + [5]) == 8 and m.num_free_blocks == 0  # both taken back
    m.free(1, tokens(8) + [5])
    # The free pool hands out the blocks freed longest ago first; new tokens drop their keys.
    m.allocate(2, tokens(12, first=50))
    assert m.cached_blocks(tokens(8)) == []


def test_sharing_invariants_hold_under_any_sequence_of_operations_and_no_write_reaches_a_shared_block():
    """A shadow of the pool: what each slot holds, as the prefix of tokens whose K/V it is. A
    request must always find its own prefixes in its blocks, whoever else holds them."""
    from hypothesis import strategies as st
    ops_strategy = st.lists(st.tuples(st.sampled_from(["admit", "fork", "append", "free"]),
                                      st.integers(0, 5), st.lists(st.integers(0, 2), min_size=1,
                                                                  max_size=14)), max_size=50)

    @settings(max_examples=300, deadline=None)
    @given(ops_strategy, st.sampled_from([1, 2, 4]), st.integers(2, 10))
    def check(ops, block_size, num_blocks):
        m = BlockManager(num_blocks, block_size, max_requests=6, max_blocks_per_request=64,
                         share_samples=True, prefix_caching=True)
        slots: dict[tuple[int, int], tuple] = {}  # (block, offset) -> the prefix it holds
        held: dict[int, list[int]] = {}  # request -> its tokens (three ids: prefixes collide)

        def write(request, position):
            block = m.owned_blocks[request][position // block_size]
            assert m.ref_counts[block] == 1, "a write into a block that another request holds"
            slots[block, position % block_size] = tuple(held[request][:position + 1])

        for op, request, ids in ops:
            try:
                if op == "admit" and request not in held:
                    cached = m.allocate(request, ids)
                    held[request] = list(ids)
                    for position in range(cached, len(ids)):
                        write(request, position)
                elif op == "fork" and request not in held and held:
                    parent = min(held)
                    m.fork(parent, request)
                    held[request] = list(held[parent])
                elif op == "append" and held:
                    live = np.array(sorted(held), dtype=np.int64)
                    sources, copies = m.append_token(live)
                    for source, copy in zip(sources, copies):  # the copies are made first
                        for offset in range(block_size):
                            if (source, offset) in slots:
                                slots[copy, offset] = slots[source, offset]
                    for r in live.tolist():
                        held[r].append(ids[r % len(ids)])
                        write(r, len(held[r]) - 1)
                elif op == "free" and request in held:
                    m.free(request, held.pop(request))
            except OutOfBlocks:
                pass  # must leave the manager consistent, checked next
            holders = [b for blocks in m.owned_blocks.values() for b in blocks]
            counts = np.bincount(holders, minlength=num_blocks) if holders else np.zeros(num_blocks)
            assert (m.ref_counts == counts).all() and (m.ref_counts >= 0).all()
            assert set(m.free_blocks) == set(np.flatnonzero(counts == 0).tolist())
            assert set(m.owned_blocks) == set(held)
            for r, blocks in m.owned_blocks.items():
                assert m.num_tokens[r] == len(held[r]) and len(blocks) == m.blocks_needed(len(held[r]))
                assert m.block_table[r, :len(blocks)].tolist() == blocks
                for p in range(len(held[r])):  # every token's K/V, computed after its own prefix
                    assert slots[blocks[p // block_size], p % block_size] == tuple(held[r][:p + 1])
        for r in list(held):
            m.free(r, held.pop(r))
        assert m.num_free_blocks == num_blocks and (m.ref_counts == 0).all()

    check()
