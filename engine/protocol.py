"""The server's requests and answers as pydantic models, with vLLM's field names, types and
ranges (vLLM's entrypoints/openai/protocol.py), and the log-probabilities in OpenAI's and vLLM's
shapes: serve.py reads every body through one (`json_body`, `parse`) and builds every answer,
whole or streamed, with `Reply`; /openapi.json shows their schemas. A field's description is
its range in words, and the same words explain a 400; a field vLLM implements and this server
does not is a 400 naming it unless it asks for nothing; OpenAI's fields that mean nothing to a
local server change nothing; any other field is ignored, with one log line, as vLLM does. No
PyTorch: the server's process never loads it.
"""

import json
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plumbing.cli import A_MESSAGE, CHAT_ROLES, chat_messages

MAX_STOP_IDS = 1024  # a request's own stop tokens: far more than any client sends
MAX_LOGIT_BIAS = 1024  # a request's biased tokens (OpenAI allows 300)
LONG = 2**63 - 1  # the largest id, seed or count a request may give (a signed 64-bit number)

# OpenAI's and vLLM's fields this engine does not implement, and the values that ask for nothing
# (their defaults): any other value gets a 400, rather than an answer that silently lacks what
# was asked for (docs/errors.md's table).
NOT_IMPLEMENTED = {"best_of": (None, 1),
                   "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"),
                   "response_format": (None, {"type": "text"}),
                   # vLLM's own
                   "use_beam_search": (None, False), "length_penalty": (None, 1),
                   "allowed_token_ids": (None,), "bad_words": (None, []),
                   "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
                   "guided_choice": (None,), "guided_grammar": (None,), "chat_template": (None,),
                   "chat_template_kwargs": (None, {}),
                   "spaces_between_special_tokens": (None, True), "priority": (None, 0),
                   "logits_processors": (None,), "prompt_embeds": (None,),
                   "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
                   "structural_tag": (None,), "return_tokens_as_token_ids": (None, False),
                   "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None, {}),
                   "reasoning_effort": (None,), "include_reasoning": (None, True),
                   "parallel_tool_calls": (None, False, True),  # no tools: nothing to call
                   "documents": (None,), "mm_processor_kwargs": (None,)}
# vLLM's defaults that differ by endpoint: a completion's prompt gets begin-of-text, a chat's
# template places its own
NOT_IMPLEMENTED_BY = {"completions": NOT_IMPLEMENTED | {"top_logprobs": (None, 0)},
                      "chat": NOT_IMPLEMENTED | {"add_special_tokens": (None, False),
                                               "echo": (None, False)}}
# OpenAI's fields that mean nothing to a local server (stored completions, billing tiers, the
# client's own labels): taken, and change nothing
LOCAL_NO_OPS = {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}


class BadRequest(Exception):
    """A request the server refuses: status, and the field to blame (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class UnknownModel(BadRequest):
    """A model this server does not serve: vLLM's 404, with its error type and code."""

    def __init__(self, name):
        super().__init__(f"The model `{name}` does not exist.", "model", 404)


def json_body(raw: bytes, model_name: str) -> dict:
    """A request's body as a JSON object for `model_name`, or the BadRequest that says why not."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest(f"The body is not UTF-8 text: {e}") from e
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadRequest(f"The body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object.")
    where = lone_surrogate_in(body)
    if where is not None:
        raise BadRequest(f"'{where}' holds a lone UTF-16 surrogate (JSON's \\ud800 to "
                         f"\\udfff without its pair), which is not Unicode text.",
                         where.split(".")[0].split("[")[0])
    if body.get("model", model_name) != model_name:
        raise UnknownModel(body.get("model"))
    return body


def lone_surrogate_in(value, path: str = "") -> str | None:
    """Where in a parsed JSON body a string (or a key) holds a lone UTF-16 surrogate, as
    "messages[0].content"; None if nowhere. JSON's escapes can spell one; no tokenizer, and no
    JSON answer that echoes it, can take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return None
        except UnicodeEncodeError:
            return path
    items = (value.items() if isinstance(value, dict) else enumerate(value)
             if isinstance(value, list) else ())
    for key, item in items:
        at = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = lone_surrogate_in(key, at) if isinstance(key, str) else None
        if found is None:
            found = lone_surrogate_in(item, at)
        if found is not None:
            return found
    return None


def whole(low: int, high: int | None = LONG, why: str = ""):
    """A whole number in [low, high] (high None: any above low), or null; `why` (else the
    range) says so in a 400."""
    return Annotated[Annotated[int, Field(ge=low, le=high)] | None, Field(description=why or (
        f"a whole number from {low:,} to {high:,}" if high is not None and high < LONG else
        f"a whole number, {low} or more"))]


