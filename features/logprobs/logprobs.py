"""Log-probabilities: how likely the model found each token, as vLLM returns them.

A request may ask for its generated tokens' log-probabilities (`logprobs=k`: the chosen token's,
its rank, and the k likeliest tokens') and its prompt's (`prompt_logprobs=k`: each prompt token's
given the tokens before it; the first has none). They come from the logits before temperature,
top-k or top-p, as vLLM's default (`logprobs_mode="raw_logprobs"`): what the model says, not what
the sampler drew from. lm-evaluation-harness scores multiple-choice tasks by them: the summed
log-probability of each answer's tokens after the question.

More in docs/engine-notes.md.
"""

import dataclasses

import numpy as np
import torch

from engine.model_runner import SamplingDecoder

ROWS_AT_ONCE = 512  # rows whose float32 logits are held at once: 4 bytes per vocabulary entry


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [B, vocab]; tokens: [B], each row's chosen (or next prompt) token. Returns
    [B, 3 + 2k] float32, a row: the token, its log-probability, its rank (1: the likeliest),
    then the k likeliest tokens' log-probabilities, then their ids (exact in float32 below 2^24)."""
    return torch.cat([_token_logprobs(logits[i:i + ROWS_AT_ONCE], tokens[i:i + ROWS_AT_ONCE], k)
                      for i in range(0, len(logits), ROWS_AT_ONCE)])


def _token_logprobs(logits, tokens, k) -> torch.Tensor:
    if logits.is_cuda:  # one read of the logits (kernel.py), not four passes
        from features.logprobs.kernel import row_stats
        total, chosen, rank = row_stats(logits, tokens).split(1, dim=-1)  # [B, 1] each
    else:
        floats = logits.float()  # the sums in float32, whatever the model's dtype
        total = torch.logsumexp(floats, dim=-1, keepdim=True)  # [B, 1]: log of the softmax's sum
        chosen_logit = floats.gather(-1, tokens[:, None])  # [B, 1]
        chosen = chosen_logit - total
        rank = ((floats > chosen_logit).sum(-1, keepdim=True) + 1).float()  # ties: the better
    top = logits.topk(k, dim=-1)  # [B, k] each, likeliest first (exact in the logits' dtype)
    return torch.cat([tokens[:, None].float(), chosen, rank, top.values.float() - total,
                      top.indices.float()], dim=-1)


class LogprobDecoder(SamplingDecoder):
    """The engine's decode step, returning [B, 3 + 2 max_logprobs] (`token_logprobs`) instead
    of [B] tokens: what the step's rows that ask for log-probabilities run, eagerly or as a
    CUDA graph (features/cuda_graphs.py records it as it records the plain step)."""

    def __init__(self, model, cache, block_table, sampler, max_logprobs: int):
        super().__init__(model, cache, block_table, sampler)
        self.max_logprobs = max_logprobs

    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        logits = self.logits(tokens, positions, rows, slots, max_cache_seqlen)  # [B, vocab]
        chosen = self.sampler(logits, rows, positions + 1)  # [B]
        return token_logprobs(logits, chosen, self.max_logprobs)


class Logprobs:
    """Which rows ask for log-probabilities, and how many top ones: of their generated tokens
    (`k`) and of their prompts (`prompt_k`); -1 for none. Kept on the host, read as a step is
    launched. `eager`, `graphs`: the decode step that gives them (`LogprobDecoder`, and CUDA
    graphs of it where the engine decodes with graphs). A script's run asks on every row
    (`every_row`: tools/bench.py --logprobs)."""

    def __init__(self, num_rows: int, eager: LogprobDecoder, graphs=None, every_row: int = -1):
        self.eager, self.graphs, self.max_logprobs = eager, graphs, eager.max_logprobs
        self.k = np.full(num_rows, every_row, dtype=np.int64)
        self.prompt_k = np.full(num_rows, -1, dtype=np.int64)

    def set_row(self, row: int, k: int | None, prompt_k: int | None) -> None:
        self.k[row] = -1 if k is None else k
        self.prompt_k[row] = -1 if prompt_k is None else prompt_k

    def release(self, row: int) -> None:
        self.k[row] = self.prompt_k[row] = -1

    def any(self, rows) -> bool:
        return bool((self.k[rows] >= 0).any())

    def any_prompt(self, rows) -> bool:
        return bool((self.prompt_k[rows] >= 0).any())

    def of(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`token_logprobs` with this engine's top k: [B, vocab], [B] -> [B, 3 + 2 max_logprobs]."""
        return token_logprobs(logits, tokens, self.max_logprobs)


@dataclasses.dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank among the vocabulary (1: the likeliest), and
    its text."""

    logprob: float
    rank: int
    decoded_token: str


def as_vllm_logprobs(row: np.ndarray, k: int, tokenizer) -> dict[int, Logprob]:
    """One row of `token_logprobs`, on the host, as vLLM gives a token's: token id -> Logprob,
    the chosen token first, then the k likeliest (the chosen one among them only once)."""
    ranked = [(int(row[0]), float(row[1]), int(row[2]))]
    ranked += [(i, v, r) for r, (i, v) in enumerate(top_of(row, k), start=1)]
    out = {}
    for i, logprob, rank in ranked:
        if i not in out:
            out[i] = Logprob(logprob, rank, tokenizer.decode([i]))
    return out


def top_of(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k likeliest tokens of a `token_logprobs` row: (id, log-probability), likeliest first."""
    width = (len(row) - 3) // 2
    return [(int(i), float(v)) for i, v in zip(row[3 + width:3 + width + k], row[3:3 + k])]
