"""The engine's settings: `Config`, one frozen dataclass, filled once and checked once, before
minutes of loading the model (vLLM's EngineArgs; nano-vllm's config.py).

It is filled from a command line (`Config.from_args`: the scripts' feature runs, serve.py) or
from keywords (`Config.from_options`: LLM(model="tiny", block_size=16, ...)), each keyword's
value checked as its flag checks it, never turned into a made-up command line. A field is a
flag's name with '_' for '-'; its default and its check are the flag's, defined once, in the
parser (plumbing/cli.py's argument_parser for the lesson's, this file's for the features').
"""

import argparse
import dataclasses
import math
from pathlib import Path

import torch

import llama3_paged as lesson
from engine.seams import plug
from plumbing import inputs
from plumbing.cli import (UserError, add_pool_arguments, argument_parser, fraction, gigabytes,
                          kv_cache_dtype, positive_int, refuse_output_over_input, request_rate,
                          seed, temperature, writable_file)

MAX_BEAM_WIDTH = 1024  # beams per prompt: more than any search uses, far fewer than a vocabulary
MAX_SEQUENCES = 1_000_000  # N x --samples: far more than any GPU holds, few enough to count
CACHES = ("naive", "paged", "virtual")  # each the cache of its script, llama3_<cache>.py


@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting of a run, by its flag's name. Frozen: a part that needs another value (the
    tensor-parallel start, compiled layers' default) makes a new Config with
    `dataclasses.replace`, which checks it again."""
    # what runs
    script: str  # llama3_<cache>.py: which cache the engine allocates
    num_requests: int  # N; 0 for a served engine, whose requests come one at a time
    # the model (the lesson's flags)
    model: str
    ckpt_dir: Path | None
    tokenizer: Path | None
    random_weights: bool
    device: torch.device
    dtype: str | None  # None: bf16 on CUDA, fp32 on the CPU
    seed: int
    # the requests of a script's run
    max_seq_len: int
    max_new_tokens: int
    samples: int
    temperature: float
    top_p: float
    system_prompt: str | None
    system_prompt_file: Path | None
    beam_width: int
    find_max_batch: bool
    logprobs: int | None  # every request's tokens' log-probabilities, with the top K
    max_logprobs: int  # the most top log-probabilities a token may ask for; 0: none at all
    show_all: bool
    json: Path | None
    # the KV pool
    gpu_memory_utilization: float | None
    kv_budget_gb: float | None
    kv_cache_dtype: str  # auto or fp8
    quantization: str | None  # fp8: the projections' weights in float8
    no_sharing: bool
    no_prefix_cache: bool
    # scheduling
    continuous: bool
    max_running: int | None
    request_rate: float  # inf: every request at the start
    preemption: str  # recompute or swap
    swap_space: float | None
    max_batched_tokens: int | None  # mixed steps of at most this many tokens
    # kernels
    attn: str
    decode_kernel: str
    cascade: str
    eager: bool
    overlap: bool | None  # None: on CUDA where the run allows it
    compile: bool | None  # None: on CUDA unless --eager (engine/loader.py)
    # the pool of one script only: the paged's blocks, the virtual's rows
    block_size: int | None = None
    num_blocks: int | None = None
    layout: str | None = None
    sync_mapping: bool = False

    @property
    def cache(self) -> str:
        return cache_of(self.script)

    @property
    def has_system_prompt(self) -> bool:
        return self.system_prompt is not None or self.system_prompt_file is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Config":
        return cls(**vars(args))

    @classmethod
    def from_options(cls, cache: str, options: dict, argv: list[str] = (),
                     num_requests: int | None = None) -> "Config":
        """`argv` as on the scripts' command line (serve.py's: a bad one exits 2 with the usage),
        then `options` by their names (LLM(model="tiny", block_size=16, ...)), each value
        checked as its flag checks it (a bad one raises UserError). num_requests: a script's run
        of N requests (the tools'); None: a served engine's, which takes the flags that build it
        only: a flag that chooses what a run asks (PER_REQUEST) is refused in one paragraph, not
        taken and silently ignored."""
        if cache not in CACHES:
            raise UserError(f"cache {cache!r}: choose one of {', '.join(CACHES)}.")
        served = num_requests is None
        parser = parser_with_features(cache, served)
        values = vars(parser.parse_args([*([] if served else [str(num_requests)]), *argv])) | {
            name: option_value(parser.flags, cache, name, value)
            for name, value in options.items()}
        if served:
            defaults = vars(parser.parse_args([]))
            refuse_per_request_flags({name: instead for name, instead in PER_REQUEST.items()
                                      if values[name] != defaults[name]})
        return cls(**values)

    def __post_init__(self):
        """How the flags combine, checked before anything loads."""
        if self.system_prompt is not None and self.system_prompt_file is not None:
            raise UserError("--system-prompt and --system-prompt-file each give the system turn: "
                            "choose one.")
        if not self.continuous:
            needs_continuous = [
                ("--max-running", "limits continuous batching (a static batch runs all N "
                 "requests at once)", self.max_running),
                ("--request-rate", "spreads requests over time, which only continuous batching "
                 "can admit as they arrive", not math.isinf(self.request_rate)),
                ("--preemption swap", "chooses how continuous batching preempts (a static batch "
                 "never preempts)", self.preemption == "swap"),
                ("--max-batched-tokens", "sets the size of continuous batching's mixed steps (a "
                 "static batch prefills every prompt first)", self.max_batched_tokens)]
            for flag, why, asked in needs_continuous:
                if asked:
                    raise UserError(f"{flag} {why}; add --continuous.")
        if self.compile and self.device.type != "cuda":  # an explicit --compile
            raise UserError("--compile fuses the model's small kernels into Triton kernels, "
                            "which run on CUDA only: drop it on this device.")
        if self.top_p < 1 and self.temperature == 0:
            raise UserError("--top-p chooses among the likeliest tokens when sampling, and "
                            "--temperature 0 (the default) is greedy: add --temperature, e.g. 0.8.")
        if self.overlap and (why_not := self.why_not_overlapped()):  # an explicit --overlap
            raise UserError(f"--overlap does not combine with this run: {why_not}. Drop "
                            f"--overlap.")
        if self.beam_width > 1 and (self.continuous or self.samples > 1
                                    or self.temperature > 0 or self.find_max_batch):
            raise UserError("--beam-width runs its own static search, greedy by summed "
                            "log-probabilities: it does not combine with --continuous, "
                            "--samples, --temperature or --find-max-batch. Drop those flags.")
        if self.logprobs is not None and self.beam_width > 1:
            raise UserError("--logprobs does not combine with --beam-width: the search scores "
                            "its beams by summed log-probabilities of its own. Drop one.")
        if self.logprobs is not None and self.logprobs > self.max_logprobs:
            raise UserError(f"--logprobs {self.logprobs} asks for more top tokens than "
                            f"--max-logprobs {self.max_logprobs}: raise --max-logprobs.")
        if self.cascade == "on" and not self.has_system_prompt:
            raise UserError("--cascade on reads a cached system prompt's blocks once per step, "
                            "and this run has no system prompt: add --system-prompt-file or "
                            "drop --cascade.")
        if self.no_prefix_cache and not self.has_system_prompt:
            raise UserError("--no-prefix-cache turns off the prefix cache, which is on only with "
                            "a system prompt, and this run has none: drop --no-prefix-cache.")
        if self.swap_space is not None and self.preemption != "swap":
            raise UserError("--swap-space sizes the host memory that --preemption swap copies "
                            "preempted K/V to, and this run recomputes them: add --preemption "
                            "swap (with --continuous) or drop --swap-space.")
        if self.find_max_batch and self.continuous:
            raise UserError("--find-max-batch finds the largest static batch that fits the KV "
                            "cache; with --continuous every batch completes, as requests wait "
                            "and are preempted when blocks run out. Drop one of the two.")
        if self.num_requests * self.samples > MAX_SEQUENCES:
            raise UserError(f"N x --samples = {self.num_requests * self.samples:,} sequences; "
                            f"this project runs at most {MAX_SEQUENCES:,} at once.")
        if self.quantization and self.device.type == "cuda" and self.dtype == "fp16":
            raise UserError("--quantization fp8 multiplies float8 with torch._scaled_mm, whose "
                            "scales per token and per channel give bf16 only: drop --dtype fp16 "
                            "(bf16 is the default on CUDA).")
        if self.kv_cache_dtype == "fp8":
            self.refuse_fp8_combinations()
        refuse_output_over_input(self.json, [*inputs.inputs_of(self), self.system_prompt_file],
                                 "--json")

    def refuse_fp8_combinations(self) -> None:
        """What the FP8 cache does not serve yet: mixed steps, whose every step would dequantize
        the running requests' blocks (features/fp8/cache.py), and the cascade's 16-bit kernels."""
        what, why = (
            ("--max-batched-tokens", "each mixed step would copy every running request's blocks "
             "out of float8") if self.max_batched_tokens else
            ("--cascade on", "the cascade's kernels read 16-bit blocks (--cascade auto leaves it "
             "off)") if self.cascade == "on" and self.has_system_prompt else (None, None))
        if what:
            raise UserError(f"--kv-cache-dtype fp8 does not combine with {what} yet: {why}. Drop "
                            f"one of the two.")

    def why_not_overlapped(self) -> str | None:
        """What keeps a run's steps in order, if anything: each of these reads on the host what
        the step in flight has not brought back yet, or changes what it may still touch."""
        if self.continuous and self.max_batched_tokens:
            return "mixed steps read the running requests' last tokens on the host"
        if self.continuous and self.preemption == "swap":
            return "swapping checks on the host whether a victim has its last token"
        if self.sync_mapping or (self.cache == "virtual" and self.find_max_batch):
            return ("mapping in the loop (--sync-mapping; --find-max-batch's runs too) unmaps a "
                    "finished request's pages at once")
        return None


PER_REQUEST = {  # the scripts' flags that choose what a run asks, not the engine: each request's
    # (--seed stays: it draws --random-weights, and a request's seed its samples)
    "temperature": "its temperature", "top_p": "its top_p",
    "samples": "its n", "max_new_tokens": "its max_tokens",
    "system_prompt": "a system message of its own",
    "system_prompt_file": "a system message of its own",
    "request_rate": "when its client sends it", "beam_width": None, "find_max_batch": None,
    "show_all": None, "json": None,  # a script's search, report and answers: no request's
    "logprobs": "its logprobs",
}


def refuse_per_request_flags(asked: dict) -> None:
    """A served engine takes the flags that build it; `asked`: flag name -> what replaces it."""
    if asked:
        flags = {"--" + name.replace("_", "-"): instead for name, instead in asked.items()}
        instead = "; ".join(f"{flag}: {what}" for flag, what in flags.items() if what)
        raise UserError(f"{', '.join(flags)}: a served engine (serve.py, engine/llm.py's LLM) "
                        f"takes the flags that build it (model, cache, pool, kernels), and each "
                        f"request chooses the rest for itself"
                        + (f" ({instead})" if instead else "")
                        + ". Drop " + ("it." if len(flags) == 1 else "them."))


def option_value(flags: dict[str, argparse.Action], cache: str, name: str, value):
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


# --- The flags ----------------------------------------------------------------------------------

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
    p.add_argument("--system-prompt", metavar="TEXT",
                   help="a system turn that begins every request (default: none)")
    p.add_argument("--system-prompt-file", type=Path, metavar="PATH",
                   help="or the system turn from a file (system_prompt.txt: 1,050 tokens)")
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
    add_fast_path_arguments(p)
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype, default="auto", metavar="{auto,fp8}",
                   help="fp8 (or fp8_e4m3): K/V in float8, half the bytes")
    p.add_argument("-q", "--quantization", choices=["fp8"],
                   help="fp8: the projections' weights in float8, half their bytes (vLLM's)")
    p.add_argument("--logprobs", type=logprobs_count, metavar="K",
                   help="each generated token's log-probability and the K likeliest (in --json)")
    p.add_argument("--max-logprobs", type=logprobs_count, default=20, metavar="K",
                   help="most top log-probabilities a request may ask for; 0: none")
    p.add_argument("--find-max-batch", action="store_true",
                   help="bisect for the largest batch, at most N, that completes")
    p.add_argument("--json", type=writable_file, metavar="PATH",
                   help="write arguments, token ids, memory and throughput here")


def add_fast_path_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's fast path, on by default on CUDA (tools/bench.py takes them too)."""
    p.add_argument("--eager", action="store_true",
                   help="kernel by kernel from Python: no CUDA graphs, no compiled layers")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step while the GPU runs the one before (default: on CUDA)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse small kernels with torch.compile (default: on CUDA unless --eager)")


def add_paged_feature_arguments(parser) -> None:
    """Features of llama3_paged.py's pool alone."""
    add_pool_arguments(parser)
    parser.add_argument("--decode-kernel", choices=["auto", "flash", "triton"], default="auto",
                        help="with flash-attn: the decode kernel (auto: the faster here)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="with a system prompt: compute every prompt in full, reuse no block")
    parser.add_argument("--cascade", choices=["auto", "on", "off"], default="auto",
                        help="with a cached system prompt: read it once a step")
    parser.add_argument("--beam-width", type=beam_width, default=1, metavar="K",
                        help="beam search: K beams per prompt, sharing blocks")
    parser.add_argument("--no-sharing", action="store_true",
                        help="every sequence holds its own blocks (the comparison run)")


MAX_LOGPROBS = 1024  # top tokens per token: far more than evaluations ask, far below a vocabulary


def logprobs_count(text: str) -> int:
    value = seed(text)  # a whole number from 0
    if value > MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {MAX_LOGPROBS}")
    return value


def beam_width(text: str) -> int:
    value = positive_int(text)
    if value > MAX_BEAM_WIDTH:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_BEAM_WIDTH:,} beams, got {text}")
    return value


def cache_of(script: str) -> str:
    """llama3_paged.py -> paged"""
    return script.removeprefix("llama3_").removesuffix(".py")


def parser_with_features(cache: str, served: bool = False) -> argparse.ArgumentParser:
    """`python llama3_<cache>.py`'s flags: the lesson's, every feature's and its pool's. served:
    a served engine's (serve.py, LLM): no N, as requests come one at a time, and continuous
    batching, as they come over time. The virtual script is imported for its own flags only:
    the others never touch CUDA's virtual memory."""
    if cache == "virtual":
        import llama3_virtual as script
        add_pool_flags = plug("virtual memory", "add_layout_arguments")
    else:
        import llama3_naive
        script, add_pool_flags = ((lesson, add_paged_feature_arguments) if cache == "paged"
                                  else (llama3_naive, lambda parser: None))
    parser = argument_parser(f"llama3_{cache}.py", script.__doc__, requests=not served)
    add_feature_arguments(parser)
    if served:
        parser.set_defaults(continuous=True)
    # The paged script's own flags for the other scripts, which have no choice of them: their
    # defaults, but flash-attn's decode kernel, the only one measured on their caches (the
    # paged flag's own default, auto, stands: a flag's default wins over the parser's).
    parser.set_defaults(beam_width=1, decode_kernel="flash", cascade="auto", no_prefix_cache=False,
                        no_sharing=False, sync_mapping=False)
    add_pool_flags(parser)
    return parser


def parse_script_arguments(cache: str, argv: list[str]) -> Config:
    """argv parsed as `python llama3_<cache>.py argv` would parse it (features included)."""
    return Config.from_args(parser_with_features(cache).parse_args(argv))
