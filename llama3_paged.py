"""Paged batched Llama 3 decoding: the lesson in one file, read top to bottom.

A naive KV cache reserves each request's longest sequence before its first token
(llama3_naive.py). Here requests share a pool of small blocks: a request claims a block only when
its tokens reach it, so at most block_size - 1 of its slots sit empty, and its blocks return to
the pool the moment it finishes. block_manager.py says who holds which block; the attention
kernel follows its block table, so a request's blocks need not be contiguous.
"""

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends in one line, exit 130
    from plumbing.interrupt import exit_quietly_on_ctrl_c
    exit_quietly_on_ctrl_c("llama3_paged.py")

import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from block_manager import BlockManager, to_device
from plumbing import cli, inputs  # flags and errors; checkpoints, prompts, the memory budget

# --- 1. The model ------------------------------------------------------------------------------
# Tokens arrive packed: a forward pass takes [T] token ids from any number of requests (a whole
# prompt each in prefill, one token each in decode), never a padded [batch, seq].

def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) by its position's angle (Meta's layout): seen as
    the complex number x[2i] + j*x[2i+1], one multiplication by e^(j*angle).
    x: [T, heads, head_dim]; rotations: [T, head_dim / 2] complex."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, heads, head_dim / 2]
    return torch.view_as_real(pairs * rotations[:, None, :]).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args, layer_index: int, dtype: torch.dtype):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # Q, K and V in one matmul: one kernel launch instead of three for every layer and step.
        self.wqkv = nn.Linear(args.dim, q_size + 2 * kv_size, bias=False, dtype=dtype)
        self.wo = nn.Linear(q_size, args.dim, bias=False, dtype=dtype)

    def forward(self, x, rotations, kv_cache, batch) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.wqkv(x).view(T, -1, self.head_dim)  # [T, n_heads + 2 * n_kv_heads, head_dim]
        q_and_k, v = qkv.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=1)
        q_and_k = apply_rope(q_and_k, rotations)  # both rotated at once, by the same angles
        q, k = q_and_k.split([self.n_heads, self.n_kv_heads], dim=1)
        # The cache stores k and v where this batch's tokens belong, then attends over everything
        # each request has cached so far. How it finds that memory is the whole lesson (part 2).
        out = kv_cache.attention(self.layer_index, q, k, v, batch)  # [T, n_heads, head_dim]
        return self.wo(out.reshape(T, -1))


class FeedForward(nn.Module):
    def __init__(self, args, dtype: torch.dtype):
        super().__init__()
        # Gate and up projections merged into one matmul, split after: SwiGLU = silu(gate) * up.
        self.w_gate_up = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False, dtype=dtype)
        self.w_down = nn.Linear(args.ffn_dim, args.dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # each [T, ffn_dim]
        return self.w_down(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args, layer_index: int, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, args.norm_eps, dtype=dtype)
        self.attention = Attention(args, layer_index, dtype)
        self.ffn_norm = nn.RMSNorm(args.dim, args.norm_eps, dtype=dtype)
        self.feed_forward = FeedForward(args, dtype)

    def forward(self, h, rotations, kv_cache, batch) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), rotations, kv_cache, batch)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Built on the `meta` device, then filled by plumbing/inputs.py, which also sets
    rope_rotations: e^(j*angle) of every position, [max_positions, head_dim / 2] complex."""

    def __init__(self, args, dtype: torch.dtype):
        super().__init__()
        self.args = args  # plumbing/inputs.py's ModelArgs: the shapes, from a config or a preset
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(args, i, dtype) for i in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, args.norm_eps, dtype=dtype)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype)
        if args.tie_embeddings:  # Llama 3.2 1B/3B reuse the embedding as the output head
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, positions, kv_cache, batch, logits_at=None) -> torch.Tensor:
        """tokens, positions: [T]. Returns logits [T, vocab], or only at rows `logits_at`:
        prefill needs each prompt's last row, and all T rows of a 128K vocabulary would not fit."""
        rotations = self.rope_rotations[positions]  # [T, head_dim / 2] complex
        h = self.tok_embeddings(tokens)  # [T, dim]
        for layer in self.layers:
            h = layer(h, rotations, kv_cache, batch)
        h = h if logits_at is None else h[logits_at]
        return self.output(self.norm(h))  # [T or len(logits_at), vocab]


# --- 2. The KV cache and the attention that reads it through the block table -------------------
# A slot is one token's K and V in one layer; slot s lives in block s // block_size, at offset
# s % block_size. The naive cache is this pool with one max_seq_len block per request.

