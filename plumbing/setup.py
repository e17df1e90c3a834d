"""What a run is made of: the model, the prompts, the memory left for KV, and the parts the flags
choose.

The scripts parse the same arguments (plumbing/cli.py) and `load` the same things. Each then
asks `kv_budget_bytes` how much memory its KV cache may take, and `generate` runs the requests
through it with the features the flags ask for: a feature's file is imported only then, so a
plain run executes the core alone.
"""

import argparse
import importlib
import math
import time
from dataclasses import dataclass

import torch

from core.attention import FLASH_BLOCK_MULTIPLE, FlashAttention, TorchAttention
from core.engine import PREFILL_CHUNK_TOKENS, EagerDecoder, Engine, greedy
from core.kv_cache import KVCache, PrefillBatch
from core.request import Request, Scheduler
from plumbing.checkpoints import load_model, random_model
from plumbing.cli import (CPU_KV_BUDGET_GB, GB, OUT_OF_MEMORY, UserError,
                          check_host_memory, format_bytes, refuse_output_over_input)
from plumbing.prompts import PROMPTS_FILE, load_prompts, load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_SEQUENCES = 1_000_000  # N x --samples: far more than any GPU holds, few enough to count
GREEDY_BELOW = 1e-5  # a temperature below this is greedy: logits / T would overflow, or make a
                     # softmax as one-hot as the argmax for any two logits 0.001 apart


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    attention: object
    tokenizer: object
    prompts: list
    system_prompt: str | None = None  # the system turn every request begins with, if any

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.args.kv_bytes_per_token(self.dtype)

    @property
    def num_system_prompt_tokens(self) -> int:
        """<|begin_of_text|> and the system turn: the tokens every request begins with (0: none)."""
        if self.system_prompt is None:
            return 0
        chat = self.tokenizer.chat_prompt
        return len(chat("", self.system_prompt)) - len(chat("")) + 1

    @property
    def num_sequences(self) -> int:
        """What the scheduler runs: each prompt's --samples (or beams, llama3_paged.py)."""
        return len(self.prompts) * self.args.samples * getattr(self.args, "beam_width", 1)


def load(args) -> Setup:
    """Check the arguments, then load tokenizer, prompts and model: all before any KV memory."""
    if args.max_running and not args.continuous:
        raise UserError("--max-running limits continuous batching; add --continuous (a static "
                        "batch runs all N requests at once).")
    if not math.isinf(args.request_rate) and not args.continuous:
        raise UserError("--request-rate spreads requests over time, which only continuous "
                        "batching can admit as they arrive; add --continuous.")
    if args.preemption == "swap" and not args.continuous:
        raise UserError("--preemption swap chooses how continuous batching preempts; a static "
                        "batch never preempts. Add --continuous.")
    if args.preemption == "swap" and args.max_batched_tokens:
        raise UserError("--preemption swap does not combine with --max-batched-tokens yet: drop "
                        "one of the two.")
    if args.max_batched_tokens and not args.continuous:
        raise UserError("--max-batched-tokens sets the size of continuous batching's mixed "
                        "steps; add --continuous (a static batch prefills every prompt first).")
    if args.compile and args.device.type != "cuda":
        raise UserError("--compile fuses the model's small kernels into Triton kernels, which "
                        "run on CUDA only: drop it on this device.")
    if args.top_p < 1 and args.temperature == 0:
        raise UserError("--top-p chooses among the likeliest tokens when sampling, and "
                        "--temperature 0 (the default) is greedy: add --temperature, e.g. 0.8.")
    if args.overlap:  # refused now, not after minutes of loading the model
        from features.overlap import why_not_overlapped
        refuse_overlap(why_not_overlapped(args))
    if args.find_max_batch and args.continuous:
        raise UserError("--find-max-batch finds the largest static batch that fits the KV cache; "
                        "with --continuous every batch completes, as requests wait and are "
                        "preempted when blocks run out. Drop one of the two.")
    if args.num_requests * args.samples > MAX_SEQUENCES:
        raise UserError(f"N x --samples = {args.num_requests * args.samples:,} sequences; this "
                        f"project runs at most {MAX_SEQUENCES:,} at once.")
    refuse_output_over_input(args.json, inputs_of(args), "--json")
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    attention = choose_attention(args.attn, device, getattr(args, "decode_kernel", "flash"))
    ckpt_dir = None if args.random_weights else args.ckpt_dir
    tokenizer = load_tokenizer(args.tokenizer, ckpt_dir)
    system = system_prompt(args)
    prompts = load_prompts(args.num_requests, tokenizer, system)
    too_long = [p for p in prompts if len(p.prompt_tokens) >= args.max_seq_len]
    if too_long:
        raise UserError(f"Request {too_long[0].id} has a {len(too_long[0].prompt_tokens)}-token "
                        f"prompt, leaving no room to generate within --max-seq-len "
                        f"{args.max_seq_len}. Raise --max-seq-len.")
    if args.random_weights:
        print("Random weights: end-of-text is ignored and each request generates as many tokens "
              "as its ShareGPT reply (at most --max-new-tokens).")
        model = random_model(args.model, device, dtype, args.max_seq_len, args.seed)
    else:
        model = load_model(args.ckpt_dir, device, dtype, args.max_seq_len)
    if model.args.vocab_size < tokenizer.encoding.n_vocab:  # an id past the embedding table
        raise UserError(f"The checkpoint's vocabulary has {model.args.vocab_size:,} tokens, the "
                        f"tokenizer's {tokenizer.encoding.n_vocab:,}: they do not belong together.")
    return Setup(args, device, dtype, model, attention, tokenizer, prompts, system)


