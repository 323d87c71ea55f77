"""The tactic store: tuned choices on disk, versioned, crash-safe and shared by processes.

Layout::

    <root>/v<schema>/<env_hash>/manifest.json          the environment this directory is valid for
    <root>/v<schema>/<env_hash>/entries/<op>/<key_hash>.json   one tuned problem (bucketed key)

Every write goes to a temporary file in the same directory, is flushed and fsynced, then
renamed over the target (``os.replace``), so a reader sees the old entry or the new one, never
part of one, and a writer killed mid-write leaves only a temporary file (removed at the next
attach once its process is gone). Only JSON is read back. An entry that is missing, truncated,
oversized, malformed, of another schema, keyed differently from its name, or holding a bare
integer instead of a tactic is a miss with one warning, never a crash. If the directory cannot
be written (read-only, full disk), the store keeps new entries in memory and warns once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tactix.autotune.environment import environment_hash
from tactix.autotune.stats import stored_tactics_changed
from tactix.errors import TactixWarning
from tactix.problems import Op, Problem, problem_from_key
from tactix.tactics import SCHEMA_VERSION, Tactic

__all__ = ["CandidateResult", "StoreEntry", "StoreWarning", "TacticStore", "default_root"]

log = logging.getLogger("tactix.store")

MAX_ENTRY_BYTES: Final = 1 << 20
OPS: Final = ("prefill", "decode", "gemm")


class StoreWarning(TactixWarning):
    """A store entry could not be used, or the store could not be written."""


def default_root() -> Path:
    """``$TACTIX_CACHE_DIR``, else ``$XDG_CACHE_HOME/tactix``, else ``~/.cache/tactix``."""
    explicit = os.environ.get("TACTIX_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tactix"


class CandidateResult(BaseModel):
    """How one tactic fared when a problem was tuned."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tactic: Tactic
    ran: Tactic | None = Field(default=None, description="the concrete tactic a default resolved to")
    status: Literal["ok", "failed", "skipped"]
    median_s: float | None = None
    samples: int = 0
    timed_as: Literal["cuda_graph", "eager"] | None = None
    reason: str | None = None


