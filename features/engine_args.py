"""The flags of the features, checked, and what they choose before an engine is built: the model
and prompts loaded, and the attention (vLLM's EngineArgs).

llama3_paged.py is the lesson: a static batch, greedy, decoded kernel by kernel. Each feature is
a file in features/ that extends the lesson's classes. This file adds their flags to a script's
and checks how they combine, before minutes of loading the model: the scripts' feature runs
(`python -m engine.run`, engine/run.py) parse their command line here, and a served engine
(engine/llm_engine.py) its flags, from serve.py's command line or the Python API's keywords.
"""

import argparse
import dataclasses
from pathlib import Path
import math
from typing import Callable, NamedTuple

import torch

import llama3_naive
import llama3_paged as lesson
from engine.kv_cache import FlashAttentionAfterPrefix, TorchAttentionAfterPrefix
from engine.pools import allocate_naive, allocate_paged
from plumbing.cli import (UserError, add_pool_arguments, argument_parser, fraction, gigabytes,
                          importable, kv_cache_dtype, positive_int, read_text_input,
                          refuse_output_over_input, request_rate, temperature, torchrun_process,
                          writable_file)
from plumbing import inputs
from plumbing.inputs import Run

MAX_BEAM_WIDTH = 1024  # beams per prompt: more than any search uses, far fewer than a vocabulary
MAX_SEQUENCES = 1_000_000  # N x --samples: far more than any GPU holds, few enough to count


def add_feature_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of every feature, beside the lesson's (plumbing/cli.py's argument_parser)."""
    p.add_argument("--attn", choices=["auto", "flash", "triton", "torch"], default="auto",
                   help="auto: flash-attn on CUDA (else Triton), torch on the CPU")
    p.add_argument("--samples", type=positive_int, default=1, metavar="K",
                   help="completions per prompt (vLLM's n), sharing its blocks")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0: greedy; above 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-p", type=fraction, default=1.0,
                   help="with --temperature: sample within this top probability")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system-prompt", metavar="TEXT",
                        help="a system turn that begins every request (default: none)")
    system.add_argument("--system-prompt-file", type=Path, metavar="PATH",
                        help="the system turn, from a file (system_prompt.txt: about 1,000 tokens)")
    p.add_argument("--continuous", action="store_true",
                   help="a stream: requests queue, join as blocks free up, are preempted when out")
    p.add_argument("--max-running", type=positive_int,
                   help="with --continuous: most requests running at once")
    p.add_argument("--request-rate", type=request_rate, default=math.inf, metavar="R",
                   help="with --continuous: Poisson arrivals per second")
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                   help="with --continuous: what a preempted request keeps")
    p.add_argument("--swap-space", type=gigabytes, metavar="GB",
                   help="with --preemption swap: host memory for swapped K/V (default: 4)")
    p.add_argument("--max-batched-tokens", type=positive_int, metavar="TOKENS",
                   help="with --continuous: steps that decode and prefill, up to TOKENS tokens")
    p.add_argument("--eager", action="store_true",
                   help="kernel by kernel from Python: no CUDA graphs, no compiled layers")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step while the GPU runs the one before (default: on CUDA)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse small kernels with torch.compile (default: on CUDA unless --eager)")
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype, default="auto", metavar="{auto,fp8}",
                   help="fp8 (or fp8_e4m3): K/V in float8, half the bytes")
    p.add_argument("--find-max-batch", action="store_true",
                   help="bisect for the largest batch, at most N, that completes")
    p.add_argument("--json", type=writable_file, metavar="PATH",
                   help="write arguments, token ids, memory and throughput here")


def add_paged_feature_arguments(parser) -> None:
    """Features of llama3_paged.py's pool alone."""
    add_pool_arguments(parser)
    parser.add_argument("--decode-kernel", choices=["flash", "triton"], default="flash",
                        help="with flash-attn: the decode kernel (triton: faster)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="with a system prompt: compute every prompt in full, reuse no block")
    parser.add_argument("--cascade", choices=["auto", "on", "off"], default="auto",
                        help="with a cached system prompt: read it once a step")
    parser.add_argument("--beam-width", type=beam_width, default=1, metavar="K",
                        help="beam search: K beams per prompt, sharing blocks")
    parser.add_argument("--no-sharing", action="store_true",
                        help="every sequence holds its own blocks (the comparison run)")


def beam_width(text: str) -> int:
    value = positive_int(text)
    if value > MAX_BEAM_WIDTH:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_BEAM_WIDTH:,} beams, got {text}")
    return value


CACHES = ("naive", "paged", "virtual")  # each the cache of its script, llama3_<cache>.py