def number(low: float, high: float, above: bool = False):
    """A number from low (or above it) to high, or null."""
    bound = {"gt": low} if above else {"ge": low}
    return Annotated[Annotated[float, Field(le=high, **bound)] | None, Field(description=(
        f"a number above {low:g}, at most {high:g}" if above else
        f"a number from {low:g} to {high:g}"))]


Flag = Annotated[bool | None, Field(description="true or false")]
Text = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=LONG)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # a message's name, say: not read
    role: Literal[CHAT_ROLES]
    content: str | Annotated[list[TextPart], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: Flag = None
    continuous_usage_stats: Flag = None


class OpenAIRequest(BaseModel):
    """What both endpoints read; None is the field's default, as a client may send null."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    max_tokens: whole(1, None) = None  # past the context: the engine says by how much
    max_completion_tokens: whole(1, None) = None
    temperature: number(0, 2) = None
    top_p: number(0, 1, above=True) = None
    top_k: whole(-1) = None
    seed: whole(0) = None
    stop: Annotated[Text | Annotated[list[Text], Field(max_length=4)] | None, Field(
        description="a non-empty string or up to 4 of them")] = None
    ignore_eos: Flag = None
    stop_token_ids: Annotated[list[TokenId] | None, Field(max_length=MAX_STOP_IDS, description=(
        f"a list of at most {MAX_STOP_IDS:,} token ids"))] = None
    include_stop_str_in_output: Flag = None
    truncate_prompt_tokens: Annotated[
        Literal[-1] | Annotated[int, Field(ge=1, le=LONG)] | None,
        Field(description="-1 or a whole number of at least 1")] = None
    presence_penalty: number(-2, 2) = None
    frequency_penalty: number(-2, 2) = None
    repetition_penalty: number(0, 100, above=True) = None
    min_p: number(0, 1) = None
    min_tokens: whole(0) = None
    logit_bias: Annotated[dict[Annotated[str, Field(pattern="^[0-9]+$")],
                               Annotated[float, Field(ge=-100, le=100)]] | None,
                          Field(max_length=MAX_LOGIT_BIAS, description=(
                              f"at most {MAX_LOGIT_BIAS} token ids (as strings) each to a number "
                              f"from -100 to 100"))] = None
    skip_special_tokens: Flag = None
    stream: Flag = None
    stream_options: Annotated[StreamOptions | None, Field(description=(
        "an object of include_usage and continuous_usage_stats, each true or false"))] = None
    user: str | None = None
    request_id: Annotated[str | None, Field(min_length=1, max_length=128,
                                            description="a string of 1 to 128 characters")] = None
    return_token_ids: Flag = None


def request_models(max_n: int, max_logprobs: int, max_prompts: int) -> dict:
    """The endpoints' models for a server of these limits (--max-num-seqs, --max-logprobs)."""
    k = whole(0, max_logprobs, f"a whole number from 0 to {max_logprobs} (--max-logprobs)")
    samples = whole(1, max_n)
    prompts = (f"a non-empty string, a list of token ids, or a list of up to {max_prompts} of "
               f"those (--max-num-seqs)")

    class CompletionRequest(OpenAIRequest):
        prompt: Annotated[Text | TokenIds | Annotated[list[Text | TokenIds], Field(
            min_length=1, max_length=max_prompts)], Field(description=prompts)]
        n: samples = None
        logprobs: k = None
        prompt_logprobs: k = None
        echo: Flag = None
        add_special_tokens: Flag = None

    class ChatCompletionRequest(OpenAIRequest):
        messages: Annotated[list[Message], Field(
            min_length=1, description=f"a non-empty list of messages: {A_MESSAGE}")]
        n: samples = None
        logprobs: Flag = None
        top_logprobs: k = None
        prompt_logprobs: k = None
        add_generation_prompt: Flag = None
        continue_final_message: Flag = None

    class TokenizeRequest(BaseModel):  # vLLM's /tokenize: a prompt's text or ids, or messages
        model_config = ConfigDict(strict=True, extra="allow")
        model: str | None = None
        prompt: Annotated[Text | TokenIds | None, Field(
            description="a non-empty string or a list of token ids")] = None
        messages: Annotated[list[Message] | None, Field(
            min_length=1, description=f"a non-empty list of messages: {A_MESSAGE}")] = None
        add_special_tokens: Flag = None
        add_generation_prompt: Flag = None
        continue_final_message: Flag = None
        return_token_strs: Flag = None

    class DetokenizeRequest(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        model: str | None = None
        tokens: Annotated[list[TokenId], Field(description="a list of token ids")]

    return {"completions": CompletionRequest, "chat": ChatCompletionRequest,
            "tokenize": TokenizeRequest, "detokenize": DetokenizeRequest}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completion logprobs: each token's text, log-probability (None for a
    prompt's first token), its likeliest as text -> log-probability, and where its text begins."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    finish_reason: str | None
    text: str
    logprobs: CompletionLogprobs | None
    prompt_logprobs: list[dict | None] | None  # vLLM's: by token id, {logprob, rank, ...}
    token_ids: list[int] | None = None  # vLLM's return_token_ids: only where asked
    prompt_token_ids: list[int] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    finish_reason: str | None
    message: ChatMessage
    logprobs: dict | None  # OpenAI's: {"content": [{token, logprob, bytes, top_logprobs}]}
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict | None] | None
    prompt_token_ids: list[int] | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None  # the first chunk's
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None  # stream_options' include_usage


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk's, with return_token_ids


class Sample:
    """One sample's answer so far, from the engine's updates (engine/engine_process.py's): its
    text, tokens, finish reason, tokens' log-probabilities and, where asked, the prompt's."""

    def __init__(self):
        self.text, self.num_tokens, self.reason, self.token_ids = "", 0, None, []
        self.logprobs = self.prompt = None

    def take(self, update: tuple) -> None:
        _, delta, self.num_tokens, reason, logprobs, prompt, token_ids = update
        self.text, self.token_ids = self.text + delta, self.token_ids + token_ids
        self.reason = reason or self.reason
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        self.prompt = prompt or self.prompt


class Reply:
    """One request's answer in OpenAI's shape, from its samples: whole, or as a stream's
    server-sent events. k: log-probabilities asked for (None: none); with_ids: vLLM's
    return_token_ids; prompt_token_ids: each prompt's, as the engine took it."""

    def __init__(self, chat: bool, answer_id: str, model: str, n: int, k: int | None,
                 with_ids: bool, prompt_token_ids: list[list[int]]):
        self.chat, self.n, self.k, self.with_ids = chat, n, k, with_ids
        self.head = dict(id=answer_id, created=int(time.time()), model=model)
        self.prompt_token_ids = prompt_token_ids
        self.tokens, self.offsets = [0] * n, [0] * n  # a stream's, by sample

    def ids(self, **named) -> dict:
        return named if self.with_ids else {}

    def usage(self, tokens: list[int]) -> Usage:
        prompt = sum(map(len, self.prompt_token_ids))
        return Usage(prompt_tokens=prompt, completion_tokens=sum(tokens),
                     total_tokens=prompt + sum(tokens))

    def whole(self, answers: list[list[Sample]], echo: bool, texts: list[str | None]) -> dict:
        """The answer's body: each prompt's n samples. echo: a completion's answer begins with
        its prompt, scored where log-probabilities are asked for; texts: each prompt's, where
        given as text (else the engine's decoding of its ids)."""
        choices, prompt_logprobs = [], None
        for p, samples in enumerate(answers):
            for i, a in enumerate(samples):
                given = {"index": p * self.n + i, "finish_reason": a.reason} | self.ids(
                    token_ids=a.token_ids, **({} if self.chat else {
                        "prompt_token_ids": self.prompt_token_ids[p]}))
                prompt_logprobs = vllm_prompt_logprobs(a.prompt)
                if self.chat:
                    choices.append(ChatChoice(**given, message={"role": "assistant",
                                                                "content": a.text},
                                              logprobs=chat_logprobs(a.logprobs, self.k)))
                    continue
                echoed = (texts[p] or a.prompt["text"]) if echo else ""
                scored = None if self.k is None else completion_logprobs(
                    (a.prompt["logprobs"] if echo else []) + a.logprobs, self.k)
                choices.append(CompletionChoice(**given, text=echoed + a.text, logprobs=scored,
                                                prompt_logprobs=prompt_logprobs))
        usage = self.usage([a.num_tokens for samples in answers for a in samples])
        if self.chat:
            return answer_body(ChatCompletionResponse(
                **self.head, object="chat.completion", choices=choices, usage=usage,
                prompt_logprobs=prompt_logprobs,
                **self.ids(prompt_token_ids=self.prompt_token_ids[0])))
        return answer_body(CompletionResponse(**self.head, object="text_completion",
                                              choices=choices, usage=usage))

    def event(self, choices: list, **extra) -> str:
        """One server-sent event of the stream: a chunk of these choices."""
        chunk = (ChatCompletionStreamResponse(**self.head, object="chat.completion.chunk",
                                              choices=choices, **extra) if self.chat else
                 CompletionStreamResponse(**self.head, object="text_completion",
                                          choices=choices, **extra))
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    def opening(self, **usage) -> str:
        """A chat stream's first event: each sample's assistant turn begins."""
        return self.event([ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""},
                                            finish_reason=None) for i in range(self.n)],
                          **self.ids(prompt_token_ids=self.prompt_token_ids[0]), **usage)

    def moved(self, index: int, a: Sample) -> ChatStreamChoice | CompletionStreamChoice:
        """A sample's new text since its last event, as a stream's choice."""
        self.tokens[index] = a.num_tokens
        given = {"index": index, "finish_reason": a.reason} | self.ids(token_ids=a.token_ids)
        if self.chat:
            return ChatStreamChoice(**given, delta={"content": a.text},
                                    logprobs=chat_logprobs(a.logprobs, self.k))
        scored = None if self.k is None else completion_logprobs(a.logprobs, self.k,
                                                                 self.offsets[index])
        self.offsets[index] += sum(len(t[0][1]) for t in a.logprobs or [])
        return CompletionStreamChoice(**given, text=a.text, logprobs=scored)

    def cut(self, index: int) -> str:
        """A sample's end when the server stops first: finish_reason "abort"."""
        end = {"delta": {}} if self.chat else {"text": "", "logprobs": None}
        return self.event([{"index": index, **end, "finish_reason": "abort"}])


