"""argparse types that only the tools take: a JSON file to read, a picture to write, lists of
numbers. The scripts' and the server's own are plumbing/cli.py's."""

import argparse
import math
from pathlib import Path

from plumbing.cli import UserError, finite_float, positive_int, read_text_input, writable_file


def finite_number(value) -> bool:
    """A JSON number a tool can draw or divide by: not a bool, not NaN or infinite."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int of hundreds of digits: no float holds it
        return False


IMAGE_FORMATS = [".png", ".pdf", ".svg"]  # matplotlib draws these itself, with no optional library


def image_file(text: str) -> Path:
    """A writable path whose suffix names a format matplotlib can draw."""
    path = writable_file(text)
    if path.suffix.lower() not in IMAGE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text}: name the picture's format with its suffix, one "
                                         f"of {', '.join(IMAGE_FORMATS)}")
    return path


def json_file(text: str):
    """A JSON file's contents, for an argparse type: a missing or unreadable file is refused
    before anything runs (exit 2)."""
    import json
    try:
        return json.loads(read_text_input(Path(text), "the JSON file"))
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text}: no such file") from None
    except UserError as e:  # a pipe, a device, too large
        raise argparse.ArgumentTypeError(str(e)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text} is not a JSON file: {e}") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise argparse.ArgumentTypeError(f"{text} is nested too deeply to be a JSON file this "
                                         f"program wrote") from None


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive whole numbers, e.g. 16,256."""
    try:
        return [positive_int(v) for v in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive whole numbers, "
                                         f"e.g. 16,256; got {text!r}") from None


def milliseconds_list(text: str) -> list[float]:
    """Comma-separated waits of 0 to a second each, e.g. 0,2.5."""
    values = [finite_float(t) for t in text.split(",")]
    if not all(0 <= v <= 1000 for v in values):
        raise argparse.ArgumentTypeError(f"expected milliseconds from 0 to 1,000, got {text}")
    return values
