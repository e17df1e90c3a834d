"""llama3_virtual.py's cache as the engine runs it (`python llama3_virtual.py 49 --eager`, LLM,
serve.py, tools/): its pages mapped ahead on a thread (mapping_ahead.py, vAttention's way) unless
--sync-mapping asks for the lesson's mapping in the loop, its attention left out of compiled
layers, and each decode step's rows read once per step, not once per layer.
"""

import torch

import llama3_virtual
from engine.attention_metadata import AttentionMetadata, Phase
from engine.kv_cache import left_out_of_compiled_layers
from virtual_pages import PageManager, check, driver
from features.virtual.mapping_ahead import BackgroundMapper, MappingAheadManager, mapping_seconds


class EngineVirtualKVCache(llama3_virtual.VirtualKVCache):
    def __init__(self, *args):
        super().__init__(*args)
        self._rows_batch = self._rows = None  # the last decode batch's rows (rows_of)

    @left_out_of_compiled_layers  # as the engine's paged cache (engine/compiled_layers.py)
    def attention(self, layer: int, q, k, v, batch: AttentionMetadata) -> torch.Tensor:
        """The lesson's, told a prefill by the step's phase, not by the lesson's batch class."""
        self.k[layer].flatten(0, 1).index_copy_(0, batch.slot_mapping, k)  # row * row_tokens + p
        self.v[layer].flatten(0, 1).index_copy_(0, batch.slot_mapping, v)
        if batch.phase is Phase.PREFILL:
            return self.attention_backend.prefill(q, k, v, batch)
        return self.decode_kernel(q[:, None], self.k[layer], self.v[layer],  # q: [B, 1, H, D]
                                  cache_seqlens=batch.cache_seqlens,
                                  cache_batch_idx=self.rows_of(batch), causal=True)[:, 0]

    def rows_of(self, batch) -> torch.Tensor:
        """The lesson's, once per step rather than once per layer (two small kernels less in
        each)."""
        if self._rows_batch is not batch:
            self._rows_batch, self._rows = batch, super().rows_of(batch)
        return self._rows


class MappingInTheLoop(PageManager):
    """The lesson's page manager, with the hooks the engine calls on the mapping-ahead one."""

    def watch_queue(self, waiting) -> None:
        """Pages wait for need: none are mapped ahead for the queue's prompts."""

    def close(self) -> None:
        """No thread maps beside the loop: nothing to end."""


def add_layout_arguments(parser):
    llama3_virtual.add_layout_arguments(parser)
    parser.add_argument("--sync-mapping", action="store_true",
                        help="map pages in the loop, as the lesson does, not ahead on a thread")


def allocate_kv_cache(run, cache_class=EngineVirtualKVCache):
    """The lesson's rows and pages, with the engine's cache class (the engine passes the FP8 one
    for --kv-cache-dtype fp8), and pages mapped ahead unless --sync-mapping or --find-max-batch
    (which makes a cache per attempt and counts requests, not time)."""
    args = run.args
    sync = args.sync_mapping or args.find_max_batch
    cache, manager = llama3_virtual.allocate_kv_cache(
        run, cache_class, MappingInTheLoop if sync else mapping_ahead_manager)
    if sync:
        return cache, manager
    seconds = manager.map_empty_rows()
    print(f"Start-up: {manager.num_idle_pages:,} pages mapped under {len(manager.idle_rows):,} "
          f"empty rows in {seconds:.2f} s, before the first request; "
          f"{len(manager.free_blocks):,} left mapped nowhere.")
    cache.memory.count_from_here()  # the report counts the run's driver calls, not these
    return cache, manager


def mapping_ahead_manager(*sizes, mapper, device) -> MappingAheadManager:
    """The lesson's page manager's arguments; the cache's driver calls made on a thread, in the
    loop's CUDA context."""
    in_the_context = lambda: check(driver.cuCtxSetCurrent(mapper.memory.context),
                                   "cuCtxSetCurrent")
    return MappingAheadManager(*sizes, device=device, mapper=BackgroundMapper(
        mapper, on_start=in_the_context))


def mapping_report(cache, manager, decode_steps: int) -> str:
    """The work the page table costs: driver calls on the host, in the loop or beside it."""
    memory, steps, seconds = cache.memory, max(decode_steps, 1), mapping_seconds(cache, manager)
    line = (f"Page mapping: {memory.num_maps:,} pages mapped and {memory.num_unmaps:,} unmapped "
            f"in {memory.seconds_mapping:.2f} s of driver calls, ")
    if not isinstance(manager, MappingAheadManager):
        return line + (f"in the loop (--sync-mapping): {seconds['in_the_loop'] / steps * 1e3:.3f} "
                       f"ms per decode step on the critical path")
    per_step = {name: value / steps * 1e3 for name, value in seconds.items()}  # ms
    return line + (f"ahead, on a background thread ({per_step['off_critical_path']:.3f} ms per "
                   f"decode step). The loop waited for it {per_step['growth']:.3f} "
                   f"ms per decode step for growing requests' pages, and "
                   f"{seconds['admission'] * 1e3:,.1f} ms in all for admitted prompts'; the "
                   f"look-ahead ran dry for {manager.lookahead_ran_dry:,} pages; "
                   f"{manager.num_idle_pages:,} pages were left mapped under idle rows at the end.")