def tokenizer_info(tokenizer, max_seq_len: int) -> dict:
    """vLLM's /tokenizer_info: what a client that tokenizes through the server asks first
    (lm-evaluation-harness's tokenizer_backend=remote)."""
    return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_seq_len,
            "bos_token": tokenizer.decode([tokenizer.bos_id]),
            "eos_token": tokenizer.decode([max(tokenizer.stop_ids)]), "pad_token": None,
            "chat_template": tokenizer.chat_template}


def completion_logprobs(scored: list, k: int, offset: int = 0) -> dict:
    """OpenAI's legacy completion logprobs: each token's text, log-probability (None for a
    prompt's first token), its k + 1 likeliest as text -> log-probability (the token's own
    first, as vLLM gives them), and where its text begins."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in scored:  # entry: (id, text, log-probability, rank) each, the token's own first
        _, text, logprob, _ = entry[0]
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(None if logprob is None else
                            {t: max(lp, -9999.0) for _, t, lp, _ in entry[:k + 1]})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(scored: list | None, k: int | None) -> dict | None:
    """OpenAI's chat logprobs: each token with its bytes and its `top_logprobs` (vLLM's: the
    first k of the token's own and the likeliest)."""
    if scored is None:
        return None
    as_one = lambda text, logprob: {"token": text, "logprob": max(logprob, -9999.0),
                                    "bytes": list(text.encode("utf-8", errors="replace"))}
    return {"content": [as_one(e[0][1], e[0][2]) | {
        "top_logprobs": [as_one(t, lp) for _, t, lp, _ in e[:k]]} for e in scored]}