@dataclass
class PrefillBatch:
    """Prompts packed into one sequence of T tokens."""
    slot_mapping: torch.Tensor  # [T] int64: the slot each token's K/V is written to
    cu_seqlens: torch.Tensor  # [B + 1] int32: prompt r is tokens cu_seqlens[r]:cu_seqlens[r+1]
    cu_seqlens_host: list[int]
    max_seqlen: int


@dataclass
class DecodeBatch:
    """One new token for each of B requests."""
    slot_mapping: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_blocks] int32: the physical blocks of each request
    cache_seqlens: torch.Tensor  # [B] int32: tokens cached per request, the new one included
    max_cache_seqlen: int


class KVCache:
    """The pool: every block of every layer, allocated once, up front."""

    def __init__(self, args, num_blocks: int, block_size: int, dtype, device, attention):
        self.num_blocks, self.block_size, self.attention_backend = num_blocks, block_size, attention
        self.num_slots = num_blocks * block_size
        self.block_shape = (num_blocks, block_size, args.n_kv_heads, args.head_dim)
        # Zeroed, so that slots no token has written stay finite.
        self.k, self.v = (torch.zeros(self.slots_shape(args), dtype=dtype, device=device)
                          for _ in range(2))

    def slots_shape(self, args) -> tuple[int, ...]:
        return (args.n_layers, self.num_slots, args.n_kv_heads, args.head_dim)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V as blocks: the same memory, as the kernel reads it."""
        return self.k[layer].view(self.block_shape), self.v[layer].view(self.block_shape)

    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor:
        """Store this batch's k, v ([T, n_kv_heads, head_dim]) in their slots, then attend."""
        self.k[layer].index_copy_(0, batch.slot_mapping, k)
        self.v[layer].index_copy_(0, batch.slot_mapping, v)
        if isinstance(batch, PrefillBatch):  # a prompt's own k, v are all it attends to
            return self.attention_backend.prefill(q, k, v, batch)
        return self.attention_backend.decode(q, *self.blocks(layer), batch)


class FlashAttention:
    """flash-attn 2: varlen prefill over the packed prompts; a paged decode kernel that follows
    the block table itself, reading each block once, never gathering."""

    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prefill(self, q, k, v, batch):
        return self.varlen(q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen,
                           batch.max_seqlen, causal=True)

    def decode(self, q, key_blocks, value_blocks, batch):
        return self.with_kvcache(q[:, None], key_blocks, value_blocks,  # q: [B, 1, n_heads, d]
                                 cache_seqlens=batch.cache_seqlens, block_table=batch.block_table,
                                 causal=True)[:, 0]


class TorchAttention:
    """The same in PyTorch, readable and slow: a request's blocks are gathered into a dense
    tensor for SDPA. It runs anywhere; the tests hold flash-attn to it."""

    name = "torch"

    def prefill(self, q, k, v, batch):
        """Each prompt over itself, causally. q: [T, n_heads, d]; k, v: [T, n_kv_heads, d]."""
        bounds = zip(batch.cu_seqlens_host[:-1], batch.cu_seqlens_host[1:])
        heads_first = lambda x: x.transpose(0, 1)  # [T, heads, d] <-> [heads, T, d], as SDPA reads
        return torch.cat([heads_first(F.scaled_dot_product_attention(
            heads_first(q[s:e]), heads_first(k[s:e]), heads_first(v[s:e]), is_causal=True,
            enable_gqa=True)) for s, e in bounds])

    def decode(self, q, key_blocks, value_blocks, batch):
        """q: [B, n_heads, d] -> [B, n_heads, d]."""
        max_len = batch.max_cache_seqlen  # known on the host: gather only blocks someone uses
        table = batch.block_table[:, :math.ceil(max_len / key_blocks.shape[1])]
        k = key_blocks[table].flatten(1, 2)[:, :max_len]  # [B, max_len, n_kv_heads, d]
        v = value_blocks[table].flatten(1, 2)[:, :max_len]
        holds_token = torch.arange(max_len, device=q.device) < batch.cache_seqlens[:, None]
        return F.scaled_dot_product_attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=holds_token[:, None, None, :], enable_gqa=True)[:, :, 0]  # [B, n_heads, d]


# --- 3. Requests and the static scheduler ------------------------------------------------------

@dataclass(eq=False)
class Request:
    row: int  # its row of the block table, and its number: requests are 0 .. N-1
    prompt_tokens: list[int]
    max_new_tokens: int  # it stops after this many, or at a stop token
    output_tokens: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """What the cache must hold for it to go on: its prompt and what it generated."""
        return self.prompt_tokens + self.output_tokens


