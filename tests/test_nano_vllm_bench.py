"""tools/nano_vllm_bench.py on the CPU: the config it gives nano-vllm has Llama 3 8B's matmuls,
its requests are tools/bench.py's workloads, and a wrong path ends in one paragraph."""

import subprocess
import sys

import pytest

import torch

from conftest import ROOT
from llama3_paged import Llama
from plumbing.inputs import PRESETS
from tools.bench import parse_arguments as bench_arguments
from tools.nano_vllm_bench import llama3_8b_as_qwen3, parse_arguments, workload_requests
from plumbing.inputs import load_prompts, load_tokenizer


def matmul_shapes(model) -> list:
    """Every weight matrix's shape but the embedding's, sorted: what a step multiplies by."""
    return sorted(tuple(p.shape) for name, p in model.named_parameters()
                  if p.dim() == 2 and "embed" not in name and "tok_embeddings" not in name)


def test_the_qwen3_config_has_llama3_8bs_matmuls():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(**{k: v for k, v in llama3_8b_as_qwen3(8192).items()
                            if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        qwen3 = Qwen3ForCausalLM(config)
        llama = Llama(PRESETS["8b"], torch.bfloat16)
    # Ours merges q, k, v into one matrix and gate and up into another, so the shapes differ
    # but not what they add up to, nor the widths they take in.
    ours, theirs = matmul_shapes(llama), matmul_shapes(qwen3)
    assert sum(a * b for a, b in ours) == sum(a * b for a, b in theirs)
    assert {b for _, b in ours} == {b for _, b in theirs}


def test_the_requests_are_bench_py_s_workloads():
    # W2 as the README gives it: 259,368 prompt tokens and 555,640 new tokens in all.
    a = parse_arguments(["somewhere", "--workload", "W2"])
    tokenizer = load_tokenizer(None, None)
    prompts, budgets = workload_requests(load_prompts(a.num_requests, tokenizer), tokenizer, a)
    assert (len(prompts), sum(map(len, prompts)), sum(budgets)) == (2000, 259_368, 555_640)
    # --new-tokens as bench.py's: 1 leaves the prefill alone, for both engines
    one = parse_arguments(["somewhere", "--workload", "W2", "--new-tokens", "1"])
    assert workload_requests(load_prompts(50, tokenizer), tokenizer, one)[1] == [1] * 50
    assert bench_arguments(["paged", "--workload", "W2", "--new-tokens", "1"]).new_tokens == 1
    w = parse_arguments(["somewhere"])
    assert vars(bench_arguments(["paged"])).items() >= {
        k: getattr(w, k) for k in ("num_requests", "new_tokens", "max_seq_len")}.items()


# slow: 5 s for one refusal, as the tools' other one-paragraph errors (tests/test_errors.py)
@pytest.mark.slow
def test_a_folder_without_nano_vllm_ends_in_one_paragraph(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "nano_vllm_bench.py"), str(tmp_path),
                          "--num-requests", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "holds no nanovllm package" in run.stderr and "Traceback" not in run.stderr
