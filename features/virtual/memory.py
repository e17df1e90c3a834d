"""CUDA's virtual memory API: the few driver calls vAttention's cache needs, every result checked.

Ordinary allocation hands out memory and its address together. The virtual memory API separates
them: reserve a range of addresses with nothing behind it (cuMemAddressReserve), create physical
pages (cuMemCreate; 2 MB each on the H100, its minimum granularity), then map a page at any
address of the range (cuMemMap) and allow the GPU to read and write it there (cuMemSetAccess).
Unmapping (cuMemUnmap) keeps the page, ready to be mapped somewhere else. A kernel sees only
addresses: a tensor over the range reads its mapped pages as ordinary memory.

This needs the cuda-python package (`cuda.bindings`), on CUDA machines only.
"""

import time

import torch


try:
    from cuda.bindings import driver
except ImportError:
    driver = None


class DriverOutOfMemory(Exception):
    """A driver call found too little GPU memory (creating the KV pages)."""

    def __init__(self, call: str):
        self.call = call
        super().__init__(f"{call}: out of GPU memory")


class DriverError(RuntimeError):
    """A driver call failed for another reason than memory."""


def check(result, call: str):
    """cuda-python returns (error, *values): raise unless the call succeeded, else the values."""
    error, *values = result
    if error == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        raise DriverOutOfMemory(call)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise DriverError(f"{call} failed: {driver.cuGetErrorName(error)[1].decode()}")
    return values[0] if len(values) == 1 else values


class VirtualMemory:
    def __init__(self, device: torch.device):
        if driver is None:
            raise ModuleNotFoundError("cuda-python (cuda.bindings) is not installed")
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

    def count_from_here(self) -> None:
        """Zero the counts of maps, unmaps and their seconds: what follows is counted alone."""
        self.seconds_mapping, self.num_maps, self.num_unmaps = 0.0, 0, 0

    def make_current(self) -> None:
        """Another thread's driver calls work in the same context
        (features/virtual/mapping_ahead.py)."""
        check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def reserve(self, num_bytes: int) -> int:
        """Addresses only: costs no memory. Returns the first."""
        num_bytes = -(-num_bytes // self.page_bytes) * self.page_bytes
        address = int(check(driver.cuMemAddressReserve(num_bytes, 0, 0, 0), "cuMemAddressReserve"))
        self.ranges.append((address, num_bytes))
        return address

    def create_page(self):
        """One physical page of page_bytes, mapped nowhere yet."""
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

    def unmap(self, address: int, num_pages: int) -> None:
        """The pages mapped at `address` and after it; they stay, to be mapped again."""
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