class ScriptParts(NamedTuple):
    module: object  # llama3_<cache>.py
    add_pool_arguments: Callable  # the flags of its pool
    allocate_kv_cache: Callable  # run -> (cache, manager), with the features its flags ask for


def script_parts(cache: str) -> ScriptParts:
    """What differs between the three scripts. The virtual script is imported for its own runs
    only: the others never touch CUDA's virtual memory."""
    if cache == "virtual":
        import llama3_virtual
        return ScriptParts(llama3_virtual, llama3_virtual.add_layout_arguments,
                           llama3_virtual.allocate_kv_cache)
    return {"paged": ScriptParts(lesson, add_paged_feature_arguments, allocate_paged),
            "naive": ScriptParts(llama3_naive, lambda parser: None, allocate_naive)}[cache]


def cache_of(script: str) -> str:
    """llama3_paged.py -> paged"""
    return script.removeprefix("llama3_").removesuffix(".py")


def parser_with_features(cache: str, served: bool = False) -> argparse.ArgumentParser:
    """`python llama3_<cache>.py`'s flags: the lesson's, every feature's and its pool's. served:
    a served engine's (serve.py, LLM): no N, as requests come one at a time, and continuous
    batching, as they come over time."""
    parts = script_parts(cache)
    parser = argument_parser(f"llama3_{cache}.py", parts.module.__doc__, requests=not served)
    add_feature_arguments(parser)
    if served:
        parser.set_defaults(continuous=True)
    # The paged and the virtual script's own flags, as their defaults set them, for the other scripts
    # (a parser's defaults win over its flags': these are the same).
    parser.set_defaults(beam_width=1, decode_kernel="flash", cascade="auto", no_prefix_cache=False,
                        no_sharing=False, sync_mapping=False)
    parts.add_pool_arguments(parser)
    return parser


def parse_script_arguments(cache: str, argv: list[str]):
    """argv parsed as `python llama3_<cache>.py argv` would parse it (features included)."""
    return parser_with_features(cache).parse_args(argv)


PER_REQUEST = {  # the scripts' flags that choose what a run asks, not the engine: each request's
    # (--seed stays: it draws --random-weights, and a request's seed its samples)
    "temperature": "its temperature", "top_p": "its top_p",
    "samples": "its n", "max_new_tokens": "its max_tokens",
    "system_prompt": "a system message of its own",
    "system_prompt_file": "a system message of its own",
    "request_rate": "when its client sends it", "beam_width": None, "find_max_batch": None,
    "show_all": None, "json": None,  # a script's search, report and answers: no request's
}


def engine_arguments(cache: str, options: dict, argv: list[str] = ()) -> argparse.Namespace:
    """A served engine's flags: `argv` as on the scripts' command line (serve.py's: a bad one
    exits 2 with the usage), then `options` by their names with underscores (LLM(model="tiny",
    random_weights=True, block_size=16, ...)), each value checked as its flag checks it (a bad
    one raises UserError). Those that build the engine only: a flag that chooses what a run asks
    (PER_REQUEST) is refused in one paragraph, not taken and silently ignored."""
    if cache not in CACHES:
        raise UserError(f"cache {cache!r}: choose one of {', '.join(CACHES)}.")
    parser = parser_with_features(cache, served=True)
    defaults = parser.parse_args([])
    args = with_options(parser, parser.parse_args(list(argv)), cache, options)
    asked = {"--" + name.replace("_", "-"): instead for name, instead in PER_REQUEST.items()
             if getattr(args, name) != getattr(defaults, name)}  # flag -> what replaces it
    if asked:
        flags = ", ".join(asked)
        instead = "; ".join(f"{flag}: {what}" for flag, what in asked.items() if what)
        raise UserError(f"{flags}: a served engine (serve.py, engine/llm.py's LLM) takes the "
                        f"flags that build it (model, cache, pool, kernels), and each request "
                        f"chooses the rest for itself" + (f" ({instead})" if instead else "")
                        + ". Drop " + ("it." if len(asked) == 1 else "them."))
    return args


def script_arguments(cache: str, num_requests: int, options: dict) -> argparse.Namespace:
    """`python llama3_<cache>.py N` with `options` by their names with underscores, each checked
    as its flag checks it (tools/bench.py's runs)."""
    parser = parser_with_features(cache)
    return with_options(parser, parser.parse_args([str(num_requests)]), cache, options)


def with_options(parser, args: argparse.Namespace, cache: str, options: dict):
    """`args`, with each of `options` set as its flag would set it (`option_value`)."""
    flags = {action.dest: action for action in parser._actions if action.option_strings}
    for name, value in options.items():
        setattr(args, name, option_value(flags, cache, name, value))
    return args


