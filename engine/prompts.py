"""The requests both scripts decode: the first N ShareGPT prompts, chat-formatted for Llama 3."""

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "sharegpt_filtered.json"


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str
    prompt_tokens: list[int]  # chat-formatted, what the model is fed
    num_reply_tokens: int  # length of the human-written ShareGPT reply, in Llama 3 tokens


def load_requests(n: int, tokenizer, path: Path = PROMPTS_FILE) -> list[Request]:
    records = json.loads(Path(path).read_text(encoding="utf-8"))
    if not 1 <= n <= len(records):
        raise UserError(f"N must be between 1 and {len(records)}, the prompts in {path.name}; got {n}.")
    return [Request(id=r["id"], prompt=r["conversations"][0]["value"],
                    prompt_tokens=tokenizer.chat_prompt(r["conversations"][0]["value"]),
                    num_reply_tokens=len(tokenizer.encode(r["conversations"][1]["value"])))
            for r in records[:n]]
