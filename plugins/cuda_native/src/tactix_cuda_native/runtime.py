"""The kernel runtime: NVRTC compilation (through ``cuda.core``), a disk cache of cubins, loading and launching.

Kernel sources are package data (``kernels/*.cu``, ``kernels/*.cuh``). A `Variant` names one
source file, its compile-time parameters (``-D`` defines) and the target architecture; it is
compiled once per machine with NVRTC into a cubin for that architecture. NVRTC needs no GPU and
no driver, so every variant compiles on a machine without one (CI does); only loading needs one.

Disk cache: ``<root>/cuda_native/v<FORMAT>/<arch>/<key>.cubin`` where ``<root>`` is the tactic
store's root (``$TACTIX_CACHE_DIR``, else the user cache directory) and ``<key>`` hashes the
source text with its headers inlined, the defines, the architecture, the compile options and
the NVRTC version. A file holds a small header (magic, payload length, SHA-256 of the payload)
before the cubin, and is written to a temporary file in the same directory and renamed over the
target (``os.replace``): concurrent processes share the cache, a reader sees a whole file or
none, and a truncated or corrupt file is recompiled, never loaded.

Plans launch with ``cuda.core.launch`` (`kernel.launcher`) on torch's current stream (`stream_for`),
with a `launch_config` and raw pointers and 64-bit integers as arguments (floats as doubles): no
allocation and no host sync, so the launches capture in CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tactix import TactixError
from tactix.plugin import cache_root, write_atomically

__all__ = [
    "CACHE_FORMAT",
    "KERNEL_DIR",
    "CudaUnavailableError",
    "KernelCompileError",
    "LoadedModule",
    "Variant",
    "cache_dir",
    "compile_all",
    "compile_variant",
    "cuda_core",
    "cuda_core_status",
    "default_jobs",
    "launch_config",
    "load",
    "nvrtc_version",
    "resident_ctas",
    "resource_usage",
    "source_text",
    "stream_for",
    "tensor_map",
    "tensor_maps_status",
]

KERNEL_DIR: Final = Path(__file__).resolve().parent / "kernels"
CACHE_FORMAT: Final = 1
_log = logging.getLogger("tactix.cuda_native")
_MAGIC: Final = b"TXCUBIN1"
_HEADER: Final = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)
_OPTIONS: Final = ("-std=c++17",)  # what ProgramOptions below sets; part of the cache key


class KernelCompileError(TactixError):
    """NVRTC refused a kernel variant; ``log`` holds the compiler's output."""

    def __init__(self, variant: Variant, log: str) -> None:
        self.variant = variant
        self.log = log
        super().__init__(f"cuda_native: NVRTC failed to compile {variant.label()} for {variant.arch}:\n{log}")

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a compile worker process, re-raised here
        return (type(self), (self.variant, self.log))


class CudaUnavailableError(TactixError):
    """cuda.core (or the NVRTC library it needs) cannot be imported or used here."""


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel source: the file, its ``-D`` defines and the target arch."""

    source: str
    defines: tuple[tuple[str, str], ...]
    arch: str

    @classmethod
    def make(cls, source: str, arch: str, **defines: int | str) -> Variant:
        return cls(source, tuple(sorted((k, str(v)) for k, v in defines.items())), arch)

    def label(self) -> str:
        args = " ".join(f"{k}={v}" for k, v in self.defines)
        return f"{self.source} [{args}]"

    def key(self) -> str:
        """The cache key: source (headers inlined), defines, arch, options, NVRTC version."""
        data = {
            "format": CACHE_FORMAT,
            "source": hashlib.sha256(source_text(self.source).encode()).hexdigest(),
            "defines": [list(d) for d in self.defines],
            "arch": self.arch,
            "options": list(_OPTIONS),
            "nvrtc": nvrtc_version(),
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:40]


# -- cuda.core -------------------------------------------------------------------------------


@functools.cache
def cuda_core_status() -> tuple[Any, str | None]:
    """``(module, None)`` for the importable ``cuda.core`` (new or ``experimental`` path), else ``(None, why)``."""
    errors = []
    for name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # not installed, or its native libraries are missing
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if all(hasattr(module, attr) for attr in ("Program", "ProgramOptions", "ObjectCode", "launch", "Device")):
            return module, None
        errors.append(f"{name}: lacks Program/ObjectCode/launch")
    return None, "cuda.core cannot be imported (" + "; ".join(errors) + ")"


def cuda_core() -> Any:
    module, why = cuda_core_status()
    if module is None:
        raise CudaUnavailableError(f"cuda_native: {why}")
    return module


@functools.cache
def nvrtc_version() -> str:
    """NVRTC's version as 'major.minor' ('unknown' if it cannot be asked)."""
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) == 0:
            return f"{major}.{minor}"
    except Exception:
        pass
    return "unknown"


