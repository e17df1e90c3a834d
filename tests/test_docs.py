"""The README stays a ten-minute read, its links lead somewhere, and its commands still parse."""

import re
import shlex

import pytest
from conftest import ROOT

from engine.config import Config, cache_of, parser_with_features
from tools import (bench, capacity_table, cascade_cost, decode_kernel_cost, graph_cost,
                   latency_sweep, nano_vllm_bench, power_cap, preemption_cost, same_tokens,
                   serve_bench)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target), web links left out below


def test_the_readme_is_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert targets or page.name != "README.md"
    assert not missing, missing


def parse(command: str) -> None:
    """Parse a quoted command line with the program's own flags, without running it."""
    program, *argv = shlex.split(command.split("#")[0])[1:]
    tools = {"tools/bench.py": bench, "tools/cascade_cost.py": cascade_cost,
             "tools/decode_kernel_cost.py": decode_kernel_cost, "tools/graph_cost.py": graph_cost,
             "tools/latency_sweep.py": latency_sweep, "tools/nano_vllm_bench.py": nano_vllm_bench,
             "tools/preemption_cost.py": preemption_cost, "tools/power_cap.py": power_cap,
             "tools/serve_bench.py": serve_bench}
    if program in ("llama3_paged.py", "llama3_naive.py", "llama3_virtual.py"):
        parser_with_features(cache_of(program)).parse_args(argv)
    elif program in tools:
        tools[program].parse_arguments(argv)
    elif program == "serve.py":  # its own flags, and the rest are the scripts'
        import serve
        args, engine_argv = serve.argument_parser().parse_known_args(argv)
        Config.from_options(args.cache, {}, engine_argv)
    else:
        assert program in ("tools/plot_memory.py", "tools/build_prompts.py", "-m"), program


def readme_commands() -> list:
    """The `python ...` commands of README.md: its indented blocks and its inline code."""
    text = (ROOT / "README.md").read_text()
    blocks = [line.strip() for line in text.splitlines() if line.startswith("    python")]
    flat = text.replace("\n", " ")
    inline = re.findall(r"`(python [^`]+)`", flat)
    bare = ["python " + c for c in re.findall(r"`(llama3_\w+\.py \d[^`]*)`", flat)]
    return blocks + inline + bare


@pytest.mark.parametrize("command", readme_commands())
def test_every_command_in_the_readme_parses_with_the_current_flags(command, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device's default: cuda
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    parse(command)


def test_a_command_with_a_flag_that_no_longer_exists_fails_to_parse(capsys):
    with pytest.raises(SystemExit):
        parse("python llama3_paged.py 7 --random-weights --no-such-flag")
    with pytest.raises(SystemExit):
        parse("python tools/bench.py paged --workload W9")


def parsers() -> dict:
    """Every program's argument parser, caught as it parses (a tool builds its own inside)."""
    import argparse
    caught = {}
    for cache in ("paged", "naive", "virtual"):
        caught[f"llama3_{cache}.py"] = parser_with_features(cache)
    real_parse, tool_name = argparse.ArgumentParser.parse_args, None

    def catch(parser, args=None, namespace=None):
        caught[tool_name] = parser
        raise SystemExit(0)
    argparse.ArgumentParser.parse_args = catch
    try:
        for tool in (bench, capacity_table, cascade_cost, decode_kernel_cost, graph_cost,
                     latency_sweep, nano_vllm_bench, preemption_cost, power_cap, same_tokens):
            tool_name = tool.__name__
            with pytest.raises(SystemExit):
                tool.parse_arguments([])
    finally:
        argparse.ArgumentParser.parse_args = real_parse
    return caught


def test_every_flag_is_described_in_one_line_at_100_columns(monkeypatch):
    import argparse
    monkeypatch.setenv("COLUMNS", "100")
    too_long = []
    for prog, parser in parsers().items():
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for p in [parser, *(c for a in sub for c in a.choices.values())]:
            formatter = p._get_formatter()
            for action in p._actions:
                if action.help:
                    text = formatter._expand_help(action)
                    if len(formatter._split_lines(text, 100 - 24)) > 1:
                        too_long.append((prog, action.option_strings or action.dest))
    assert not too_long, too_long


@pytest.mark.parametrize("tool", [same_tokens, capacity_table])
def test_a_tools_help_keeps_its_example_commands_one_per_line(tool, capsys, monkeypatch):
    # Its epilog is the docstring after the first paragraph: the commands, then the prose,
    # which is filled to the width as argparse fills text.
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        tool.parse_arguments(["--help"])
    shown = capsys.readouterr().out.splitlines()
    examples = tool.__doc__.split("\n\n")[1].splitlines()
    assert all(line in shown for line in examples)
    assert all(len(line) <= 100 for line in shown)
