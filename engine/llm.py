"""A Python API over the engine, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`.

    from engine.llm import LLM, SamplingParams
    llm = LLM(model="tiny", random_weights=True, device="cpu")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16, temperature=0))

`LLM` runs every prompt at once through engine/llm_engine.py's `LLMEngine`, the incremental
form that serve.py drives from its engine process (`add_request`, `step`, `abort`), built from
the same flags the scripts take, or vLLM's names for them (`EngineArgs`, so that vLLM's offline
examples run with only the import and the model changed: tests/test_vllm_examples.py).
"""

import argparse
import dataclasses
import os
import sys
import time
import typing
from collections import deque
from pathlib import Path

from tqdm import tqdm

from engine.llm_engine import LLMEngine, QueueFull, Sequence
from engine.sampler import SamplingParams, is_whole_number
from plumbing.cli import MODELS, UserError, chat_messages

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs",
           "FlexibleArgumentParser"]

# vLLM's names for the engine's keywords, and its dtypes' names for ours
VLLM_KEYWORDS = {"max_model_len": "max_seq_len", "enforce_eager": "eager"}
VLLM_DTYPES = {"auto": None, "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
               "float32": "fp32", "float": "fp32"}


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's: an ArgumentParser that takes --max_tokens as --max-tokens."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args([dashed(a) for a in args], namespace)