class StoreEntry(BaseModel):
    """One tuned problem: its full key, the chosen tactic, and every candidate's result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    op: Op
    key: dict[str, Any]
    key_hash: str
    tactic: Tactic
    baseline: Tactic = Field(description="the untuned choice the winner had to beat")
    candidates: list[CandidateResult] = Field(default_factory=list)
    env_hash: str
    created: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    @field_validator("schema_version")
    @classmethod
    def _this_schema(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(f"schema version {value}, this tactix reads {SCHEMA_VERSION}")
        return value

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1) + "\n"

    def speedup(self) -> float | None:
        """Untuned time over tuned time, from the recorded candidates."""
        times = {c.tactic: c.median_s for c in self.candidates if c.status == "ok" and c.median_s}
        base, best = times.get(self.baseline), times.get(self.tactic)
        return base / best if base and best else None


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a part.

    The temporary file lives in the same directory (``.tmp-<pid>-*``), is flushed and fsynced,
    then renamed over ``path``; the directory is fsynced so the rename survives a crash.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{os.getpid()}-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TacticStore:
    """The entries of one environment under ``root``; lookups are served from memory."""

    def __init__(self, root: Path | str, env: dict[str, Any]) -> None:
        self.root = Path(root)
        self.env = env
        self.env_hash = environment_hash(env)
        self.path = self.root / f"v{SCHEMA_VERSION}" / self.env_hash
        self._entries: dict[tuple[Any, ...], StoreEntry] = {}  # by Problem.bucket_key()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.writable = True
        self._attached = False
        self._disk_lookups = True  # off once the view is another rank's (see adopt)
        self._listed: set[tuple[str, str]] = set()
        # (key hash, entry path) by bucket key: a miss probes the disk on every lookup, and
        # hashing the key costs far more than the probe
        self._names: dict[tuple[Any, ...], tuple[str, Path]] = {}

    @classmethod
    def open(cls, env_dir: Path | str) -> TacticStore:
        """The store of an existing environment directory (``<root>/v<schema>/<env_hash>``)."""
        env_dir = Path(env_dir)
        manifest = json.loads((env_dir / "manifest.json").read_text())
        store = cls(env_dir.parent.parent, manifest["env"])
        if store.path.resolve() != env_dir.resolve():
            raise ValueError(f"{env_dir}: its manifest describes environment {store.env_hash}")
        return store

    @staticmethod
    def environments(root: Path | str) -> list[Path]:
        """Environment directories of this schema under ``root``."""
        base = Path(root) / f"v{SCHEMA_VERSION}"
        return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    def verify(self) -> list[tuple[Path, str]]:
        """Every entry file that would be ignored, with the reason (reads the disk afresh)."""
        bad: list[tuple[Path, str]] = []
        for op, key_hash, path in self._entry_files():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", StoreWarning)
                self._warned.discard(str(path))
                found = self._read(path, op, key_hash)
            if found is None:
                bad.append((path, str(caught[0].message) if caught else "unreadable"))
        return bad

    # -- attach ---------------------------------------------------------------------------

    def attach(self) -> TacticStore:
        """Create the directory and manifest if needed, clear dead writers' leftovers, list entries.

        Entries are parsed on first use (a lookup of their bucket, or `entries()`), so attaching
        costs a directory listing however large the store is.
        """
        if self._attached:
            return self
        try:
            for op in OPS:
                (self.path / "entries" / op).mkdir(parents=True, exist_ok=True)
            manifest = self.path / "manifest.json"
            if not manifest.exists():
                write_atomically(manifest, json.dumps(
                    {"schema_version": SCHEMA_VERSION, "env_hash": self.env_hash, "env": self.env}, indent=1,
                    sort_keys=True) + "\n")  # fmt: skip
        except OSError as exc:
            self._degrade(exc)
        self._remove_stale_temporaries()
        self._listed = {(op, key_hash) for op, key_hash, _ in self._entry_files()}
        self._attached = True
        log.info("tactic store %s (environment %s): %d entries%s", self.path, self.env_hash, len(self._listed),
                 "" if self.writable else ", read-only: new entries stay in memory")  # fmt: skip
        return self

    def _entry_files(self) -> Iterator[tuple[str, str, Path]]:
        for op in OPS:
            folder = self.path / "entries" / op
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if name.endswith(".json") and not name.startswith("."):
                    yield op, name[: -len(".json")], folder / name

    def _remove_stale_temporaries(self) -> None:
        for folder in [self.path] + [self.path / "entries" / op for op in OPS]:
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if not name.startswith(".tmp-"):
                    continue
                try:
                    pid = int(name.split("-")[1])
                except (IndexError, ValueError):
                    continue
                if not _pid_alive(pid):
                    with contextlib.suppress(OSError):
                        os.unlink(folder / name)

    # -- reading --------------------------------------------------------------------------

    def _warn(self, what: str, why: str) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        warnings.warn(StoreWarning(f"tactic store: ignoring {what}: {why}"), stacklevel=3)

    def _read(self, path: Path, op: str, key_hash: str) -> tuple[StoreEntry, Problem] | None:
        """Parse and validate one entry file; any defect is a miss with one warning."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn(str(path), f"unreadable ({exc})")
            return None
        if len(raw) > MAX_ENTRY_BYTES:
            self._warn(str(path), f"{len(raw)} bytes is larger than an entry can be ({MAX_ENTRY_BYTES})")
            return None
        try:
            entry = StoreEntry.model_validate_json(raw)  # one pass, JSON only
            problem = problem_from_key(entry.key)
        except ValidationError as exc:
            self._warn(str(path), self._diagnose(raw, exc))
            return None
        canonical = json.dumps(entry.key, sort_keys=True, separators=(",", ":"))
        if (
            entry.op != op
            or problem.op != op
            or entry.key_hash != key_hash
            or hashlib.sha256(canonical.encode()).hexdigest()[:32] != key_hash
        ):
            self._warn(str(path), "its key does not match its name (a stale or hand-edited entry)")
            return None
        if entry.env_hash != self.env_hash:
            self._warn(str(path), f"it was tuned in environment {entry.env_hash}, not {self.env_hash}")
            return None
        return entry, problem

    @staticmethod
    def _diagnose(raw: bytes, exc: ValidationError) -> str:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as bad:
            return f"not JSON ({type(bad).__name__}: {bad})"
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            got = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
            return f"schema version {got!r}, this tactix reads {SCHEMA_VERSION}"
        return f"malformed entry ({exc.errors()[0]['msg']})"

    def lookup(self, problem: Problem) -> StoreEntry | None:
        """The entry for ``problem``'s bucket, or None. Checks the disk for entries other
        processes wrote since this store was attached."""
        index = problem.bucket_key()
        entry = self._entries.get(index)
        if entry is not None or not self._disk_lookups:
            return entry
        named = self._names.get(index)
        if named is None:
            key_hash = problem.key_hash()
            named = (key_hash, self.path / "entries" / problem.op / f"{key_hash}.json")
            if len(self._names) >= 4096:
                self._names.clear()
            self._names[index] = named
        key_hash, path = named
        if not os.path.exists(path):  # a stat, where a failed open costs twice as much
            return None
        found = self._read(path, problem.op, key_hash)
        if found is None:
            return None
        with self._lock:
            self._entries[index] = found[0]
            self._listed.add((problem.op, key_hash))
        return found[0]

    @property
    def reads_disk(self) -> bool:
        """Whether a miss looks on disk for entries other processes wrote (off once the view is
        another rank's): a miss may then become a hit without a write through this store."""
        return self._disk_lookups

    def entries(self) -> list[StoreEntry]:
        """Every valid entry (parsing those not used yet); defective files are skipped with a warning."""
        if self._disk_lookups:
            known = {(e.op, e.key_hash) for e in self._entries.values()}
            for op, key_hash, path in self._entry_files():
                if (op, key_hash) not in known:
                    found = self._read(path, op, key_hash)
                    if found is not None:
                        with self._lock:
                            self._entries.setdefault(found[1].bucket_key(), found[0])
        return list(self._entries.values())

    def __len__(self) -> int:
        """Entry files listed at attach plus entries recorded since (defective files included)."""
        return len(self._listed | {(e.op, e.key_hash) for e in self._entries.values()})

    # -- writing --------------------------------------------------------------------------

    def _degrade(self, exc: OSError) -> None:
        if self.writable:
            self.writable = False
            warnings.warn(StoreWarning(
                f"tactic store {self.path} cannot be written ({exc.strerror or exc}); "
                "tuned tactics are kept in memory for this process only"), stacklevel=3)  # fmt: skip

    def put(self, entry: StoreEntry) -> None:
        """Record an entry in memory and, if the store is writable, on disk (atomically)."""
        if entry.env_hash != self.env_hash:
            raise ValueError(f"entry of environment {entry.env_hash} put into store of {self.env_hash}")
        with self._lock:
            self._entries[problem_from_key(entry.key).bucket_key()] = entry
        stored_tactics_changed()
        if not self.writable:
            return
        try:
            write_atomically(self.path / "entries" / entry.op / f"{entry.key_hash}.json", entry.to_json())
        except OSError as exc:
            self._degrade(exc)

    def adopt(self, entries: list[StoreEntry]) -> None:
        """Replace this process's view with ``entries`` (another rank's), writing them through."""
        with self._lock:
            self._entries = {problem_from_key(e.key).bucket_key(): e for e in entries}
            self._listed = set()
            self._disk_lookups = False  # what this rank reads must stay what every rank reads
        stored_tactics_changed()
        for e in entries:
            if self.writable:
                try:
                    write_atomically(self.path / "entries" / e.op / f"{e.key_hash}.json", e.to_json())
                except OSError as exc:
                    self._degrade(exc)
