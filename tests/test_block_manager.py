"""The block manager's bookkeeping: unit tests for the edges, a property test for the invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import BlockManager
from conftest import request
from block_manager import OutOfBlocks


def manager(num_blocks=8, block_size=4, max_requests=4, max_blocks=6):
    return BlockManager(num_blocks, block_size, max_requests, max_blocks)


def check_invariants(m: BlockManager):
    owned = [b for blocks in m.owned_blocks.values() for b in blocks]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert set(owned).isdisjoint(m.free_blocks), "a block is both owned and free"
    assert len(owned) + len(m.free_blocks) == m.num_blocks
    table = m.block_table.numpy()
    assert ((0 <= table) & (table < m.num_blocks)).all(), "a table entry points outside the pool"
    for row, blocks in m.owned_blocks.items():
        assert table[row, :len(blocks)].tolist() == blocks
        assert len(blocks) == m.blocks_needed(int(m.num_tokens[row]))


def test_a_prompt_that_exactly_fills_blocks_takes_no_extra_block():
    m = manager()
    m.allocate(request(0, 4))  # one full block
    m.allocate(request(1, 8))  # two full blocks
    assert m.owned_blocks == {0: [0], 1: [1, 2]} and m.num_unfilled_slots == 0


def test_the_token_after_a_full_block_opens_a_new_one():
    m = manager()
    m.allocate(request(0, 4))
    m.append_token(np.array([0]))  # position 4: block 0 is full
    assert m.owned_blocks[0] == [0, 1] and m.num_unfilled_slots == 3
    m.append_token(np.array([0]))  # position 5: fits in block 1
    assert m.owned_blocks[0] == [0, 1] and m.num_unfilled_slots == 2
    check_invariants(m)


def test_freeing_a_sequence_returns_every_block():
    m = manager()
    m.allocate(request(0, 9))
    m.allocate(request(1, 3))
    m.free(request(0, 0))
    assert m.num_free_blocks == 8 - 1 and 0 not in m.owned_blocks
    assert m.block_table[0].tolist() == [0] * 6
    check_invariants(m)


def test_freed_blocks_are_reused():
    m = manager(num_blocks=2)
    m.allocate(request(0, 8))
    assert m.num_blocks_to_allocate(request(1, 1)) > m.num_free_blocks
    m.free(request(0, 0))
    assert m.num_blocks_to_allocate(request(1, 8)) <= m.num_free_blocks
    m.allocate(request(1, 8))
    assert sorted(m.owned_blocks[1]) == [0, 1]


def test_running_out_raises_with_the_numbers_and_changes_nothing():
    m = manager(num_blocks=3)
    m.allocate(request(0, 4))
    m.allocate(request(1, 8))
    before = (dict(m.owned_blocks), m.num_tokens.copy(), m.block_table.clone())
    with pytest.raises(OutOfBlocks) as e:
        m.append_token(np.array([0, 1]))  # both need a block, none is free
    assert (e.value.needed, e.value.free, e.value.total, e.value.block_size) == (2, 0, 3, 4)
    assert m.owned_blocks == before[0] and (m.num_tokens == before[1]).all()
    assert (m.block_table == before[2]).all()
    with pytest.raises(OutOfBlocks):
        m.allocate(request(2, 1))
    check_invariants(m)


def test_slots_follow_the_block_table():
    m = manager()
    m.allocate(request(0, 2))
    m.allocate(request(1, 6))  # blocks 1, 2
    assert m.slots(np.full(6, 1), np.arange(6)).tolist() == [4, 5, 6, 7, 8, 9]
    m.free(request(0, 0))
    m.append_token(np.array([1]))
    m.append_token(np.array([1]))
    m.append_token(np.array([1]))  # position 8 opens a block: the first free one, block 3
    assert m.owned_blocks[1] == [1, 2, 3] and m.slots(np.array([1, 1]), np.array([7, 8])).tolist() == [11, 12]
    # Several requests at once, as a decode step asks: each at its own position.
    assert m.slots(np.array([1, 1]), np.array([0, 8])).tolist() == [4, 12]


operations = st.lists(st.tuples(st.sampled_from(["admit", "append", "free"]),
                                st.integers(0, 5), st.integers(1, 20)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(operations, st.sampled_from([1, 3, 4, 16]), st.integers(1, 24))
def test_invariants_hold_under_any_sequence_of_operations(ops, block_size, num_blocks):
    m = BlockManager(num_blocks, block_size, max_requests=6, max_blocks_per_request=64)
    for op, request_row, count in ops:
        try:
            if op == "admit" and request_row not in m.owned_blocks:
                m.allocate(request(request_row, count))
            elif op == "append":
                live = np.array(sorted(m.owned_blocks), dtype=np.int64)
                for _ in range(count % 5):
                    m.append_token(live)
            elif op == "free" and request_row in m.owned_blocks:
                m.free(request(request_row, 0))
        except OutOfBlocks:
            pass  # must leave the manager consistent, checked next
        check_invariants(m)
    for row in list(m.owned_blocks):
        m.free(request(row, 0))
    assert m.num_free_blocks == num_blocks and m.num_unfilled_slots == 0
    assert (m.block_table == 0).all()
