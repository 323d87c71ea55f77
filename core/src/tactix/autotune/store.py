"""The tactic store: tuned choices on disk, versioned, crash-safe and shared by processes.

Layout::

    <root>/v<schema>/<env_hash>/manifest.json          the environment this directory is valid for
    <root>/v<schema>/<env_hash>/entries/<op>/<key_hash>.json   one tuned problem (bucketed key)

Every write goes to a temporary file in the same directory, is flushed and fsynced, then
renamed over the target (``os.replace``), so a reader sees the old entry or the new one, never
part of one, and a writer killed mid-write leaves only a temporary file (removed at the next
attach once its process is gone). Only JSON is read back, and only from regular files inside
the root: an entry that is missing, truncated, oversized, malformed, nested too deeply, of
another schema, keyed differently from its name, holding a bare integer instead of a tactic, a
symbolic link, a FIFO, a device or a directory is a miss with one warning naming the file and
the defect, never a crash, a hang or an unbounded read. If the directory cannot be written
(read-only, full disk), the store keeps new entries in memory and warns once; an op folder that
leads outside the root (a symbolic link) is neither read nor written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import logging
import os
import stat
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tactix.autotune.environment import environment_hash
from tactix.autotune.stats import stored_tactics_changed
from tactix.errors import StoreError, TactixWarning
from tactix.ops import OPS as _REGISTRY
from tactix.ops import AnyProblem, Op
from tactix.problems import key_hash as problem_key_hash
from tactix.problems import problem_from_key
from tactix.tactics import SCHEMA_VERSION, Tactic

__all__ = ["CandidateResult", "StoreEntry", "StoreWarning", "TacticStore", "default_root"]

log = logging.getLogger("tactix.store")

MAX_ENTRY_BYTES: Final = 1 << 20
MAX_REASON_CHARS: Final = 2000  # a failure reason beyond this is a traceback nobody reads in a store
OPS: Final = tuple(_REGISTRY)  # one entries/<op> folder per op of the registry


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

    @field_validator("reason")
    @classmethod
    def _capped(cls, value: str | None) -> str | None:
        if value is None or len(value) <= MAX_REASON_CHARS:
            return value
        return f"{value[:MAX_REASON_CHARS]}... ({len(value) - MAX_REASON_CHARS} more characters)"


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

    def fitted(self) -> StoreEntry | None:
        """This entry, or one that keeps only the winner's and the baseline's candidate results if
        it is larger than a reader accepts (`MAX_ENTRY_BYTES`); None if even that is too large."""
        if len(self.to_json().encode()) <= MAX_ENTRY_BYTES:
            return self
        kept = [c for c in self.candidates if self.tactic in (c.tactic, c.ran) or c.tactic == self.baseline]
        smaller = self.model_copy(update={"candidates": kept})
        return smaller if len(smaller.to_json().encode()) <= MAX_ENTRY_BYTES else None

    def speedup(self) -> float | None:
        """Untuned time over tuned time, from the recorded candidates."""
        ok = [c for c in self.candidates if c.status == "ok" and c.median_s]
        base = next((c.median_s for c in ok if c.tactic == self.baseline), None)
        best = next((c.median_s for c in ok if self.tactic in (c.tactic, c.ran)), None)  # a default: by what it ran
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


class _Defect(Exception):
    """Why an entry file cannot be used (the text of its warning)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def read_entry_file(path: Path, limit: int = MAX_ENTRY_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Never follows a symbolic link, never blocks on a FIFO, never reads more than ``limit + 1``
    bytes (a link to ``/dev/zero`` cannot exhaust memory). Raises FileNotFoundError if there is no
    file, `_Defect` for anything else that is not a readable regular file of at most ``limit`` bytes.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW refuses a link, a loop included
            raise _Defect("it is a symbolic link (the store reads only regular files inside its root)") from None
        raise _Defect(f"unreadable ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Defect(f"it is {_kind(info.st_mode)}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            try:
                chunk = os.read(fd, limit + 1 - size)
            except OSError as exc:
                raise _Defect(f"unreadable ({exc.strerror or exc})") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise _Defect(f"{max(size, info.st_size)} bytes is larger than an entry can be ({limit})")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_entry(raw: bytes) -> tuple[StoreEntry, AnyProblem]:
    """An entry and its problem from a file's bytes; `_Defect` says what is wrong with them."""
    try:
        entry = StoreEntry.model_validate_json(raw)  # one pass, JSON only
    except ValidationError as exc:
        raise _Defect(_diagnose(raw, exc)) from None
    try:
        problem = problem_from_key(entry.key)
        hashed = problem_key_hash(entry.key)
    except ValidationError as exc:
        raise _Defect(f"malformed key ({_first_error(exc)})") from None
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. an integer too long to print
        raise _Defect(f"malformed key ({exc})") from None
    if entry.op != problem.op or hashed != entry.key_hash:
        raise _Defect("its key does not match its name (a stale or hand-edited entry)")
    return entry, problem


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else str(err["msg"])


def _diagnose(raw: bytes, exc: ValidationError) -> str:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        return f"not JSON ({type(bad).__name__}: {bad})"
    except RecursionError:
        return "not an entry (JSON nested too deeply)"
    except ValueError as bad:  # Python's limit on the digits of an integer
        return f"not an entry ({bad})"
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        got = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
        return f"schema version {got!r:.40}, this tactix reads {SCHEMA_VERSION}"
    return f"malformed entry ({_first_error(exc)})"


class TacticStore:
    """The entries of one environment under ``root``; lookups are served from memory."""

    def __init__(self, root: Path | str, env: dict[str, Any]) -> None:
        self.root = Path(root)
        self.env = env
        self.env_hash = environment_hash(env)
        self.path = self.root / f"v{SCHEMA_VERSION}" / self.env_hash
        self.manifest_defect: str | None = None  # set by `open` when the manifest cannot be used
        self._entries: dict[tuple[Any, ...], StoreEntry] = {}  # by ProblemBase.bucket_key()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.writable = True
        self._attached = False
        self._creates = True  # False for a store opened for inspection: attach creates nothing
        self._disk_lookups = True  # off once the view is another rank's (see adopt)
        self._outside: set[str] = set()  # ops whose folder leads outside the root: memory only
        self._listed: set[tuple[str, str]] = set()
        # (key hash, entry path) by bucket key: a miss probes the disk on every lookup, and
        # hashing the key costs far more than the probe
        self._names: dict[tuple[Any, ...], tuple[str, Path]] = {}

    @classmethod
    def open(cls, env_dir: Path | str) -> TacticStore:
        """The store of an existing environment directory (``<root>/v<schema>/<env_hash>``), for
        inspection: attaching it creates nothing. A manifest that is missing, unreadable or of
        another environment does not stop the entries from being listed and verified against the
        directory's name; ``manifest_defect`` says what is wrong with it."""
        env_dir = Path(env_dir)
        env: dict[str, Any] = {}
        defect: str | None = None
        try:
            data = json.loads(read_entry_file(env_dir / "manifest.json"))
            if not isinstance(data, dict) or not isinstance(data.get("env"), dict):
                raise _Defect("it has no 'env' object")
            env = data["env"]
            if environment_hash(env) != env_dir.name:
                raise _Defect(f"it describes environment {environment_hash(env)}, not {env_dir.name}")
        except FileNotFoundError:
            defect = "manifest.json is missing"
        except _Defect as exc:
            defect = f"manifest.json: {exc}"
            env = {}
        except (ValueError, RecursionError) as exc:  # not JSON (UnicodeDecodeError and JSONDecodeError included)
            defect = f"manifest.json is not JSON ({type(exc).__name__})"
        except TypeError as exc:  # an env whose values cannot be hashed back to JSON
            defect = f"manifest.json: its environment cannot be read ({exc})"
            env = {}
        store = cls(env_dir.parent.parent, env)
        store.env_hash, store.path, store.manifest_defect = env_dir.name, env_dir, defect
        store._creates = False
        return store

    @staticmethod
    def environments(root: Path | str) -> list[Path]:
        """Environment directories of this schema under ``root``."""
        base = Path(root) / f"v{SCHEMA_VERSION}"
        return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    def verify(self) -> list[tuple[Path, str]]:
        """Every entry file that would be ignored, with the reason (reads the disk afresh)."""
        bad: list[tuple[Path, str]] = []
        if self.manifest_defect is not None:
            bad.append((self.path / "manifest.json", self.manifest_defect))
        for op in sorted(self._outside):
            bad.append((self.path / "entries" / op, "it leads outside the store's root (a symbolic link)"))
        for op, key_hash, path in self._entry_files():
            try:
                self._parse(path, op, key_hash)
            except _Defect as exc:
                bad.append((path, str(exc)))
            except FileNotFoundError:
                continue  # removed since the listing
        return bad

    # -- attach ---------------------------------------------------------------------------

    def attach(self) -> TacticStore:
        """Create the directory and manifest if needed, clear dead writers' leftovers, list entries.

        Entries are parsed on first use (a lookup of their bucket, or `entries()`), so attaching
        costs a directory listing however large the store is.
        """
        if self._attached:
            return self
        if self._creates:
            try:
                (self.path / "entries").mkdir(parents=True, exist_ok=True)
                manifest = self.path / "manifest.json"
                if not os.path.lexists(manifest):
                    write_atomically(manifest, json.dumps(
                        {"schema_version": SCHEMA_VERSION, "env_hash": self.env_hash, "env": self.env}, indent=1,
                        sort_keys=True) + "\n")  # fmt: skip
            except OSError as exc:
                self._degrade(exc)
        self._check_folders()
        self._remove_stale_temporaries()
        self._listed = {(op, key_hash) for op, key_hash, _ in self._entry_files()}
        self._attached = True
        log.info("tactic store %s (environment %s): %d entries%s", self.path, self.env_hash, len(self._listed),
                 "" if self.writable else ", read-only: new entries stay in memory")  # fmt: skip
        return self

    def _check_folders(self) -> None:
        """Create the op folders; leave out of every read and write one that is not a directory
        inside the root (a symbolic link to elsewhere, a file), with one warning."""
        inside = os.path.realpath(self.root)
        for op in OPS:
            folder = self.path / "entries" / op
            if self._creates and self.writable:
                try:
                    folder.mkdir(exist_ok=True)
                except OSError as exc:
                    if not os.path.lexists(folder):
                        self._degrade(exc)
                        continue
            if not os.path.lexists(folder):
                continue
            real = os.path.realpath(folder)
            if os.path.islink(folder) or not os.path.isdir(folder) or os.path.commonpath([inside, real]) != inside:
                self._outside.add(op)
                what = "a symbolic link to " + real if real != str(folder.absolute()) else "not a directory"
                self._warn(str(folder), f"it is {what}; the store never reads or writes outside its root, so "
                           f"{op} entries stay in memory for this process")  # fmt: skip

    def _entry_files(self) -> Iterator[tuple[str, str, Path]]:
        for op in OPS:
            if op in self._outside:
                continue
            folder = self.path / "entries" / op
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if name.endswith(".json") and not name.startswith("."):
                    yield op, name[: -len(".json")], folder / name

    def _remove_stale_temporaries(self) -> None:
        if not self.writable:
            return
        folders = [self.path] + [self.path / "entries" / op for op in OPS if op not in self._outside]
        for folder in folders:
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
                if not _pid_alive(pid) and os.path.isfile(folder / name) and not os.path.islink(folder / name):
                    with contextlib.suppress(OSError):
                        os.unlink(folder / name)

    # -- reading --------------------------------------------------------------------------

    def _warn(self, what: str, why: str) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        warnings.warn(StoreWarning(f"tactic store: ignoring {what}: {why}"), stacklevel=3)

    def _parse(self, path: Path, op: str, key_hash: str) -> tuple[StoreEntry, AnyProblem]:
        entry, problem = parse_entry(read_entry_file(path))
        if entry.op != op or entry.key_hash != key_hash:
            raise _Defect("its key does not match its name (a stale or hand-edited entry)")
        if entry.env_hash != self.env_hash:
            raise _Defect(f"it was tuned in environment {entry.env_hash}, not {self.env_hash}")
        return entry, problem

    def _read(self, path: Path, op: str, key_hash: str) -> tuple[StoreEntry, AnyProblem] | None:
        """Parse and validate one entry file; any defect is a miss with one warning."""
        try:
            return self._parse(path, op, key_hash)
        except FileNotFoundError:
            return None
        except _Defect as exc:
            self._warn(str(path), str(exc))
        except Exception as exc:  # an entry file is untrusted input: never fatal to serving
            self._warn(str(path), f"unreadable ({type(exc).__name__}: {exc})")
        return None

    def lookup(self, problem: AnyProblem) -> StoreEntry | None:
        """The entry for ``problem``'s bucket, or None. Checks the disk for entries other
        processes wrote since this store was attached."""
        index = problem.bucket_key()
        entry = self._entries.get(index)
        if entry is not None or not self._disk_lookups or problem.op in self._outside:
            return entry
        named = self._names.get(index)
        if named is None:
            key_hash = problem.key_hash()
            named = (key_hash, self.path / "entries" / problem.op / f"{key_hash}.json")
            if len(self._names) >= 4096:
                self._names.clear()
            self._names[index] = named
        key_hash, path = named
        try:
            os.lstat(path)  # a stat, where a failed open costs twice as much; lstat sees a dangling link
        except FileNotFoundError:
            return None
        except OSError:
            pass  # _read says what is wrong
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

    def put(self, entry: StoreEntry) -> bool:
        """Record an entry in memory and, if the store is writable, on disk (atomically).

        Returns whether it is on disk. An entry larger than a reader accepts keeps only the
        winner's and the baseline's candidate results; a target path taken by something other
        than an entry file (a directory, say) leaves that one entry in memory, with a warning.
        """
        if entry.env_hash != self.env_hash:
            raise StoreError(f"an entry of environment {entry.env_hash} cannot be put into the store of "
                             f"environment {self.env_hash}")  # fmt: skip
        fitted = entry.fitted()
        with self._lock:
            self._entries[problem_from_key(entry.key).bucket_key()] = fitted or entry
        stored_tactics_changed()
        if fitted is None:
            self._warn(f"the entry of {problem_from_key(entry.key)}", f"it is larger than an entry can be "
                       f"({MAX_ENTRY_BYTES} bytes) even without its candidates; kept in memory only")  # fmt: skip
            return False
        return self._write(fitted)

    def _write(self, entry: StoreEntry) -> bool:
        if not self.writable or entry.op in self._outside:
            return False
        folder = self.path / "entries" / entry.op
        path = folder / f"{entry.key_hash}.json"
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._degrade(exc)
            return False
        else:
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):  # a link is replaced, not followed
                self._warn(str(path), f"it is {_kind(info.st_mode)}, so this entry stays in memory for this process")
                return False
        try:
            write_atomically(path, entry.to_json())
        except OSError as exc:
            self._degrade(exc)
            return False
        return True

    def adopt(self, entries: list[StoreEntry]) -> None:
        """Replace this process's view with ``entries`` (another rank's), writing them through."""
        fitted = [e.fitted() or e for e in entries]
        with self._lock:
            self._entries = {problem_from_key(e.key).bucket_key(): e for e in fitted}
            self._listed = set()
            self._disk_lookups = False  # what this rank reads must stay what every rank reads
        stored_tactics_changed()
        for e in fitted:
            self._write(e)
