"""Mapping ahead (features/virtual/mapping_ahead.py) against a fake page table on a real background
thread: every page a step writes or reads is mapped before the step, pages are mapped steps ahead, a
row is reused without driver calls, nothing leaks, a failing driver call ends the run instead of
hanging it; and generation gives the tokens of the paged cache."""

import concurrent.futures
import math
import random
import time
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import BlockManager, OutOfBlocks
from conftest import engine_model, generate, request
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from features.virtual.mapping_ahead import (LOOKAHEAD_STEPS, MAP_RUN_TOKENS, BackgroundMapper,
                                            MappingAheadManager, MappingFailed)
from test_scheduler import MAX_SEQ_LEN, random_prompts


class FakePageTable:
    """Stands in for the virtual KV cache's driver calls: remembers which page is under which
    page of which row, refuses to map an address twice or a page at two addresses, and to unmap
    what is not mapped. Each call may sleep a little, so that the thread falls behind the loop."""

    def __init__(self, max_sleep_seconds=0.0, fail_at_call=None):
        self.under: dict[tuple[int, int], int] = {}  # (virtual row, page of the row) -> page
        self.max_sleep, self.fail_at_call, self.num_calls = max_sleep_seconds, fail_at_call, 0
        self.rng = random.Random(0)
        self.map_sizes = []  # pages per map call

    def _call(self):
        self.num_calls += 1
        if self.num_calls == self.fail_at_call:
            time.sleep(0.2)  # while the loop goes on asking
            raise RuntimeError("cuMemMap failed: CUDA_ERROR_INVALID_VALUE")
        if self.max_sleep:
            time.sleep(self.rng.uniform(0, self.max_sleep))

    def map(self, page_sets: list[int], row: int, first_page: int) -> None:
        self._call()
        self.map_sizes.append(len(page_sets))
        assert row > 0, "row 0 is the spare row"
        for page, page_set in enumerate(page_sets, start=first_page):
            assert (row, page) not in self.under, "mapped twice"
            assert page_set not in self.under.values(), "one page under two addresses"
            self.under[row, page] = page_set

    def unmap(self, row: int, first_page: int, num_pages: int) -> None:
        self._call()
        for page in range(first_page, first_page + num_pages):
            del self.under[row, page]  # KeyError: unmapping what is not mapped


class CheckedManager(MappingAheadManager):
    """Checks, each time the loop asks for slots (just before a step runs), that every page the
    step's requests hold is mapped where their rows say."""

    def slots(self, rows, positions):
        slots = super().slots(rows, positions)
        table = self.mapper.cache
        for r in rows.tolist():
            for column, page in enumerate(self.owned_blocks[r]):
                assert table.under.get((int(self.row_of[r]), column)) == page, "step before its map"
        return slots


def manager(num_pages, tokens_per_page, max_requests, pages_per_row, table=None):
    table = table or FakePageTable()
    return CheckedManager(num_pages, tokens_per_page, max_requests, pages_per_row,
                          BackgroundMapper(table))


def settled(m):
    """Wait for every call asked so far, as a test's point of comparison."""
    m.mapper.wait(m.mapper.asked)
    return m.mapper.cache.under


def test_a_page_is_mapped_steps_before_the_token_that_crosses_into_it():
    tokens_per_page = 4
    m = manager(num_pages=60, tokens_per_page=tokens_per_page, max_requests=1, pages_per_row=60)
    m.allocate(request(0, 3))
    asked_at_step, crossed_at_step = {}, {}  # page of the row -> step its map was asked, first held
    for step in range(200):
        for column in range(int(m.num_mapped[m.row_of[0]])):
            asked_at_step.setdefault(column, step)
        held = len(m.owned_blocks[0])
        m.append_token(np.array([0]))
        if len(m.owned_blocks[0]) > held:
            crossed_at_step[held] = step
    # Past those mapped at admission, page j is wanted once num_tokens + LOOKAHEAD_STEPS passes
    # 4j: 9 steps or more before the token at position 4j needs it.
    ahead = {column: step for column, step in crossed_at_step.items() if asked_at_step[column] > 0}
    assert len(ahead) > 20
    for column, step in ahead.items():
        assert step - asked_at_step[column] >= LOOKAHEAD_STEPS - 1
    # ... in runs of MAP_RUN_TOKENS, 16 pages of 4 tokens per call, not a call per page (but the
    # last, at the row's end).
    settled(m)
    assert min(m.mapper.cache.map_sizes[1:-1]) >= MAP_RUN_TOKENS // tokens_per_page
    m.close()