def inputs_of(args) -> list:
    """Every file a run reads: the prompts, the system prompt, the tokenizer, the checkpoint."""
    ckpt = [] if args.random_weights or not args.ckpt_dir.is_dir() else list(args.ckpt_dir.iterdir())
    return [PROMPTS_FILE, args.system_prompt_file, args.tokenizer, *ckpt]


def system_prompt(args) -> str | None:
    if args.system_prompt_file is None:
        return args.system_prompt
    try:
        return args.system_prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Could not read --system-prompt-file {args.system_prompt_file}: {e}") from e


def importable(module: str) -> bool:
    """Whether an optional package (flash_attn, triton) is installed and loads."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def choose_attention(name: str, device: torch.device, decode_kernel: str = "flash"):
    """`auto` takes flash-attn on CUDA when it imports, else the Triton kernel on CUDA, else the
    PyTorch reference. decode_kernel "triton" (llama3_paged.py) decodes through the Triton
    kernel beside flash-attn's prefill."""
    if name == "auto":
        name = ("torch" if device.type != "cuda" else "flash" if importable("flash_attn")
                else "triton" if importable("triton") else "torch")
    if decode_kernel == "triton" and name != "flash":
        raise UserError(f"--decode-kernel triton pairs the Triton decode kernel with flash-attn's "
                        f"prefill, and this run attends with --attn {name}: use --attn flash "
                        f"(with flash-attn installed), or drop --decode-kernel.")
    if name == "torch":
        return TorchAttention()
    if device.type != "cuda":
        raise UserError(f"--attn {name} needs a CUDA device; use --attn torch on the CPU.")
    if name == "triton":
        if not importable("triton"):
            raise UserError("--attn triton: Triton is not installed (it comes with PyTorch's CUDA "
                            "builds); use --attn torch.")
        from features.triton_attention import TritonAttention
        return TritonAttention()
    if not importable("flash_attn"):
        raise UserError("--attn flash: flash-attn is not installed. Install it after torch with "
                        "`pip install flash-attn --no-build-isolation`, or use --attn triton.")
    if decode_kernel == "triton":
        from features.triton_attention import TritonDecode
        return TritonDecode()
    return FlashAttention()


