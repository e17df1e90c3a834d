"""Choosing the next token: greedy, or sampled with a temperature and top-p, reproducibly.

Sampling must not depend on who else is in the batch. A sequence forked from a shared prompt and
the same sequence run with its own copy of the prompt sit in different batches, and a preempted
one is recomputed in yet another; with the same --seed, each must draw the same tokens. So no
random-number generator advances step by step: the draw for the token at position p of sequence s
is a hash of (seed, s, p), computed on the device, inside the CUDA graphs, with no host sync.

One uniform number per row is enough: inverse-CDF sampling walks the cumulative probabilities to
the first token whose running total passes it.

More in docs/engine-notes.md.
"""

import dataclasses

import numpy as np
import torch

from block_manager import to_device
from engine.model_runner import greedy

MASK_32 = 0xFFFFFFFF
ROWS_AT_ONCE = 512  # rows sampled together: the sort and sums take ~24 bytes per vocabulary entry
GREEDY_BELOW = 1e-5  # a temperature below this is greedy: logits / T would overflow, or make a
                     # softmax as one-hot as the argmax for any two logits 0.001 apart


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Thomas Mueller's), in int64 so that the products (< 2^59) never
    overflow: each input bit flips about half of the output bits."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK_32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK_32
    return x ^ (x >> 16)