def test_with_the_pool_short_the_look_ahead_runs_dry_and_a_page_mapped_ahead_is_taken_back():
    m = manager(num_pages=3, tokens_per_page=4, max_requests=3, pages_per_row=8)
    # It holds page 0 of its row; the rest of the row's 8 are wanted ahead (10 steps and a run of
    # 64 tokens more), and 2 are free.
    m.allocate(request(0, 4))
    assert m.lookahead_ran_dry == 5 and m.num_free_blocks == 2  # pages mapped ahead are free
    row_a = int(m.row_of[0])
    assert len(settled(m)) == 3
    m.allocate(request(1, 4))  # the pool is empty: it takes the last page mapped ahead for 0
    m.slots(np.array([0, 1]), np.array([3, 3]))  # CheckedManager: both mapped where they belong
    assert set(settled(m)) == {(row_a, 0), (row_a, 1), (int(m.row_of[1]), 0)}
    with pytest.raises(OutOfBlocks):
        m.allocate(request(2, 5))  # two pages: one free
    m.close()


def test_a_finished_requests_pages_stay_mapped_and_the_next_request_in_its_row_maps_nothing():
    m = manager(num_pages=10, tokens_per_page=4, max_requests=3, pages_per_row=8)
    m.allocate(request(0, 9))  # pages 0-2 held, 3-7 (the rest of its row) mapped ahead
    under = dict(settled(m))
    row, asked = int(m.row_of[0]), m.mapper.asked
    m.free(request(0, 0))
    assert settled(m) == under and m.num_free_blocks == 10 and m.num_used_blocks == 0
    m.allocate(request(2, 13))  # the row freed last: its pages 0-3 and those ahead are there
    assert m.row_of[2] == row and m.mapper.asked == asked  # no driver call at all
    assert m.owned_blocks[2] == [under[row, j] for j in range(4)]
    # Another row takes pages mapped ahead from under a running row when none is mapped nowhere.
    m.allocate(request(1, 17))  # 5 pages: the pool's 2, then 3 of request 2's pages ahead
    m.slots(np.array([1, 2]), np.array([16, 12]))
    m.close()


def test_the_next_prompts_in_the_queue_find_their_pages_mapped_in_the_rows_they_take():
    m = manager(num_pages=40, tokens_per_page=4, max_requests=5, pages_per_row=8)
    m.allocate(request(0, 9))
    m.free(request(0, 0))  # an idle row with 3 pages held (and ahead: 5 in all)
    queue = deque([request(1, 30), request(2, 5), request(3, 17), request(4, 2)])
    m.watch_queue(queue)
    m.slots(np.array([], dtype=np.int64), np.array([], dtype=np.int64))  # a step runs
    asked = m.mapper.asked
    for r in [1, 2, 3]:
        m.allocate(queue.popleft())  # admitted in order, as the scheduler does
    # Request 1 took the idle row (8 pages for 30 tokens + 10 ahead), 2 and 3 the first empty
    # rows: all their prompts' pages were there already; only pages ahead of them are new.
    assert all(m.admission_ticket[r] <= asked for r in [1, 2, 3])
    assert [len(m.owned_blocks[r]) for r in [1, 2, 3]] == [8, 2, 5]
    m.slots(np.array([1, 2, 3]), np.array([29, 4, 16]))  # CheckedManager: mapped where held
    assert m.seconds_waiting["admission"] < 0.05
    m.close()


