"""``tactix cache``: inspect and manage the tactic store (ls, show, verify, clear, export, import).

Every command reads the store as the runtime does: a defective entry file is reported (``ls
--entries`` marks it, ``verify`` lists it with the reason) and never crashes the command; a
defective manifest is reported, and the entries of its directory are still listed. Anything that
was asked for and not done (an entry not deleted, a bundle not written, a read-only root) is a
one-line error and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import sys
import warnings
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import tactix
from tactix.autotune.store import StoreEntry, StoreWarning, TacticStore, default_root
from tactix.cli._output import add_json_option, json_to_stdout, write_json
from tactix.errors import StoreError
from tactix.problems import problem_from_key

__all__ = ["add_cache_parser", "cmd_cache"]


def add_cache_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``cache`` subcommand; ``--root`` and ``--env`` are accepted before or after the action."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", help="store root (default: $TACTIX_CACHE_DIR or the user cache directory)")
    common.add_argument("--env", help="only the environment whose hash starts with this")
    # after the action, the same options must not reset what was given before it
    late = argparse.ArgumentParser(add_help=False)
    late.add_argument("--root", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    late.add_argument("--env", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    p = sub.add_parser("cache", parents=[common], help="inspect and manage the tactic store",
                       description="Inspect and manage the tactic store. --root and --env may come before or "
                       "after the action.")  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("ls", parents=[late], help="environments and their entry counts")
    q.add_argument("--entries", action="store_true", help="list every entry too (defective files marked BAD)")
    add_json_option(q, "the environments (and with --entries, their entries)")
    q = actions.add_parser("show", parents=[late], help="print the entries whose key hash starts with KEY")
    q.add_argument("key")
    q = actions.add_parser("verify", parents=[late], help="check every entry file; exit 1 if any is bad")
    q.add_argument("--delete", action="store_true", help="delete bad entries")
    q = actions.add_parser("clear", parents=[late], help="delete environments (all, or --env)")
    q.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    q = actions.add_parser("export", parents=[late], help="write one environment's entries to a JSON bundle")
    q.add_argument("path")
    q = actions.add_parser("import", parents=[late], help="add a bundle's entries to the store")
    q.add_argument("path")
    p.set_defaults(func=cmd_cache)


def _root(args: argparse.Namespace) -> Path:
    return Path(args.root) if args.root else default_root()


def _stores(args: argparse.Namespace, root: Path) -> list[TacticStore]:
    try:
        envs = TacticStore.environments(root)
    except OSError as exc:
        raise StoreError(f"cannot list the tactic store under {root}: {exc.strerror or exc}") from None
    if args.env:
        envs = [e for e in envs if e.name.startswith(args.env)]
        if not envs:
            raise tactix.InvalidArgumentError("--env", f"the prefix of an environment hash under {root}", args.env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)  # verify and ls --entries report defects themselves
        return [TacticStore.open(e).attach() for e in envs]


def cmd_cache(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.action == "import":
        return _import(args, root)
    stores = _stores(args, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        action = {"ls": _ls, "show": _show, "verify": _verify, "clear": _clear, "export": _export}[args.action]
        return action(args, root, stores)


def _ls_json(s: TacticStore, entries: bool) -> dict[str, Any]:
    row: dict[str, Any] = {
        "env_hash": s.env_hash,
        "path": str(s.path),
        "entry_count": len(s),
        "env": s.env if s.manifest_defect is None else None,
        "manifest_defect": s.manifest_defect,
    }
    if entries:
        row["entries"] = [json.loads(e.to_json()) for e in sorted(s.entries(), key=lambda e: (e.op, e.key_hash))]
        row["bad"] = [{"file": p.name, "why": why} for p, why in s.verify() if p.name != "manifest.json"]
    return row


def _ls(args: argparse.Namespace, root: Path, stores: list[TacticStore]) -> int:
    if args.json is not None:
        write_json(args.json, [_ls_json(s, args.entries) for s in stores])
    if json_to_stdout(args):
        return 1 if any(s.manifest_defect is not None for s in stores) else 0
    if not stores:
        print(f"no tactic store under {root}")
    defective = 0
    for s in stores:
        if s.manifest_defect is not None:
            defective += 1
            print(f"{s.env_hash}  {len(s)} entries  environment unknown: {s.manifest_defect}  {s.path}")
        else:
            env = s.env
            device = env.get("device", {})
            backends = ", ".join(f"{k} {v.get('version')}" for k, v in env.get("backends", {}).items())
            print(
                f"{s.env_hash}  {len(s)} entries  {device.get('name')}  torch {env.get('torch')}  "
                f"backends {backends}  {s.path}"
            )
        if args.entries:
            for e in sorted(s.entries(), key=lambda e: (e.op, e.key_hash)):
                speed = e.speedup()
                shown = f"{speed:.2f}x over {e.baseline}" if speed else "untimed"
                print(f"  {e.key_hash[:12]}  {problem_from_key(e.key)}  {e.tactic}  ({shown})")
            for path, why in s.verify():
                if path.name != "manifest.json":
                    print(f"  BAD  {path.name}  {why}")
    return 1 if defective else 0


def _show(args: argparse.Namespace, root: Path, stores: list[TacticStore]) -> int:
    found = [e for s in stores for e in s.entries() if e.key_hash.startswith(args.key)]
    if not found:
        raise tactix.InvalidArgumentError("key", "the prefix of a stored entry's key hash", args.key)
    for e in found:
        print(e.to_json(), end="")
    return 0


def _remove(path: Path) -> str | None:
    """Delete one defective entry (a file, a link, a FIFO, an empty directory); why not, if not."""
    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            os.rmdir(path)  # never a recursive delete of something the store did not write
        else:
            os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _verify(args: argparse.Namespace, root: Path, stores: list[TacticStore]) -> int:
    bad = [(path, why) for s in stores for path, why in s.verify()]
    kept = 0
    for path, why in bad:
        print(f"BAD {path}: {why}")
        if args.delete:
            if path.name == "manifest.json" or path.parent.name == "entries":
                print(f"  not deleted: {path.name} is not an entry; fix or remove it by hand", file=sys.stderr)
                kept += 1
            elif (failure := _remove(path)) is not None:
                print(f"  not deleted: {failure}", file=sys.stderr)
                kept += 1
    total = sum(len(s.entries()) for s in stores)
    deleted = len(bad) - kept if args.delete else 0
    print(f"{total} valid entries, {len(bad)} bad" + (f" ({deleted} deleted)" if deleted else ""))
    if kept:
        raise StoreError(f"{kept} of {len(bad)} bad entries could not be deleted (see above)")
    return 1 if bad and not args.delete else 0


def _clear(args: argparse.Namespace, root: Path, stores: list[TacticStore]) -> int:
    if not stores:
        print(f"no tactic store under {root}")
        return 0
    count = sum(len(s) for s in stores)
    if not args.yes:
        what = f"{len(stores)} environment(s) with {count} entries under {root}"
        if not sys.stdin.isatty():
            raise tactix.InvalidArgumentError("--yes", f"given to delete {what} without a terminal to ask", "none")
        answer = input(f"delete {what}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    for s in stores:
        try:
            shutil.rmtree(s.path)
        except OSError as exc:
            raise StoreError(f"cannot remove {s.path}: {exc.strerror or exc}") from None
        print(f"removed {s.path} ({len(s)} entries)")
    return 0


def _export(args: argparse.Namespace, root: Path, stores: list[TacticStore]) -> int:
    if not stores:
        raise StoreError(f"nothing to export: no tactic store under {root}")
    if len(stores) != 1:
        raise tactix.InvalidArgumentError("--env", "the prefix of one environment's hash to export",
                                          f"{len(stores)} environments under {root}")  # fmt: skip
    s = stores[0]
    if s.manifest_defect is not None:
        raise StoreError(f"cannot export {s.path}: {s.manifest_defect}")
    entries = s.entries()
    bundle = {"env": s.env, "env_hash": s.env_hash, "entries": [json.loads(e.to_json()) for e in entries]}
    try:
        Path(args.path).write_text(json.dumps(bundle, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise tactix.InvalidArgumentError(
            "path", "a file that can be written", f"{args.path}: {exc.strerror}"
        ) from None
    print(f"exported {len(entries)} entries of {s.env_hash} to {args.path}")
    return 0


def _import(args: argparse.Namespace, root: Path) -> int:
    try:
        bundle = json.loads(Path(args.path).read_text())
        entries = [StoreEntry.model_validate(e) for e in bundle["entries"]]
        for entry in entries:
            problem_from_key(entry.key)  # refuse a malformed key before anything is written
        store = TacticStore(root, bundle["env"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}"
        raise tactix.InvalidArgumentError("path", "a bundle written by 'tactix cache export'", why) from None
    mismatched = [e.key_hash for e in entries if e.env_hash != store.env_hash]
    if mismatched:
        raise tactix.InvalidArgumentError("path", "entries of the bundle's own environment", mismatched[:3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StoreWarning)
        store.attach()
        written = sum(store.put(entry) for entry in entries)
    if written < len(entries):
        why = "; ".join(dict.fromkeys(str(w.message) for w in caught)) or "unknown reason"
        raise StoreError(f"imported {written} of {len(entries)} entries into {store.path}: {why}")
    print(f"imported {written} entries into {store.path}")
    return 0
