"""The few CUDA runtime calls a plan makes itself, for plugins: an asynchronous host-to-device copy,
events to know when a pinned buffer may be written again, and torch's current stream.

Through torch they cost several microseconds each (``torch.cuda.current_stream()`` alone about
4 us on an H200 host, a ``copy_`` of sliced views about 8, ``Event.record`` about 7); called
through ctypes on the CUDA runtime library torch has already loaded they cost about one.

Public API (what `tactix.staging` uses, and what a plugin may call directly):

* `runtime()` -> `CudaRuntime` or None: the ``libcudart`` torch mapped into this process, found
  once (after CUDA is initialised); None without a GPU or where no such library is mapped (then
  use torch's API: ``Tensor.copy_(..., non_blocking=True)``, ``torch.cuda.Event``).
* `CudaRuntime`: ``copy_to_device(dst, src, nbytes, stream)`` (``cudaMemcpyAsync``, host to
  device), ``copy_on_device(dst, src, nbytes, stream)`` (device to device),
  ``event(device_index)`` (a timing-free event handle), ``record(event, stream)``,
  ``done(event)`` (``cudaEventQuery``: False while not ready), ``synchronize(event)``,
  ``destroy(event)``. Addresses, streams and events are plain ints; a failing call raises
  `tactix.TactixError` with the runtime's message (and clears the error, so torch does not
  report it later).
* `raw_stream(device_index)`: the handle of torch's current stream on that device (0: the
  legacy default stream), as an int, at about 0.1 us (what ``cuda.core`` launches and
  ``cudaMemcpyAsync`` take).

Importing this module does not initialise CUDA.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Final

import torch

from tactix.errors import TactixError

__all__ = ["CudaRuntime", "raw_stream", "runtime"]

_HOST_TO_DEVICE: Final = 1
_DEVICE_TO_DEVICE: Final = 3
_NOT_READY: Final = 600  # cudaErrorNotReady
_DISABLE_TIMING: Final = 2


class CudaRuntime:
    """ctypes handles on ``cudaMemcpyAsync`` and the event calls of one loaded ``libcudart``."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        vp, i = ctypes.c_void_p, ctypes.c_int
        self._memcpy = _fn(lib.cudaMemcpyAsync, [vp, vp, ctypes.c_size_t, i, vp])
        self._create = _fn(lib.cudaEventCreateWithFlags, [ctypes.POINTER(vp), ctypes.c_uint])
        self._record = _fn(lib.cudaEventRecord, [vp, vp])
        self._query = _fn(lib.cudaEventQuery, [vp])
        self._synchronize = _fn(lib.cudaEventSynchronize, [vp])
        self._destroy = _fn(lib.cudaEventDestroy, [vp])
        self._error = lib.cudaGetErrorString
        self._error.restype = ctypes.c_char_p
        self._error.argtypes = [i]
        self._last_error = _fn(lib.cudaGetLastError, [])

    def _check(self, rc: int, what: str) -> None:
        if rc:
            self._last_error()  # clear the sticky-free error so torch does not report it later
            raise TactixError(f"tactix plan: the CUDA runtime's {what} failed: {self._error(rc).decode()} ({rc})")

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._memcpy(dst, src, nbytes, _HOST_TO_DEVICE, stream), "cudaMemcpyAsync")

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._memcpy(dst, src, nbytes, _DEVICE_TO_DEVICE, stream), "cudaMemcpyAsync")

    def event(self, device_index: int) -> int:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device_index):
            self._check(self._create(ctypes.byref(handle), _DISABLE_TIMING), "cudaEventCreateWithFlags")
        assert handle.value is not None
        return handle.value

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cudaEventRecord")

    def done(self, event: int) -> bool:
        rc = self._query(event)
        if rc == _NOT_READY:
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def synchronize(self, event: int) -> None:
        self._check(self._synchronize(event), "cudaEventSynchronize")

    def destroy(self, event: int) -> None:
        self._destroy(event)


def _fn(f: Any, argtypes: list[Any]) -> Any:
    f.argtypes = argtypes
    f.restype = ctypes.c_int
    return f


def _loaded_cudart(maps_file: str = "/proc/self/maps") -> str | None:
    """The path of the CUDA runtime library already mapped into this process (torch's), if any."""
    try:
        with open(maps_file) as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.cache
def runtime() -> CudaRuntime | None:
    """The runtime torch uses (after CUDA is initialised), or None."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # type: ignore[no-untyped-call]
    path = _loaded_cudart()
    if path is None:
        return None
    try:
        return CudaRuntime(ctypes.CDLL(path), path)
    except (OSError, AttributeError):
        return None


_raw: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(device_index: int) -> int:
    """The handle of torch's current stream on ``device_index`` (0: the legacy default stream)."""
    if _raw is not None:
        return int(_raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)
