"""Kernel launches on the run path: one `Launch` per plan, the driver's ``cuLaunchKernel`` called
through ctypes with a parameter buffer the plan keeps, filled by one ``struct.pack_into`` a call.

Why not ``cuda.core.launch`` on every call (what plans did before): it converts each argument from
Python and builds its parameter array anew per launch, which cost about a microsecond more than
this on the H200 host for the ~25 arguments of an attention kernel
(`benchmarks/launch_cost.py`; results/h200-launch-cost-*.json). ``run()`` of a decode step is
a dozen microseconds of host time in all, so that is what eager callers (and the plan/run A/B
of contract v2) see.

Every argument of tactix's kernels is a 64-bit integer or pointer or a double (the kernels take
``i64``, pointers and ``double``: what ``cuda.core`` passes a Python int and float as), so a
parameter is one 8-byte slot. The format (``q`` or ``d`` per slot) is taken from the first call's
Python types and kept while they stay the same; a call whose arguments do not fit it (a tensor
map, which is 128 bytes, or a float where an int was) lays the buffer out again, or goes through
``cuda.core.launch`` when an argument is neither. ``TACTIX_CUDA_NATIVE_LAUNCH=cuda.core`` sends
every launch there (a check that the two agree, or a way round a driver this does not suit).

The buffer is filled and launched under a lock (a plan run from two threads at once must not
launch with the other's pointers); the driver copies the parameters before ``cuLaunchKernel``
returns, so the buffer is free again after it. Launches capture in CUDA graphs as before: the
stream is torch's current one, nothing is allocated and nothing syncs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import struct
import threading
from typing import Any, Final

from tactix import TactixError

__all__ = ["LAUNCH_ENV", "Launch", "direct_launch_status"]

LAUNCH_ENV: Final = "TACTIX_CUDA_NATIVE_LAUNCH"
"""``cuda.core``: every launch through ``cuda.core.launch``; unset or ``driver``: the direct path."""


@functools.cache
def _driver() -> tuple[Any, Any, str | None]:
    """(``cuLaunchKernel``, ``cuGetErrorName``) from libcuda through ctypes, or (None, None, why not)."""
    if os.environ.get(LAUNCH_ENV, "driver").strip().lower() in ("cuda.core", "cuda_core", "core"):
        return None, None, f"{LAUNCH_ENV} asks for cuda.core"
    names = ["libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda") or ""]
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cuLaunchKernel
        vp, uint = ctypes.c_void_p, ctypes.c_uint
        fn.argtypes = [vp, uint, uint, uint, uint, uint, uint, uint, vp, vp, vp]
        fn.restype = ctypes.c_int
        err_name = lib.cuGetErrorName
        err_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        err_name.restype = ctypes.c_int
        return fn, err_name, None
    return None, None, "libcuda could not be loaded through ctypes"


def direct_launch_status() -> str | None:
    """None where launches go to the driver directly, else why they go through ``cuda.core``."""
    return _driver()[2]


def _format(args: tuple[Any, ...]) -> str | None:
    """The struct format of ``args`` (one 8-byte slot each), or None where one is neither an int nor
    a float."""
    out = []
    for a in args:
        if isinstance(a, int):  # (bool too: 0 or 1, as cuda.core passes it)
            out.append("q")
        elif isinstance(a, float):
            out.append("d")
        else:
            return None
    return "<" + "".join(out)


class Launch:
    """One kernel's launches with a fixed grid, block and dynamic shared memory.

    ``launch(stream, *args)``: ``stream`` is a raw ``cudaStream_t`` (torch's current stream,
    `tactix.plugin.raw_stream`; 0 the legacy default stream). The kernel is a ``cuda.core`` kernel
    (its handle, a ``CUkernel``, is what ``cuLaunchKernel`` takes as its function); ``config`` the
    matching ``cuda.core`` launch configuration, for the fallback."""

    __slots__ = ("_addr", "_buf", "_config", "_device", "_dims", "_fmt", "_fn", "_func", "_kernel", "_lock",
                 "_params")  # fmt: skip

    def __init__(self, kernel: Any, grid: tuple[int, int, int], block: int, smem: int, config: Any,
                 device_index: int) -> None:  # fmt: skip
        self._kernel, self._config, self._device = kernel, config, device_index
        handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
        self._func = int(handle)
        self._dims = (*grid, block, 1, 1, smem)
        self._fn = _driver()[0]  # None: through cuda.core
        self._fmt: str | None = ""  # None once a call's arguments needed cuda.core: this launch stays there
        self._buf: Any = None
        self._params: Any = None
        self._addr = 0
        self._lock = threading.Lock()

    def _layout(self, args: tuple[Any, ...]) -> bool:
        """Lay the buffer out for ``args``' types; False where they need ``cuda.core``."""
        fmt = _format(args)
        if fmt is None:
            self._fmt = None
            return False
        n = len(args)
        self._buf = (ctypes.c_uint64 * max(n, 1))()
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * max(n, 1))(*(base + 8 * i for i in range(n)))
        self._addr = ctypes.addressof(self._params)
        self._fmt = fmt
        return True

    def __call__(self, stream: int, *args: Any) -> None:
        fn = self._fn
        if fn is None or self._fmt is None:
            return self._through_cuda_core(stream, args)
        with self._lock:
            try:
                struct.pack_into(self._fmt, self._buf, 0, *args)
            except (struct.error, TypeError):  # first call, or other types: lay it out for these
                if not self._layout(args):
                    return self._through_cuda_core(stream, args)
                struct.pack_into(self._fmt, self._buf, 0, *args)
            err = fn(self._func, *self._dims, stream, self._addr, None)
        if err:
            raise TactixError(f"cuda_native: cuLaunchKernel failed: {_error_name(err)} ({err})")
        return None

    def _through_cuda_core(self, stream: int, args: tuple[Any, ...]) -> None:
        from tactix_cuda_native.runtime import cuda_core, stream_for

        cuda_core().launch(stream_for(self._device, stream), self._config, self._kernel, *args)


def _error_name(err: int) -> str:
    name = ctypes.c_char_p()
    fn = _driver()[1]
    if fn is not None and fn(err, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return "CUDA error"