def kv_budget_bytes(setup) -> float:
    """The memory the KV cache may take, the same for every script: --kv-budget-gb if given. Else
    on CUDA --gpu-memory-utilization of the GPU's memory, less what is allocated (the weights),
    less the peak of the activations; on the CPU, whose memory is not the point, a small fixed
    budget, so that the naive cache runs out there as it does on a GPU."""
    if setup.args.kv_budget_gb:
        return setup.args.kv_budget_gb * GB
    if setup.device.type != "cuda":
        return CPU_KV_BUDGET_GB * GB
    total = torch.cuda.get_device_properties(setup.device).total_memory
    allowed = total * setup.args.gpu_memory_utilization
    weights = torch.cuda.memory_allocated(setup.device)
    budget = allowed - weights - activation_peak_bytes(setup)
    if budget <= 0:
        raise UserError(f"No GPU memory left for KV blocks: {allowed / GB:.1f} GB allowed, "
                        f"{weights / GB:.1f} GB taken by the weights. Raise "
                        f"--gpu-memory-utilization or use a smaller --model.", OUT_OF_MEMORY)
    return budget


def activation_peak_bytes(setup) -> int:
    """Measured, not guessed: run one full prefill chunk on a throwaway cache and read the peak.
    Decode needs less, apart from the logits of the whole batch, which are added."""
    model, seq_len = setup.model, min(PREFILL_CHUNK_TOKENS, setup.args.max_seq_len)
    total = (PREFILL_CHUNK_TOKENS // seq_len) * seq_len
    scratch = KVCache(model.args, num_blocks=1, block_size=PREFILL_CHUNK_TOKENS, dtype=setup.dtype,
                      device=setup.device, attention=setup.attention)  # total <= one chunk
    bounds = list(range(0, total + 1, seq_len))
    batch = PrefillBatch(slot_mapping=torch.arange(total, device=setup.device),
                         cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=setup.device),
                         cu_seqlens_host=bounds, max_seqlen=seq_len)
    tokens = torch.randint(model.args.vocab_size, (total,), device=setup.device)
    positions = torch.arange(total, device=setup.device) % seq_len
    torch.cuda.synchronize(setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device)
    with torch.inference_mode():
        model(tokens, positions, scratch, batch,
              logits_at=torch.tensor(bounds[1:], device=setup.device) - 1)
    prefill_peak = torch.cuda.max_memory_allocated(setup.device) - before
    decode_logits = setup.num_sequences * model.args.vocab_size * (setup.dtype.itemsize + 4)
    return max(prefill_peak, decode_logits + sampling_peak_bytes(setup))


def sampling_peak_bytes(setup) -> int:
    """Sampling's own memory (softmax, sort, sums), measured on one batch of rows."""
    if setup.args.temperature < GREEDY_BELOW:
        return 0  # greedy: an argmax
    sampler = make_sampler(setup.args)
    from features.sampling import ROWS_AT_ONCE
    rows = min(setup.num_sequences, ROWS_AT_ONCE)
    logits = torch.zeros(rows, setup.model.args.vocab_size, dtype=setup.dtype, device=setup.device)
    ids = torch.arange(rows, device=setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device)
    sampler(logits, ids, ids)
    return torch.cuda.max_memory_allocated(setup.device) - before


def kv_cache(setup, num_blocks: int, block_size: int) -> KVCache:
    """The pool of num_blocks blocks of block_size tokens, checked against what the kernel takes
    and what memory holds."""
    if setup.attention.name == "flash" and block_size % FLASH_BLOCK_MULTIPLE:
        raise UserError(
            f"KV blocks of {block_size} tokens (the paged script's --block-size; the naive "
            f"script's block is --max-seq-len long): flash-attn 2's paged kernel needs blocks "
            f"of a multiple of {FLASH_BLOCK_MULTIPLE} tokens. Use a multiple of "
            f"{FLASH_BLOCK_MULTIPLE}, or --attn triton or torch for any size.")
    per_token, slots = setup.kv_bytes_per_token, num_blocks * block_size + 1
    if setup.device.type == "cpu":
        check_host_memory(slots * per_token, "the KV cache",
                          "Ask for a smaller cache (--kv-budget-gb, --num-blocks).")
    try:
        return KVCache(setup.model.args, num_blocks, block_size, setup.dtype, setup.device,
                       setup.attention)
    except torch.OutOfMemoryError as e:
        free = torch.cuda.mem_get_info(setup.device)[0]
        raise UserError(
            f"Out of GPU memory allocating the KV cache: {num_blocks:,} blocks x "
            f"{block_size:,} tokens x {per_token // 1024} KiB per token = "
            f"{num_blocks * block_size * per_token / 1e9:.1f} GB needed, {free / 1e9:.1f} GB "
            f"free after the weights. Try fewer requests or a smaller cache.", OUT_OF_MEMORY) from e