@dataclass
class Step:
    """What one forward pass computes: "prefill", the prompts of requests just admitted, or
    "decode", one new token for each running request."""
    kind: str
    requests: list[Request]  # in admission order
    rows: np.ndarray  # [B] their rows
    positions: np.ndarray | None = None  # decode: [B] the position each new token takes


class Scheduler:
    """Static batching, the original experiment's: all requests are admitted at the first step;
    a batch that does not fit ends the run (OutOfBlocks)."""

    def __init__(self, manager: BlockManager, requests: list[Request]):
        self.manager, self.waiting = manager, deque(requests)
        self.running: list[Request] = []  # admission order: the newest is last
        self.rows = np.zeros(0, dtype=np.int64)  # [len(running)] their rows, for the manager

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> Step:
        if self.waiting:
            step = self._admit(list(self.waiting))
            self.waiting.clear()
            return step
        return self._decode()

    def finish(self, requests: list[Request]) -> None:
        """Requests that are done give every block back at once."""
        for request in requests:
            self.manager.free(request)
            i = self.running.index(request)  # a search in C: no Python loop over the batch
            self.running = self.running[:i] + self.running[i + 1:]
            self.rows = np.delete(self.rows, i)

    def _admit(self, requests: list[Request]) -> Step:
        """Each request's blocks, for its whole prompt, and a prefill step of them all."""
        for request in requests:
            self.manager.allocate(request)
        rows = np.array([r.row for r in requests], dtype=np.int64)
        self.running, self.rows = self.running + requests, np.concatenate([self.rows, rows])
        return Step("prefill", requests, rows)

    def _decode(self) -> Step:
        positions = self.manager.num_tokens[self.rows].copy()  # the cache holds all but the last
        self.manager.append_token(self.rows)  # a slot each: a new block at a block's end
        return Step("decode", self.running, self.rows, positions=positions)


# --- 4. The loop -------------------------------------------------------------------------------
# Each step the scheduler says who runs; the block manager's `slots` says where each new token's
# K and V go, for prefill and decode alike. The host waits for the GPU once a step, for the new
# tokens; block bookkeeping touches only requests that cross a block boundary.

@dataclass
class KVSnapshot:
    """The cache at one decode step, in slots (times kv_bytes_per_token: bytes)."""
    step: int
    running_requests: int
    reserved_slots: int  # slots in blocks owned by running requests
    unfilled_slots: int  # of those, slots holding no token: the fragmentation

    @property
    def filled_slots(self) -> int:
        return self.reserved_slots - self.unfilled_slots


@dataclass
class Generation:
    requests: list[Request]  # in order, each with its output_tokens (stop token excluded)
    prefill_seconds: float
    decode_seconds: float
    timeline: list[KVSnapshot]  # one per decode step

    @property
    def fullest(self) -> KVSnapshot:
        """The step at which the cache held the most tokens."""
        return max(self.timeline, key=lambda s: s.filled_slots, default=KVSnapshot(0, 0, 0, 0))


def packed_passes(sizes: list[int], tokens_per_pass: int):
    """Consecutive ranges of prompts of at most tokens_per_pass tokens in all (one at least)."""
    start = 0
    while start < len(sizes):
        fit = int((np.cumsum(sizes[start:]) <= tokens_per_pass).sum())  # the next ones that fit
        end = start + max(fit, 1)
        yield range(start, end)
        start = end


