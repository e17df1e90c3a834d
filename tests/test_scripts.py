"""Both scripts end to end, as a user runs them: answers, report, exit codes, never a traceback."""

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, hf_to_meta, tiny_hf_model

from plumbing.inputs import load_prompts
from plumbing.inputs import load_tokenizer

TINY = ["--random-weights", "--model", "tiny", "--device", "cpu"]


def run_script(script, *args):
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", ["llama3_naive.py", "llama3_paged.py"])
def test_script_runs_end_to_end_and_reports_memory(script, tmp_path):
    out = run_script(script, 3, *TINY, "--max-new-tokens", 12, "--max-seq-len", 1536,
                     "--json", tmp_path / "run.json")
    assert out.returncode == 0, out.stderr
    assert "Fragmented Memory:" in out.stdout and "Random weights" in out.stdout
    record = json.loads((tmp_path / "run.json").read_text())
    # Random weights: each request generates its ShareGPT reply's length, capped by the flag.
    expected = [min(12, r.num_reply_tokens) for r in load_prompts(3, load_tokenizer())]
    assert [len(r["output_tokens"]) for r in record["requests"]] == expected
    # Every step's figures against the requests themselves: at decode step k a request that is
    # still running holds its prompt and k + 1 generated tokens, in ceil(tokens / block) blocks.
    # The tiny model in fp32: K and V x 2 layers x 2 KV heads x 64 values x 4 bytes per token.
    m = record["memory"]
    per_token = 2 * 2 * 2 * 64 * 4
    block_size = 16 if script == "llama3_paged.py" else 1536  # the CPU's default; max_seq_len
    assert m["kv_bytes_per_token"] == per_token and m["block_size_tokens"] == block_size
    for s in record["timeline"]:
        held = [len(r["prompt_tokens"]) + s["step"] + 1 for r in record["requests"]
                if len(r["output_tokens"]) > s["step"] + 1]
        assert s["running_requests"] == len(held)
        assert s["filled_bytes"] == sum(held) * per_token
        assert s["reserved_bytes"] == sum(-(-n // block_size) * block_size for n in held) * per_token
        # Each running request leaves at most block_size - 1 slots of its last block empty.
        assert s["unfilled_bytes"] <= len(held) * (block_size - 1) * per_token
    # The report's figures are the timeline's: the fullest step and its unfilled bytes, as a
    # percentage of the machine's memory (on the CPU, MemTotal).
    fullest = max(record["timeline"], key=lambda s: s["filled_bytes"])
    assert m["at_fullest_step"] == {k: v for k, v in fullest.items() if k != "seconds"}
    assert m["fragmented_bytes"] == fullest["unfilled_bytes"] > 0
    mem_total = int(open("/proc/meminfo").readline().split()[1]) * 1024
    assert m["device_total_bytes"] == mem_total
    assert m["fragmented_percent_of_device"] == pytest.approx(100 * fullest["unfilled_bytes"] / mem_total)


# slow: 11 s of two script runs; tests/test_figures.py checks each cache's reserved and filled
# bytes
@pytest.mark.slow
def test_naive_reserves_max_seq_len_per_request_and_paged_only_what_is_used(tmp_path):
    runs = {}
    for script in ["llama3_naive.py", "llama3_paged.py"]:
        out = run_script(script, 4, *TINY, "--max-new-tokens", 6, "--max-seq-len", 2048,
                         "--json", tmp_path / f"{script}.json")
        assert out.returncode == 0, out.stderr
        runs[script] = json.loads((tmp_path / f"{script}.json").read_text())
    naive, paged = runs["llama3_naive.py"], runs["llama3_paged.py"]
    assert [r["output_tokens"] for r in naive["requests"]] == [r["output_tokens"] for r in paged["requests"]]
    per_token = naive["memory"]["kv_bytes_per_token"]
    first = naive["timeline"][0]
    assert naive["memory"]["at_fullest_step"]["reserved_bytes"] == first["running_requests"] * 2048 * per_token
    fullest = paged["memory"]["at_fullest_step"]
    assert fullest["unfilled_bytes"] < fullest["running_requests"] * 16 * per_token  # < 1 block each
    # The picture of the two runs, as the README shows it.
    png = tmp_path / "kv_memory.png"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_memory.py"), tmp_path / "llama3_naive.py.json",
                          tmp_path / "llama3_paged.py.json", "-o", png], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000


@pytest.mark.parametrize("layout", ["hugging_face", "meta"])
def test_tokens_match_transformers_greedy_generation(tmp_path, layout):
    hf = tiny_hf_model(rope_scaling=(layout == "hugging_face"), tied=False, vocab_size=128_256,
                       original_context=64 if layout == "hugging_face" else 8192)
    ckpt = tmp_path / "ckpt"
    if layout == "hugging_face":
        hf.save_pretrained(ckpt)
    else:
        hf_to_meta(hf, ckpt)
    # Both scripts read the Hugging Face layout; the Meta layout differs in the loader alone.
    scripts = ["llama3_naive.py", "llama3_paged.py"] if layout == "hugging_face" else ["llama3_paged.py"]
    for script in scripts:
        out = run_script(script, 4, "--ckpt-dir", ckpt, "--device", "cpu", "--max-new-tokens", 10,
                         "--max-seq-len", 1024, "--json", tmp_path / "run.json")
        assert out.returncode == 0, out.stderr
        for request in json.loads((tmp_path / "run.json").read_text())["requests"]:
            with torch.no_grad():
                expected = hf.generate(torch.tensor([request["prompt_tokens"]]), do_sample=False,
                                       max_new_tokens=10, eos_token_id=[128001, 128009],
                                       pad_token_id=0)[0, len(request["prompt_tokens"]):].tolist()
            if expected and expected[-1] in (128001, 128009):
                expected = expected[:-1]
            assert request["output_tokens"] == expected


def test_find_max_batch_returns_the_batch_the_pool_fits_exactly(tmp_path):
    # Each request generates 3 tokens: its prompt plus 2 decode inputs are cached when it ends,
    # all at the same step. A pool of exactly the first k requests' blocks fits k and not k + 1.
    block_size, k = 16, 5
    requests = load_prompts(9, load_tokenizer())
    assert all(r.num_reply_tokens >= 3 for r in requests)
    blocks = [math.ceil((len(r.prompt_tokens) + 2) / block_size) for r in requests]
    out = run_script("llama3_paged.py", 9, *TINY, "--max-new-tokens", 3, "--block-size", block_size,
                     "--num-blocks", sum(blocks[:k]), "--find-max-batch", "--json", tmp_path / "f.json")
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "f.json").read_text())
    assert record["largest_batch_that_completes"] == k
    outcomes = {a["num_requests"]: a["outcome"] for a in record["attempts"]}
    assert outcomes[k] == "completes" and outcomes[k + 1] == "out of KV blocks"
    assert f"Largest batch that completes: {k} requests" in out.stdout
    # Random weights: the replay of the first attempt's pool named the boundary, so the search
    # ran 9 (out of blocks), then k and k + 1, where bisection would have run 9, 4, 6 and 5.
    assert [a["num_requests"] for a in record["attempts"]] == [9, k, k + 1]


