"""A Python API over the engine, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`.

    from features.llm import LLM, SamplingParams
    llm = LLM(model="tiny", random_weights=True, device="cpu")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16, temperature=0))

`LLMEngine` is the incremental form that serve.py drives from its engine process: `add_request`,
`step`, `abort`. Both build their engine with features/run.py's parts, from the same flags the
scripts take, so a served request runs through the same continuous batching, CUDA graphs and
cache as `llama3_paged.py N --continuous`.

What serving adds to the scripts' runs:
- Rows come back. A script's request r owns row r of the block table for the whole run; a server
  sees requests without end. Here a request takes a free row when it is added and gives it back
  when it finishes or is aborted, as its blocks go back to the free list.
- A request's n samples (and any requests with the same prompt) share the prompt's blocks in the
  paged cache: the samples after the first fork (features/sharing.py), as `--samples` does.
- Each request samples with its own parameters (`RowSampler`), and ends at its own stop strings,
  at end-of-text unless `ignore_eos`, or at `max_tokens`. The first two are checked here, on the
  host, between steps. On CUDA steps overlap (features/overlap.py) as in the scripts' runs: the
  next step is in flight when a request is found to end, so the engine lets it go (`let_go`)
  and throws away the token that step draws for it, as it does for a stop token.
"""

import argparse
import dataclasses
import itertools
import random
import time
from collections import deque

import numpy as np
import torch
from tqdm import tqdm

import llama3_naive
import llama3_paged
import llama3_virtual
from block_manager import to_device
from features import run as features
from features.cached_prefix import SamplingDecoder, greedy
from features.compiled_layers import warm_up_prompts
from features.continuous import RequestTooLarge
from features.request_state import ServedRequest, Status
from features.sampling import uniform
from features.timed_engine import StepTimer
from plumbing.cli import UserError, chat_messages, torchrun_process

SCRIPTS = {"naive": llama3_naive, "paged": llama3_paged, "virtual": llama3_virtual}  # by cache


def parse_script_arguments(cache: str, argv: list[str], raise_errors: bool = False):
    """argv parsed as `python llama3_<cache>.py argv` would parse it (features included).
    raise_errors: a bad flag raises UserError (the Python API's callers), rather than printing
    the usage and exiting 2 (a command line's)."""
    name = f"llama3_{cache}.py"
    add_pool_arguments = (llama3_virtual.add_layout_arguments if cache == "virtual"
                          else features.SCRIPTS[name][1])
    parser = features.argument_parser_with_features(name, SCRIPTS[cache].__doc__,
                                                    add_pool_arguments)
    if raise_errors:
        def error(message: str):
            raise UserError(f"{message} (the engine's keywords are {name}'s flags, '_' for "
                            f"'-': python {name} --help lists them)")
        parser.error = error
    return parser.parse_args(argv)


def allocate_kv_cache(cache: str, run):
    """The script's KV cache and block manager, as its command line with features makes them."""
    if cache == "virtual":
        return llama3_virtual.allocate_kv_cache(run)
    if cache == "paged":  # a request's n samples share their prompt's blocks, as --samples's do
        return features.allocate_paged(run, samples=True)
    return features.SCRIPTS[f"llama3_{cache}.py"][2](run)