def option_value(flags: dict, cache: str, name: str, value):
    """A keyword's value as its flag takes it: a switch True or False; a value through the flag's
    own check (`type`, `choices`), so that LLM(...) and the command line accept the same; None
    for the flag's default."""
    action, flag = flags.get(name), "--" + name.replace("_", "-")
    script = f"llama3_{cache}.py"
    if action is None:
        raise UserError(f"{name}= is no keyword of the engine: its keywords are {script}'s flags, "
                        f"'_' for '-' (python {script} --help lists them).")
    if value is None:
        return action.default
    if action.nargs == 0:  # a switch: --random-weights, --overlap/--no-overlap
        if not isinstance(value, bool):
            raise UserError(f"{flag}: expected True or False, got {value!r}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Path)):
        raise UserError(f"{flag}: expected a value as {script} {flag} takes it, got {value!r}.")
    try:
        checked = action.type(str(value)) if action.type else str(value)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise UserError(f"{flag}: {e}") from e
    if action.choices is not None and checked not in action.choices:
        raise UserError(f"{flag}: choose from {', '.join(map(str, action.choices))}; got "
                        f"{value!r}.")
    return checked


def load(args) -> Run:
    """Check the features' flags, then load tokenizer, prompts and model: all before any KV
    memory."""
    if args.max_running and not args.continuous:
        raise UserError("--max-running limits continuous batching; add --continuous (a static "
                        "batch runs all N requests at once).")
    if not math.isinf(args.request_rate) and not args.continuous:
        raise UserError("--request-rate spreads requests over time, which only continuous "
                        "batching can admit as they arrive; add --continuous.")
    if args.preemption == "swap" and not args.continuous:
        raise UserError("--preemption swap chooses how continuous batching preempts; a static "
                        "batch never preempts. Add --continuous.")
    if args.max_batched_tokens and not args.continuous:
        raise UserError("--max-batched-tokens sets the size of continuous batching's mixed "
                        "steps; add --continuous (a static batch prefills every prompt first).")
    if args.compile and args.device.type != "cuda":  # an explicit --compile
        raise UserError("--compile fuses the model's small kernels into Triton kernels, which "
                        "run on CUDA only: drop it on this device.")
    if args.top_p < 1 and args.temperature == 0:
        raise UserError("--top-p chooses among the likeliest tokens when sampling, and "
                        "--temperature 0 (the default) is greedy: add --temperature, e.g. 0.8.")
    if args.overlap:  # refused now, not after minutes of loading the model
        refuse_overlap(why_not_overlapped(args))
    if args.beam_width > 1 and (args.continuous or args.samples > 1
                                               or args.temperature > 0 or args.find_max_batch):
        raise UserError("--beam-width runs its own static search, greedy by summed "
                        "log-probabilities: it does not combine with --continuous, --samples, "
                        "--temperature or --find-max-batch. Drop those flags.")
    no_system_prompt = args.system_prompt is None and args.system_prompt_file is None
    if args.cascade == "on" and no_system_prompt:
        raise UserError("--cascade on reads a cached system prompt's blocks once per step, and this "
                        "run has no system prompt: add --system-prompt-file or drop --cascade.")
    if args.no_prefix_cache and no_system_prompt:
        raise UserError("--no-prefix-cache turns off the prefix cache, which is on only with a "
                        "system prompt, and this run has none: drop --no-prefix-cache.")
    if args.swap_space is not None and args.preemption != "swap":
        raise UserError("--swap-space sizes the host memory that --preemption swap copies "
                        "preempted K/V to, and this run recomputes them: add --preemption swap "
                        "(with --continuous) or drop --swap-space.")
    if args.find_max_batch and args.continuous:
        raise UserError("--find-max-batch finds the largest static batch that fits the KV cache; "
                        "with --continuous every batch completes, as requests wait and are "
                        "preempted when blocks run out. Drop one of the two.")
    if args.num_requests * args.samples > MAX_SEQUENCES:
        raise UserError(f"N x --samples = {args.num_requests * args.samples:,} sequences; this "
                        f"project runs at most {MAX_SEQUENCES:,} at once.")
    refuse_output_over_input(args.json, [*inputs.inputs_of(args), args.system_prompt_file],
                             "--json")
    model_class = lesson.Llama
    if torchrun_process() is not None:  # torchrun's processes split the model
        from features import tensor_parallel
        tensor_parallel.start(args)
        model_class = tensor_parallel.SplitLlama
    decode_kernel = args.decode_kernel
    if args.kv_cache_dtype == "fp8":
        refuse_fp8_combinations(args, no_system_prompt)
        if args.device.type == "cuda" and (args.attn == "flash" or args.attn == "auto"
                                           and importable("flash_attn")):
            decode_kernel = "triton"  # flash-attn 2 reads no float8: Triton decodes, flash prefills
    attention = choose_attention(args.attn, args.device, decode_kernel, args.dtype)
    if args.compile is None:
        args.compile = compiles_by_default(args, attention)
    sequences = args.samples * args.beam_width
    run = inputs.load_run(args, model_class, attention, system_prompt(args), sequences)
    if args.kv_cache_dtype == "fp8":
        from features.fp8_cache import FP8
        run = dataclasses.replace(run, kv_cache_dtype=FP8)
    return run


def refuse_fp8_combinations(args, no_system_prompt: bool) -> None:
    """What the FP8 cache does not serve yet: mixed steps, whose every step would dequantize the
    running requests' blocks (features/fp8_cache.py) and the cascade's 16-bit kernels."""
    what, why = (
        ("--max-batched-tokens", "each mixed step would copy every running request's blocks out "
         "of float8") if args.max_batched_tokens else
        ("--cascade on", "the cascade's kernels read 16-bit blocks (--cascade auto leaves it "
         "off)") if args.cascade == "on" and not no_system_prompt else (None, None))
    if what:
        raise UserError(f"--kv-cache-dtype fp8 does not combine with {what} yet: {why}. Drop one "
                        f"of the two.")


def why_not_overlapped(args) -> str | None:
    """What keeps a run on the core loop, if anything: each of these reads on the host what the
    step in flight has not brought back yet, or changes what it may still touch."""
    if args.continuous and args.max_batched_tokens:
        return "mixed steps read the running requests' last tokens on the host"
    if args.continuous and args.preemption == "swap":
        return "swapping checks on the host whether a victim has its last token"
    if args.sync_mapping or (args.script == "llama3_virtual.py" and args.find_max_batch):
        return ("mapping in the loop (--sync-mapping; --find-max-batch's runs too) unmaps a "
                "finished request's pages at once")
    return None


def refuse_overlap(why_not: str | None) -> None:
    """An explicit --overlap that the run cannot have ends here, with the reason."""
    if why_not:
        raise UserError(f"--overlap does not combine with this run: {why_not}. Drop --overlap.")


def compiles_by_default(args, attention) -> bool:
    """Compiled layers (engine/compiled_layers.py) where nothing stands in their way: CUDA, a
    GPU attention kernel, and not --eager. In bf16 they round otherwise than the eager kernels,
    so tokens can differ from an --eager run's; --no-compile keeps CUDA graphs without them."""
    return args.device.type == "cuda" and attention.name != "torch" and not args.eager


def system_prompt(args) -> str | None:
    if args.system_prompt_file is None:
        return args.system_prompt
    try:
        return read_text_input(args.system_prompt_file, "--system-prompt-file")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Could not read --system-prompt-file {args.system_prompt_file}: {e}") from e


def choose_attention(name: str, device: torch.device, decode_kernel: str = "flash",
                     dtype: str | None = None):
    """`auto` takes flash-attn on CUDA when it imports, else the Triton kernel on CUDA, else the
    PyTorch reference; for --dtype fp32 the reference, as both kernels read fp16 and bf16 only.
    decode_kernel "triton" (llama3_paged.py) decodes through the Triton kernel beside
    flash-attn's prefill."""
    if name == "auto":
        name = ("torch" if device.type != "cuda" or dtype == "fp32" else
                "flash" if importable("flash_attn") else "triton" if importable("triton") else "torch")
    if name != "torch" and dtype == "fp32":
        raise UserError(f"--attn {name} reads fp16 and bf16 only: with --dtype fp32 use --attn "
                        f"torch (the PyTorch reference), or --dtype bf16.")
    if decode_kernel == "triton" and name != "flash":
        raise UserError(f"--decode-kernel triton pairs the Triton decode kernel with flash-attn's "
                        f"prefill, and this run attends with --attn {name}: use --attn flash "
                        f"(with flash-attn installed), or drop --decode-kernel.")
    if name == "torch":
        return TorchAttentionAfterPrefix()
    if device.type != "cuda":
        raise UserError(f"--attn {name} needs a CUDA device; use --attn torch on the CPU.")
    if name == "triton":
        if not importable("triton"):
            raise UserError("--attn triton: Triton is not installed (it comes with PyTorch's CUDA "
                            "builds); use --attn torch.")
        from features.triton_attention import TritonAttention
        return TritonAttention()
    if not importable("flash_attn"):
        raise UserError("--attn flash: flash-attn is not installed. Install it after torch with "
                        "`pip install flash-attn --no-build-isolation`, or use --attn triton.")
    if decode_kernel == "triton":
        from features.triton_attention import TritonDecode
        return TritonDecode()
    return FlashAttentionAfterPrefix()