"""The page mapping of llama3_virtual.py: CUDA's virtual memory API, and a page manager that
maps pages under each request's row in the loop, as the request grows.

The API separates memory from its addresses: reserve a range of addresses with nothing behind it
(cuMemAddressReserve), create physical pages (cuMemCreate; 2 MB here), map a page at any
address of the range (cuMemMap) and let the GPU read and write it there (cuMemSetAccess);
unmapping (cuMemUnmap) keeps the page for another address. The page manager is block_manager.py's,
but request r's page j is always page (r + 1) * pages_per_row + j of the rows, so that its tokens
are contiguous: the pool's page is *mapped* there, and the GPU's MMU finds it, as an operating
system's page table does. Needs the cuda-python package (`cuda.bindings`).
"""

import time

import numpy as np
import torch

from block_manager import BlockManager, OutOfBlocks
from plumbing.cli import DRIVER_ERROR, OUT_OF_MEMORY, UserError

try:
    from cuda.bindings import driver
except ImportError:
    driver = None


class DriverError(UserError):
    """A driver call failed: the run ends in one paragraph (its tokens would go to no memory)."""


def check(result, call: str):
    """cuda-python returns (error, *values): raise unless the call succeeded, else the values."""
    error, *values = result
    if error == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:  # creating the pool's pages
        raise DriverError(f"Out of GPU memory in {call}: the KV pages did not fit beside the "
                          f"weights. Lower --kv-budget-gb or --gpu-memory-utilization.",
                          OUT_OF_MEMORY)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise DriverError(f"{call} failed: {driver.cuGetErrorName(error)[1].decode()}. A driver "
                          f"call mapping a KV page failed, so the run cannot go on. Check the "
                          f"GPU (nvidia-smi).", DRIVER_ERROR)
    return values[0] if len(values) == 1 else values


class VirtualMemory:
    def __init__(self, device: torch.device):
        self.device = device = torch.device(device)
        torch.zeros(1, device=device)  # the CUDA context the driver calls work in
        self.context = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.page_properties = driver.CUmemAllocationProp()
        self.page_properties.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.page_properties.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.page_properties.location.id = device.index or 0
        self.read_write = driver.CUmemAccessDesc()
        self.read_write.location = self.page_properties.location
        self.read_write.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.page_bytes = int(check(driver.cuMemGetAllocationGranularity(
            self.page_properties,
            driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity"))
        self.ranges, self.pages, self.mapped = [], [], set()  # to give back in close()
        self.count_from_here()

    def count_from_here(self) -> None:  # the maps, unmaps and seconds that follow, alone
        self.seconds_mapping, self.num_maps, self.num_unmaps = 0.0, 0, 0

    def reserve(self, num_bytes: int) -> int:  # addresses only, costing no memory: the first
        num_bytes = -(-num_bytes // self.page_bytes) * self.page_bytes
        address = int(check(driver.cuMemAddressReserve(num_bytes, 0, 0, 0), "cuMemAddressReserve"))
        self.ranges.append((address, num_bytes))
        return address

    def create_page(self):  # one physical page of page_bytes, mapped nowhere yet
        page = check(driver.cuMemCreate(self.page_bytes, self.page_properties, 0), "cuMemCreate")
        self.pages.append(page)
        return page

    def map(self, address: int, pages: list) -> None:
        """Map pages[0] at `address`, pages[1] right after it, and so on. Allowing access is the
        slow call (about 40 us against 4 for a map): one call allows the whole run."""
        start = time.perf_counter()
        addresses = [address + i * self.page_bytes for i in range(len(pages))]
        for at, page in zip(addresses, pages):
            check(driver.cuMemMap(at, self.page_bytes, 0, page, 0), "cuMemMap")
        check(driver.cuMemSetAccess(address, len(pages) * self.page_bytes, [self.read_write], 1),
              "cuMemSetAccess")
        self.mapped.update(addresses)
        self.seconds_mapping += time.perf_counter() - start
        self.num_maps += len(pages)

    def unmap(self, address: int, num_pages: int) -> None:  # the pages stay, to be mapped again
        start = time.perf_counter()
        check(driver.cuMemUnmap(address, num_pages * self.page_bytes), "cuMemUnmap")
        self.mapped -= {address + i * self.page_bytes for i in range(num_pages)}
        self.seconds_mapping += time.perf_counter() - start
        self.num_unmaps += num_pages

    def tensor(self, address: int, num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over a reserved range. It owns nothing: only its mapped pages may be touched."""
        class Range:  # what torch.as_tensor reads a CUDA pointer from
            __cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1",
                                        "data": (address, False), "version": 3}
        with torch.cuda.device(self.device):
            return torch.as_tensor(Range(), device=self.device).view(dtype)

    def close(self) -> None:
        """Unmap every page, release the pages and the address ranges."""
        torch.cuda.synchronize(self.device)  # no kernel may still read them
        for address in self.mapped:
            check(driver.cuMemUnmap(address, self.page_bytes), "cuMemUnmap")
        for page in self.pages:
            check(driver.cuMemRelease(page), "cuMemRelease")
        for address, num_bytes in self.ranges:
            check(driver.cuMemAddressFree(address, num_bytes), "cuMemAddressFree")
        self.mapped, self.pages, self.ranges = set(), [], []


class OutOfPages(OutOfBlocks):
    unit = "pages"


class PageManager(BlockManager):
    """Pages mapped as requests need them, in the loop; `mapper`: the cache. The table says which
    row each request is: a row no request holds lists zeros, the cache's spare row."""

    def __init__(self, num_pages: int, tokens_per_page: int, max_requests: int,
                 pages_per_row: int, mapper, device="cpu"):
        super().__init__(num_pages, tokens_per_page, max_requests, pages_per_row, device)
        self.mapper, self.pages_per_row = mapper, pages_per_row

    def _place(self, rows: np.ndarray, columns: np.ndarray, pages: list[int]) -> None:
        # A request's new pages are consecutive columns of its row (a prompt's, or one more), one
        # driver call's. Request r lives in virtual row r + 1 (row 0 is the cache's spare row).
        for row in np.unique(rows):
            on_row = np.flatnonzero(rows == row)
            self.mapper.map([pages[i] for i in on_row], int(row) + 1, int(columns[on_row[0]]))
        super()._place(rows, columns, ((rows + 1) * self.pages_per_row + columns).tolist())

    def free(self, request) -> None:
        self.mapper.unmap(request.row + 1, 0, len(self.owned_blocks[request.row]))
        super().free(request)  # its row of the table back to the spare row

    def _check_free(self, needed: int) -> None:
        if needed > self.num_free_blocks:
            raise OutOfPages(needed, self.num_free_blocks, self.num_blocks, self.block_size)

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Position p of request r is slot p of its row: contiguous, whatever pages are under it."""
        return (rows + 1) * self.pages_per_row * self.block_size + positions