def is_whole_number(value) -> bool:
    """An int (numpy's too), and not a bool, which Python counts as one."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """vLLM's names and defaults: temperature 1 samples; temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): every token
    n: int = 1
    stop: list[str] = dataclasses.field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def check(self) -> None:
        """A ValueError naming the first parameter out of range (serve.py answers it with 400)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, ok in [("max_tokens", is_whole_number(self.max_tokens) and self.max_tokens >= 1),
                         ("n", is_whole_number(self.n) and self.n >= 1),
                         ("temperature", 0 <= self.temperature <= 100),
                         ("top_p", 0 < self.top_p <= 1),
                         ("top_k", is_whole_number(self.top_k) and self.top_k >= -1),
                         ("seed", self.seed is None or 0 <= self.seed < 2**63),
                         ("stop", all(isinstance(s, str) and s for s in self.stop))]:
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r} is out of range")


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while it runs


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput | None]  # a sample's, once it has ended

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finish_reason is not None for o in self.outputs)


class RowSampler:
    """Each row of the block table samples with its own request's parameters. A draw depends on
    (seed, sample index, position) only, never on the row or the batch: a request gives the
    same tokens whoever runs beside it."""

    def __init__(self, num_rows: int, device):
        self.temperature = torch.zeros(num_rows, device=device)
        self.top_p = torch.ones(num_rows, device=device)
        self.top_k = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.seed = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.sample = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.samples = np.zeros(num_rows, dtype=bool)  # on the host: which rows in use sample

    def set_row(self, row: int, params: SamplingParams, sample: int, seed: int) -> None:
        # From pinned memory (to_device), queued behind the step in flight: a Python number
        # written into a GPU tensor is a copy the host waits for, and it waits for that step to
        # end first (2 ms an added request on an H200, each stalling the overlapped steps).
        device = self.temperature.device
        self.temperature[row], self.top_p[row] = to_device(
            np.array([params.temperature, params.top_p]), device, torch.float32)
        self.top_k[row], self.seed[row], self.sample[row] = to_device(
            np.array([max(params.top_k, 0), seed, sample]), device, torch.long)
        self.samples[row] = params.temperature > 0

    def release(self, row: int) -> None:
        self.samples[row] = False

    def any_samples(self, rows) -> bool:
        return bool(self.samples[rows].any())

    def __call__(self, logits, rows, positions) -> torch.Tensor:
        """logits: [B, vocab]; rows, positions: [B] -> [B] token ids. Asked on the host, of every
        row in use, not of these rows (on the device: a sync): all greedy, or greedy rows kept
        by torch.where below."""
        greedy = logits.argmax(-1)
        if not self.samples.any():
            return greedy
        temperature = self.temperature[rows]
        probs = torch.softmax(logits.float() / temperature.clamp(min=1e-5)[:, None], dim=-1)
        probs, order = probs.sort(dim=-1, descending=True)  # [B, vocab], likeliest first
        k = self.top_k[rows][:, None]
        probs = probs.masked_fill((k > 0) & (torch.arange(probs.shape[-1], device=k.device) >= k), 0)
        probs = probs / probs.sum(-1, keepdim=True)
        mass_before = probs.cumsum(-1) - probs  # top-p over what top-k left, as vLLM does
        probs = probs.masked_fill(mass_before >= self.top_p[rows][:, None], 0.0)
        cumulative = probs.cumsum(-1)
        target = uniform(self.seed[rows], self.sample[rows], positions) * cumulative[:, -1]
        picked = torch.searchsorted(cumulative, target[:, None], right=True).clamp(max=probs.shape[-1] - 1)
        return torch.where(temperature > 0, order.gather(-1, picked)[:, 0], greedy)


@dataclasses.dataclass
class GreedyOrSampling:
    """The engine's decoder. Greedy decode steps may be CUDA graphs; a step with a sampling row
    runs eagerly, with the per-row sampler (a graph would have recorded one path for every row
    forever). Chosen as each step is launched, which with overlapped steps is a step ahead of
    the one LLMEngine.step returns."""

    graphs: object
    eager: SamplingDecoder
    sampler: RowSampler

    def step(self, tokens, positions, rows, slots) -> torch.Tensor:
        decoder = self.eager if self.sampler.any_samples(rows) else self.graphs
        return decoder.step(tokens, positions, rows, slots)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One of a request's n samples: a row of the engine, and what the client has been sent."""

    request: ServedRequest
    request_id: str
    index: int
    params: SamplingParams
    text: str = ""  # the answer so far, each character whole
    num_sent_tokens: int = 0
    num_text_tokens: int = 0  # the tokens `text` decodes: up to the last whole character
    finish_reason: str | None = None

    @property
    def sendable_text(self) -> str:
        """What a stream may show now. While the request runs, its last len(stop) - 1
        characters wait: the next token may complete a stop string they begin, and a stop
        string is never shown (vLLM holds them back too)."""
        held = max(map(len, self.params.stop), default=1) - 1
        if self.finish_reason is not None or not held:
            return self.text
        return self.text[:max(len(self.text) - held, 0)]


class QueueFull(Exception):
    """Every row is taken: serve.py answers 503 with Retry-After."""


PER_REQUEST = {  # the scripts' flags that choose what a run asks, not the engine: each request's
    # (--seed stays: it draws --random-weights, and a request's seed its samples)
    "temperature": "its temperature", "top_p": "its top_p",
    "samples": "its n", "max_new_tokens": "its max_tokens",
    "system_prompt": "a system message of its own",
    "system_prompt_file": "a system message of its own",
    "request_rate": "when its client sends it", "beam_width": None, "find_max_batch": None,
    "show_all": None, "json": None,  # a script's search, report and answers: no request's
}


