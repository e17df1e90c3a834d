"""Mapping ahead: vAttention's way of taking the page table's driver calls off the critical path.

virtual_pages.py's page manager (llama3_virtual.py's) maps a page when a request's next token crosses into it, and unmaps
a request's pages when it finishes, in the loop, between two steps: every driver call (cuMemMap and
cuMemSetAccess, tens of microseconds each) is time the GPU waits. vAttention (Prabhu et al., 2024)
hides them in two ways, and this manager does both.

More in docs/engine-notes.md.
"""

import itertools
import queue
import threading
import time
from collections import OrderedDict, deque

import numpy as np
import torch

from block_manager import BlockManager
from engine.swap import consecutive_runs
from plumbing.inputs import TOKENS_PER_PASS
from virtual_pages import OutOfPages

LOOKAHEAD_STEPS = 10  # vAttention's: pages are mapped up to 10 decode steps before they are needed
MAP_RUN_TOKENS = 64  # a row found short gets pages for this many tokens more, in one call: 4 pages
                     # of 16 tokens (per-token rows), 1 of 1,024 (per-layer). Fewer, longer calls
                     # cost both threads less host time (and the GIL) per step.
QUEUE_LOOKAHEAD_TOKENS = TOKENS_PER_PASS  # the queue's next prompts, as many as a step admits
START_UP_SHARE = 0.5  # of the pool, mapped under the empty rows before the first request


class MappingFailed(Exception):
    """A driver call on the mapping thread failed: the run cannot go on."""


class BackgroundMapper:
    """A thread that makes the cache's map and unmap calls in the order they were asked for. Each
    call gets a ticket; `wait(ticket)` returns once that call and every one before it is done."""

    def __init__(self, cache, on_start=lambda: None):
        self.cache, self.calls = cache, queue.SimpleQueue()
        self.asked = self.done = 0  # the last ticket handed out, and the last one done
        self.error = None  # what the thread failed with, raised in the loop at its next call
        self.done_changed = threading.Condition()
        self.thread = threading.Thread(target=self._work, args=(on_start,), daemon=True,
                                       name="page mapper")
        self.thread.start()

    def map(self, page_sets: list[int], row: int, first_page: int) -> int:
        return self._ask(self.cache.map, page_sets, row, first_page)

    def unmap(self, row: int, first_page: int, num_pages: int) -> int:
        # Unlike the GPU's writes, an unmap is not queued behind the steps already queued, which
        # may still use the pages (engine/model_runner.py queues a step before the last one ends):
        # the thread waits until the GPU has passed this point.
        queued = None
        if torch.cuda.is_initialized():
            queued = torch.cuda.Event()
            queued.record()
        return self._ask(self._unmap_after, queued, row, first_page, num_pages)

    def _unmap_after(self, queued, row: int, first_page: int, num_pages: int) -> None:
        if queued is not None:
            queued.synchronize()  # releases the GIL, as the driver calls do
        self.cache.unmap(row, first_page, num_pages)

    def wait(self, ticket: int) -> float:
        """Returns the seconds it waited."""
        start = time.perf_counter()
        if self.done < ticket:
            with self.done_changed:
                self.done_changed.wait_for(lambda: self.done >= ticket or self.error is not None)
        self._raise_if_failed()
        return time.perf_counter() - start

    def close(self) -> None:
        """Finish the calls asked for, then end the thread. (An error is raised at a wait.)"""
        self.calls.put(None)
        self.thread.join()

    def _ask(self, call, *args) -> int:
        self._raise_if_failed()
        self.asked += 1
        self.calls.put((self.asked, call, args))
        return self.asked

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise MappingFailed(str(self.error)) from self.error

    def _work(self, on_start) -> None:
        try:
            on_start()
            while (call := self.calls.get()) is not None:
                ticket, function, args = call
                function(*args)
                with self.done_changed:
                    self.done = ticket
                    self.done_changed.notify_all()
        except Exception as e:  # the loop must hear of it, not wait forever
            with self.done_changed:
                self.error = e
                self.done_changed.notify_all()