# -- sources ---------------------------------------------------------------------------------

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.cache
def source_text(name: str) -> str:
    """The source of ``kernels/<name>`` with its local ``#include "..."`` headers inlined (once each)."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        path = KERNEL_DIR / file
        if not path.is_file():
            raise TactixError(f"cuda_native: kernel source {file!r} is missing from {KERNEL_DIR}")
        text = path.read_text()

        def include(match: re.Match[str]) -> str:
            header = match.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return f"// ---- {header}\n" + expand(header) + f"\n// ---- end of {header}\n"

        return _INCLUDE.sub(include, text)

    return expand(name)


def sources() -> list[str]:
    """Every kernel source file shipped with the package."""
    return sorted(p.name for p in KERNEL_DIR.iterdir() if p.suffix in (".cu", ".cuh"))


# -- disk cache ------------------------------------------------------------------------------


def cache_dir(root: Path | None = None) -> Path:
    """Where cubins are kept: ``<tactix cache root>/cuda_native/v<FORMAT>``."""
    return (cache_root() if root is None else Path(root)) / "cuda_native" / f"v{CACHE_FORMAT}"


def _cache_path(variant: Variant, root: Path | None) -> Path:
    return cache_dir(root) / variant.arch / f"{variant.key()}.cubin"


def _read_cached(path: Path) -> bytes | None:
    """The cubin in ``path`` if the file is whole and its digest matches, else None."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size :]
    if magic != _MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def _write_atomically(path: Path, payload: bytes) -> None:
    """The cubin behind a header (magic, length, SHA-256), written with the store's atomic write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload)


class _Log:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: object) -> None:
        self.parts.append(text.decode() if isinstance(text, bytes) else str(text))


_memory: dict[tuple[str, str], bytes] = {}
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
stats = {"compiled": 0, "disk_hits": 0, "memory_hits": 0, "recompiled_corrupt": 0}
"""Counters (this process): NVRTC compiles, disk-cache hits, memory hits, corrupt files replaced."""


def _program_options(cc: Any, variant: Variant, **extra: Any) -> Any:
    """NVRTC options of ``variant`` (what `_OPTIONS` records in the cache key, plus ``extra``)."""
    return cc.ProgramOptions(arch=variant.arch, std="c++17", define_macro=[(k, v) for k, v in variant.defines],
                             name=variant.source, **extra)  # fmt: skip


def _nvrtc_compile(variant: Variant) -> bytes:
    cc = cuda_core()
    options = _program_options(cc, variant)
    log = _Log()
    try:
        program = cc.Program(source_text(variant.source), "c++", options)
        code = program.compile("cubin", logs=log)
    except Exception as exc:
        text = "".join(log.parts).strip()
        message = str(exc)
        raise KernelCompileError(variant, "\n".join(p for p in (message, text) if p)) from exc
    return bytes(code.code)


_PTXAS_INFO = re.compile(
    r"Function properties for (\w+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\s*\n.*?Used (\d+) registers",
    re.S,
)


# ptxas' advisory when it cannot keep wgmma asynchronous (it then waits after each one): e.g.
# "(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient
# register resources for the function 'tactix_prefill'"
_WGMMA_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized[^\n]*?function '(\w+)'")


def resource_usage(variant: Variant, *, root: Path | None = None) -> dict[str, dict[str, int]]:
    """Per kernel of ``variant``: registers, stack frame and spill bytes, from ptxas' report, and
    ``wgmma_serialized`` 1 where ptxas had to serialize the kernel's wgmma instructions.

    Compiles afresh with ``-v`` (the report is not cached): for tests and tuning tables, not for
    plans. With ``root`` the cubin (the same code: ``-v`` only reports) also goes into that
    cache, so a `compile_variant` of the same variant and root after it is a hit.
    """
    cc = cuda_core()
    options = _program_options(cc, variant, ptxas_options="-v")
    log = _Log()
    try:
        code = cc.Program(source_text(variant.source), "c++", options).compile("cubin", logs=log)
    except Exception as exc:
        raise KernelCompileError(variant, "\n".join((str(exc), "".join(log.parts)))) from exc
    if root is not None:
        cubin = bytes(code.code)
        with contextlib.suppress(OSError):
            _write_atomically(_cache_path(variant, root), cubin)
        _memory[(str(cache_dir(root)), variant.key())] = cubin
    text = "".join(log.parts)
    serialized = set(_WGMMA_SERIALIZED.findall(text))
    out = {}
    for m in _PTXAS_INFO.finditer(text):
        out[m.group(1)] = {
            "registers": int(m.group(5)),
            "stack": int(m.group(2)),
            "spill_stores": int(m.group(3)),
            "spill_loads": int(m.group(4)),
            "wgmma_serialized": int(m.group(1) in serialized),
        }
    return out


def compile_variant(variant: Variant, *, root: Path | None = None) -> tuple[bytes, bool]:
    """The cubin of ``variant`` and whether NVRTC had to compile it now (False: a cache hit)."""
    key = variant.key()
    memo = (str(cache_dir(root)), key)
    found = _memory.get(memo)
    if found is not None:
        stats["memory_hits"] += 1
        return found, False
    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        found = _memory.get(memo)
        if found is not None:
            return found, False
        path = _cache_path(variant, root)
        cubin = _read_cached(path)
        if cubin is not None:
            stats["disk_hits"] += 1
            _memory[memo] = cubin
            return cubin, False
        if path.exists():
            stats["recompiled_corrupt"] += 1
        cubin = _nvrtc_compile(variant)
        stats["compiled"] += 1
        with contextlib.suppress(OSError):  # a read-only or full cache costs a recompile next process
            _write_atomically(path, cubin)
        _memory[memo] = cubin
        return cubin, True


def _compile_in_worker(variant: Variant, root: str | None) -> bool:
    """A worker process's job: compile into the disk cache (the parent reads the file back)."""
    return compile_variant(variant, root=None if root is None else Path(root))[1]