def engine_arguments(cache: str, options: dict, argv: list[str] = ()) -> argparse.Namespace:
    """The scripts' flags for a served engine: `argv` as on their command line (serve.py's: a
    bad one exits 2 with the usage), or `options` by their names with underscores
    (model="tiny", random_weights=True, block_size=16, ...; a bad one raises UserError).
    Those that build the engine only: a flag that chooses what a run asks (PER_REQUEST) is
    refused in one paragraph, not taken and silently ignored."""
    if cache not in SCRIPTS:
        raise UserError(f"cache {cache!r}: choose one of {', '.join(SCRIPTS)}.")
    from_python = not argv  # keywords only: LLM(...), not serve.py's command line
    prefix = ["1", "--continuous"]
    argv = [*prefix, *argv]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, str(value)]
    args = parse_script_arguments(cache, argv, raise_errors=from_python)
    defaults = parse_script_arguments(cache, prefix)
    asked = {"--" + name.replace("_", "-"): instead for name, instead in PER_REQUEST.items()
             if getattr(args, name) != getattr(defaults, name)}  # flag -> what replaces it
    if asked:
        flags = ", ".join(asked)
        instead = "; ".join(f"{flag}: {what}" for flag, what in asked.items() if what)
        raise UserError(f"{flags}: a served engine (serve.py, features/llm.py's LLM) takes the "
                        f"flags that build it (model, cache, pool, kernels), and each request "
                        f"chooses the rest for itself" + (f" ({instead})" if instead else "")
                        + ". Drop " + ("it." if len(asked) == 1 else "them."))
    args.num_requests = 0  # requests come through add_request, none from the prompts file
    return args


