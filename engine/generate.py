"""The generation loop both scripts share: admit, prefill, then decode one token per step.

`generate(setup, cache, manager)` is what the scripts call; `generate_tokens` is the loop itself.

Host work per decode step does not grow with layers x requests: block bookkeeping touches only
requests that cross a block boundary, per-request state lives in numpy arrays updated with one
vectorised operation, and the only GPU-to-CPU copy is the sampled tokens, once per step.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from engine.cuda_graphs import GraphDecoder
from engine.kv_cache import DecodeBatch, PrefillBatch

PREFILL_CHUNK_TOKENS = 8192  # prompts per prefill pass: big enough for full-speed matmuls,
                             # small enough that activations stay a small share of memory


@dataclass
class KVSnapshot:
    """The cache at one decode step, in slots (multiply by kv_bytes_per_token for bytes), as the
    block manager counts them."""

    step: int
    live_requests: int
    reserved_slots: int  # slots in blocks owned by live requests
    unfilled_slots: int  # of those, slots holding no token: the fragmentation
    seconds: float = 0.0  # the step's time on the GPU (CUDA events), or wall time on the CPU

    @property
    def filled_slots(self) -> int:
        return self.reserved_slots - self.unfilled_slots


@dataclass
class Generation:
    output_tokens: list[list[int]]  # per request, the stop token excluded
    num_prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    timeline: list[KVSnapshot] = field(default_factory=list)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t) for t in self.output_tokens)

    @property
    def fullest(self) -> KVSnapshot:
        """The step at which the cache held the most tokens."""
        return max(self.timeline, key=lambda s: s.filled_slots)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, cache, manager, prompts: list[list[int]], chunk_tokens: int, device):
    """Run whole prompts, packed into chunks of about `chunk_tokens`, writing every prompt
    token's K/V into its slot. Returns each request's first generated token: [N] on device."""
    first_tokens = torch.empty(len(prompts), dtype=torch.long, device=device)
    chunk_start = 0
    while chunk_start < len(prompts):
        chunk_end, tokens_in_chunk = chunk_start, 0
        while chunk_end < len(prompts) and (
                chunk_end == chunk_start or tokens_in_chunk + len(prompts[chunk_end]) <= chunk_tokens):
            tokens_in_chunk += len(prompts[chunk_end])
            chunk_end += 1
        chunk = range(chunk_start, chunk_end)
        lengths = [len(prompts[r]) for r in chunk]
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        to_device = lambda a, dtype: torch.from_numpy(np.asarray(a)).to(device, dtype)
        batch = PrefillBatch(
            slot_mapping=to_device(np.concatenate([manager.slots(r, 0, len(prompts[r])) for r in chunk]),
                                   torch.long),
            cu_seqlens=to_device(cu_seqlens, torch.int32),
            cu_seqlens_host=cu_seqlens.tolist(), max_seqlen=max(lengths))
        tokens = to_device(np.concatenate([prompts[r] for r in chunk]), torch.long)  # [T]
        positions = to_device(np.concatenate([np.arange(n) for n in lengths]), torch.long)
        last_token_rows = to_device(cu_seqlens[1:] - 1, torch.long)
        logits = model(tokens, positions, cache, batch, logits_at=last_token_rows)  # [len(chunk), vocab]
        first_tokens[chunk_start:chunk_end] = logits.argmax(-1)  # greedy
        chunk_start = chunk_end
    return first_tokens


def decode_step(model, cache, block_table, tokens, positions, requests, max_cache_seqlen: int):
    """One token for each of B requests. tokens, positions, requests: [B] on device.

    A row at position -1 is padding (a CUDA graph runs a fixed batch size): it writes its K/V to
    the cache's spare slot, reads one slot of block 0, and its output is ignored."""
    is_padding = positions < 0
    positions = positions.clamp(min=0)
    block_table = block_table[requests]  # [B, max_blocks]: the rows of the live requests
    block_size = cache.block_size
    # Where the new token's K/V go: the block that holds its position, at the offset within it.
    blocks = block_table.gather(1, (positions // block_size)[:, None])[:, 0]
    slot_mapping = torch.where(is_padding, cache.spare_slot,
                               blocks.long() * block_size + positions % block_size)
    batch = DecodeBatch(slot_mapping=slot_mapping, block_table=block_table,
                        cache_seqlens=(positions + 1).int(), max_cache_seqlen=max_cache_seqlen)
    return model(tokens, positions, cache, batch).argmax(-1)  # [B] greedy


def append_slots(manager, live: np.ndarray, step: int):
    """The block manager's part of a decode step, on the host: each live request feeds its
    newest token at position = tokens cached so far, and gets a slot for it (a new block only
    at a block boundary). Returns the positions and the cache's snapshot for this step."""
    positions = manager.num_tokens[live].copy()
    manager.append_token(live)
    return positions, KVSnapshot(step, len(live), manager.num_reserved_slots,
                                 manager.num_unfilled_slots)


class EagerDecoder:
    """Runs decode_step from Python, kernel by kernel: the readable path, and the one --eager
    takes. `cuda_graphs.GraphDecoder` replays the same function as CUDA graphs."""

    def __init__(self, model, cache, block_table):
        self.model, self.cache, self.block_table = model, cache, block_table

    def decode(self, tokens, positions, requests, max_cache_seqlen: int) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.block_table, tokens, positions, requests,
                           max_cache_seqlen)

    def step(self, last_tokens, live: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Feed each live request its newest token (`last_tokens[live]`, at `positions`) and
        return the next ones, [B] on device; `last_tokens[live]` is updated to them."""
        device = last_tokens.device
        live_on_device = torch.from_numpy(live).to(device)
        next_tokens = self.decode(last_tokens[live_on_device], torch.from_numpy(positions).to(device),
                                  live_on_device, int(positions.max()) + 1)
        last_tokens[live_on_device] = next_tokens
        return next_tokens


class StepTimer:
    """Each step's GPU time from CUDA events, read once at the end so that timing adds no sync;
    wall time on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.starts, self.stops = [], []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.starts.append(self._now())

    def stop(self) -> None:
        self.stops.append(self._now())

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [stop - start for start, stop in zip(self.starts, self.stops)]
        torch.cuda.synchronize()
        return [start.elapsed_time(stop) / 1000 for start, stop in zip(self.starts, self.stops)]


def make_decoder(model, cache, manager, max_batch: int, cuda_graphs: bool):
    """CUDA graphs where they can run (CUDA, an attention that reads its lengths on the GPU),
    else the eager decoder."""
    eager = EagerDecoder(model, cache, manager.block_table)
    if not (cuda_graphs and cache.k.is_cuda and cache.attention_backend.cuda_graphs):
        return eager
    return GraphDecoder(eager, max_batch)


def generate(setup, cache, manager, progress: bool = True) -> Generation:
    """Every request of the run through `cache`: what both scripts call."""
    args = setup.args
    start = time.perf_counter()
    decoder = make_decoder(setup.model, cache, manager, len(setup.requests), not args.eager)
    if progress and isinstance(decoder, GraphDecoder):
        print(f"Captured {len(decoder.buckets)} CUDA graphs of a decode step, batch 1 to "
              f"{decoder.buckets[-1]}, in {time.perf_counter() - start:.1f} s")
    if args.random_weights:  # text is nonsense: stop where the ShareGPT reply stopped
        max_new_tokens = [min(r.num_reply_tokens, args.max_new_tokens) for r in setup.requests]
        stop_ids = set()
    else:
        max_new_tokens = [args.max_new_tokens] * len(setup.requests)
        stop_ids = setup.tokenizer.stop_ids
    return generate_tokens(setup.model, cache, manager, [r.prompt_tokens for r in setup.requests],
                           max_new_tokens, args.max_seq_len, stop_ids, progress=progress,
                           decoder=decoder)


@torch.inference_mode()
def generate_tokens(model, cache, manager, prompts: list[list[int]], max_new_tokens: list[int],
                    max_seq_len: int, stop_ids: set[int], chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                    progress: bool = True, decoder=None) -> Generation:
    """Greedy-decode every prompt as one batch. Request r stops at a token in `stop_ids`, after
    `max_new_tokens[r]` tokens, or when it reaches `max_seq_len`; it then leaves the batch and
    gives its blocks back. The caller has checked that every prompt is shorter than max_seq_len.
    `decoder` runs each step: an EagerDecoder unless the caller passes CUDA graphs."""
    device = cache.k.device
    decoder = decoder or EagerDecoder(model, cache, manager.block_table)
    n = len(prompts)
    prompt_lens = np.array([len(p) for p in prompts])
    limits = np.minimum(np.array(max_new_tokens), max_seq_len - prompt_lens)  # [N] tokens to make
    stop_ids_array = np.array(sorted(stop_ids), dtype=np.int64)
    outputs = np.zeros((n, max(limits)), dtype=np.int64)
    num_out = np.zeros(n, dtype=np.int64)

    for r in range(n):  # admission: every prompt's blocks, or OutOfBlocks before any work
        manager.allocate(r, len(prompts[r]))
    t0 = time.perf_counter()
    last_tokens = prefill(model, cache, manager, prompts, chunk_tokens, device)  # [N]
    sync(device)
    t1 = time.perf_counter()

    live = np.arange(n)
    new_tokens = last_tokens.cpu().numpy()
    timeline, timer, step = [], StepTimer(device), 0
    # A context, so that the bar is gone before an error message (out of blocks) is printed.
    with tqdm(desc="decode", unit="step", disable=not progress, leave=False) as bar:
        while True:
            # Record this step's tokens; retire requests that hit a stop token or their limit.
            is_stop = np.isin(new_tokens, stop_ids_array)
            outputs[live[~is_stop], num_out[live[~is_stop]]] = new_tokens[~is_stop]
            num_out[live] += ~is_stop
            done = is_stop | (num_out[live] >= limits[live])
            for r in live[done].tolist():
                manager.free(r)
            live = live[~done]
            if len(live) == 0:
                break
            # Every live request feeds its newest token, at position = tokens cached so far.
            positions, snapshot = append_slots(manager, live, step)
            timeline.append(snapshot)
            timer.start()
            next_tokens = decoder.step(last_tokens, live, positions)
            timer.stop()
            new_tokens = next_tokens.cpu().numpy()  # the one sync per step
            step += 1
            bar.update()
            bar.set_postfix(live=len(live), blocks=manager.num_used_blocks, refresh=False)
    sync(device)
    t2 = time.perf_counter()
    for snapshot, seconds in zip(timeline, timer.seconds()):
        snapshot.seconds = seconds
    return Generation(output_tokens=[outputs[r, :num_out[r]].tolist() for r in range(n)],
                      num_prompt_tokens=int(prompt_lens.sum()), prefill_seconds=t1 - t0,
                      decode_seconds=t2 - t1, decode_steps=step, timeline=timeline)