def default_jobs() -> int:
    """Parallel compile processes: ``$TACTIX_COMPILE_JOBS``, else the CPU count up to 16."""
    explicit = os.environ.get("TACTIX_COMPILE_JOBS")
    if explicit:
        try:
            return max(1, int(explicit))
        except ValueError:
            raise TactixError(f"TACTIX_COMPILE_JOBS must be a positive integer, got {explicit!r}") from None
    return max(1, min(16, os.cpu_count() or 1))


def compile_all(
    variants: Iterable[Variant],
    progress: Callable[[int, int, str], None] | None = None,
    *,
    root: Path | None = None,
    jobs: int | None = None,
) -> int:
    """Compile (or find cached) every variant; returns how many NVRTC compiled now.

    Variants missing from the disk cache are compiled by up to ``jobs`` (default `default_jobs`)
    fresh processes at once (NVRTC only: no CUDA context is made in them); if processes cannot
    be started, they are compiled here one by one. A compile error raises `KernelCompileError`."""
    todo = list(dict.fromkeys(variants))
    done = 0
    compiled = 0

    def report(variant: Variant, how: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(todo), f"{variant.label()} {variant.arch}: {how}")

    missing = []
    for variant in todo:
        if (str(cache_dir(root)), variant.key()) in _memory or _read_cached(_cache_path(variant, root)) is not None:
            compile_variant(variant, root=root)
            report(variant, "cached")
        else:
            missing.append(variant)
    workers = min(jobs if jobs is not None else default_jobs(), len(missing))
    if workers > 1:
        import concurrent.futures
        import multiprocessing

        t0 = time.perf_counter()
        try:
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = {pool.submit(_compile_in_worker, v, None if root is None else str(root)): v for v in missing}
                for future in concurrent.futures.as_completed(futures):
                    variant = futures[future]
                    built = future.result()  # a KernelCompileError travels back as itself
                    compile_variant(variant, root=root)  # into this process's memory from the file
                    compiled += built
                    report(variant, f"compiled ({time.perf_counter() - t0:.1f} s since start)" if built else "cached")
            return compiled
        except (OSError, concurrent.futures.process.BrokenProcessPool) as exc:
            _log.warning("parallel compile failed (%s: %s); compiling one by one", type(exc).__name__, exc)
            missing = [v for v in missing if (str(cache_dir(root)), v.key()) not in _memory]
            done = len(todo) - len(missing)
    for variant in missing:
        t0 = time.perf_counter()
        _, built = compile_variant(variant, root=root)
        compiled += built
        report(variant, f"compiled in {time.perf_counter() - t0:.2f} s" if built else "cached")
    return compiled


