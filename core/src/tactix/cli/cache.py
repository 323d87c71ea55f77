"""``tactix cache``: inspect and manage the tactic store (ls, show, verify, clear, export, import)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import tactix

__all__ = ["cmd_cache"]


def _stores(args: argparse.Namespace) -> list[Any]:
    from pathlib import Path

    from tactix.autotune.store import TacticStore, default_root

    root = Path(args.root) if args.root else default_root()
    envs = TacticStore.environments(root)
    if args.env:
        envs = [e for e in envs if e.name.startswith(args.env)]
        if not envs:
            raise tactix.InvalidArgumentError("--env", f"an environment hash under {root}", args.env)
    return [TacticStore.open(e) for e in envs]


def cmd_cache(args: argparse.Namespace) -> int:
    import warnings
    from pathlib import Path

    from tactix.autotune.store import StoreEntry, StoreWarning, TacticStore, default_root
    from tactix.problems import problem_from_key

    root = Path(args.root) if args.root else default_root()
    if args.action == "import":
        from pydantic import ValidationError

        try:
            bundle = json.loads(Path(args.path).read_text())
            entries = [StoreEntry.model_validate(e) for e in bundle["entries"]]
            for entry in entries:
                problem_from_key(entry.key)  # refuse a malformed key before anything is written
            store = TacticStore(root, bundle["env"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}"
            raise tactix.InvalidArgumentError("path", "a bundle written by 'tactix cache export'", why) from None
        mismatched = [e.key_hash for e in entries if e.env_hash != store.env_hash]
        if mismatched:
            raise tactix.InvalidArgumentError("path", "entries of the bundle's own environment", mismatched[:3])
        store.attach()
        for entry in entries:
            store.put(entry)
        print(f"imported {len(entries)} entries into {store.path}")
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)  # verify reports defects; the others skip them
        return _cache_action(args, root, [s.attach() for s in _stores(args)])


def _cache_action(args: argparse.Namespace, root: Any, stores: list[Any]) -> int:
    import shutil
    from pathlib import Path

    from tactix.problems import problem_from_key

    if args.action == "ls":
        if not stores:
            print(f"no tactic store under {root}")
        for s in stores:
            env = s.env
            device = env.get("device", {})
            backends = ", ".join(f"{k} {v['version']}" for k, v in env.get("backends", {}).items())
            print(
                f"{s.env_hash}  {len(s)} entries  {device.get('name')}  torch {env.get('torch')}  "
                f"backends {backends}  {s.path}"
            )
            if args.entries:
                for e in sorted(s.entries(), key=lambda e: (e.op, e.key_hash)):
                    speed = e.speedup()
                    shown = f"{speed:.2f}x over {e.baseline}" if speed else "untimed"
                    print(f"  {e.key_hash[:12]}  {problem_from_key(e.key)}  {e.tactic}  ({shown})")
        return 0
    if args.action == "show":
        found = [e for s in stores for e in s.entries() if e.key_hash.startswith(args.key)]
        if not found:
            raise tactix.InvalidArgumentError("key", "the prefix of a stored entry's key hash", args.key)
        for e in found:
            print(e.to_json(), end="")
        return 0
    if args.action == "verify":
        bad = [(path, why) for s in stores for path, why in s.verify()]
        for path, why in bad:
            print(f"BAD {path}: {why}")
            if args.delete:
                path.unlink()
        total = sum(len(s.entries()) for s in stores)
        print(f"{total} valid entries, {len(bad)} bad{' (deleted)' if bad and args.delete else ''}")
        return 1 if bad and not args.delete else 0
    if args.action == "clear":
        for s in stores:
            shutil.rmtree(s.path)
            print(f"removed {s.path} ({len(s)} entries)")
        return 0
    if args.action == "export":
        if len(stores) != 1:
            raise tactix.InvalidArgumentError("--env", "one environment to export", f"{len(stores)} environments")
        s = stores[0]
        bundle = {"env": s.env, "env_hash": s.env_hash, "entries": [json.loads(e.to_json()) for e in s.entries()]}
        Path(args.path).write_text(json.dumps(bundle, indent=1, sort_keys=True) + "\n")
        print(f"exported {len(s)} entries of {s.env_hash} to {args.path}")
        return 0
    raise AssertionError(args.action)
