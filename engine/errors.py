"""Failures a user can cause or hit, each ending the program with one paragraph and an exit code
(`setup.one_paragraph_errors` prints them).

This module imports nothing heavy: a script installs `exit_quietly_on_ctrl_c` before it imports
torch, so that Ctrl-C during the imports ends in one line too.
"""

import os
import signal
import sys

USAGE = 2  # bad arguments, missing or damaged files: fix the command and run again
OUT_OF_MEMORY = 1  # the run itself did not fit: fewer requests or a smaller cache
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT


class UserError(Exception):
    """Printed as a message without a traceback; the scripts exit with `exit_code`."""

    def __init__(self, message: str, exit_code: int = USAGE):
        super().__init__(message)
        self.exit_code = exit_code


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than asked for. Nothing was allocated."""

    def __init__(self, needed: int, free: int, total: int, block_size: int):
        self.needed, self.free, self.total, self.block_size = needed, free, total, block_size
        super().__init__(f"needed {needed} blocks of {block_size} tokens, {free} of {total} free")


def exit_quietly_on_ctrl_c(program: str) -> None:
    """Ctrl-C at any moment (importing, loading, inside the decode loop) prints one line and
    exits 130. os._exit, not an exception: no half-finished `finally` can print a traceback."""
    def interrupted(signum, frame):
        sys.stdout.flush()
        print(f"\n{program}: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)
    signal.signal(signal.SIGINT, interrupted)
