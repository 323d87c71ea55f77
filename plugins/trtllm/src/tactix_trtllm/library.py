"""flashinfer-python as this plugin sees it: imported lazily, its version checked, its JIT
modules (XQA, FMHAv2) compiled and loaded with a log line when a compile starts and ends.

Nothing here runs at import: the plugin imports cleanly without flashinfer or a GPU, and
`status()` says why it cannot run. The plugin calls flashinfer's *module-level* entry points
(the JIT spec generators ``flashinfer.jit.xqa.gen_xqa_module`` and
``flashinfer.jit.attention.modules.gen_fmha_v2_module``, and the exported ``xqa_wrapper`` /
``run`` functions of the modules they build) rather than the public Python wrappers, whose
per-call work (argument checks, view creation, device queries) is host time ``run()`` cannot
afford. Those signatures are not a stable API, so the plugin accepts exactly the flashinfer
release it was written against (`TESTED_VERSIONS`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import torch

__all__ = [
    "TESTED_VERSIONS",
    "FmhaKey",
    "LibraryStatus",
    "ModuleKey",
    "XqaKey",
    "compile_ahead",
    "flashinfer",
    "load",
    "status",
    "target",
]

log = logging.getLogger("tactix_trtllm")

TESTED_VERSIONS: Final = ("0.7.2.post1",)
"""flashinfer-python releases whose internal XQA/FMHAv2 entry points this plugin calls."""

INSTALL_HINT: Final = "pip install 'tactix-trtllm[kernels]'"


@dataclass(frozen=True)
class LibraryStatus:
    version: str | None
    error: str | None

    @property
    def usable(self) -> bool:
        return self.error is None


@functools.cache
def status() -> LibraryStatus:
    """Find and import flashinfer once per process; never raises."""
    if importlib.util.find_spec("flashinfer") is None:
        return LibraryStatus(None, f"flashinfer-python is not installed ({INSTALL_HINT})")
    try:
        module = importlib.import_module("flashinfer")
        importlib.import_module("flashinfer.jit.xqa")
        importlib.import_module("flashinfer.jit.attention.modules")
    except Exception as exc:  # any failure to load is a reason to report, not a crash
        return LibraryStatus(None, f"flashinfer cannot be imported ({type(exc).__name__}: {exc})")
    version = str(getattr(module, "__version__", "unknown"))
    if version not in TESTED_VERSIONS:
        return LibraryStatus(
            version,
            f"flashinfer-python {version} is not a release this plugin was written against "
            f"({', '.join(TESTED_VERSIONS)}): it calls flashinfer's internal XQA/FMHAv2 entry points, "
            f"whose signatures change between releases ({INSTALL_HINT})",
        )
    return LibraryStatus(version, None)


def flashinfer(submodule: str = "") -> Any:
    """``flashinfer`` or one of its submodules (only after `status()` said it is usable)."""
    return importlib.import_module("flashinfer" + (f".{submodule}" if submodule else ""))


_TORCH_DTYPES: Final = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class XqaKey:
    """One compiled XQA variant: flashinfer compiles one module per combination of these."""

    dtype: str
    page_size: int
    head_dim: int
    group_size: int
    sliding_window: bool
    kv_dtype: str = ""
    """The cache's dtype when it is not ``dtype``: ``float8_e4m3fn`` (the only fp8 format
    flashinfer 0.7.2 compiles XQA for: jit/xqa.py maps any other to a 16-bit cache)."""

    @property
    def label(self) -> str:
        window = ", sliding window" if self.sliding_window else ""
        cache = f", {self.kv_dtype} cache" if self.kv_dtype else ""
        return (f"XQA decode ({self.dtype}{cache}, page {self.page_size}, head dim {self.head_dim}, "
                f"GQA {self.group_size}{window})")  # fmt: skip

    def spec(self) -> Any:
        dtype = _TORCH_DTYPES[self.dtype]
        kv = _TORCH_DTYPES[self.kv_dtype or self.dtype]
        gen = flashinfer("jit.xqa").gen_xqa_module
        # (input, kv cache, page size, head dim, group size, sliding window, output, q_seq_len 1: no
        # speculative decoding, no ragged q)
        return gen(dtype, kv, self.page_size, self.head_dim, self.group_size, self.sliding_window, dtype, 1, False)


@dataclass(frozen=True)
class FmhaKey:
    """One compiled FMHAv2 module: every head dim, mask, soft-cap and page size of one paged-KV
    layout and dtype (flashinfer generates about 180 kernels into it; minutes of nvcc)."""

    layout: str  # "HND" or "NHD"
    dtype: str

    @property
    def input_layout(self) -> str:
        return f"Q_PAGED_KV_{self.layout}"

    @property
    def label(self) -> str:
        return f"FMHAv2 prefill ({self.dtype}, {self.layout} paged KV)"

    def spec(self) -> Any:
        gen = flashinfer("jit.attention.modules").gen_fmha_v2_module
        return gen(self.input_layout, _TORCH_DTYPES[self.dtype], None)


ModuleKey = XqaKey | FmhaKey

_modules: dict[ModuleKey, Any] = {}
_lock = threading.Lock()


def load(key: ModuleKey, spec: Any = None) -> tuple[Any, bool]:
    """The loaded module for ``key`` and whether this call built or loaded it (first use in this
    process). Compiles with nvcc into flashinfer's cache when it is not there, logging when the
    compile starts and ends: XQA takes seconds, FMHAv2 minutes (`compile_ahead` does it ahead)."""
    module = _modules.get(key)
    if module is not None:
        return module, False
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module, False
        spec = key.spec() if spec is None else spec
        cached = bool(spec.is_compiled)
        if not cached:
            log.info("trtllm: compiling %s with nvcc (first use; `tactix warmup trtllm` does this ahead)", key.label)
        start = time.perf_counter()
        try:
            module = spec.build_and_load()
        except Exception:
            log.error("trtllm: building or loading %s failed after %.1f s", key.label, time.perf_counter() - start)
            raise
        elapsed = time.perf_counter() - start
        if not cached:
            log.info("trtllm: compiled %s in %.1f s", key.label, elapsed)
        else:
            log.debug("trtllm: loaded %s in %.2f s", key.label, elapsed)
        _modules[key] = module
        return module, True


ARCHES: Final = {"sm_90": "9.0a"}
"""Targets `compile_ahead` accepts (the only one whose kernels this plugin serves)."""


def target(arch: str | None) -> None:
    """Make flashinfer compile for ``arch`` (None: the GPUs it sees, or FLASHINFER_CUDA_ARCH_LIST)."""
    if arch is None:
        return
    wanted = ARCHES[arch]
    current = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    if current is not None and wanted not in current.split():
        raise ValueError(f"FLASHINFER_CUDA_ARCH_LIST={current!r} does not include {wanted} (asked for {arch})")
    if "flashinfer" not in sys.modules:
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = wanted  # read once, when flashinfer is imported
        return
    targets = flashinfer("jit.core").current_compilation_context.TARGET_CUDA_ARCHS
    if (9, "0a") not in targets:
        raise ValueError(
            f"flashinfer was imported in this process targeting {sorted(targets)}, not {arch}; run the warm-up "
            f"in a fresh process or set FLASHINFER_CUDA_ARCH_LIST={wanted}"
        )


def compile_ahead(keys: Iterable[ModuleKey], arch: str | None, progress: Callable[[int, int, str], None] | None) -> int:
    """Compile every module in ``keys`` that flashinfer's cache lacks; returns how many were compiled.

    With a GPU the modules are loaded too (later plans in this process find them ready); without
    one they are only built (``arch`` names the target then: nothing can be asked of a GPU).
    """
    target(arch)
    todo = list(dict.fromkeys(keys))
    load_too = torch.cuda.is_available()
    compiled = 0
    for done, key in enumerate(todo, start=1):
        spec = key.spec()
        cached = bool(spec.is_compiled)
        if load_too:
            load(key, spec)  # logs when it compiles
        elif not cached:
            log.info("trtllm: compiling %s with nvcc", key.label)
            start = time.perf_counter()
            try:
                spec.build(need_lock=True)
            except Exception:
                log.error("trtllm: compiling %s failed after %.1f s", key.label, time.perf_counter() - start)
                raise
            log.info("trtllm: compiled %s in %.1f s", key.label, time.perf_counter() - start)
        compiled += 0 if cached else 1
        if progress is not None:
            progress(done, len(todo), f"{key.label}: {'found in the cache' if cached else 'compiled'}")
    return compiled