# -- loading and launching -------------------------------------------------------------------


class LoadedModule:
    """A cubin loaded on one device: its kernels by name, with their dynamic shared memory raised."""

    def __init__(self, cubin: bytes, device_index: int) -> None:
        cc = cuda_core()
        self.device_index = device_index
        device = cc.Device(device_index)
        device.set_current()
        from_cubin = getattr(cc.ObjectCode, "from_cubin", None)
        self._code = from_cubin(cubin) if from_cubin is not None else cc.ObjectCode(cubin, "cubin")
        self._kernels: dict[str, Any] = {}
        self._smem: dict[str, int] = {}

    def kernel(self, name: str, dynamic_smem: int = 0) -> Any:
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self._code.get_kernel(name)
        if dynamic_smem > self._smem.get(name, 48 * 1024):
            _set_max_dynamic_smem(k, dynamic_smem, self.device_index)
            self._smem[name] = dynamic_smem
        return k


def _set_max_dynamic_smem(kernel: Any, size: int, device_index: int) -> None:
    from cuda.bindings import driver

    attrs = driver.CUfunction_attribute
    handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
    # the size itself, then the largest shared-memory carveout so that several CTAs fit per SM
    for attr, value in ((attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, size),
                        (attrs.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)):  # fmt: skip
        if isinstance(handle, driver.CUkernel):
            result = driver.cuKernelSetAttribute(attr, value, handle, driver.CUdevice(device_index))
        else:
            result = driver.cuFuncSetAttribute(handle, attr, value)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            raise TactixError(f"cuda_native: cannot set {attr} = {value} for a kernel ({err})")


_modules: dict[tuple[str, int], LoadedModule] = {}
_modules_lock = threading.Lock()
_loaded: dict[tuple[Variant, int], LoadedModule] = {}  # by the variant itself: no source hashed (Variant.key: ~40 us)


def load(variant: Variant, device_index: int) -> tuple[LoadedModule, bool]:
    """The variant loaded on ``device_index`` (compiled or read from the cache first) and whether it was built."""
    found = _loaded.get((variant, device_index))
    if found is not None:
        return found, False
    key = (variant.key(), device_index)
    with _modules_lock:
        found = _modules.get(key)
    if found is not None:
        _loaded[(variant, device_index)] = found
        return found, False
    cubin, built = compile_variant(variant)
    module = LoadedModule(cubin, device_index)
    with _modules_lock:
        module = _modules.setdefault(key, module)
        _loaded[(variant, device_index)] = module
        return module, built


class _TorchStream:
    """A stream handle in the ``__cuda_stream__`` protocol (what cuda.core wraps)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_streams: dict[tuple[int, int, int], Any] = {}


def stream_for(device_index: int, handle: int) -> Any:
    """The cuda.core Stream for torch's stream ``handle`` (cached per thread, device and handle)."""
    key = (threading.get_ident(), device_index, handle)
    stream = _streams.get(key)
    if stream is None:
        cc = cuda_core()
        device = cc.Device(device_index)
        device.set_current()  # cuda.core tracks the current device per thread
        legacy = getattr(cc, "LEGACY_DEFAULT_STREAM", None)
        # torch's default stream (handle 0) is the legacy NULL stream
        use_legacy = handle == 0 and legacy is not None
        _streams[key] = stream = legacy if use_legacy else device.create_stream(_TorchStream(handle))
    return stream


