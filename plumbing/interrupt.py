"""Ctrl-C at any moment ends a program in one line and exit code 130.

Every program imports this module first, before anything else of its own: it needs only what the
interpreter has loaded already, so it takes effect about a millisecond after the program's first
line. (Before that line, the interpreter's own start-up, about 10 ms, is Python's: Ctrl-C there
prints Python's KeyboardInterrupt.)
"""

import _signal  # the C module under `signal`, loaded at start-up; `signal` imports enum first (3 ms)
import os
import sys

INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT


CLOSED_AT_START = set()  # "stdout", "stderr": the streams the program was started without


def fill_closed_streams() -> None:
    """A program started with its output or error stream closed (`>&-`, `2>&-`) writes them to
    /dev/null instead (a program whose report goes to standard output refuses to run:
    plumbing/cli.py's one_paragraph_errors). The file descriptors are filled too: a file the run
    opens later must not become descriptor 1 or 2, where library code still writes."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            CLOSED_AT_START.add(name)
            null = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: often fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", closefd=False))


def exit_quietly_on_ctrl_c(program: str) -> None:
    """Ctrl-C at any moment (importing, loading, inside the decode loop) prints one line and
    exits 130. os._exit, not an exception: no half-finished `finally` can print a traceback.
    Every program calls this first, so it also fills closed standard streams."""
    fill_closed_streams()
    def interrupted(signum, frame):
        sys.stdout.flush()
        print(f"\n{program}: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)
    _signal.signal(_signal.SIGINT, interrupted)