def vllm_prompt_logprobs(prompt: dict | None) -> list | None:
    """vLLM's prompt_logprobs: None for the first token, then for each token its own and the
    likeliest, by token id: {"logprob", "rank", "decoded_token"}."""
    if prompt is None or prompt["logprobs"] is None:
        return None
    return [None] + [{str(i): {"logprob": lp, "rank": rank, "decoded_token": t}
                      for i, t, lp, rank in entry} for entry in prompt["logprobs"][1:]]


def answer_body(response: BaseModel) -> dict:
    """A response model as JSON: the fields given, and an optional one only where it was."""
    return response.model_dump(exclude_unset=True)


def parse(model: type[BaseModel], body: dict, endpoint: str | None = None):
    """`body` as `model`, or a BadRequest naming the first field it cannot take (a value out
    of the field's range, or of its type). endpoint: one of OpenAI's, whose fields this server
    does not implement are checked too."""
    for name, asks_nothing in NOT_IMPLEMENTED_BY.get(endpoint, {}).items():
        if name in body and body[name] not in asks_nothing:
            raise BadRequest(f"'{name}' is not implemented by this server; leave it out", name)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        name = str(e.errors()[0]["loc"][0])
        field = model.model_fields.get(name)
        what = (field.description if field and field.description
                else e.errors()[0]["msg"].lower())
        given = f", not {json.dumps(body[name])[:100]}" if name in body else ""
        raise BadRequest(f"'{name}' must be {what}{given}", name) from None