_resident: dict[tuple[int, int, int], tuple[Any, int | None]] = {}


def resident_ctas(kernel: Any, threads: int, smem: int) -> int | None:
    """CTAs of ``kernel`` one SM holds at once with ``threads`` threads and ``smem`` bytes of dynamic
    shared memory (the driver's occupancy calculator: registers, shared memory, the carveout), or
    None where this cuda.core cannot ask. Asked once per kernel and launch shape (plans ask every
    batch)."""
    key = (id(kernel), threads, smem)
    found = _resident.get(key)
    if found is not None and found[0] is kernel:  # the entry holds the kernel: its id is not reused
        return found[1]
    value = _ask_resident(kernel, threads, smem)
    _resident[key] = (kernel, value)
    return value


def _ask_resident(kernel: Any, threads: int, smem: int) -> int | None:
    try:
        value = int(kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem))
    except Exception:  # an older cuda.core without Kernel.occupancy, or a driver refusal
        return None
    return value if value > 0 else None


@functools.lru_cache(maxsize=1024)
def launch_config(grid: tuple[int, int, int], block: int, smem: int) -> Any:
    """The cuda.core launch configuration (immutable once made, so shared between plans)."""
    return cuda_core().LaunchConfig(grid=grid, block=(block, 1, 1), shmem_size=smem)


# -- tensor maps (TMA descriptors) -----------------------------------------------------------


@functools.cache
def _tensor_map_api() -> tuple[Any, Any, str | None]:
    """(``cuda.core._tensor_map``, ``StridedMemoryView``, None), or (None, None, why not)."""
    try:
        enums = importlib.import_module("cuda.core._tensor_map")
        view = importlib.import_module("cuda.core.utils").StridedMemoryView
        for name in ("TensorMapDataType", "TensorMapL2Promotion", "TensorMapSwizzle"):
            getattr(enums, name)
    except Exception as exc:  # an older or newer cuda.core
        return None, None, f"this cuda.core cannot encode tensor maps ({type(exc).__name__}: {exc})"
    if not hasattr(view, "as_tensor_map"):
        return None, None, "this cuda.core's StridedMemoryView has no as_tensor_map"
    return enums, view, None


def tensor_maps_status() -> str | None:
    """None where this ``cuda.core`` can encode tiled tensor maps (``StridedMemoryView.as_tensor_map``
    and the enums of ``cuda.core._tensor_map``), else why not."""
    return _tensor_map_api()[2]


def tensor_map(t: Any, box: tuple[int, ...]) -> Any:
    """The tiled TMA descriptor (a cuda.core ``TensorMapDescriptor``, a kernel argument) of a CUDA
    tensor ``t`` of 16-bit floats (rank 3 to 5) whose last dimension is contiguous, with boxes of
    ``box`` elements (outermost first; 64 innermost: 128-byte rows), the 128-byte swizzle and zeros
    outside the tensor. Encoding costs microseconds of host time: callers keep the descriptors of
    tensors that do not move."""
    import torch

    enums, view_type, why = _tensor_map_api()
    if why is not None:
        raise CudaUnavailableError(f"cuda_native: {why}")
    from_dlpack = getattr(view_type, "from_dlpack", None)
    view = from_dlpack(t, stream_ptr=-1) if from_dlpack is not None else view_type(t, stream_ptr=-1)
    dtype = enums.TensorMapDataType.BFLOAT16 if t.dtype == torch.bfloat16 else enums.TensorMapDataType.FLOAT16
    return view.as_tensor_map(box, data_type=dtype, swizzle=enums.TensorMapSwizzle.SWIZZLE_128B,
                              l2_promotion=enums.TensorMapL2Promotion.L2_256B)  # fmt: skip