class Decoder:
    """One decode step, kernel by kernel from Python."""

    def __init__(self, model, cache, block_table):
        self.model, self.cache, self.block_table = model, cache, block_table

    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        """The likeliest next token of B requests: tokens, positions, rows, slots [B] on device."""
        return self.logits(tokens, positions, rows, slots, max_cache_seqlen).argmax(-1)  # [B]

    def logits(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        batch = DecodeBatch(slot_mapping=slots, block_table=self.block_table[rows],  # their rows
                            cache_seqlens=(positions + 1).int(), max_cache_seqlen=max_cache_seqlen)
        return self.model(tokens, positions, self.cache, batch)  # [B, vocab]

    def step(self, tokens, positions, rows, slots) -> torch.Tensor:
        """The same, but positions, rows and slots are host arrays."""
        inputs = to_device(np.stack([positions, rows, slots]), self.block_table.device)  # [3, B]
        return self.decode(tokens, *inputs, int(positions.max()) + 1)


class Engine:
    tokens_per_pass = inputs.TOKENS_PER_PASS

    def __init__(self, model, cache, manager: BlockManager):
        self.model, self.cache, self.manager = model, cache, manager
        self.decoder = Decoder(model, cache, manager.block_table)
        self.device = manager.block_table.device

    @torch.inference_mode()
    def generate(self, scheduler: Scheduler, stop_ids=frozenset(), progress=True) -> Generation:
        """Run every request to its end: a stop token (not kept) or its max_new_tokens."""
        requests, self.timeline, seconds = list(scheduler.waiting), [], [0.0, 0.0]
        with cli.decode_progress(scheduler, self.manager, progress) as advance_the_bar:
            start = time.perf_counter()
            for step in self.steps(scheduler, stop_ids):
                decodes = step.kind != "prefill"  # the engine's mixed steps do both
                seconds[decodes] += time.perf_counter() - start  # [in prefill, in decode]
                start = time.perf_counter()
                if decodes:
                    advance_the_bar()
        return Generation(requests, *seconds, self.timeline)

    def steps(self, scheduler: Scheduler, stop_ids):
        """Schedule a step, compute it, append its tokens, let the finished requests go."""
        while scheduler.has_work():
            step = scheduler.schedule()
            if step.kind == "decode":
                self.note_the_cache(scheduler)
                last = np.array([r.output_tokens[-1] for r in step.requests])  # prefill's first
                tokens = self.decode(step, to_device(last, self.device))
            else:
                tokens = self.prefill(step)
            tokens = tokens.cpu().numpy()  # [B]: the host waits for the GPU here, once a step
            scheduler.finish(append_tokens(step.requests, tokens, stop_ids))
            yield step

    def note_the_cache(self, scheduler: Scheduler) -> None:
        """The cache as a decode step finds it: a point of the timeline."""
        self.timeline.append(KVSnapshot(len(self.timeline), len(scheduler.running),
                                        self.manager.num_reserved_slots,
                                        self.manager.num_unfilled_slots))

    def decode(self, step: Step, last_tokens: torch.Tensor) -> torch.Tensor:
        """One token for every running request, after its last one ([B] on device)."""
        slots = self.manager.slots(step.rows, step.positions)  # [B]: as prefill finds them
        return self.decoder.step(last_tokens, step.positions, step.rows, slots)

    def prefill(self, step: Step) -> torch.Tensor:
        """Each request's prompt, packed into passes of about tokens_per_pass tokens; returns
        each request's next token, [B] on device."""
        prompts = [r.tokens for r in step.requests]
        return torch.cat([self._prefill_pass(step.rows[p], [prompts[i] for i in p])
                          for p in packed_passes(list(map(len, prompts)), self.tokens_per_pass)])

    def _prefill_pass(self, rows: np.ndarray, prompts: list[list[int]]) -> torch.Tensor:
        return self.prefill_logits(rows, prompts).argmax(-1)  # [B]: each one's likeliest next

    def prefill_logits(self, rows: np.ndarray, prompts: list[list[int]]) -> torch.Tensor:
        on_device = lambda a, dtype=torch.long: to_device(a, self.device, dtype)
        lengths = np.array([len(p) for p in prompts])
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1], lengths)  # [T]
        slots = self.manager.slots(np.repeat(rows, lengths), positions)  # as decode finds them
        batch = PrefillBatch(on_device(slots), on_device(cu_seqlens, torch.int32),
                             cu_seqlens.tolist(), int(lengths.max()))
        return self.model(on_device(np.concatenate(prompts)), on_device(positions), self.cache,
                          batch, logits_at=on_device(cu_seqlens[1:] - 1))  # [B, vocab]: each last


def append_tokens(requests: list[Request], new_tokens: np.ndarray, stop_ids) -> list:
    """Append each request's new token; return those done: a stop token (not kept) or their
    last allowed token."""
    done = []
    for request, token in zip(requests, new_tokens.tolist()):
        if token not in stop_ids:
            request.output_tokens.append(token)
        if token in stop_ids or len(request.output_tokens) >= request.max_new_tokens:
            done.append(request)
    return done


# --- 5. The report -----------------------------------------------------------------------------
# Reserved: slots in blocks that running requests own. Filled: those holding a token's K and V.
# Unfilled: reserved minus filled, memory no one can use until its request ends. Fragmented
# Memory is the unfilled memory at the step the cache held the most tokens, as the original
# experiment printed it (GB = 10^9 bytes), and its share of the device's memory.

