"""The requests the scripts decode: the first N ShareGPT prompts, chat-formatted for Llama 3."""

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "sharegpt_filtered.json"
SYSTEM_PROMPT_FILE = PROMPTS_FILE.parent / "system_prompt.txt"  # for --system-prompt-file


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str
    prompt_tokens: list[int]  # chat-formatted, what the model is fed
    num_reply_tokens: int  # length of the human-written ShareGPT reply, in Llama 3 tokens


def load_requests(n: int, tokenizer, system_prompt: str | None = None,
                  path: Path | None = None) -> list[Request]:
    """The first n prompts, each after `system_prompt` if one is given."""
    path = path or PROMPTS_FILE
    rebuild = "Restore it with `git checkout sharegpt_filtered.json` or `python tools/build_prompts.py`."
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise UserError(f"The prompts file {path} is missing. {rebuild}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"The prompts file {path} is damaged ({e}). {rebuild}") from e
    if not isinstance(records, list):
        raise UserError(f"The prompts file {path} holds no list of conversations. {rebuild}")
    if not 1 <= n <= len(records):
        raise UserError(f"N must be between 1 and {len(records)}, the prompts in {path.name}; got {n}.")
    requests = []
    for i, record in enumerate(records[:n]):
        try:  # the first human turn and the first reply
            request_id, (prompt, reply) = record["id"], (t["value"] for t in record["conversations"][:2])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"Record {i} of {path} has no id, prompt and reply. {rebuild}") from e
        if not (isinstance(prompt, str) and isinstance(reply, str)):
            raise UserError(f"Record {i} of {path}: its prompt and reply are not text. {rebuild}")
        requests.append(Request(id=str(request_id), prompt=prompt,
                                prompt_tokens=tokenizer.chat_prompt(prompt, system_prompt),
                                num_reply_tokens=len(tokenizer.encode(reply))))
    return requests
