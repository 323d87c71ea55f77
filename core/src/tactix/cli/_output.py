"""What every ``tactix`` subcommand shares about its output: the ``--json`` convention and output paths.

``--json PATH`` writes the command's JSON to PATH and the command prints its usual text;
``--json`` alone or ``--json -`` writes the JSON to standard output and nothing else goes there
(text that would have gone there is left out; progress and errors stay on standard error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Final

__all__ = ["STDOUT", "add_json_option", "check_output_path", "json_to_stdout", "write_json"]

STDOUT: Final = "-"


def add_json_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json [PATH]``: ``what`` as JSON, in a file or (no PATH, or ``-``) on standard output."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="PATH",
        help=f"write {what} as JSON to PATH and print the usual text; without PATH (or with '-'): "
        "only the JSON, on standard output",
    )


def json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == STDOUT


def check_output_path(option: str, value: str | None) -> None:
    """Refuse an output path that cannot be written, before the command does its (long) work."""
    from tactix.errors import InvalidArgumentError

    if value is None or value == STDOUT:
        return
    path = Path(value)
    parent = path.parent if str(path.parent) else Path(".")
    why = None
    if path.is_dir():
        why = "a directory"
    elif not parent.is_dir():
        why = f"{str(parent)!r} is not a directory"
    elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        why = "not writable"
    if why is not None:
        raise InvalidArgumentError(option, "a file path that can be written", f"{value!r}: {why}")


def write_json(destination: str, data: Any, indent: int = 2) -> None:
    """``data`` as indented JSON to a file, or to standard output for ``-``."""
    text = json.dumps(data, indent=indent) + "\n"
    if destination == STDOUT:
        sys.stdout.write(text)
    else:
        Path(destination).write_text(text)
