"""Llama 3 in plain PyTorch: the model every script shares.

The model knows nothing about how the KV cache is laid out. Each attention layer computes the
query and the new token's key and value, then hands all three to `kv_cache.attention(...)`: the
naive script passes a cache with one max-length block per request, the paged script one with a
shared pool of small blocks, the virtual script rows of virtual memory. That call is the only
place they differ.

Tokens arrive packed: a forward pass takes `[T]` token ids from any number of requests (a whole
prompt per request in prefill, one token per request in decode), never a padded `[batch, seq]`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
}


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


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) by its position's angle (Meta's layout).

    Seen as the complex number x[2i] + j*x[2i+1], the rotation is one multiplication by
    e^(j*angle): three kernels in all, where cos and sin terms written out take nine.
    x: [T, heads, head_dim]; rotations: [T, head_dim / 2] complex.
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, heads, head_dim / 2]
    return torch.view_as_real(pairs * rotations[:, None, :]).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch's fused kernel: one pass, where the formula written out takes eight kernels.
        # It sums the squares in float32; bf16's 8-bit mantissa is too coarse for that.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, dtype: torch.dtype):
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
        q, k = q_and_k.split([self.n_heads, self.n_kv_heads], dim=1)  # [T, n_heads | n_kv_heads, head_dim]
        # The cache stores k and v where this batch's tokens belong, then attends over everything
        # each request has cached so far. How it finds that memory is the whole lesson.
        out = kv_cache.attention(self.layer_index, q, k, v, batch)  # [T, n_heads, head_dim]
        return self.wo(out.reshape(T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        # Gate and up projections merged into one matmul, split after: SwiGLU = silu(gate) * up.
        self.w_gate_up = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False, dtype=dtype)
        self.w_down = nn.Linear(args.ffn_dim, args.dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # each [T, ffn_dim]
        return self.w_down(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attention = Attention(args, layer_index, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.feed_forward = FeedForward(args, dtype)

    def forward(self, h, rotations, kv_cache, batch) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), rotations, kv_cache, batch)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Build on the `meta` device and materialise with `checkpoints.py`: no weights are
    initialised twice, and an 8B model never passes through host memory as float32."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(args, i, dtype) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def set_max_positions(self, max_positions: int) -> None:
        """Precompute the rotation of every position a request can reach, e^(j*angle):
        [max_positions, head_dim/2] complex."""
        device = self.tok_embeddings.weight.device
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                             rope_frequencies(self.args))
        self.rope_rotations = torch.polar(torch.ones_like(angles), angles).to(device)

    def forward(self, tokens, positions, kv_cache, batch, logits_at=None) -> torch.Tensor:
        """tokens, positions: [T]. Returns logits [T, vocab], or only at rows `logits_at`:
        prefill needs each prompt's last row, and all T rows of a 128K vocabulary would not fit."""
        rotations = self.rope_rotations[positions]  # [T, head_dim / 2] complex
        h = self.tok_embeddings(tokens)  # [T, dim]
        for layer in self.layers:
            h = layer(h, rotations, kv_cache, batch)
        if logits_at is not None:
            h = h[logits_at]
        return self.output(self.norm(h))  # [T or len(logits_at), vocab]