def uniform(seed, sequences: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A number in [0, 1) for each (sequence, position), the same on every device: [B] float32.
    seed: one int, or [B] int64, a seed per row (a served engine's requests each have theirs)."""
    seed32 = (seed ^ (seed >> 32)) & MASK_32
    start = torch.full_like(sequences, seed32) if isinstance(seed32, int) else seed32
    x = mix32(mix32(mix32(start) ^ sequences) ^ positions)
    return (x >> 8).float() / 2**24  # 24 bits: exactly representable in float32


def draw(logits, temperature, top_p, top_k, seed, sequences, positions,
         narrows: bool = True) -> torch.Tensor:
    """Each row's token, sampled: logits [B, vocab]; temperature, top_p: [B] float; top_k: [B]
    long (0: every token); seed: an int or [B] long; sequences, positions: [B], the sequence a row
    belongs to and the position its token takes. Returns [B] token ids. narrows: whether a row
    may keep fewer than every token. Then the likeliest tokens come first: top-k keeps k of
    them, top-p (over what top-k left, as vLLM) those whose mass before them is below p; the
    row's uniform number picks by the running total of what is kept. Without narrowing nothing
    is sorted (on the CPU the sort costs twenty times the rest), so the same number picks
    another token: a caller chooses `narrows` for a whole run, never by the batch."""
    probs = torch.softmax(logits.float() / temperature.clamp(min=GREEDY_BELOW)[:, None], dim=-1)
    order = None
    if narrows:
        probs, order = probs.sort(dim=-1, descending=True)  # [B, vocab], likeliest first
        k = top_k[:, None]
        probs = probs.masked_fill((k > 0) & (torch.arange(probs.shape[-1], device=k.device) >= k),
                                  0)
        # Running totals, not a row sum: on CUDA a sum's order of additions depends on how many
        # rows there are, and a row's draw must not depend on the rows beside it (a scan's not).
        cumulative = probs.cumsum(-1)  # [B, vocab]
        mass_before = cumulative - probs  # top-p of what top-k kept: its total, the last entry
        probs = probs.masked_fill(mass_before >= top_p[:, None] * cumulative[:, -1:], 0.0)
    cumulative = probs.cumsum(-1)  # [B, vocab]; the likeliest token always stays
    # Scaled by the row's total, so that rounding in the sums cannot leave a draw past the end
    target = uniform(seed, sequences, positions) * cumulative[:, -1]
    picked = torch.searchsorted(cumulative, target[:, None], right=True)  # first total > target
    picked = picked.clamp(max=probs.shape[-1] - 1)
    return (picked if order is None else order.gather(-1, picked))[:, 0]


def make_sampler(args):
    """The scripts' sampler: --temperature, --top-p and --seed."""
    return sampler(args.temperature, args.top_p, args.seed)


def sampler(temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
    """One sampler for every row, (logits [B, vocab], sequences [B], positions [B]) -> [B] token
    ids: greedy, or drawn ROWS_AT_ONCE rows at a time (a static batch may hold thousands)."""
    if temperature < GREEDY_BELOW:
        return greedy

    def sample(logits, sequences, positions) -> torch.Tensor:
        drawn = []
        for start in range(0, len(logits), ROWS_AT_ONCE):
            rows = slice(start, start + ROWS_AT_ONCE)
            part = logits[rows]  # [at most ROWS_AT_ONCE, vocab]
            each = lambda value, dtype=torch.float32: torch.full(  # a fill: graph-safe
                (len(part),), value, dtype=dtype, device=part.device)
            drawn.append(draw(part, each(temperature), each(top_p), each(0, torch.long), seed,
                              sequences[rows], positions[rows], narrows=top_p < 1))
        return torch.cat(drawn)
    return sample


def is_whole_number(value) -> bool:
    """An int (numpy's too), and not a bool, which Python counts as one."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real_number(value) -> bool:
    """An int or a float (numpy's too), not a bool, not a text such as "0.5"."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """vLLM's names and defaults: temperature 1 samples; temperature 0 is greedy."""

    max_tokens: int | None = 16  # None: as many as the context has room for (vLLM's None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): every token
    n: int = 1
    stop: list[str] = dataclasses.field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # end there, as at EOS
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    logprobs: int | None = None  # the generated tokens' log-probabilities, with the top k
    prompt_logprobs: int | None = None  # the prompt's, with the top k (features/logprobs/)
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens only; -1: the context's
    # vLLM's logits processors (RowProcessing), applied before temperature, greedy rows too
    presence_penalty: float = 0.0  # subtracted once from a token generated before
    frequency_penalty: float = 0.0  # subtracted for each time a token was generated before
    repetition_penalty: float = 1.0  # a token of the prompt or the answer: logit / p if > 0, else * p
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (sampling only)
    min_tokens: int = 0  # no end of text or stop token before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 to 100)
    skip_special_tokens: bool = True  # the text leaves out control tokens (the token ids keep them)
    # vLLM's fields this engine does not implement, at the defaults that ask for nothing: any
    # other value is refused by name (check), not taken and silently ignored
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        """Checked as made, as vLLM's are: a wrong value fails here, naming its field, not deep
        in the engine."""
        if self.stop is None or isinstance(self.stop, str):  # "" is refused, as the server does
            self.stop = [] if self.stop is None else [self.stop]
        self.check()

    def check(self) -> None:
        """A ValueError naming the first parameter of the wrong kind or out of range (serve.py
        answers it with 400)."""
        stop = self.stop
        for name, ok in [("max_tokens", self.max_tokens is None
                          or is_whole_number(self.max_tokens) and self.max_tokens >= 1),
                         ("n", is_whole_number(self.n) and self.n >= 1),
                         ("temperature", is_real_number(self.temperature)
                          and 0 <= self.temperature <= 100),
                         ("top_p", is_real_number(self.top_p) and 0 < self.top_p <= 1),
                         ("top_k", is_whole_number(self.top_k) and -1 <= self.top_k < 2**63),
                         ("seed", self.seed is None
                          or is_whole_number(self.seed) and 0 <= self.seed < 2**63),
                         ("stop", isinstance(stop, list) and all(isinstance(s, str) and s
                                                                 for s in stop)),
                         ("ignore_eos", isinstance(self.ignore_eos, bool)),
                         ("stop_token_ids", isinstance(self.stop_token_ids, list) and all(
                             is_whole_number(t) and 0 <= t < 2**63 for t in self.stop_token_ids)),
                         ("include_stop_str_in_output",
                          isinstance(self.include_stop_str_in_output, bool)),
                         *[(name, k is None or is_whole_number(k) and 0 <= k < 2**31) for name, k
                           in (("logprobs", self.logprobs),
                               ("prompt_logprobs", self.prompt_logprobs))],
                         ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1) or
                          is_whole_number(self.truncate_prompt_tokens)
                          and 1 <= self.truncate_prompt_tokens < 2**63),
                         *[(name, is_real_number(v) and -2 <= v <= 2) for name, v in
                           (("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty))],
                         ("repetition_penalty", is_real_number(self.repetition_penalty)
                          and 0 < self.repetition_penalty <= 100),
                         ("min_p", is_real_number(self.min_p) and 0 <= self.min_p <= 1),
                         ("min_tokens", is_whole_number(self.min_tokens) and 0 <= self.min_tokens
                          and (not is_whole_number(self.max_tokens)  # said by max_tokens
                               or self.min_tokens <= self.max_tokens)),
                         ("logit_bias", self.logit_bias is None or isinstance(self.logit_bias, dict)
                          and all(is_whole_number(t) and 0 <= t < 2**63 and is_real_number(b)
                                  and -100 <= b <= 100 for t, b in self.logit_bias.items())),
                         ("skip_special_tokens", isinstance(self.skip_special_tokens, bool))]:
            if not ok:
                raise ValueError(f"SamplingParams {name} = {getattr(self, name)!r} is of the "
                                 f"wrong kind or out of range")
        for name, default in NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value != default and not (default is None and value in ([], {})):  # none asked
                raise ValueError(f"SamplingParams {name} = {value!r}: not implemented by this "
                                 f"engine yet; leave it at {default!r}")


# SamplingParams' fields this engine does not implement yet -> the default that asks for nothing,
# as the class declares it (serve.py refuses the same fields of a request)
NOT_IMPLEMENTED = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                   if f.name in ("allowed_token_ids", "bad_words", "spaces_between_special_tokens")}


def processes_logits(params: SamplingParams) -> bool:
    """Whether a request asks for any of vLLM's logits processors (RowProcessing's)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.min_p
                or params.repetition_penalty != 1 or params.min_tokens or params.logit_bias)


class TokenValues:
    """Each row's few (token id, value) pairs, on the device, added to its logits in one
    scatter: [rows, width], the unused ones pointing at a column past the vocabulary. The width
    grows to the most pairs one row has had."""

    def __init__(self, num_rows: int, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.ids = torch.full((num_rows, 0), vocab_size, dtype=torch.long, device=device)
        self.values = torch.zeros(num_rows, 0, device=device)

    def set_row(self, row: int, pairs: dict) -> None:
        if len(pairs) > self.ids.shape[1]:
            grow = len(pairs) - self.ids.shape[1]
            self.ids = torch.nn.functional.pad(self.ids, (0, grow), value=self.vocab_size)
            self.values = torch.nn.functional.pad(self.values, (0, grow))
        ids = np.full(self.ids.shape[1], self.vocab_size)
        values = np.zeros(self.ids.shape[1])
        ids[:len(pairs)], values[:len(pairs)] = list(pairs), list(pairs.values())
        self.ids[row] = to_device(ids, self.ids.device, torch.long)
        self.values[row] = to_device(values, self.ids.device, torch.float32)

    def add_to(self, logits: torch.Tensor, rows, when: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, vocab] float32 plus the rows' values ([B] `when`: only in those rows)."""
        values = self.values[rows] if when is None else torch.where(
            when[:, None], self.values[rows], 0.0)
        padded = torch.nn.functional.pad(logits, (0, 1))  # [B, vocab + 1]: the unused pairs' column
        return padded.scatter_add(1, self.ids[rows], values)[:, :-1]


class RowProcessing:
    """vLLM's logits processors, each row its own request's, in vLLM's sampler's order:
    logit_bias and min_tokens (no stop token yet), the repetition, frequency and presence
    penalties (greedy rows too), then min_p (sampling rows only). A row that asks for none is
    left as it was: its penalties are 0 and 1, exactly.

    The penalties count the tokens of each row so far. They live on the device, written as each
    token is drawn (`record`), since with overlapped steps the host learns a token only after the
    next step has been launched: `history[row, p]` is token p, `known[row]` how many are there.
    A mixed step's prompt computed only in part draws a token it throws away, and so does a
    recomputed request's (after preemption); a token is kept only where its position is the next
    unknown one."""

    def __init__(self, num_rows: int, vocab_size: int, context: int, device):
        self.asks = np.zeros(num_rows, dtype=bool)  # on the host: the rows in use that ask
        row_of = lambda value: torch.full((num_rows,), value, dtype=torch.float32, device=device)
        self.presence, self.frequency, self.repetition = row_of(0.0), row_of(0.0), row_of(1.0)
        self.min_p_below = row_of(-float("inf"))  # T ln(min_p): see __call__
        self.min_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.prompt_length = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.known = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.shape = (num_rows, context)
        self.history = None  # [rows, context] int32, made for the first row that asks
        self.bias = TokenValues(num_rows, vocab_size, device)
        self.early_stops = TokenValues(num_rows, vocab_size, device)  # -inf until min_tokens

    def set_row(self, row: int, params: SamplingParams, prompt: list[int], stop_ids) -> None:
        """stop_ids: the tokens min_tokens holds back (end of text, unless ignore_eos, and the
        request's stop_token_ids), as vLLM's min-tokens processor does. A row that asks for
        nothing is set too, to values that change nothing, once any row has asked: it may sit
        in a step beside one that does, where the row's last request's values would apply."""
        self.asks[row] = processes_logits(params)
        if not self.asks[row] and self.history is None:
            return  # no row has asked yet: every row's values change nothing
        device = self.known.device
        if self.history is None:
            self.history = torch.zeros(self.shape, dtype=torch.int32, device=device)
        samples_min_p = params.min_p > 0 and params.temperature > 0
        min_p_below = params.temperature * np.log(params.min_p) if samples_min_p else -np.inf
        self.presence[row], self.frequency[row], self.repetition[row], self.min_p_below[row] = (
            to_device(np.array([params.presence_penalty, params.frequency_penalty,
                                params.repetition_penalty, min_p_below]), device, torch.float32))
        self.min_tokens[row], self.prompt_length[row], self.known[row] = to_device(
            np.array([params.min_tokens, len(prompt), len(prompt)]), device, torch.long)
        self.history[row, :len(prompt)] = to_device(np.array(prompt), device, torch.int32)
        self.bias.set_row(row, params.logit_bias or {})
        self.early_stops.set_row(row, dict.fromkeys(stop_ids, -float("inf")))

    def release(self, row: int) -> None:
        self.asks[row] = False  # its values stay until the row's next request sets its own

    def __call__(self, logits, rows, positions) -> torch.Tensor:
        """logits [B, vocab] -> float32 [B, vocab], processed; positions [B]: the next token's."""
        logits = self.bias.add_to(logits.float(), rows)
        generated = positions - self.prompt_length[rows]  # [B]: tokens of the answer so far
        logits = self.early_stops.add_to(logits, rows, when=generated < self.min_tokens[rows])
        history = self.history[rows].long()  # [B, context]
        at = torch.arange(history.shape[1], device=history.device)
        so_far = at < positions[:, None]  # [B, context]
        in_answer = so_far & (at >= self.prompt_length[rows][:, None])
        vocab = logits.shape[-1]
        counts = torch.zeros(len(logits), vocab + 1, device=logits.device).scatter_add_(
            1, torch.where(in_answer, history, vocab), in_answer.float())[:, :-1]  # [B, vocab]
        seen = torch.zeros(len(logits), vocab + 1, dtype=torch.bool, device=logits.device)
        seen = seen.scatter_(1, torch.where(so_far, history, vocab), True)[:, :-1]
        penalty = torch.where(seen, self.repetition[rows][:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = (logits - self.frequency[rows][:, None] * counts
                  - self.presence[rows][:, None] * (counts > 0))
        # min_p after temperature T keeps p >= min_p p_max, that is exp((l - l_max) / T) >=
        # min_p: the logits l >= l_max + T ln(min_p), a bound in the logits themselves
        below = logits.max(-1, keepdim=True).values + self.min_p_below[rows][:, None]
        return logits.masked_fill(logits < below, -float("inf"))

    def record(self, rows, positions, tokens) -> None:
        """Keep each row's drawn token where it is the next unknown one (see the class)."""
        at = positions.clamp(max=self.history.shape[1] - 1)
        keeps = positions == self.known[rows]
        self.history[rows, at] = torch.where(keeps, tokens.int(), self.history[rows, at])
        self.known[rows] += keeps


class RowSampler:
    """Each row of the block table samples with its own request's parameters. A draw depends on
    (seed, sample index, position) only, never on the row or the batch: a request gives the
    same tokens whoever runs beside it."""

    def __init__(self, num_rows: int, device, vocab_size: int, context: int):
        self.temperature = torch.zeros(num_rows, device=device)
        self.top_p = torch.ones(num_rows, device=device)
        self.top_k = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.seed = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.sample = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.samples = np.zeros(num_rows, dtype=bool)  # on the host: which rows in use sample
        self.processing = RowProcessing(num_rows, vocab_size, context, device)

    def set_row(self, row: int, params: SamplingParams, sample: int, seed: int,
                prompt: list[int], stop_ids) -> None:
        # From pinned memory (to_device), queued behind the step in flight: a Python number
        # written into a GPU tensor is a copy the host waits for, and it waits for that step to
        # end first, stalling the overlapped steps.
        device = self.temperature.device
        self.temperature[row], self.top_p[row] = to_device(
            np.array([params.temperature, params.top_p]), device, torch.float32)
        self.top_k[row], self.seed[row], self.sample[row] = to_device(
            np.array([max(params.top_k, 0), seed, sample]), device, torch.long)
        self.samples[row] = params.temperature > 0
        self.processing.set_row(row, params, prompt, stop_ids)

    def release(self, row: int) -> None:
        self.samples[row] = False
        self.processing.release(row)

    def runs_eagerly(self, rows) -> bool:
        """Whether the step's rows need more than the argmax a greedy CUDA graph records."""
        return bool(self.samples[rows].any() or self.processing.asks[rows].any())

    def __call__(self, logits, rows, positions) -> torch.Tensor:
        """logits: [B, vocab]; rows, positions: [B] -> [B] token ids. Asked on the host, of every
        row in use, not of these rows (on the device: a sync): all greedy, or greedy rows kept
        by torch.where below; none processed, or unasking rows left as they were."""
        processes = self.processing.asks.any()
        if processes:
            logits = self.processing(logits, rows, positions)
        tokens = self._draw(logits, rows, positions) if self.samples.any() else logits.argmax(-1)
        if processes:
            self.processing.record(rows, positions, tokens)
        return tokens

    def _draw(self, logits, rows, positions) -> torch.Tensor:
        """Sampling rows drawn, greedy rows (temperature 0) their argmax. Every row is drawn
        sorted (narrows), whatever its top-p and top-k: the rows beside it must not decide."""
        temperature = self.temperature[rows]
        drawn = draw(logits, temperature, self.top_p[rows], self.top_k[rows], self.seed[rows],
                     self.sample[rows], positions)
        return torch.where(temperature > 0, drawn, logits.argmax(-1))
