"""Tensor parallelism on the CPU: torchrun's two processes over gloo give the one process's tokens,
each holding half of every token's K/V, and no process holds the whole model."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, hf_to_meta, tiny_hf_model
from features import tensor_parallel
from llama3_paged import KVCache, Llama, TorchAttention
from plumbing.inputs import load_model, load_prompts, load_tokenizer, random_model

TINY = ["--random-weights", "--model", "tiny", "--device", "cpu"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def run(argv, out, processes: int) -> dict:
    """A script's --json, run in one process or over torchrun's two."""
    launcher = TORCHRUN if processes == 2 else [sys.executable]
    done = subprocess.run([*launcher, *argv, "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()) | {"stdout": done.stdout}


SLOW = pytest.mark.slow  # the suite's time: the same path as the cases kept in it


@pytest.mark.parametrize("script, flags", [
    pytest.param("llama3_paged.py", [], marks=SLOW),  # a static batch: continuous's path too
    ("llama3_paged.py", ["--continuous", "--num-blocks", "10"]),  # preemption and recompute
    pytest.param("llama3_paged.py", ["--samples", "2"], marks=SLOW),  # forks sharing blocks:
    # host bookkeeping, the same in every process (tests/test_sharing.py holds it in one)
    pytest.param("llama3_paged.py", ["--continuous", "--system-prompt", "You answer in one short "
                 "sentence, and you never give advice."], marks=SLOW),  # the prefix cache
    pytest.param("llama3_naive.py", [], marks=SLOW),
    pytest.param("llama3_paged.py", ["--kv-cache-dtype", "fp8", "--system-prompt", "You answer "
                 "in one short sentence."], marks=SLOW),  # each process scales by the largest of
    # all; prompts after the first read the system prompt from float8 blocks
    pytest.param("llama3_paged.py", ["--quantization", "fp8"], marks=SLOW),  # o's and down's
    # scales, a weight row's and a token's, the largest over both processes' slices
], ids=["static", "continuous-preempting", "samples", "system-prompt", "naive", "fp8",
        "fp8-weights"])
def test_two_processes_give_the_one_process_tokens_with_half_the_kv_per_token(script, flags,
                                                                              tmp_path):
    argv = [script, "4", *TINY, "--max-new-tokens", "40", *flags]
    one = run(argv, tmp_path / "one.json", 1)
    two = run(argv, tmp_path / "two.json", 2)
    assert [r["output_tokens"] for r in two["requests"]] == [r["output_tokens"] for r in one["requests"]]
    assert two["memory"]["kv_bytes_per_token"] * 2 == one["memory"]["kv_bytes_per_token"]
    assert two["stdout"].count("Fragmented Memory:") == 1, "rank 0 alone reports"
    summed = two["memory"]["summed_over_processes"]
    assert summed["processes"] == 2 and "gloo, on the CPU" in summed["transport"]
    # Each process held the same blocks, each block half the heads: the sum is the one process's.
    assert summed["fragmented_bytes"] == one["memory"]["fragmented_bytes"] > 0
    assert "Tensor parallel over 2 processes" in two["stdout"]
    if "--continuous" in flags and "10" in flags:
        assert two["preemptions"] == one["preemptions"] > 0


@SLOW
def test_four_processes_split_8_kv_heads_two_each_and_give_the_one_process_tokens(tmp_path):
    argv = ["llama3_paged.py", "2", "--random-weights", "--model", "1b", "--device", "cpu",
            "--max-new-tokens", "8", "--max-seq-len", "1024", "--json"]
    one = subprocess.run([sys.executable, *argv, str(tmp_path / "one.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=ENV)
    four = subprocess.run([*TORCHRUN[:-1], "4", *argv, str(tmp_path / "four.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert one.returncode == four.returncode == 0, four.stderr[-3000:]
    tokens = [[r["output_tokens"] for r in json.loads((tmp_path / f"{n}.json").read_text())
               ["requests"]] for n in ("one", "four")]
    assert tokens[0] == tokens[1]
    assert "(2 of 8 K/V heads)" in four.stdout


def as_rank(monkeypatch, rank: int, tp: int) -> None:
    """This process plays rank `rank` of `tp` while a model is built and loaded."""
    monkeypatch.setattr(tensor_parallel.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(tensor_parallel.dist, "get_world_size", lambda: tp)


def assert_slices_make_the_whole(whole, ranks) -> None:
    """Each rank's parameters are its slice, and the slices side by side are the whole model."""
    args = whole.args
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    for i, layer in enumerate(whole.layers):
        wq, wk, wv = layer.attention.wqkv.weight.split([q, kv, kv])
        parts = [m.layers[i].attention.wqkv.weight.split([q // 2, kv // 2, kv // 2]) for m in ranks]
        for j, w in enumerate((wq, wk, wv)):
            assert torch.equal(torch.cat([p[j] for p in parts]), w)
        gates_ups = [m.layers[i].feed_forward.w_gate_up.weight.chunk(2) for m in ranks]
        for j, w in enumerate(layer.feed_forward.w_gate_up.weight.chunk(2)):
            assert torch.equal(torch.cat([p[j] for p in gates_ups]), w)
        for name in ("attention.wo", "feed_forward.w_down"):
            assert torch.equal(torch.cat([m.layers[i].get_submodule(name).weight for m in ranks],
                                         dim=1), layer.get_submodule(name).weight)
        for m in ranks:
            assert torch.equal(m.layers[i].attention_norm.weight, layer.attention_norm.weight)
    heads = [m.output.weight[m.output.rows] for m in ranks]
    assert torch.equal(torch.cat(heads), whole.output.weight)
    assert all(torch.equal(m.tok_embeddings.weight, whole.tok_embeddings.weight) for m in ranks)
    matrices = lambda model: sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    assert all(matrices(m) * 2 == matrices(whole) for m in ranks), "the layers' matrices: half each"


def test_random_weights_drawn_whole_give_each_rank_its_slice(monkeypatch):
    whole = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=3)
    ranks = []
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        ranks.append(random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=3,
                                  share=tensor_parallel.SHARE))
    assert_slices_make_the_whole(whole, ranks)
    cache = KVCache(ranks[0].args, 4, 16, torch.float32, "cpu", TorchAttention())
    assert cache.block_shape == (4, 16, whole.args.n_kv_heads // 2, whole.args.head_dim)


@pytest.mark.parametrize("layout", ["hugging-face", "meta"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_loads_each_ranks_slice(monkeypatch, tmp_path, layout, tied):
    hf = tiny_hf_model(rope_scaling=False, tied=tied, original_context=8192)
    if layout == "meta":
        ckpt = hf_to_meta(hf, tmp_path)
    else:
        hf.save_pretrained(tmp_path)
        ckpt = tmp_path
    whole = load_model(Llama, ckpt, "cpu", torch.float32, 64)
    ranks = []
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        ranks.append(load_model(Llama, ckpt, "cpu", torch.float32, 64,
                                share=tensor_parallel.SHARE))
    assert_slices_make_the_whole(whole, ranks)


@SLOW  # each rank's slices are held in this process (test_a_checkpoint_loads_each_ranks_slice)
def test_a_real_checkpoint_over_two_processes_gives_the_one_process_tokens(tmp_path):
    """Loaded slice by slice, stopping at end-of-text as real weights do."""
    hf = tiny_hf_model(rope_scaling=True, tied=False, vocab_size=128_256)
    hf.save_pretrained(tmp_path / "ckpt")
    argv = ["llama3_paged.py", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--device", "cpu",
            "--max-new-tokens", "24"]  # the packaged tokenizer
    one = run(argv, tmp_path / "one.json", 1)
    two = run(argv, tmp_path / "two.json", 2)
    assert [r["output_tokens"] for r in two["requests"]] == [r["output_tokens"] for r in one["requests"]]


# slow: eight runs of two processes; the one-process search is tests/test_scripts.py's
@SLOW
def test_find_max_batch_over_two_processes_finds_the_one_process_batch(tmp_path):
    # The pool of exactly the first 5 requests' blocks, which one process fits and no more
    # (test_scripts.py): each process holds those blocks with half the heads, the block
    # manager is the one process's, and so is the answer.
    block_size, k = 16, 5
    requests = load_prompts(9, load_tokenizer())
    blocks = sum(math.ceil((len(r.prompt_tokens) + 2) / block_size) for r in requests[:k])
    argv = ["llama3_paged.py", "9", *TINY, "--max-new-tokens", "3", "--block-size",
            str(block_size), "--num-blocks", str(blocks), "--find-max-batch"]
    two = run(argv, tmp_path / "two.json", 2)
    assert two["largest_batch_that_completes"] == k
    outcomes = {a["num_requests"]: a["outcome"] for a in two["attempts"]}
    assert outcomes[k] == "completes" and outcomes[k + 1] == "out of KV blocks"
    assert two["stdout"].count("Largest batch that completes") == 1, "rank 0 alone reports"


@SLOW
def test_two_processes_search_the_one_process_beams(tmp_path):
    # Beam search is the host's bookkeeping over whole logits: every process keeps the same beams.
    argv = ["llama3_paged.py", "3", *TINY, "--max-new-tokens", "20", "--beam-width", "3"]
    one = run(argv, tmp_path / "one.json", 1)
    two = run(argv, tmp_path / "two.json", 2)
    tokens = [[[b["output_tokens"] for b in p] for p in r["beams"]] for r in (one, two)]
    assert tokens[0] == tokens[1]
    scores = [b["score"] for r in (one, two) for p in r["beams"] for b in p]
    # the all-reduces add the partial sums in another order: scores agree to float32 rounding
    assert scores[:len(scores) // 2] == pytest.approx(scores[len(scores) // 2:], rel=1e-5)
    assert two["memory"] == one["memory"], "the K/V of all heads, not rank 0's half"


SMALLEST_BUDGET = """
import os, sys
sys.path.insert(0, os.getcwd())
import torch.distributed as dist
from features import tensor_parallel
dist.init_process_group("gloo")
measured = 1000.0 + 250.0 * dist.get_rank()  # each process found other free memory
sys.stderr.write(f"rank {dist.get_rank()}: {tensor_parallel.least_over_processes(measured)}\\n")
dist.barrier()  # leave together, as plumbing/cli.py's scripts do: gloo aborts a process that
dist.destroy_process_group()  # exits while its group is still open
"""


def test_every_process_takes_the_smallest_of_their_kv_budgets(tmp_path):
    script = tmp_path / "smallest_budget.py"
    script.write_text(SMALLEST_BUDGET)
    done = subprocess.run([*TORCHRUN, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0: 1000.0" in done.stderr and "rank 1: 1000.0" in done.stderr


def before_torchruns_summary(stderr: str) -> str:
    """What the processes wrote, before torchrun's own log lines and traceback of who failed."""
    return stderr.split("/elastic/")[0]


@pytest.mark.parametrize("processes, argv, why", [
    pytest.param("2", ["serve.py", *TINY], "serve.py run in one process for now", marks=SLOW),
    pytest.param("4", ["llama3_paged.py", "3", *TINY], "n_kv_heads (2) does not split over 4 "
                 "processes", marks=SLOW),  # four processes start to say it
], ids=["serve", "heads"])
def test_what_is_not_split_yet_is_refused_in_one_paragraph(processes, argv, why):
    done = subprocess.run([*TORCHRUN[:-1], processes, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert done.returncode != 0
    assert why in done.stderr
    assert "Traceback" not in before_torchruns_summary(done.stderr)


RANK_ONE_FAILS = """
import os, sys
sys.path.insert(0, os.getcwd())
from engine import build, run
from plumbing.cli import UserError
if os.environ["RANK"] == "1":  # one process meets a failure the other does not
    def fails(*args, **kwargs):
        raise UserError("this process alone failed")
    build.make_runner = fails
run.main("llama3_paged.py", sys.argv[1:])
"""


def test_a_rank_that_raises_ends_both_processes_with_its_paragraph(tmp_path):
    script = tmp_path / "rank_one_fails.py"
    script.write_text(RANK_ONE_FAILS)
    start = time.monotonic()
    done = subprocess.run([*TORCHRUN, str(script), "3", *TINY], cwd=ROOT, capture_output=True,
                          text=True, timeout=150, env=ENV)
    assert time.monotonic() - start < 120, "no process waited out a hang"
    assert done.returncode != 0
    assert "llama3_paged.py (process 1 of 2): this process alone failed" in done.stderr
    ours = before_torchruns_summary(done.stderr)
    assert "Traceback" not in ours
    assert "llama3_paged.py (process 0 of 2): Another of this run's processes failed" in ours


# slow: a rank's failure reaches the other as the raising case above shows
@SLOW
def test_a_killed_rank_ends_the_other_within_bounded_time(tmp_path):
    launcher = subprocess.Popen([*TORCHRUN, "llama3_paged.py", "7", *TINY, "--max-new-tokens",
                                 "2000"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True, env=ENV)
    deadline = time.monotonic() + 120
    seen = b""
    while b"decode" not in seen and time.monotonic() < deadline:  # rank 0 is decoding
        seen += os.read(launcher.stderr.fileno(), 4096)
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 2, children
    os.kill(int(children[1]), signal.SIGKILL)
    start = time.monotonic()
    launcher.communicate(timeout=90)
    assert launcher.returncode != 0
    assert time.monotonic() - start < 90
    assert all(subprocess.run(["kill", "-0", c], capture_output=True).returncode != 0
               for c in children), "no rank is left running"
