"""``tactix untuned-order``: the table of backends ``auto`` tries first without a stored tactic.

``build REPORT.json ...`` derives a table from ``tactix bench`` reports (`tactix.untuned_order`:
cost = the longer of a row's device and ``run()`` host times) and writes it (``-o PATH``,
replaced atomically) or prints it; ``show [PATH]`` prints a table: the one in force
(``$TACTIX_UNTUNED_ORDER`` or the shipped one) when no path is given.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tactix import untuned_order
from tactix.cli._output import add_json_option, json_to_stdout, write_json
from tactix.errors import InvalidArgumentError

__all__ = ["add_untuned_order_parser", "cmd_untuned_order"]


def add_untuned_order_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("untuned-order", help="build or show the measured order 'auto' tries backends in, untuned")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("build", help="derive a table from 'tactix bench --json' reports (oldest first)")
    q.add_argument("reports", nargs="+", help="bench reports; a case in several keeps the last one's rows")
    q.add_argument("--arch", help="architecture of reports that do not record one, e.g. sm90")
    q.add_argument("-o", "--output", metavar="PATH",
                   help="write the table here (replaced atomically; default: print it as JSON)")  # fmt: skip
    q = actions.add_parser("show", help="print a table: PATH, or the one in force")
    q.add_argument("path", nargs="?", help="a table file (default: $TACTIX_UNTUNED_ORDER or the shipped table)")
    add_json_option(q, "the table")
    p.set_defaults(func=cmd_untuned_order)


def _report(path: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError("reports", "readable 'tactix bench --json' reports", f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError("reports", "'tactix bench --json' reports", f"{path}: a {type(data).__name__}")
    return data


def _write_atomically(path: str, text: str) -> None:
    """``text`` into ``path`` through a temporary file in its folder and a rename: a crash leaves
    the old table or the new one, never a part."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_untuned_order(args: argparse.Namespace) -> int:
    if args.action == "build":
        table = untuned_order.build_table([(p, _report(p)) for p in args.reports], args.arch)
        text = table.model_dump_json(indent=1) + "\n"
        if args.output:
            _write_atomically(args.output, text)
            for line in untuned_order.describe(table):
                print(line)
        else:
            print(text, end="")
        return 0
    table = untuned_order.read(Path(args.path)) if args.path else untuned_order.current_table()
    if args.json:
        write_json(args.json, table.model_dump(mode="json"), indent=1)
    if not json_to_stdout(args):
        for line in untuned_order.describe(table):
            print(line)
    return 0