def test_a_request_freed_before_the_queue_is_admitted_changes_the_rows_and_costs_nothing():
    m = manager(num_pages=12, tokens_per_page=4, max_requests=3, pages_per_row=4)
    queue = deque([request(1, 8), request(2, 8)])
    m.allocate(request(0, 4))
    m.watch_queue(queue)
    m.slots(np.array([0]), np.array([3]))  # rows guessed for 1 and 2, pages mapped there
    m.free(request(0, 0))  # its row is now the first taken: the guess is off by one row
    for r in [1, 2]:
        m.allocate(queue.popleft())
    m.slots(np.array([1, 2]), np.array([7, 7]))
    under = settled(m)
    assert under == {(r, j): page for r, pages in enumerate(m.row_pages) for j, page in enumerate(pages)}
    assert m.num_free_blocks + 4 == 12  # 2 + 2 pages held; the rest free, mapped or not
    m.close()


def test_rows_mapped_at_start_up_hold_the_first_prompts_without_a_driver_call():
    m = manager(num_pages=40, tokens_per_page=4, max_requests=4, pages_per_row=8)
    m.map_empty_rows()  # half the pool, 20 pages, 5 under each of the 4 rows; waits for the maps
    at_start = dict(settled(m))
    assert sorted(at_start) == [(row, j) for row in range(1, 5) for j in range(5)]
    assert len(m.free_blocks) == 20 and m.num_free_blocks == 40 and not m.empty_rows
    asked = m.mapper.asked
    m.allocate(request(0, 20))  # 5 pages: its row's share
    assert m.row_of[0] == 1 and m.admission_ticket[0] <= asked  # its pages were there
    assert m.owned_blocks[0] == [at_start[1, j] for j in range(5)]
    m.allocate(request(1, 30))  # 8 pages: the 5 of row 2, 3 mapped now from the unmapped half
    assert m.row_of[1] == 2 and m.admission_ticket[1] > asked
    m.slots(np.array([0, 1]), np.array([19, 29]))  # CheckedManager: every held page mapped
    m.close()


def test_a_pool_smaller_than_two_pages_a_row_maps_nothing_at_start_up():
    m = manager(num_pages=7, tokens_per_page=4, max_requests=4, pages_per_row=8)
    assert m.map_empty_rows() == 0.0 and m.mapper.asked == 0 and len(m.empty_rows) == 4
    m.close()


operations = st.lists(st.tuples(st.sampled_from(["admit", "append", "append", "free"]),
                                st.integers(0, 3), st.integers(1, 30)), max_size=50)


@settings(max_examples=60, deadline=None)
@given(operations, st.sampled_from([1, 3, 16]), st.integers(1, 20), st.booleans())
def test_the_page_table_is_what_the_manager_says_under_any_operations(ops, tokens_per_page,
                                                                      num_pages, start_mapped):
    m = manager(num_pages, tokens_per_page, 4, 64, FakePageTable(max_sleep_seconds=1e-4))
    if start_mapped:
        m.map_empty_rows()
    queue = deque()
    m.watch_queue(queue)
    for i, (op, row, count) in enumerate(ops):
        # The queue: the admissions still to come, some of which will find their rows taken.
        queue.clear()
        queue.extend(request(r, c) for o, r, c in ops[i + 1:] if o == "admit")
        try:
            if op == "admit" and row not in m.owned_blocks:
                m.allocate(request(row, count))
            elif op == "append" and m.owned_blocks:
                rows = np.array(sorted(m.owned_blocks), dtype=np.int64)
                m.append_token(rows)
                m.slots(rows, m.num_tokens[rows] - 1)  # checks every held page is mapped
            elif op == "free" and row in m.owned_blocks:
                m.free(request(row, 0))
        except OutOfBlocks:
            pass
        under = settled(m)
        assert under == {(r, j): page for r, pages in enumerate(m.row_pages) for j, page in enumerate(pages)}
        for r, held in m.owned_blocks.items():  # a request holds the first pages of its row
            assert m.row_pages[m.row_of[r]][:len(held)] == held
        mapped = [page for pages in m.row_pages for page in pages]
        assert sorted(mapped + list(m.free_blocks)) == list(range(num_pages)), "a page leaked"
        assert m.num_free_blocks + sum(map(len, m.owned_blocks.values())) == num_pages
        assert all(m.num_mapped[r] > 0 for r in m.idle_rows), "an idle row holds pages"
        assert all(m.num_mapped[r] == 0 for r in m.empty_rows), "an empty row holds none"
    for row in list(m.owned_blocks):
        m.free(request(row, 0))
    assert m.num_free_blocks == num_pages and m.num_used_blocks == 0
    m.close()