def make_requests(setup) -> list[Request]:
    """One request per sequence: with --samples K, prompt i yields requests i*K .. i*K + K-1.
    With random weights text is nonsense: each stops where its ShareGPT reply stopped (after one
    token at least: the prefill always makes one)."""
    args, requests = setup.args, []
    arrivals = arrival_times(args, len(setup.prompts))
    for prompt, arrival in zip(setup.prompts, arrivals):
        reply = max(prompt.num_reply_tokens, 1) if args.random_weights else args.max_new_tokens
        new_tokens = min(reply, args.max_new_tokens, args.max_seq_len - len(prompt.prompt_tokens))
        requests += [Request(len(requests) + k, prompt.prompt_tokens, new_tokens,
                             arrival_time=float(arrival)) for k in range(args.samples)]
    return requests


def arrival_times(args, n: int) -> list[float]:
    """When each of n prompts arrives, in seconds from the start: all at once unless
    --request-rate."""
    if math.isinf(args.request_rate):
        return [0.0] * n
    from features.arrivals import poisson_arrival_times
    return poisson_arrival_times(n, args.request_rate, args.seed).tolist()


def make_sampler(args):
    if args.temperature < GREEDY_BELOW:
        return greedy
    from features.sampling import Sampler
    return Sampler(args.temperature, args.top_p, args.seed)


def make_scheduler(setup, cache, manager, requests: list[Request]) -> Scheduler:
    """Static batching, or with --continuous a stream with preemption, in mixed steps with
    --max-batched-tokens, swapping with --preemption swap."""
    scheduler = scheduler_for_flags(setup, cache, manager, requests)
    if hasattr(manager, "watch_queue"):  # features/mapping_ahead.py maps the next prompts' pages
        manager.watch_queue(scheduler.waiting)
    return scheduler


def scheduler_for_flags(setup, cache, manager, requests: list[Request]) -> Scheduler:
    args = setup.args
    if not args.continuous:
        return Scheduler(manager, requests)
    from features.continuous import ContinuousScheduler, RequestTooLarge
    try:
        if args.preemption == "swap":
            return swapping_scheduler(setup, cache, manager, requests)
        if args.max_batched_tokens:
            if hasattr(manager, "cached_tokens"):
                raise UserError("--max-batched-tokens does not combine with shared blocks yet "
                                "(--samples above 1, or a system prompt's prefix cache): add "
                                "--no-sharing, or drop --max-batched-tokens.")
            from features.mixed_steps import MixedScheduler
            return MixedScheduler(manager, requests, args.max_running, args.max_batched_tokens)
        return ContinuousScheduler(manager, requests, args.max_running, Engine.chunk_tokens)
    except RequestTooLarge as e:
        prompt = len(e.request.prompt_tokens)
        raise UserError(
            f"Request {e.request.row} can grow to {e.largest_tokens:,} tokens ({prompt:,} prompt + "
            f"{e.request.max_new_tokens:,} new), {e.blocks:,} blocks of {e.block_size:,}: more "
            f"than the whole pool of {e.num_blocks:,}, so it could never finish. Give the KV "
            f"cache more memory (--kv-budget-gb, --gpu-memory-utilization) or lower "
            f"--max-new-tokens.", OUT_OF_MEMORY) from e


