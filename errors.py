"""Failures a user can cause or hit, each ending the program with one paragraph and an exit code."""

USAGE = 2  # bad arguments, missing files: fix the command and run again
OUT_OF_MEMORY = 1  # the run itself did not fit: fewer requests or a smaller cache


class UserError(Exception):
    """Printed as a message without a traceback; the scripts exit with `exit_code`."""

    def __init__(self, message: str, exit_code: int = USAGE):
        super().__init__(message)
        self.exit_code = exit_code