# slow: 14 s of script runs; tests/test_scheduler.py checks the same tokens in-process
@pytest.mark.slow
def test_continuous_batching_in_a_small_pool_preempts_and_keeps_every_token(tmp_path):
    # The smallest pool of blocks of 16 in which the longest request fits alone.
    requests = load_prompts(6, load_tokenizer())
    new_tokens = [min(30, r.num_reply_tokens) for r in requests]
    pool = max(math.ceil((len(r.prompt_tokens) + n - 1) / 16) for r, n in zip(requests, new_tokens))
    for name, extra in [("static", []), ("continuous", ["--continuous", "--num-blocks", pool])]:
        out = run_script("llama3_paged.py", 6, *TINY, "--max-new-tokens", 30, "--block-size", 16,
                         *extra, "--json", tmp_path / f"{name}.json")
        assert out.returncode == 0, out.stderr
    assert "Scheduling: continuous, 6 requests completed" in out.stdout
    static, continuous = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("static", "continuous"))
    assert [r["output_tokens"] for r in continuous["requests"]] == [r["output_tokens"] for r in static["requests"]]
    assert continuous["preemptions"] > 0 and continuous["max_running"] < 6 == static["max_running"]
    assert static["preemptions"] == 0
    timeline = continuous["timeline"]
    assert timeline[0]["waiting_requests"] > 0 and timeline[-1]["waiting_requests"] == 0
    assert max(s["running_requests"] for s in timeline) <= continuous["max_running"]
    assert all(s["reserved_bytes"] <= continuous["memory"]["kv_pool_bytes"] for s in timeline)
    png = tmp_path / "both.png"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_memory.py"), tmp_path / "static.json",
                          tmp_path / "continuous.json", "-o", png], capture_output=True, text=True)
    assert out.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", out.stderr


