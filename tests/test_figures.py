"""The figures the README prints, computed here from first principles and held against the code."""

import json
import signal

import pytest
import torch

import llama3_naive
import llama3_paged
from engine.run import command_line
from plumbing.inputs import PRESETS

signal.signal(signal.SIGINT, signal.default_int_handler)  # the scripts' import replaced pytest's

TINY = ["--random-weights", "--model", "tiny", "--device", "cpu"]
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # K and V x 2 layers x 2 KV heads x 64 values x fp32


def test_a_token_of_llama3_8b_costs_128_kib_of_kv_cache():
    # K and V, 32 layers, 8 KV heads of 128 values, 2 bytes each in bf16.
    assert PRESETS["8b"].kv_bytes_per_token(torch.bfloat16) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert PRESETS["tiny"].kv_bytes_per_token(torch.float32) == TINY_BYTES_PER_TOKEN


@pytest.mark.parametrize("budget_gb, block_size", [(0.01, 16), (0.125, 16), (0.05, 48)])
def test_the_paged_pool_is_the_kv_budget_in_whole_blocks(budget_gb, block_size, tmp_path):
    command_line("llama3_paged.py", [*TINY, "1", "--max-new-tokens", "2", "--kv-budget-gb", str(budget_gb),
                       "--block-size", str(block_size), "--json", str(tmp_path / "run.json")])
    memory = json.loads((tmp_path / "run.json").read_text())["memory"]
    assert memory["kv_pool_blocks"] == int(budget_gb * 1e9 // (block_size * TINY_BYTES_PER_TOKEN))


def test_on_the_cpu_the_naive_cache_fits_7_requests_of_8192_tokens(tmp_path):
    # 0.125 GB / (8,192 tokens x 2 KiB) = 7.45: seven max-length caches fit, an eighth does not.
    command_line("llama3_naive.py", [*TINY, "7", "--max-new-tokens", "4", "--json", str(tmp_path / "run.json")])
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["memory"]["kv_pool_bytes"] >= 7 * 8192 * TINY_BYTES_PER_TOKEN
    with pytest.raises(SystemExit) as exit:
        command_line("llama3_naive.py", [*TINY, "8"])
    assert exit.value.code == 1


@pytest.mark.parametrize("script, block_size", [(llama3_paged, 16), (llama3_naive, 8192)])
def test_the_printed_fragmented_memory_is_the_unfilled_kv_at_the_fullest_step(script, block_size,
                                                                             tmp_path, capsys):
    """Four requests of different lengths (their ShareGPT replies, at most 100 tokens): the
    fullest step is not the last, and the printed figure is the arithmetic done here."""
    from plumbing.inputs import load_prompts, load_tokenizer
    from engine.report import device_total_bytes
    prompts = load_prompts(4, load_tokenizer())
    budgets = [min(p.num_reply_tokens, 100) for p in prompts]
    assert len(set(budgets)) > 1, "requests of different lengths"
    command_line(f"{script.__name__}.py", [*TINY, "4", "--max-new-tokens", "100", "--json", str(tmp_path / "run.json")])
    printed = capsys.readouterr().out
    # Decode step s feeds each request its (s + 1)th new token: it then holds its prompt and
    # s + 1 new tokens, while it has tokens left to make (the first came from the prefill).
    def held(step):
        return [len(p.prompt_tokens) + step + 1 for p, b in zip(prompts, budgets) if b - 1 > step]
    steps = range(max(budgets) - 1)
    fullest = max(steps, key=lambda s: sum(held(s)))
    assert fullest != steps[-1], "the fullest step is not the last one"
    reserved = sum(-(-n // block_size) * block_size for n in held(fullest))
    unfilled_bytes = (reserved - sum(held(fullest))) * TINY_BYTES_PER_TOKEN
    percent = 100 * unfilled_bytes / device_total_bytes(torch.device("cpu"))
    figure = (f"{unfilled_bytes / 1e6:,.2f} MB" if unfilled_bytes >= 1e6
              else f"{unfilled_bytes / 1e3:,.2f} KB")
    assert f"Fragmented Memory: {figure} ({percent:.2f}%)" in printed
    assert f"at the fullest step ({fullest}, {len(held(fullest))} running)" in printed
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["memory"]["at_fullest_step"]["step"] == fullest


def test_every_json_value_keeps_its_type(tmp_path):
    command_line("llama3_paged.py", [*TINY, "2", "--max-new-tokens", "3", "--json", str(tmp_path / "run.json")])
    record = json.loads((tmp_path / "run.json").read_text())
    text_keys = {"script", "mode", "kv_pool_unit", "id", "ckpt_dir", "device", "attn", "model",
                 "dtype", "weights_dtype", "tokenizer", "json", "system_prompt", "system_prompt_file"}

    def check(key, value):
        if isinstance(value, dict):
            for k, v in value.items():
                check(k, v)
        elif isinstance(value, list):
            for v in value:
                check(key, v)
        elif isinstance(value, str):
            assert key in text_keys, f"{key} is written as text: {value!r}"

    for key in ("memory", "throughput", "scheduling", "sharing", "timeline", "requests"):
        check(key, record[key])
    assert isinstance(record["throughput"]["num_prefilled_tokens"], int)
    assert isinstance(record["memory"]["at_fullest_step"]["reserved_bytes"], int)
    assert record["arguments"]["num_requests"] == 2 and record["arguments"]["device"] == "cpu"
