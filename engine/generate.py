"""The generation loop the scripts share: admit, prefill, then decode one token per step.

`generate(setup, cache, manager)` is what the scripts call; `generate_tokens` is the loop itself.
Who is admitted, who runs and who is preempted, step by step, is the scheduler's (scheduler.py).

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
from engine.sampling import Sampler
from engine.scheduler import Scheduler

PREFILL_CHUNK_TOKENS = 8192  # prompts per prefill pass: big enough for full-speed matmuls,
                             # small enough that activations stay a small share of memory


@dataclass
class KVSnapshot:
    """The cache at one decode step, in slots (multiply by kv_bytes_per_token for bytes), as the
    block manager counts them."""

    step: int
    running_requests: int
    waiting_requests: int
    reserved_slots: int  # slots in blocks owned by running requests
    unfilled_slots: int  # of those, slots holding no token: the fragmentation
    unshared_slots: int  # what the running requests would reserve if none shared a block
    seconds: float = 0.0  # the step's time on the GPU (CUDA events), or wall time on the CPU

    @property
    def filled_slots(self) -> int:
        return self.reserved_slots - self.unfilled_slots


@dataclass
class Generation:
    output_tokens: list[list[int]]  # per request, the stop token excluded
    num_prompt_tokens: int
    num_prefilled_tokens: int  # the prompts, and the tokens of preempted requests prefilled again
    prefill_seconds: float  # wall time of the prefill steps
    decode_seconds: float  # wall time of the decode steps
    timeline: list[KVSnapshot] = field(default_factory=list)  # one per decode step
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # cached tokens that preemption threw away
    most_running: int = 0  # the largest number of requests running at once
    queue_wait_seconds: list[float] = field(default_factory=list)  # start to first admission
    # Sharing. Per request, at its first admission: prompt tokens found in the prefix cache, and
    # whether it forked from its prompt's first sample instead (--samples).
    first_cached_tokens: list[int] = field(default_factory=list)
    forked: list[bool] = field(default_factory=list)
    num_shared_blocks: int = 0  # references taken to blocks computed for another request
    num_copied_blocks: int = 0  # copies on write

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t) for t in self.output_tokens)

    @property
    def decode_steps(self) -> int:
        return len(self.timeline)

    @property
    def fullest(self) -> KVSnapshot:
        """The step at which the cache held the most tokens."""
        return max(self.timeline, key=lambda s: s.filled_slots)


def packed_chunks(sizes: list[int], chunk_tokens: int):
    """Consecutive ranges of items whose sizes add up to at most chunk_tokens (one item at least)."""
    start = 0
    while start < len(sizes):
        end, total = start + 1, sizes[start]
        while end < len(sizes) and total + sizes[end] <= chunk_tokens:
            total, end = total + sizes[end], end + 1
        yield range(start, end)
        start = end


def prefill(model, cache, manager, sampler, requests: np.ndarray, sequences: list[list[int]],
            num_cached: np.ndarray, readers: list[np.ndarray], chunk_tokens: int, device):
    """Compute whole sequences (prompts, or a preempted request's prompt and outputs), packed into
    chunks of about `chunk_tokens`, writing every token's K/V into its slot. Sequence i skips its
    first num_cached[i] tokens, found in the prefix cache. Each request in readers[i] (requests[i]
    and the samples forked from it) draws its first token from sequence i's last position.
    Returns those tokens, [sum of len(readers)] on device, in the order of the readers."""
    to_device = lambda a, dtype: torch.from_numpy(np.asarray(a)).to(device, dtype)
    # A sequence cached whole still computes its last token, for the logits that choose the next
    # one; that token's K/V is in the cache already, so it is written to the spare slot.
    starts = [min(int(c), len(seq) - 1) for c, seq in zip(num_cached, sequences)]
    next_tokens = []
    for chunk in packed_chunks([len(s) - b for s, b in zip(sequences, starts)], chunk_tokens):
        lengths = [len(sequences[i]) for i in chunk]  # each sequence's tokens, cached and new
        new = [len(sequences[i]) - starts[i] for i in chunk]  # the tokens computed here
        cu_seqlens = np.concatenate([[0], np.cumsum(new)])
        slots = [manager.slots(int(requests[i]), starts[i], len(sequences[i])) for i in chunk]
        for i, seq_slots in zip(chunk, slots):
            seq_slots[:max(0, int(num_cached[i]) - starts[i])] = cache.spare_slot
        batch = PrefillBatch(slot_mapping=to_device(np.concatenate(slots), torch.long),
                             cu_seqlens=to_device(cu_seqlens, torch.int32),
                             cu_seqlens_host=cu_seqlens.tolist(), max_seqlen=max(new))
        if any(starts[i] for i in chunk):  # attention must read the cached prefixes too
            cu_seqlens_k = np.concatenate([[0], np.cumsum(lengths)])
            batch.block_table = manager.block_table[to_device(requests[chunk.start:chunk.stop],
                                                              torch.long)]
            batch.cu_seqlens_k = to_device(cu_seqlens_k, torch.int32)
            batch.cu_seqlens_k_host, batch.max_seqlen_k = cu_seqlens_k.tolist(), max(lengths)
        tokens = to_device(np.concatenate([sequences[i][starts[i]:] for i in chunk]), torch.long)  # [T]
        positions = to_device(np.concatenate([np.arange(starts[i], len(sequences[i])) for i in chunk]),
                              torch.long)
        # Each reader samples from its sequence's last row: [readers in the chunk].
        fanout = [len(readers[i]) for i in chunk]
        last_token_rows = to_device(np.repeat(cu_seqlens[1:] - 1, fanout), torch.long)
        # Every input goes to the device before the forward pass is queued: a copy from host
        # memory waits for the GPU to finish what it has, so one after it would stall.
        reader_ids = to_device(np.concatenate(readers[chunk.start:chunk.stop]), torch.long)
        next_positions = to_device(np.repeat(lengths, fanout), torch.long)
        logits = model(tokens, positions, cache, batch, logits_at=last_token_rows)  # [readers, vocab]
        next_tokens.append(sampler(logits, reader_ids, next_positions))
    return torch.cat(next_tokens)


def decode_step(model, cache, block_table, sampler, tokens, positions, requests,
                max_cache_seqlen: int):
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
    return sampler(model(tokens, positions, cache, batch), requests, positions + 1)  # [B]


class EagerDecoder:
    """Runs decode_step from Python, kernel by kernel: the readable path, and the one --eager
    takes. `cuda_graphs.GraphDecoder` replays the same function as CUDA graphs."""

    def __init__(self, model, cache, block_table, sampler):
        self.model, self.cache, self.block_table, self.sampler = model, cache, block_table, sampler
        self.padding_request = block_table.shape[0] - 1  # the table's row that no request owns

    def decode(self, tokens, positions, requests, max_cache_seqlen: int) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.block_table, self.sampler, tokens,
                           positions, requests, max_cache_seqlen)

    def step(self, last_tokens, running: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Feed each running request its newest token (`last_tokens[running]`, at `positions`)
        and return the next ones, [B] on device; `last_tokens[running]` is updated to them."""
        device = last_tokens.device
        running_on_device = torch.from_numpy(running).to(device)
        next_tokens = self.decode(last_tokens[running_on_device],
                                  torch.from_numpy(positions).to(device), running_on_device,
                                  int(positions.max()) + 1)
        last_tokens[running_on_device] = next_tokens
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


def make_decoder(model, cache, manager, sampler, max_batch: int, cuda_graphs: bool):
    """CUDA graphs where they can run (CUDA, an attention that reads its lengths on the GPU),
    else the eager decoder."""
    eager = EagerDecoder(model, cache, manager.block_table, sampler)
    on_gpu = next(model.parameters()).is_cuda
    if not (cuda_graphs and on_gpu and cache.attention_backend.cuda_graphs):
        return eager
    return GraphDecoder(eager, max_batch)


def generate(setup, cache, manager, progress: bool = True) -> Generation:
    """Every request of the run through `cache`: what the scripts call. With --samples K, prompt
    r yields K sequences, requests r*K to r*K + K-1."""
    args, samples = setup.args, setup.args.samples
    start = time.perf_counter()
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    num_sequences = len(setup.requests) * samples
    largest_batch = min(num_sequences, args.max_running or num_sequences)
    decoder = make_decoder(setup.model, cache, manager, sampler, largest_batch, not args.eager)
    if progress and isinstance(decoder, GraphDecoder):
        print(f"Captured {len(decoder.buckets)} CUDA graphs of a decode step, batch 1 to "
              f"{decoder.buckets[-1]}, in {time.perf_counter() - start:.1f} s")
    if args.random_weights:  # text is nonsense: stop where the ShareGPT reply stopped
        max_new_tokens = [min(r.num_reply_tokens, args.max_new_tokens) for r in setup.requests]
        stop_ids = set()
    else:
        max_new_tokens = [args.max_new_tokens] * len(setup.requests)
        stop_ids = setup.tokenizer.stop_ids
    repeat = lambda per_prompt: [x for x in per_prompt for _ in range(samples)]
    return generate_tokens(setup.model, cache, manager,
                           repeat([r.prompt_tokens for r in setup.requests]),
                           repeat(max_new_tokens), args.max_seq_len, stop_ids,
                           continuous=args.continuous, max_running=args.max_running,
                           progress=progress, decoder=decoder, sampler=sampler, samples=samples)


@torch.inference_mode()
def generate_tokens(model, cache, manager, prompts: list[list[int]], max_new_tokens: list[int],
                    max_seq_len: int, stop_ids: set[int], continuous: bool = False,
                    max_running: int | None = None, chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                    progress: bool = True, decoder=None, sampler=None,
                    samples: int = 1) -> Generation:
    """Decode every prompt, greedily unless `sampler` samples. Request r stops at a token in
    `stop_ids`, after `max_new_tokens[r]` tokens, or when it reaches `max_seq_len`; it then leaves
    the batch and gives its blocks back. Static batching admits every request at the first step;
    `continuous` admits them as blocks free up and preempts when blocks run out (scheduler.py).
    With `samples` K, requests r*K .. r*K + K-1 have the same prompt and may share its blocks
    (the manager's share_samples). The caller has checked that every prompt is shorter than
    max_seq_len. `decoder` runs each decode step, with the same sampler: an EagerDecoder unless
    the caller passes CUDA graphs."""
    device = next(model.parameters()).device
    sampler = sampler or Sampler()
    decoder = decoder or EagerDecoder(model, cache, manager.block_table, sampler)
    n = len(prompts)
    prompt_lens = np.array([len(p) for p in prompts])
    limits = np.minimum(np.array(max_new_tokens), max_seq_len - prompt_lens)  # [N] tokens to make
    outputs = np.zeros((n, max(limits)), dtype=np.int64)
    num_generated = np.zeros(n, dtype=np.int64)
    tokens_of = lambda r: prompts[r] + outputs[r, :num_generated[r]].tolist()  # prompt + outputs
    scheduler = Scheduler(manager, prompt_lens, limits, continuous, max_running, chunk_tokens,
                          tokens_of, samples)
    stop_ids_array = np.array(sorted(stop_ids), dtype=np.int64)
    last_tokens = torch.zeros(n, dtype=torch.long, device=device)  # each request's newest token
    timeline, timer, num_prefilled = [], StepTimer(device), 0
    seconds = {"prefill": 0.0, "decode": 0.0}  # wall time of each kind of step

    # A context, so that the bar is gone before an error message (out of blocks) is printed.
    with tqdm(desc="decode", unit="step", disable=not progress, leave=False) as bar:
        while scheduler.has_work():
            start = time.perf_counter()
            step = scheduler.schedule(num_generated)
            requests = step.requests
            if step.is_prefill:  # new prompts, or preempted requests' prompts and outputs so far
                is_computed = step.sources == requests  # forks are not computed
                computed, num_cached = requests[is_computed], step.num_cached[is_computed]
                # Who draws from each computed request's last position: it, then its forks.
                readers = [requests[step.sources == r] for r in computed]
                requests = np.concatenate(readers)
                sequences = [tokens_of(r) for r in computed]
                num_prefilled += sum(len(s) - min(c, len(s) - 1) for s, c in zip(sequences, num_cached))
                next_tokens = prefill(model, cache, manager, sampler, computed, sequences,
                                      num_cached, readers, chunk_tokens, device)
                last_tokens[torch.from_numpy(requests).to(device)] = next_tokens
            else:  # every running request feeds its newest token; the scheduler gave it a slot
                timeline.append(KVSnapshot(len(timeline), len(requests), len(scheduler.waiting),
                                           manager.num_reserved_slots, manager.num_unfilled_slots,
                                           manager.num_unshared_slots))
                timer.start()
                if step.copies[0]:  # copy on write, before the step writes into the copies
                    cache.copy_blocks(*step.copies)
                next_tokens = decoder.step(last_tokens, requests, step.positions)
                timer.stop()
            new_tokens = next_tokens.cpu().numpy()  # the one sync per step
            # Record this step's tokens; retire requests that hit a stop token or their limit.
            is_stop = np.isin(new_tokens, stop_ids_array)
            kept = requests[~is_stop]
            outputs[kept, num_generated[kept]] = new_tokens[~is_stop]
            num_generated[kept] += 1
            scheduler.finish(requests[is_stop | (num_generated[requests] >= limits[requests])])
            seconds["prefill" if step.is_prefill else "decode"] += time.perf_counter() - start
            if not step.is_prefill:
                bar.update()
                bar.set_postfix(running=len(requests), waiting=len(scheduler.waiting),
                                blocks=manager.num_used_blocks, refresh=False)
    for snapshot, step_seconds in zip(timeline, timer.seconds()):
        snapshot.seconds = step_seconds
    return Generation(
        output_tokens=[outputs[r, :num_generated[r]].tolist() for r in range(n)],
        num_prompt_tokens=int(prompt_lens.sum()), num_prefilled_tokens=num_prefilled,
        prefill_seconds=seconds["prefill"], decode_seconds=seconds["decode"], timeline=timeline,
        num_preemptions=scheduler.num_preemptions,
        num_recomputed_tokens=scheduler.num_recomputed_tokens,
        most_running=scheduler.most_running, queue_wait_seconds=scheduler.admitted_at.tolist(),
        first_cached_tokens=scheduler.first_cached.tolist(), forked=scheduler.forked.tolist(),
        num_shared_blocks=manager.num_shared, num_copied_blocks=manager.num_copied)