class MappingAheadManager(BlockManager):
    def _check_free(self, needed: int) -> None:
        """Out of pages, not blocks: the error the lesson's page manager raises."""
        if needed > self.num_free_blocks:
            raise OutOfPages(needed, self.num_free_blocks, self.num_blocks, self.block_size)

    def __init__(self, num_pages: int, tokens_per_page: int, max_requests: int,
                 pages_per_row: int, mapper: BackgroundMapper, device="cpu"):
        super().__init__(num_pages, tokens_per_page, max_requests, pages_per_row, device)
        # self.free_blocks: free pages mapped nowhere. Free pages still mapped are counted apart.
        self.mapper, self.pages_per_row = mapper, pages_per_row
        self.row_tokens = pages_per_row * tokens_per_page
        num_rows = max_requests + 1  # row 0 is the spare row
        self.row_pages = [[] for _ in range(num_rows)]  # virtual row -> the pages at its 0, 1, ...
        self.num_mapped = np.zeros(num_rows, dtype=np.int64)  # len(row_pages[row]), as an array
        self.row_of = np.zeros(max_requests, dtype=np.int64)  # request row -> its virtual row
        self.empty_rows = list(range(num_rows - 1, 0, -1))  # no request, nothing mapped
        self.idle_rows = OrderedDict()  # no request, pages mapped; the one freed longest ago first
        self.num_idle_pages = 0  # mapped, held by no request: idle rows' and those mapped ahead
        self.to_map = []  # (page, row, column): maps decided, not yet asked of the thread
        self.map_ticket = {}  # page -> the ticket of the call that mapped it
        # Per request row, the last call that mapped a page it holds (a step waits for those of
        # its own requests only: the thread maps the next prefill chunk's pages while this one
        # runs), and the last that mapped a page it held when admitted.
        self.held_ticket = np.zeros(max_requests, dtype=np.int64)
        self.admission_ticket = np.zeros(max_requests, dtype=np.int64)
        self.lookahead_ran_dry = 0  # pages the look-ahead wanted and found no free page for
        # The loop's time waiting for the thread (the mapping left on the critical path): for
        # the pages of requests just admitted, whose prompts need them at once, and of those growing.
        self.seconds_waiting = {"admission": 0.0, "growth": 0.0}
        self.waiting = deque()  # the scheduler's queue, once watch_queue is given it

    def map_empty_rows(self) -> float:
        """At start-up: put an equal share of START_UP_SHARE of the pool under every empty row (a
        whole row at most), and wait for the thread to map it. Returns the seconds it took. The
        rows become idle rows, taken by requests in the order empty rows are: row 1 first."""
        rows = list(self.empty_rows)
        each = min(self.pages_per_row, int(len(self.free_blocks) * START_UP_SHARE) // max(len(rows), 1))
        if each == 0:
            return 0.0
        for row in rows:  # from the last row to row 1: the idle row taken next is the newest
            for column in range(each):
                self._map(self.free_blocks.popleft(), row, column)
            self.idle_rows[row] = None
        self.empty_rows = []
        self._ask_for_maps()
        return self.mapper.wait(self.mapper.asked)

    def watch_queue(self, waiting: deque) -> None:
        """The scheduler's queue of requests (engine/build.py's make_scheduler hands it over): the prompts at its
        head get their pages mapped before they are admitted."""
        self.waiting = waiting

    def allocate(self, request) -> int:
        needed = self.blocks_needed(len(request.tokens))
        if needed > self.pages_per_row:
            raise ValueError(f"{len(request.tokens)} tokens exceed a row's {self.pages_per_row} pages")
        self._check_free(needed)
        row = self.idle_rows.popitem()[0] if self.idle_rows else self.empty_rows.pop()
        self.row_of[request.row], self.owned_blocks[request.row] = row, []
        self.num_tokens[request.row] = len(request.tokens)
        self._hold(np.full(needed, request.row), np.arange(needed))
        self.admission_ticket[request.row] = self.held_ticket[request.row]
        self._map_ahead(np.array([request.row]))
        return 0

    def append_token(self, rows: np.ndarray) -> None:
        needs_page = rows[self.num_tokens[rows] % self.block_size == 0]
        self._check_free(len(needs_page))
        self._hold(needs_page, self.num_tokens[needs_page] // self.block_size)
        self.num_tokens[rows] += 1
        self._map_ahead(rows)

    def free(self, request) -> None:
        """The request's pages stay mapped in its row, idle, for the next request placed there."""
        pages = self.owned_blocks.pop(request.row)
        self.num_idle_pages += len(pages)
        self.num_tokens[request.row] = 0
        self._clear(request.row)
        row = int(self.row_of[request.row])
        if self.num_mapped[row]:
            self.idle_rows[row] = None  # the newest idle row: the next request takes it
        else:
            self.empty_rows.append(row)

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """As the page manager's, once the pages these requests hold are mapped (the step writes
        and reads no others): the one place the loop waits for the thread."""
        if len(rows):
            kind = "admission" if self.mapper.done < self.admission_ticket[rows].max() else "growth"
            self.seconds_waiting[kind] += self.mapper.wait(int(self.held_ticket[rows].max()))
        self._map_for_the_queue()  # while this step runs
        return self.row_of[rows] * self.row_tokens + positions

    def close(self) -> None:
        """End the thread. Idle pages stay mapped until the cache is closed."""
        self.mapper.close()

    def _hold(self, rows: np.ndarray, columns: np.ndarray) -> None:
        """Request rows[i] now holds page columns[i] of its row: the page mapped there already
        (ahead, or by the row's previous request), or else one mapped now."""
        virtual, held = self.row_of[rows], []
        for request_row, row, column in zip(rows.tolist(), virtual.tolist(), columns.tolist()):
            if column == self.num_mapped[row]:  # nothing there yet
                self._map(self._unmapped_page(take_ahead=True), row, column)
            held.append(self.row_pages[row][column])
            self.owned_blocks[request_row].append(held[-1])
            self.num_idle_pages -= 1
        self._ask_for_maps()
        for request_row, page in zip(rows.tolist(), held):
            self.held_ticket[request_row] = max(self.held_ticket[request_row], self.map_ticket[page])
        self._place(rows, columns, (virtual * self.pages_per_row + columns).tolist())

    def _map_ahead(self, rows: np.ndarray) -> None:
        """Map the pages the requests in `rows` will cross into within LOOKAHEAD_STEPS steps,
        and MAP_RUN_TOKENS more with them. Most steps no row is short: the Python loop is over
        the few that are."""
        soon = self.num_tokens[rows] + LOOKAHEAD_STEPS
        virtual = self.row_of[rows]
        short = np.minimum(self.blocks_needed(soon), self.pages_per_row) > self.num_mapped[virtual]
        wanted = np.minimum(self.blocks_needed(soon + MAP_RUN_TOKENS), self.pages_per_row)
        for row, want in zip(virtual[short].tolist(), wanted[short].tolist()):
            while self.num_mapped[row] < want:
                page = self._unmapped_page(take_ahead=False)
                if page is None:
                    self.lookahead_ran_dry += want - self.num_mapped[row]
                    break
                self._map(page, row, int(self.num_mapped[row]))
        self._ask_for_maps()

    def _map_for_the_queue(self) -> None:
        """Map the pages of the prompts at the head of the queue into the rows they will take:
        allocate takes idle rows, freed last first, then empty ones. Only pages mapped nowhere are
        used. It is a guess (a request finishing before they are admitted frees a row they take
        instead), and a wrong one costs nothing: the pages stay mapped, idle, for whoever takes
        that row. An empty row given pages becomes idle, behind the idle rows, in the same order."""
        rows = itertools.chain(reversed(self.idle_rows), reversed(self.empty_rows))
        tokens, newly_idle = 0, []
        for request, row in zip(self.waiting, rows):
            if tokens >= QUEUE_LOOKAHEAD_TOKENS or not self.free_blocks:
                break
            tokens += request.num_tokens
            was_empty = self.num_mapped[row] == 0
            wanted = min(self.blocks_needed(request.num_tokens), self.pages_per_row)
            while self.num_mapped[row] < wanted and self.free_blocks:
                self._map(self.free_blocks.popleft(), row, int(self.num_mapped[row]))
            if was_empty:  # it has a page now: the loop went on only with one free
                newly_idle.append(row)
        if newly_idle:  # they were the last empty rows, the next of them to be taken first
            del self.empty_rows[len(self.empty_rows) - len(newly_idle):]
            for row in newly_idle:
                self.idle_rows[row] = None
                self.idle_rows.move_to_end(row, last=False)
        self._ask_for_maps()

    def _map(self, page: int, row: int, column: int) -> None:
        self.row_pages[row].append(page)
        self.num_mapped[row] += 1
        self.num_idle_pages += 1  # until a request holds it
        self.to_map.append((page, row, column))

    def _ask_for_maps(self) -> None:
        """Hand the maps decided to the thread, a call per run of consecutive pages of a row."""
        if not self.to_map:
            return
        pages, rows, columns = (np.array(x) for x in zip(*self.to_map))
        for start, end in consecutive_runs(rows, columns):
            ticket = self.mapper.map(pages[start:end].tolist(), int(rows[start]), int(columns[start]))
            self.map_ticket.update(dict.fromkeys(pages[start:end].tolist(), ticket))
        self.to_map = []

    def _unmapped_page(self, take_ahead: bool) -> int | None:
        """A free page mapped nowhere: from the pool, else taken from under the idle row freed
        longest ago, else (take_ahead) from a running row's pages mapped ahead. The thread unmaps
        it before it maps it anywhere else: it runs the calls in order."""
        if self.free_blocks:
            return self.free_blocks.popleft()
        if self.idle_rows:
            row = next(iter(self.idle_rows))
            if self.num_mapped[row] == 1:
                del self.idle_rows[row]
                self.empty_rows.append(row)
            return self._unmap_last(row)
        for request_row, held in self.owned_blocks.items() if take_ahead else ():
            row = int(self.row_of[request_row])
            if self.num_mapped[row] > len(held):
                return self._unmap_last(row)
        return None

    def _unmap_last(self, row: int) -> int:
        page = self.row_pages[row].pop()
        self.num_mapped[row] -= 1
        self.num_idle_pages -= 1
        self.mapper.unmap(row, int(self.num_mapped[row]), 1)
        return page

    @property
    def num_free_blocks(self) -> int:
        """Free pages: mapped nowhere, or mapped but held by no request."""
        return len(self.free_blocks) + self.num_idle_pages


def mapping_seconds(cache, manager) -> dict:
    """Host seconds of driver calls so far, on the loop's critical path (waiting for the thread's
    maps of admitted and of growing requests' pages) and off it."""
    if isinstance(manager, MappingAheadManager):
        manager.mapper.wait(manager.mapper.asked)  # every call asked so far done, and counted
        return manager.seconds_waiting | {"off_critical_path": cache.memory.seconds_mapping}
    return {"in_the_loop": cache.memory.seconds_mapping, "off_critical_path": 0.0}