def ignored_fields(request: BaseModel) -> list[str]:
    """The fields none of the endpoint's, which the request is served without (vLLM logs
    them): neither read, nor a no-op on a local server, nor one that asks for nothing."""
    asks_nothing = set().union(*NOT_IMPLEMENTED_BY.values())  # refused already if they ask
    return sorted(set(request.model_extra) - LOCAL_NO_OPS - asks_nothing)


def sampling_params(request: OpenAIRequest, chat: bool, default_max_tokens: int | None) -> dict:
    """engine/sampler.py's SamplingParams, by name (the engine's process builds it). Without
    max_tokens, a completion takes 16 (OpenAI's legacy default) and a chat answer
    default_max_tokens: None, the context left (vLLM's defaults). Log-probabilities: a
    completion's `logprobs` is k; a chat's is true or false, with `top_logprobs` k; `echo` with
    `logprobs` scores the prompt too (vLLM's `prompt_logprobs`)."""
    r = request
    if chat:
        if r.top_logprobs is not None and not r.logprobs:
            raise BadRequest("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
        logprobs = (r.top_logprobs or 0) if r.logprobs else None
    else:
        logprobs = r.logprobs
    prompt_logprobs = r.prompt_logprobs
    if not chat and r.echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)  # the echoed prompt's tokens too
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    given = lambda value, default: default if value is None else value
    return dict(
        max_tokens=given(max_tokens, default_max_tokens), temperature=given(r.temperature, 1.0),
        top_p=given(r.top_p, 1.0), top_k=given(r.top_k, 0), n=given(r.n, 1),
        stop=[r.stop] if isinstance(r.stop, str) else list(r.stop or []), seed=r.seed,
        ignore_eos=given(r.ignore_eos, False), stop_token_ids=given(r.stop_token_ids, []),
        include_stop_str_in_output=given(r.include_stop_str_in_output, False),
        truncate_prompt_tokens=r.truncate_prompt_tokens,
        presence_penalty=given(r.presence_penalty, 0.0),
        frequency_penalty=given(r.frequency_penalty, 0.0),
        repetition_penalty=given(r.repetition_penalty, 1.0), min_p=given(r.min_p, 0.0),
        min_tokens=given(r.min_tokens, 0),
        logit_bias={int(k): v for k, v in (r.logit_bias or {}).items()},
        skip_special_tokens=given(r.skip_special_tokens, True),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def completion_prompts(request) -> list[dict]:
    """One prompt (a text, or a list of token ids), or a batch of them (a list of texts or of
    token-id lists, as lm-evaluation-harness sends), each run as a request of its own; a text
    without begin-of-text where add_special_tokens is false (vLLM's)."""
    prompt = request.prompt
    batch = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
    plain = request.add_special_tokens is False
    return [{"text": p, "plain": plain} if isinstance(p, str) else {"ids": p} for p in batch]


def chat_prompt(request) -> dict:
    """The messages, with vLLM's add_generation_prompt (open the assistant's turn: true by
    default) and continue_final_message (leave the last turn open for the model to go on)."""
    opens = request.add_generation_prompt is not False
    if opens and request.continue_final_message:
        raise BadRequest("'continue_final_message' goes on with the last message: send "
                         "\"add_generation_prompt\": false with it", "continue_final_message")
    messages = chat_messages([m.model_dump() for m in request.messages])
    return {"messages": messages, "add_generation_prompt": opens,
            "continue_final_message": bool(request.continue_final_message)}


def openapi_body(model: type[BaseModel], endpoint: str | None = None) -> dict:
    """FastAPI's openapi_extra for a route that reads its body itself: the model's schema, and
    the values that ask for nothing of the fields this server does not implement."""
    schema = model.model_json_schema()
    schema = inlined(schema, schema.pop("$defs", {}))  # its own refs resolve in no OpenAPI file
    for name, values in NOT_IMPLEMENTED_BY.get(endpoint, {}).items():
        schema["properties"].setdefault(name, {"enum": list(values)})
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": schema}}}}


def inlined(schema, defs: dict):
    """`schema` with each {"$ref": "#/$defs/Name"} replaced by that definition."""
    if isinstance(schema, list):
        return [inlined(item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        return inlined(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    return {key: inlined(value, defs) for key, value in schema.items()}
