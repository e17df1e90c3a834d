"""The page manager's bookkeeping against a fake mapper: pages mapped exactly when a row crosses
into them, every one returned at the end, and running out of pages changes nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import request
from block_manager import OutOfBlocks
from virtual_pages import PageManager


class FakeMapper:
    """Stands in for the virtual KV cache: remembers which physical page is under which page of
    which row, and refuses to map a page twice or unmap one that is not there."""

    def __init__(self):
        self.under: dict[tuple[int, int], int] = {}  # (request, page of its row) -> physical page

    def map(self, pages: list[int], row: int, first_page: int) -> None:
        request = row - 1  # request r lives in virtual row r + 1
        for page, physical in enumerate(pages, start=first_page):
            assert (request, page) not in self.under, "mapped twice"
            assert physical not in self.under.values(), "one physical page under two addresses"
            self.under[request, page] = physical

    def unmap(self, row: int, first_page: int, num_pages: int) -> None:
        for page in range(first_page, first_page + num_pages):
            del self.under[row - 1, page]  # KeyError: unmapping what is not mapped


def manager(num_pages=8, tokens_per_page=4, max_requests=3, pages_per_row=5):
    return PageManager(num_pages, tokens_per_page, max_requests, pages_per_row, FakeMapper())


def test_a_prompt_maps_the_pages_it_fills_and_its_slots_are_its_row():
    m = manager()
    m.allocate(request(1, 9))  # 9 tokens: pages 0, 1 and 2 of request 1's row
    assert m.mapper.under == {(1, 0): 0, (1, 1): 1, (1, 2): 2}
    assert m.slots(np.full(9, 1), np.arange(9)).tolist() == list(range(40, 49))  # its row, 2 (row 0 is spare), at 2 * 5 * 4


def test_a_page_is_mapped_exactly_when_the_next_token_crosses_into_it():
    m = manager()
    m.allocate(request(0, 4))  # one full page
    m.append_token(np.array([0]))  # token 4 starts page 1
    assert set(m.mapper.under) == {(0, 0), (0, 1)}
    for _ in range(3):  # tokens 5 to 7 fill page 1: nothing mapped
        m.append_token(np.array([0]))
    assert set(m.mapper.under) == {(0, 0), (0, 1)}
    m.append_token(np.array([0]))  # token 8 starts page 2
    assert set(m.mapper.under) == {(0, 0), (0, 1), (0, 2)}


def test_the_block_table_lists_a_rows_virtual_pages_while_a_request_holds_them():
    m = manager()
    # A row no request holds lists zeros: the cache's spare row, whose first page stays mapped.
    assert (m.block_table == 0).all()
    m.allocate(request(0, 6)), m.allocate(request(2, 3)), m.append_token(np.array([0, 2]))
    # Request r's held pages are those of virtual row r + 1, whichever physical pages they are.
    assert m.block_table.tolist() == [[5, 6, 0, 0, 0], [0] * 5, [15, 0, 0, 0, 0]]
    m.free(request(0, 0))
    assert m.block_table.tolist() == [[0] * 5, [0] * 5, [15, 0, 0, 0, 0]]


def test_freeing_unmaps_every_page_and_returns_it_to_the_pool():
    m = manager()
    m.allocate(request(0, 13))
    m.allocate(request(1, 2))
    m.free(request(0, 0))
    assert m.mapper.under == {(1, 0): 4} and m.num_free_blocks == 7
    m.free(request(1, 0))
    assert m.mapper.under == {} and m.num_free_blocks == 8 and m.num_reserved_slots == 0


def test_running_out_of_pages_maps_nothing_and_changes_nothing():
    m = manager(num_pages=3)
    m.allocate(request(0, 4))
    m.allocate(request(1, 8))
    under, num_tokens = dict(m.mapper.under), m.num_tokens.copy()
    with pytest.raises(OutOfBlocks):
        m.append_token(np.array([0, 1]))  # both cross into a new page; none is free
    assert m.mapper.under == under and (m.num_tokens == num_tokens).all()
    with pytest.raises(OutOfBlocks):
        m.allocate(request(2, 1))
    assert m.mapper.under == under


operations = st.lists(st.tuples(st.sampled_from(["admit", "append", "free"]),
                                st.integers(0, 3), st.integers(1, 30)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(operations, st.sampled_from([1, 3, 16]), st.integers(1, 20))
def test_the_pages_under_each_row_are_the_pages_it_owns_under_any_operations(ops, tokens_per_page,
                                                                              num_pages):
    m = PageManager(num_pages, tokens_per_page, 4, 64, FakeMapper())
    for op, row, count in ops:
        try:
            if op == "admit" and row not in m.owned_blocks:
                m.allocate(request(row, count))
            elif op == "append":
                m.append_token(np.array(sorted(m.owned_blocks), dtype=np.int64))
            elif op == "free" and row in m.owned_blocks:
                m.free(request(row, 0))
        except OutOfBlocks:
            pass
        expected = {(r, j): page for r, pages in m.owned_blocks.items() for j, page in enumerate(pages)}
        assert m.mapper.under == expected
    for row in list(m.owned_blocks):
        m.free(request(row, 0))
    assert m.mapper.under == {} and m.num_free_blocks == num_pages