def test_a_driver_call_failing_on_the_thread_ends_the_run_in_the_loop_instead_of_hanging_it():
    m = manager(10, 4, 2, 8, FakePageTable(fail_at_call=1))  # the call mapping its 3 pages
    m.allocate(request(0, 9))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a hang fails the test, not the suite
        waited = pool.submit(m.slots, np.array([0]), np.array([8]))
        with pytest.raises(MappingFailed, match="CUDA_ERROR_INVALID_VALUE"):
            waited.result(timeout=10)
    with pytest.raises(MappingFailed):
        m.allocate(request(1, 4))  # a later request asks for a page: refused at once
    m.close()
    assert not m.mapper.thread.is_alive()


def run(model, prompts, budgets, tokens_per_page, num_pages, mapping_ahead, start_mapped=False,
        **scheduling):
    """Generation through a cache in ordinary memory whose blocks are the virtual pages: with
    blocks of tokens_per_page, slot v * row_tokens + p of a virtual row is block
    v * pages_per_row + p // tokens_per_page, so the pages of row v are blocks as well."""
    pages_per_row = math.ceil(MAX_SEQ_LEN / tokens_per_page)
    virtual_blocks = (len(prompts) + 1) * pages_per_row  # every row's every page, as address space
    cache = EngineKVCache(model.args, virtual_blocks, tokens_per_page, torch.float32, "cpu",
                    TorchAttentionAfterPrefix())
    if mapping_ahead:
        m = manager(num_pages, tokens_per_page, len(prompts), pages_per_row,
                    FakePageTable(max_sleep_seconds=2e-4))
        if start_mapped:
            m.map_empty_rows()
    else:
        m = BlockManager(num_pages, tokens_per_page, len(prompts), pages_per_row)
    result = generate(model, cache, m, prompts, budgets, MAX_SEQ_LEN, **scheduling)
    assert m.num_free_blocks == num_pages and not m.owned_blocks, "every page back"
    if mapping_ahead:
        m.close()
    return result, m


@pytest.mark.parametrize("num_pages, start_mapped, scheduling", [
    (64, False, {}),  # ample: the look-ahead never runs dry
    (64, True, {}),  # and with the rows mapped at start-up
    (14, False, {"continuous": True}),  # tight: preemption, rows reused, pages taken back
    (16, True, {"continuous": True}),  # from idle rows; and with 8 pages mapped at start-up
    (14, False, {"continuous": True, "max_batched_tokens": 24}),  # and in mixed steps
])
def test_mapping_ahead_gives_the_tokens_of_the_paged_cache(num_pages, start_mapped, scheduling):
    model = engine_model(11, torch.float32, MAX_SEQ_LEN)
    prompts = random_prompts([5, 12, 3, 9, 14, 7, 1, 20], seed=2)
    budgets = [30, 4, 40, 17, 9, 33, 25, 12]
    paged, _ = run(model, prompts, budgets, 8, 64, mapping_ahead=False)
    ahead, m = run(model, prompts, budgets, 8, num_pages, mapping_ahead=True,
                   start_mapped=start_mapped, **scheduling)
    assert ahead.output_tokens == paged.output_tokens
    if num_pages < 64:
        assert ahead.scheduler.num_preemptions > 0 and m.lookahead_ran_dry > 0