def test_samples_and_a_system_prompt_share_blocks_and_say_how_much(tmp_path):
    system = "You are a terse assistant. " * 12  # about 70 tokens: four full blocks of 16
    runs, printed = {}, {}
    for name, extra in [("shared", []), ("unshared", ["--no-sharing"])]:
        out = run_script("llama3_paged.py", 4, *TINY, "--max-new-tokens", 8, "--block-size", 16,
                         "--samples", 3, "--system-prompt", system, *extra,
                         "--json", tmp_path / f"{name}.json")
        assert out.returncode == 0, out.stderr
        runs[name], printed[name] = json.loads((tmp_path / f"{name}.json").read_text()), out.stdout
    assert "sharing saved" in printed["shared"] and "Sharing:" not in printed["unshared"]
    shared, unshared = runs["shared"], runs["unshared"]
    outputs = [r["output_tokens"] for r in shared["requests"]]
    assert outputs == [r["output_tokens"] for r in unshared["requests"]]
    assert [r["sample"] for r in shared["requests"]] == [0, 1, 2] * 4
    assert all(outputs[3 * i] == outputs[3 * i + k] for i in range(4) for k in (1, 2)), "greedy"
    s, u = shared["sharing"], unshared["sharing"]
    assert s["samples_forked"] == 8 and u["samples_forked"] == 0 and not u["prefix_caching"]
    # The first request computes the common beginning (the system turn and the user turn's
    # header); the other three find its full blocks.
    prompts = [r["prompt_tokens"] for r in shared["requests"]]
    common = next(i for i in range(len(prompts[0])) if len({tuple(p[:i + 1]) for p in prompts}) > 1)
    assert common > s["system_prompt_tokens"] > 64
    assert s["prompt_tokens_from_prefix_cache"] == 3 * (common // 16) * 16
    assert s["saved_bytes_at_fullest_step"] > 0 == u["saved_bytes_at_fullest_step"]
    assert shared["memory"]["at_fullest_step"]["reserved_bytes"] == s["at_fullest_step_reserved_bytes"]
    assert u["at_fullest_step_unshared_bytes"] == u["at_fullest_step_reserved_bytes"]


@pytest.mark.parametrize("fits, fails, predicted, expected", [
    (0, 9, 5, 5),  # the replay's boundary: it should complete
    (5, 9, 5, 6),  # it did: the batch past it, which should not
    (0, 5, 5, 2),  # the replay was wrong (5 did not complete): bisection from here
    (6, 9, 5, 7),  # wrong the other way (6 completed)
    (0, 9, None, 4),  # lengths unknown (real weights): bisection
])
def test_the_search_tries_the_replays_boundary_while_it_is_in_doubt(fits, fails, predicted, expected):
    from features.max_batch import next_attempt
    assert next_attempt(fits, fails, predicted) == expected
