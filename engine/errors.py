"""Failures a user can cause or hit, each ending the program with one paragraph and an exit code
(`setup.one_paragraph_errors` prints them).

This module imports nothing heavy: a script installs `exit_quietly_on_ctrl_c` before it imports
torch, so that Ctrl-C during the imports ends in one line too.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

USAGE = 2  # bad arguments, missing or damaged files: fix the command and run again
OUT_OF_MEMORY = 1  # the run itself did not fit: fewer requests or a smaller cache
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT


class UserError(Exception):
    """Printed as a message without a traceback; the scripts exit with `exit_code`."""

    def __init__(self, message: str, exit_code: int = USAGE):
        super().__init__(message)
        self.exit_code = exit_code


class OutOfBlocks(Exception):
    """The pool has fewer free blocks (or pages) than asked for. Nothing was allocated."""

    def __init__(self, needed: int, free: int, total: int, block_size: int, unit: str = "blocks"):
        self.needed, self.free, self.total, self.block_size = needed, free, total, block_size
        self.unit = unit
        super().__init__(f"needed {needed} {unit} of {block_size} tokens, {free} of {total} free")


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


def writable_file(text: str) -> Path:
    """Checked before the run, so that no result is computed only to be lost."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return path


def exit_quietly_on_ctrl_c(program: str) -> None:
    """Ctrl-C at any moment (importing, loading, inside the decode loop) prints one line and
    exits 130. os._exit, not an exception: no half-finished `finally` can print a traceback."""
    def interrupted(signum, frame):
        sys.stdout.flush()
        print(f"\n{program}: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)
    signal.signal(signal.SIGINT, interrupted)