def report(run, cache: KVCache, manager: BlockManager, g: Generation) -> None:
    """The first answers, the speed, and where the KV cache's memory went."""
    outputs = [r.output_tokens for r in g.requests]
    inputs.print_answers(run.prompts, outputs, run.tokenizer, run.args.show_all)
    per_token, gb = run.kv_bytes_per_token, cli.format_bytes
    print(f"\n=== {run.args.script} ===\nTokens: {sum(map(len, outputs)):,} generated "
          f"({inputs.lengths_note(run, g.requests)}) in {g.prefill_seconds:.2f} s of prefill and "
          f"{len(g.timeline):,} decode steps in {g.decode_seconds:.2f} s")
    print(f"KV cache: {gb(cache.nbytes)} allocated up front = {manager.num_blocks:,} blocks x "
          f"{manager.block_size:,} tokens x {per_token // 1024} KiB per token")
    fullest = g.fullest
    reserved, unfilled = fullest.reserved_slots * per_token, fullest.unfilled_slots * per_token
    print(f"  at the fullest step ({fullest.step}, {fullest.running_requests} running): reserved "
          f"{gb(reserved)}, filled {gb(reserved - unfilled)}, unfilled {gb(unfilled)} "
          f"({100 * unfilled / max(reserved, 1):.1f}% of reserved)")
    total = inputs.device_total_bytes(run.device)
    print(f"Fragmented Memory: {gb(unfilled)} ({100 * unfilled / total:.2f}%)")


# --- 6. main -----------------------------------------------------------------------------------

def pool_size(run, budget_bytes: float) -> tuple[int, int]:
    """(num_blocks, block_size): as many small blocks as the KV budget holds."""
    flash = run.attention.name == "flash"
    block_size = run.args.block_size or (inputs.FLASH_BLOCK_MULTIPLE if flash else 16)
    num_blocks = run.args.num_blocks or int(budget_bytes // (block_size * run.kv_bytes_per_token))
    inputs.check_a_block_fits(num_blocks, block_size, run, budget_bytes)
    return num_blocks, block_size


def allocate_kv_cache(run) -> tuple[KVCache, BlockManager]:
    """The pool, and the block manager that hands its blocks out. The block table the kernel
    reads is [N, max_blocks_per_request]: row r lists request r's blocks, in order."""
    num_blocks, block_size = pool_size(run, inputs.kv_budget_bytes(run))
    with inputs.checked_kv_allocation(run, num_blocks, block_size):  # fits kernel and memory?
        cache = KVCache(run.model.args, num_blocks, block_size, run.dtype, run.device,
                        run.attention)
    max_blocks_per_request = math.ceil(run.args.max_seq_len / block_size)
    return cache, BlockManager(num_blocks, block_size, run.num_sequences, max_blocks_per_request,
                               run.device)


def choose_attention(args):
    """flash-attn on CUDA, the PyTorch reference on the CPU or with --attn torch."""
    if args.attn == "torch" or (args.attn == "auto" and args.device.type != "cuda"):
        return TorchAttention()
    inputs.check_flash_attn(args.device)  # a CUDA device and the package, or one paragraph
    return FlashAttention()


def main(argv=None, script="llama3_paged.py", doc=__doc__, add_arguments=cli.add_pool_arguments,
         allocate=allocate_kv_cache, report=report) -> None:
    """Arguments -> model and prompts -> the KV cache (where the scripts differ) -> generate ->
    report. llama3_naive.py runs it with its own cache, llama3_virtual.py with its own report."""
    with cli.one_paragraph_errors(script):
        args = cli.argument_parser(script, doc, add_arguments).parse_args(argv)
        run = inputs.load_run(args, Llama, choose_attention(args))
        cache, manager = allocate(run)
        budgets = inputs.new_token_budgets(run)  # each request's max_new_tokens
        requests = [Request(i, p.prompt_tokens, n)
                    for i, (p, n) in enumerate(zip(run.prompts, budgets))]
        stop_ids = set() if args.random_weights else run.tokenizer.stop_ids  # random: no text
        scheduler, engine = Scheduler(manager, requests), Engine(run.model, cache, manager)
        report(run, cache, manager, engine.generate(scheduler, stop_ids))


if __name__ == "__main__":
    # A flag this file does not define is a feature's: the engine's program runs that command
    # line (python -m engine.run). The lesson's flags alone run main() above, on every device.
    if cli.needs_features("llama3_paged.py", sys.argv[1:], cli.add_pool_arguments):
        cli.hand_to_the_engine("llama3_paged.py", sys.argv[1:])
    else:
        main()