def swapping_scheduler(setup, cache, manager, requests: list[Request]):
    """--preemption swap: a pool of host blocks of --swap-space, checked before it is made."""
    if not isinstance(cache, KVCache) or hasattr(manager, "cached_tokens"):
        raise UserError("--preemption swap copies a request's own blocks of the paged or naive "
                        "cache; it does not combine with shared blocks (--samples, a system "
                        "prompt's prefix cache: add --no-sharing) or llama3_virtual.py yet.")
    block_bytes = cache.block_size * setup.kv_bytes_per_token
    swap_blocks = int(setup.args.swap_space * GB // block_bytes)
    if swap_blocks == 0:
        raise UserError(f"--swap-space {setup.args.swap_space:g} GB holds no block of "
                        f"{format_bytes(block_bytes)}: raise it.")
    check_host_memory(swap_blocks * block_bytes, "--swap-space", "Lower --swap-space.")
    from features.swapping import SwappingScheduler
    return SwappingScheduler(manager, requests, setup.args.max_running, Engine.chunk_tokens, cache,
                             swap_blocks)


def make_decoder(setup, cache, manager, sampler, largest_batch: int, progress: bool):
    """CUDA graphs where they can run (CUDA, an attention that reads its lengths on the GPU),
    unless --eager; else the eager decoder. With a shared system prompt, attention may be a
    cascade (--cascade, the paged script's)."""
    if setup.args.compile:
        from features.compiled_layers import compile_layers
        compile_layers(setup.model, cache)
    cascade = None
    shared_prefix = getattr(manager, "prefix_cache", None) is not None  # a system prompt, cached
    if shared_prefix and getattr(setup.args, "cascade", "off") != "off":
        from features.cascade import cascade_for
        cascade = cascade_for(setup, cache, manager)  # before the graphs record attention
    eager = decoder = EagerDecoder(setup.model, cache, manager.block_table, sampler)
    if not (setup.args.eager or setup.device.type != "cuda" or not setup.attention.cuda_graphs):
        from features.cuda_graphs import GraphDecoder
        start = time.perf_counter()
        decoder = GraphDecoder(eager, largest_batch)
        if progress:
            print(f"Captured {len(decoder.buckets)} CUDA graphs of a decode step, batch 1 to "
                  f"{decoder.buckets[-1]}, in {time.perf_counter() - start:.1f} s")
    if cascade:
        from features.cascade import CascadeDecoder
        return CascadeDecoder(decoder, eager, cascade, manager.table)
    return decoder


def generate(setup, cache, manager, progress: bool = True):
    """Every request of the run through `cache`, with the parts the flags choose: what the
    scripts call."""
    args, requests = setup.args, make_requests(setup)
    sampler = make_sampler(args)
    scheduler = make_scheduler(setup, cache, manager, requests)
    largest_batch = min(len(requests), args.max_running or len(requests))
    decoder = make_decoder(setup, cache, manager, sampler, largest_batch, progress)
    stop_ids = set() if args.random_weights else setup.tokenizer.stop_ids
    engine = make_engine(setup, cache, manager, sampler, decoder)
    return engine.generate(scheduler, stop_ids, progress)


def make_engine(setup, cache, manager, sampler, decoder) -> Engine:
    """The core loop, or with --overlap (the default on CUDA) steps scheduled while the GPU runs
    the one before, where the run allows it."""
    overlap = setup.args.overlap
    if overlap is None:
        overlap = setup.device.type == "cuda"
    if not overlap:
        return Engine(setup.model, cache, manager, sampler, decoder)
    from features.overlap import OverlappedEngine, why_not_overlapped
    why_not = why_not_overlapped(setup.args, manager)  # the manager too: --find-max-batch's
    if setup.args.overlap:
        refuse_overlap(why_not)
    engine_class = Engine if why_not else OverlappedEngine
    return engine_class(setup.model, cache, manager, sampler, decoder)


def refuse_overlap(why_not: str | None) -> None:
    """An explicit --overlap that the run cannot have ends here, with the reason."""
    if why_not:
        raise UserError(f"--overlap does not combine with this run: {why_not}. Drop --overlap.")


def find_max_batch(setup, allocate_kv_cache) -> None:
    """--find-max-batch (plumbing/max_batch.py), loaded only when asked for."""
    from plumbing import max_batch
    max_batch.find_max_batch(setup, allocate_kv_cache)