class LLMEngine:
    """Requests in, tokens out, one step at a time (serve.py's engine process calls `step`)."""

    def __init__(self, cache: str = "paged", max_num_seqs: int = 256, argv: list[str] = (),
                 run=None, progress: bool = False, **options):
        """The model and flags from argv and options, or `run`: a model loaded already, with the
        flags it was loaded for (tools/latency_sweep.py's, whose curves share one model).
        progress: say what the start-up's long parts took (serve.py's engine does)."""
        if torchrun_process() is not None:  # each process would serve, none would split
            raise UserError("The Python API and serve.py run in one process for now, not under "
                            "torchrun: run them without it.")
        if run is None:
            args = engine_arguments(cache, {"max_running": max_num_seqs, **options}, argv)
            if cache == "virtual":  # as its script does: from the flags, before loading
                llama3_virtual.require_cuda_and_flash_attn(args)
            run = features.load(args)
        elif run.args.max_running is None:  # the scripts' "all at once": here, every row
            run = dataclasses.replace(run, args=argparse.Namespace(
                **vars(run.args) | {"max_running": max_num_seqs}))
        self.run = dataclasses.replace(run, num_sequences=max_num_seqs)
        self.cache, self.manager = allocate_kv_cache(cache, self.run)
        self.sampler = RowSampler(max_num_seqs, self.run.device)
        graphs = features.make_decoder(self.run, self.cache, self.manager, greedy, max_num_seqs,
                                       progress)
        eager = SamplingDecoder(self.run.model, self.cache, self.manager.block_table, self.sampler)
        self.engine = features.make_engine(self.run, self.cache, self.manager, self.sampler,
                                           GreedyOrSampling(graphs, eager, self.sampler))
        self.scheduler = features.make_scheduler(self.run, self.cache, self.manager, [])
        self.engine.last_tokens = torch.zeros(max_num_seqs, dtype=torch.long, device=self.run.device)
        self.engine.timeline = []
        self.free_rows = deque(range(max_num_seqs))
        self.sequences: dict[int, Sequence] = {}  # by row
        self.tokenizer, self.max_seq_len = self.run.tokenizer, self.run.args.max_seq_len
        self.stop_ids = self.tokenizer.stop_ids
        self.num_prompt_tokens = self.num_generated_tokens = self.num_finished = 0
        self._steps = None
        self._ids = itertools.count()
        if self.run.args.compile:
            start = time.perf_counter()
            self.warm_up()
            if progress:
                print(f"Warmed up in {time.perf_counter() - start:.1f} s: prefill passes compiled "
                      f"before the first request", flush=True)

    def warm_up(self) -> None:
        """A few requests, run to their end and forgotten. Compiled layers compile for prefill on
        the first ones (tens of seconds; decode compiled as its CUDA graphs were captured), which
        would otherwise fall on the first clients' time to first token."""
        for prompts in warm_up_prompts(self.run.args.compile, self.manager, self.max_seq_len, 8):
            for prompt in prompts:  # added together: one prefill pass
                self.add_request(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))
            while self.has_unfinished():
                self.step()
        self.num_prompt_tokens = self.num_generated_tokens = self.num_finished = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.run.kv_bytes_per_token

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request's n samples; raises ValueError for one that cannot run, QueueFull
        when there are not n free rows. arrival_time: when it arrived on the scheduler's clock
        (a replayed trace's time; by default now), from which its latencies count."""
        params.check()
        request_id = request_id or f"req-{next(self._ids)}"
        if not prompt_token_ids or len(prompt_token_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids):,} tokens; it must have "
                             f"1 to {self.max_seq_len - 1:,} (--max-seq-len {self.max_seq_len:,})")
        if max(prompt_token_ids) >= self.run.model.args.vocab_size or min(prompt_token_ids) < 0:
            raise ValueError("a prompt token id is outside the vocabulary")
        if params.n > len(self.free_rows):
            if params.n > len(self.sampler.samples):
                raise ValueError(f"n = {params.n} is more than the {len(self.sampler.samples)} "
                                 f"sequences the engine runs at once (--max-num-seqs)")
            raise QueueFull(f"{len(self.sequences)} sequences queued or running; no free row")
        max_tokens = min(params.max_tokens, self.max_seq_len - len(prompt_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        arrived = self.scheduler.now() if arrival_time is None else arrival_time
        rows = [self.free_rows.popleft() for _ in range(params.n)]
        requests = [ServedRequest(row, list(prompt_token_ids), max_tokens, arrival_time=arrived)
                    for row in rows]
        try:
            for request in requests:
                self.scheduler._refuse_if_larger_than_the_pool(request)
        except RequestTooLarge as e:
            self.free_rows.extend(rows)
            raise ValueError(f"the prompt and max_tokens need more KV blocks than the whole pool "
                             f"has ({e})") from e
        last_token = to_device(np.array(prompt_token_ids[-1:]), self.run.device)  # [1], as set_row
        for index, request in enumerate(requests):
            self.sampler.set_row(request.row, params, index, seed)
            self.engine.last_tokens[request.row] = last_token[0]
            self.sequences[request.row] = Sequence(request, request_id, index, params)
            self.scheduler.waiting.append(request)
        self.num_prompt_tokens += len(prompt_token_ids)  # once: its samples share it
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request's samples now: their blocks and rows are free at once."""
        for sequence in [s for s in self.sequences.values() if s.request_id == request_id]:
            self._end(sequence, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that changed (new tokens or finished). In
        inference mode, as the scripts' Engine.generate runs and the CUDA graphs were captured:
        no autograd, and compiled layers meet the mode they were compiled in (a step in another
        would recompile every layer, tens of seconds: on an H200 a server at 64 requests/s
        stalled so when its batch first outgrew the graphs' 512 rows)."""
        if not self.scheduler.has_work():
            return []
        if self._steps is None:
            self._steps = self.engine.steps(self.scheduler, frozenset())  # stops: checked here
        self.engine.timer = StepTimer(self.run.device)  # one step's events, not a run's
        try:
            step = next(self._steps)
        except StopIteration:
            self._steps = None
            return []
        del self.engine.timeline[:-1]  # a server runs forever: keep only the latest snapshot
        return self._collect(step.requests)

    def _collect(self, requests: list[ServedRequest]) -> list[Sequence]:
        """The step's requests that took a token or finished: stop tokens and strings, text."""
        changed = []
        for request in requests:
            sequence = self.sequences.get(request.row)
            if sequence is None or sequence.request is not request or (
                    len(request.output_tokens) == sequence.num_sent_tokens
                    and request.status != Status.FINISHED):
                continue  # aborted already, or a prompt computed only in part
            changed.append(sequence)
            self.num_generated_tokens += len(request.output_tokens) - sequence.num_sent_tokens
            if (request.output_tokens and request.output_tokens[-1] in self.stop_ids
                    and not sequence.params.ignore_eos):
                request.output_tokens.pop()  # the stop token is not part of the answer
                self._end(sequence, "stop")
            # Only the new tokens are decoded: from the last whole character on, the bytes start
            # a character afresh. One cut between tokens ends in U+FFFD: it waits for the rest.
            tail = self.tokenizer.decode(request.output_tokens[sequence.num_text_tokens:])
            text = sequence.text
            if not tail.endswith("\ufffd") or request.status == Status.FINISHED:
                text, sequence.num_text_tokens = text + tail, len(request.output_tokens)
            look_from = max(len(sequence.text) - max(map(len, sequence.params.stop), default=0), 0)
            stop_at = min((i for i in (text.find(s, look_from) for s in sequence.params.stop)
                           if i >= 0), default=-1)
            if stop_at >= 0:
                text = text[:stop_at]
                self._end(sequence, "stop")
            sequence.text, sequence.num_sent_tokens = text, len(request.output_tokens)
            if sequence.finish_reason is None and request.status == Status.FINISHED:
                sequence.finish_reason = "length"
                self._release(sequence)
        return changed

    def _end(self, sequence: Sequence, reason: str) -> None:
        if sequence.finish_reason is not None:
            return
        sequence.finish_reason, request = reason, sequence.request
        if request.status == Status.RUNNING:
            self.engine.let_go(request, self.scheduler)
        elif request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
            request.status = Status.FINISHED
        self._release(sequence)

    def _release(self, sequence: Sequence) -> None:
        self.sequences.pop(sequence.request.row, None)
        self.sampler.release(sequence.request.row)
        self.free_rows.append(sequence.request.row)
        self.num_finished += 1


class LLM:
    """Offline generation: every prompt at once through continuous batching."""

    def __init__(self, model: str = "8b", cache: str = "paged", **options):
        self.engine = LLMEngine(cache, model=model, **options)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a text, token ids, vLLM's {"prompt": text} or {"prompt_token_ids": ids}, or a
        list of those; sampling_params: one SamplingParams for all, or a list with one per prompt
        (as vLLM takes them); use_tqdm: a bar of prompts done, with the time left (vLLM's).
        Returns one RequestOutput each, in order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._token_ids(p) for p in prompts], sampling_params, use_tqdm)

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, (list, tuple)) and all(map(is_whole_number, prompt)):
            return [int(t) for t in prompt]
        raise ValueError(f"a prompt is a text, a list of token ids, {{'prompt': text}} or "
                         f"{{'prompt_token_ids': ids}}, not {str(prompt)[:80]}")

    def chat(self, conversations, sampling_params=None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """conversations: one conversation, a list of {"role", "content"} messages, or a list of
        them (as vLLM takes them), each formatted by the model's chat template (Llama 3's, or
        SmolLM2's ChatML); sampling_params and use_tqdm as generate's."""
        if conversations and isinstance(conversations[0], dict):  # one conversation
            conversations = [conversations]
        token_lists = [self.tokenizer.chat(chat_messages(c)) for c in conversations]
        return self._run(token_lists, sampling_params, use_tqdm)

    def _run(self, token_lists, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(token_lists))
        if len(params) != len(token_lists):
            raise ValueError(f"{len(params)} SamplingParams for {len(token_lists)} prompts: give "
                             f"one for all, or one each")
        outputs: dict[str, RequestOutput] = {}  # by request id, in the prompts' order
        pending = deque(enumerate(token_lists))
        generated_before, start = self.engine.num_generated_tokens, time.perf_counter()
        bar = tqdm(total=len(token_lists), desc="Processed prompts", unit="prompt",
                   disable=not use_tqdm)
        try:
            while pending or self.engine.has_unfinished():
                self._add_while_rows_are_free(pending, params, outputs)
                for sequence in self.engine.step():
                    if sequence.finish_reason is not None and self._keep(sequence, outputs):
                        generated = self.engine.num_generated_tokens - generated_before
                        rate = generated / (time.perf_counter() - start)
                        bar.set_postfix_str(f"output {rate:,.0f} tokens/s", refresh=False)
                        bar.update()
        except BaseException:  # a bad prompt, Ctrl-C: this call's requests end with it, so that
            for request_id in outputs:  # none is left running for the next call to find
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return list(outputs.values())

    def _add_while_rows_are_free(self, pending: deque, params, outputs: dict) -> None:
        """Prompts from the head of `pending` while the engine has free rows; the rest join as
        rows come back."""
        while pending:
            i, tokens = pending[0]
            try:
                request_id = self.engine.add_request(tokens, params[i], f"offline-{i}")
            except QueueFull:
                return
            pending.popleft()
            outputs[request_id] = RequestOutput(request_id, tokens, [None] * params[i].n)

    @staticmethod
    def _keep(sequence: Sequence, outputs: dict) -> bool:
        """An ended sample's output, in its request's place; whether the request is done."""
        output = outputs[sequence.request_id]
        output.outputs[sequence.index] = CompletionOutput(
            sequence.index, sequence.text, list(sequence.request.output_tokens),
            sequence.finish_reason)
        return output.finished
