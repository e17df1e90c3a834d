"""Choosing the next token: greedy, or sampled with a temperature and top-p, reproducibly.

Sampling must not depend on who else is in the batch. A sequence forked from a shared prompt and
the same sequence run with its own copy of the prompt sit in different batches, and a preempted
one is recomputed in yet another; with the same --seed, each must draw the same tokens. So no
random-number generator advances step by step: the draw for the token at position p of sequence s
is a hash of (seed, s, p), computed on the device, inside the CUDA graphs, with no host sync.

One uniform number per row is enough: inverse-CDF sampling walks the cumulative probabilities to
the first token whose running total passes it.
"""

import torch

MASK_32 = 0xFFFFFFFF
ROWS_AT_ONCE = 512  # rows sampled together: the sort and sums take ~24 bytes per vocabulary entry


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Thomas Mueller's), in int64 so that the products (< 2^59) never
    overflow: each input bit flips about half of the output bits."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK_32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK_32
    return x ^ (x >> 16)


def uniform(seed, sequences: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A number in [0, 1) for each (sequence, position), the same on every device: [B] float32.
    seed: one int, or [B] int64, a seed per row (features/llm.py's requests each have theirs)."""
    seed32 = (seed ^ (seed >> 32)) & MASK_32
    start = torch.full_like(sequences, seed32) if isinstance(seed32, int) else seed32
    x = mix32(mix32(mix32(start) ^ sequences) ^ positions)
    return (x >> 8).float() / 2**24  # 24 bits: exactly representable in float32


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        self.temperature, self.top_p, self.seed = temperature, top_p, seed

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits, sequences, positions) -> torch.Tensor:
        """logits: [B, vocab]; sequences, positions: [B], the sequence each row belongs to and the
        position its next token will take. Returns [B] token ids."""
        if self.is_greedy:
            return logits.argmax(-1)
        return torch.cat([self._sample(logits[i:i + ROWS_AT_ONCE], sequences[i:i + ROWS_AT_ONCE],
                                       positions[i:i + ROWS_AT_ONCE])
                          for i in range(0, len(logits), ROWS_AT_ONCE)])

    def _sample(self, logits, sequences, positions) -> torch.Tensor:
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [B, vocab]
        order = None
        if self.top_p < 1:  # the nucleus: the most likely tokens until their mass reaches top_p
            probs, order = probs.sort(dim=-1, descending=True)
            mass_before = probs.cumsum(-1) - probs
            probs = probs.masked_fill(mass_before >= self.top_p, 0.0)  # the first always stays
        cumulative = probs.cumsum(-1)  # [B, vocab]
        # Scaled by the row's total, so that rounding in the sums cannot leave a draw past the end.
        target = uniform(self.seed, sequences, positions) * cumulative[:, -1]
        picked = torch.searchsorted(cumulative, target[:, None], right=True)  # first total > target
        picked = picked.clamp(max=logits.shape[-1] - 1)
        return (order.gather(-1, picked) if order is not None else picked)[:, 0]