def dashed(arg: str) -> str:
    """--max_tokens=8 as --max-tokens=8: the flag's name only, not its value."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


@dataclasses.dataclass
class EngineArgs:
    """vLLM's engine arguments that this engine takes, by vLLM's names (`LLM(**...)` takes them
    as it takes the scripts' flags): `add_cli_args` puts them on a command line, as vLLM's
    examples build theirs."""
    model: str = "8b"
    dtype: str = "auto"
    seed: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    device: str | None = None
    random_weights: bool = False  # ours: real shapes, no checkpoint

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("Engine arguments (vLLM's names; python "
                                          "llama3_paged.py --help says what each does)")
        for field in dataclasses.fields(EngineArgs):
            flag = "--" + field.name.replace("_", "-")
            if field.type is bool:
                group.add_argument(flag, action="store_true")
                continue
            types = (field.type, *typing.get_args(field.type))  # int, or int | None
            kind = next(t for t in (int, float, str) if t in types)
            group.add_argument(flag, type=kind, default=field.default,
                               help=f"default: {field.default}")
        return parser


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while it runs
    logprobs: list[dict] | None = None  # per token: id -> Logprob (features/logprobs/logprobs.py)
    cumulative_logprob: float | None = None  # the sum of the chosen tokens' log-probabilities


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the prompt's text: as given, or a chat's as its template made it
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput | None]  # a sample's, once it has ended
    prompt_logprobs: list[dict | None] | None = None  # None first: nothing scores the first token

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finish_reason is not None for o in self.outputs)


class LLM:
    """Offline generation: every prompt at once through continuous batching."""

    def __init__(self, model: str = "8b", cache: str = "paged", **options):
        """model: a preset's name (the scripts' --model), or, as vLLM's LLM(model=PATH) takes
        one, a checkpoint: a folder (Meta's or Hugging Face's layout) or a .gguf file (the
        scripts' --ckpt-dir); options: the scripts' other flags, by name."""
        options = {VLLM_KEYWORDS.get(name, name): value for name, value in options.items()}
        if options.get("dtype") in VLLM_DTYPES:
            options["dtype"] = VLLM_DTYPES[options["dtype"]]
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if not isinstance(model, str):
            raise TypeError(f"LLM(model=...) is a preset's name ({', '.join(MODELS)}) or a "
                            f"checkpoint's path, not {model!r}")
        if model not in MODELS:
            if not Path(model).exists():
                raise UserError(f"model={model!r} is neither a preset ({', '.join(MODELS)}) nor a "
                                f"checkpoint folder or .gguf file that exists.")
            model, options = None, {"ckpt_dir": model} | options  # None: --model's default
        self.llm_engine = LLMEngine(cache, model=model, **options)
        self.tokenizer = self.llm_engine.tokenizer  # the engine's own (plumbing/)
        self.transformers_tokenizer = None  # get_tokenizer's, made when first asked

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling a request gets when it asks for none."""
        return SamplingParams()

    def get_tokenizer(self):
        """vLLM's: the tokenizer prompts are encoded with, as transformers' tokenizer (its chat
        template, special tokens, `convert_ids_to_tokens`, ...), built once when first asked."""
        if self.transformers_tokenizer is None:
            self.transformers_tokenizer = self.tokenizer.transformers()
        return self.transformers_tokenizer

    def generate(self, prompts, sampling_params=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a text, token ids, vLLM's {"prompt": text} or {"prompt_token_ids": ids}, or a
        list of those; sampling_params: one SamplingParams for all, or a list with one per prompt
        (as vLLM takes them); use_tqdm: a bar of prompts done, with the time left (vLLM's).
        Returns one RequestOutput each, in order."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and is_whole_number(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts is a text, token ids, a dict or a list of those, not "
                             f"{str(prompts)[:80]}")
        texts = [p.get("prompt") if isinstance(p, dict) else p if isinstance(p, str) else None
                 for p in prompts]
        try:
            token_lists = [self._token_ids(p) for p in prompts]
        except ValueError as e:  # a text the tokenizer cannot take: said of the argument
            raise ValueError(f"prompts: {e}") from None
        return self._run(token_lists, sampling_params, use_tqdm, texts)

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, (list, tuple)) and all(map(is_whole_number, prompt)):
            return [int(t) for t in prompt]
        raise ValueError(f"a prompt is a text, a list of token ids, {{'prompt': text}} or "
                         f"{{'prompt_token_ids': ids}}, not {str(prompt)[:80]}")

    def chat(self, conversations, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None) -> list[RequestOutput]:
        """conversations: one conversation, a list of {"role", "content"} messages, or a list of
        them (as vLLM takes them), each formatted by the model's chat template (Llama 3's, or
        SmolLM2's ChatML) or by `chat_template` (a Jinja template, as transformers renders
        one); sampling_params and use_tqdm as generate's; add_generation_prompt,
        continue_final_message: vLLM's (the assistant's turn opened, or the last turn left open
        for the model to go on with)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message goes on with the last message: pass "
                             "add_generation_prompt=False with it")
        if conversations and isinstance(conversations[0], dict):  # one conversation
            conversations = [conversations]
        try:
            token_lists = [self.tokenizer.chat(chat_messages(c), add_generation_prompt,
                                               continue_final_message) if chat_template is None
                           else self.tokenizer.encode(self.get_tokenizer().apply_chat_template(
                               chat_messages(c), chat_template=chat_template, tokenize=False,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message), special=True)
                           for c in conversations]
        except ValueError as e:  # a malformed message, or text the tokenizer cannot take
            raise ValueError(f"messages: {e}") from None
        texts = [self.tokenizer.decode(tokens) for tokens in token_lists]  # the templated prompt
        return self._run(token_lists, sampling_params, use_tqdm, texts)

    def _run(self, token_lists, sampling_params, use_tqdm: bool, texts) -> list[RequestOutput]:
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(token_lists))
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params is a SamplingParams, or a list of one per prompt")
        if len(params) != len(token_lists):
            raise ValueError(f"{len(params)} SamplingParams for {len(token_lists)} prompts: give "
                             f"one for all, or one each")
        outputs: dict[str, RequestOutput] = {}  # by request id, in the prompts' order
        pending = deque(enumerate(token_lists))
        generated_before, start = self.llm_engine.num_generated_tokens, time.perf_counter()
        bar = tqdm(total=len(token_lists), desc="Processed prompts", unit="prompt",
                   disable=not use_tqdm)
        try:
            while pending or self.llm_engine.has_unfinished():
                self._add_while_rows_are_free(pending, params, outputs, texts)
                for sequence in self.llm_engine.step():
                    if sequence.finish_reason is not None and self._keep(sequence, outputs):
                        generated = self.llm_engine.num_generated_tokens - generated_before
                        rate = generated / (time.perf_counter() - start)
                        bar.set_postfix_str(f"output {rate:,.0f} tokens/s", refresh=False)
                        bar.update()
        except BaseException:  # a bad prompt, Ctrl-C: this call's requests end with it, so that
            for request_id in outputs:  # none is left running for the next call to find
                self.llm_engine.abort(request_id)
            raise
        finally:
            bar.close()
        return list(outputs.values())

    def _add_while_rows_are_free(self, pending: deque, params, outputs: dict, texts) -> None:
        """Prompts from the head of `pending` while the engine has free rows; the rest join as
        rows come back."""
        while pending:
            i, tokens = pending[0]
            try:
                request_id = self.llm_engine.add_request(tokens, params[i], f"offline-{i}")
            except QueueFull:
                return
            pending.popleft()
            outputs[request_id] = RequestOutput(request_id, texts[i],
                                                self.llm_engine.truncated(tokens, params[i]),
                                                [None] * params[i].n)

    def _keep(self, sequence: Sequence, outputs: dict) -> bool:
        """An ended sample's output, in its request's place; whether the request is done."""
        output, tokens = outputs[sequence.request_id], list(sequence.request.output_tokens)
        logprobs = self.llm_engine.logprobs_of(sequence)
        cumulative = (None if logprobs is None else
                      sum(chosen[t].logprob for chosen, t in zip(logprobs, tokens)))
        output.outputs[sequence.index] = CompletionOutput(
            sequence.index, sequence.text, tokens, sequence.finish_reason, logprobs, cumulative)
        if output.prompt_logprobs is None:
            output.prompt_logprobs = self.llm_engine.prompt_logprobs_of(sequence)
        return output.finished
