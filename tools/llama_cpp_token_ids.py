"""llama.cpp's token ids for SmolLM2's GGUF, saved once as the tests' truth for our tokenizer.

    pip install llama-cpp-python        # builds llama.cpp: a C++ compiler and cmake, minutes
    python tools/llama_cpp_token_ids.py  # writes tests/data/smollm2_llama_cpp_ids.json

The texts: the first two turns of ShareGPT's first 150 records (the prompts the scripts run;
their first 1,000 characters), and edge cases around what SmolLM2's pre-tokenizer ("smollm" in
the file's tokenizer.ggml.pre) does differently from GPT-2's byte-level pattern alone:
whitespace before a digit, runs of digits, digits inside words. llama.cpp reads only the
file's vocabulary here (vocab_only), with no beginning-of-text token and control tokens spelled
in the text left as text, as our tokenizer encodes a prompt's text.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plumbing.cli import HelpFormatter, first_paragraph  # noqa: E402
from plumbing.gguf_checkpoint import packaged_smollm2  # noqa: E402
from plumbing.inputs import PROMPTS_FILE, read_records  # noqa: E402

OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_llama_cpp_ids.json"
EDGE_CASES = [
    ":\n\n1.", "x  42 y", "1\n2\n3", "Step 1: add 2 and 3.", "  7", "\t9 lives", "\n\n\n10",
    "version 3.11.4", "pi is 3.14159", "1,000,000 tokens", "x2y3z", "H2O and CO2", "2024-11-28",
    "$ 5", "( 1 ) [ 2 ]", "a\u00a01", "\u00e9t\u00e9 2", "\u65e5\u672c 3", "1st 2nd 3rd",
    "0x1F 0b101", "    4 spaces", "end 9", "9", " 9", "  99  ", "e.g. 1. 2. 3.",
]


def texts() -> list[str]:
    records = read_records(PROMPTS_FILE)[:150]
    turns = [t["value"][:1000] for r in records for t in r["conversations"][:2]]  # a file of KBs
    return turns + EDGE_CASES


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__),
                                     formatter_class=HelpFormatter)
    parser.parse_args()
    from llama_cpp import Llama
    gguf = packaged_smollm2()
    llama = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    pairs = [{"text": text, "ids": llama.tokenize(text.encode(), add_bos=False, special=False)}
             for text in texts()]
    OUTPUT.parent.mkdir(exist_ok=True)
    lines = [json.dumps(pair, ensure_ascii=False) for pair in pairs]  # one text a line
    OUTPUT.write_text(f'{{"gguf": "{gguf.name}", "llama_cpp_python": "{_version()}", "texts": [\n'
                      + ",\n".join(lines) + "\n]}\n")
    print(f"{len(pairs)} texts, {sum(len(p['ids']) for p in pairs):,} tokens -> {OUTPUT}")


def _version() -> str:
    from importlib.metadata import version
    return version("llama-cpp-python")


if __name__ == "__main__":
    main()
