"""Load Llama 3 weights in Meta's or Hugging Face's layout, or make random ones with the real shapes.

Both layouts become the same model: Hugging Face permutes the rows of wq and wk so that RoPE can
rotate the two halves of each head; we undo that and rotate adjacent pairs, as Meta's code does.
Every tensor goes straight from the file (memory-mapped) to the target device and dtype.
"""

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from plumbing.cli import OUT_OF_MEMORY, UserError, check_host_memory
from core.model import PRESETS, Llama, ModelArgs, RopeScaling

DOWNLOAD_HINT = (
    "Download Meta's checkpoint with\n"
    "  huggingface-cli download meta-llama/Meta-Llama-3-8B-Instruct --include \"original/*\" "
    "--local-dir Meta-Llama-3-8B-Instruct\n"
    "and pass --ckpt-dir Meta-Llama-3-8B-Instruct/original, point --ckpt-dir at a Hugging Face "
    "folder (config.json + *.safetensors), or run with --random-weights.")


def build_model(args: ModelArgs, device, dtype, max_positions: int) -> Llama:
    """An uninitialised model on `device`: parameters allocated once, never filled twice."""
    with torch.device("meta"):
        model = Llama(args, dtype)
    weights = sum(p.nbytes for p in model.parameters())  # tied weights counted once
    rope_table = max_positions * args.head_dim * 8  # complex64 per pair, float32 scratch as much
    advice = "Use a smaller --model or --dtype bf16, or a GPU."
    if torch.device(device).type == "cpu":
        check_host_memory(weights + rope_table, "the model's weights", advice)
    try:
        model.to_empty(device=device)
    except torch.OutOfMemoryError as e:
        free = torch.cuda.mem_get_info(device)[0]
        raise UserError(f"Out of GPU memory: the model's weights need {weights / 1e9:.1f} GB, "
                        f"{free / 1e9:.1f} GB are free. {advice}", OUT_OF_MEMORY) from e
    if args.tie_embeddings:  # to_empty gives every module its own tensor: tie them again
        model.output.weight = model.tok_embeddings.weight
    model.set_max_positions(max_positions)
    return model.eval().requires_grad_(False)


def random_model(preset: str, device, dtype, max_positions: int, seed: int = 0) -> Llama:
    """Random weights with the preset's shapes, drawn on the device in the target dtype.

    Each matrix has std 1/sqrt(fan_in), so every projection keeps unit-scale activations and the
    residual stream grows only with the square root of the depth: finite in bf16 at 32 layers.
    """
    args = PRESETS[preset]
    model = build_model(args, device, dtype, max_positions)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name == "tok_embeddings.weight":
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
    return model


def load_model(ckpt_dir: Path, device, dtype, max_positions: int) -> Llama:
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "params.json").exists():
        return _load_meta(ckpt_dir, device, dtype, max_positions)
    if (ckpt_dir / "config.json").exists():
        return _load_hugging_face(ckpt_dir, device, dtype, max_positions)
    raise UserError(
        f"No Llama 3 checkpoint in {ckpt_dir}: expected Meta's layout (params.json, "
        f"consolidated.00.pth, tokenizer.model) or Hugging Face's (config.json, *.safetensors).\n"
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


def _load_meta(ckpt_dir: Path, device, dtype, max_positions: int) -> Llama:
    shard = ckpt_dir / "consolidated.00.pth"
    if not shard.exists():
        raise UserError(f"{ckpt_dir} has params.json but no consolidated.00.pth.\n" + DOWNLOAD_HINT)
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
    model = build_model(args, device, dtype, max_positions)
    _fill(model, tensor_names(args, "meta"), state.__getitem__, state.keys(), shard)
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


def _load_hugging_face(ckpt_dir: Path, device, dtype, max_positions: int) -> Llama:
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
    model = build_model(args, device, dtype, max_positions)
    names = tensor_names(args, "hf")
    seen = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = set(f.keys())
                seen |= keys
                get = lambda name, f=f: _unpermute_rope_rows(name, f.get_tensor(name), args)
                _fill(model, {k: v for k, v in names.items() if k in keys}, get, keys, file)
        except (SafetensorError, OSError) as e:
            raise UserError(f"{file} is not a readable safetensors file (truncated or damaged?): "
                            f"{e}") from e
    missing = sorted(set(names) - seen)
    if missing:
        raise UserError(f"{ckpt_dir} is missing {len(missing)} tensors, e.g. {missing[:3]}.")
    return model


# Each tensor's name in Meta's and Hugging Face's checkpoints -> (our parameter, which part of it:
# 0, 1, 2 for q, k, v of the merged wqkv, or gate, up of the merged w_gate_up).
TOP_TENSORS = [  # (ours, Meta's, Hugging Face's)
    ("tok_embeddings.weight", "tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "norm.weight", "model.norm.weight"),
    ("output.weight", "output.weight", "lm_head.weight"),
]
LAYER_TENSORS = [  # (ours, part, Meta's, Hugging Face's), under layers.{i}. / model.layers.{i}.
    ("attention.wqkv.weight", 0, "attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wqkv.weight", 1, "attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wqkv.weight", 2, "attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", 0, "attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w_gate_up.weight", 0, "feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w_gate_up.weight", 1, "feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w_down.weight", 0, "feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("attention_norm.weight", 0, "attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", 0, "ffn_norm.weight", "post_attention_layernorm.weight"),
]


def tensor_names(args: ModelArgs, layout: str) -> dict[str, tuple[str, int]]:
    """The checkpoint's tensor names in `layout` ("meta" or "hf") -> (our parameter, part)."""
    column = 1 if layout == "meta" else 2
    names = {row[column]: (row[0], 0) for row in TOP_TENSORS
             if not (args.tie_embeddings and row[0] == "output.weight")}
    prefix = "layers.{}." if layout == "meta" else "model.layers.{}."
    for i in range(args.n_layers):
        for ours, part, meta, hf in LAYER_TENSORS:
            names[prefix.format(i) + (meta if layout == "meta" else hf)] = (f"layers.{i}.{ours}", part)
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

def _fill(model: Llama, names: dict, get_tensor, keys, source: Path) -> None:
    """Copy each checkpoint tensor into its parameter (or its rows of a merged one)."""
    missing = sorted(set(names) - set(keys))
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensors, e.g. {missing[:3]}; "
                        f"is it a Llama 3 checkpoint?\n" + DOWNLOAD_HINT)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (ours, part) in names.items():
        tensor = get_tensor(name)
        if not isinstance(tensor, torch.Tensor):
            raise UserError(f"{source}: {name} is a {type(tensor).__name__}, not a tensor.")
        target = params[ours]
        if ours.endswith("wqkv.weight"):
            a = model.args
            sizes = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
            target = target.split(sizes)[part]
        elif ours.endswith("w_gate_up.weight"):
            target = target.chunk(2)[part]
        if target.shape != tensor.shape:
            raise UserError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config implies "
                            f"{tuple(target.shape)}. The checkpoint and its config disagree.")
        target.copy_(tensor)  # casts to the model's dtype on the way


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
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
