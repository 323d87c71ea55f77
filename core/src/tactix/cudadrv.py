"""Small kernels that tactix's core launches itself through the CUDA driver, with no compiler and
no extension module: PTX text loaded with ``cuModuleLoadData`` (the driver compiles it for the
GPU on first use, a few milliseconds) and launched with ``cuLaunchKernel`` through ctypes: a few
microseconds of host time where a chain of torch ops costs tens (`Staging.gather`: 7.6 us a call
against 18-20 for its torch path on an H100 host, benchmarks/results/h100-gather-probe-session31.json).

Public API (what `tactix.staging` uses, and plugins through `tactix.plugin`):

* `Kernel(ptx, name, argtypes)`: one ``.entry`` of a PTX module; ``launcher(device_index)`` gives
  a `Launcher` for that device, or None where the driver cannot load it (no ``libcuda``, a driver
  older than the PTX, ...: the caller keeps its torch path; the reason is logged once);
  ``disable(device_index, why)`` after a launch the driver refused (then None from then on).
* `Launcher(grid, block, stream, *args, smem=0)`: enqueue one launch on ``stream`` (an int
  handle, `tactix.cudart.raw_stream`) with ``smem`` bytes of dynamic shared memory; arguments are
  ints, in the order of ``argtypes``. A failing launch raises `tactix.TactixError` with the
  driver's message.
* `function_launcher(handle, device_index, argtypes, name, library_kernel=False)`: a `Launcher`
  for a kernel another loader loaded (a plugin's ``CUfunction``, or with ``library_kernel`` the
  ``CUkernel`` of a library that ``cuda.core`` loads, resolved once to the context's
  ``CUfunction``), or None where the driver cannot be used.
  A plugin launches a hot kernel this way for a few microseconds less host time a launch than
  through ``cuda.core`` (`tactix_cuda_native`'s decode plan).

The PTX a kernel ships is generated from the CUDA C kept next to it (``nvcc -ptx
-arch=compute_75``), with its ``.version`` lowered to the oldest ISA its instructions need, so
that drivers from CUDA 11.0 on load it.

Importing this module does not initialise CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any, Final

from tactix.cudart import _fn
from tactix.errors import TactixError

__all__ = ["INT", "INT64", "POINTER", "Kernel", "Launcher", "function_launcher"]

log = logging.getLogger("tactix")

INT: Final = ctypes.c_int
"""A kernel argument of type ``int`` (32-bit)."""
INT64: Final = ctypes.c_int64
"""A kernel argument of type ``long long`` (64-bit)."""
POINTER: Final = ctypes.c_void_p
"""A kernel argument that is a device address."""


class _Driver:
    """ctypes handles on the few driver entry points a launch needs."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        pvp = ctypes.POINTER(vp)
        self.init = _fn(lib.cuInit, [u])
        self.device_get = _fn(lib.cuDeviceGet, [ctypes.POINTER(i), i])
        self.retain = _fn(lib.cuDevicePrimaryCtxRetain, [pvp, i])
        self.current = _fn(lib.cuCtxGetCurrent, [pvp])
        self.push = _fn(lib.cuCtxPushCurrent_v2, [vp])
        self.pop = _fn(lib.cuCtxPopCurrent_v2, [pvp])
        self.load = _fn(lib.cuModuleLoadData, [pvp, ctypes.c_char_p])
        self.function = _fn(lib.cuModuleGetFunction, [pvp, vp, ctypes.c_char_p])
        self.launch = _fn(lib.cuLaunchKernel, [vp, u, u, u, u, u, u, u, vp, pvp, pvp])
        # CUDA 12.0+: a library's CUkernel resolved to the CUfunction of the current context
        entry = getattr(lib, "cuKernelGetFunction", None)
        self.kernel_function = None if entry is None else _fn(entry, [pvp, vp])
        self._error = lib.cuGetErrorString
        self._error.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
        self._error.restype = i

    def message(self, rc: int) -> str:
        text = ctypes.c_char_p()
        self._error(rc, ctypes.byref(text))
        return f"{text.value.decode() if text.value else 'unknown error'} ({rc})"

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise TactixError(f"tactix: the CUDA driver's {what} failed: {self.message(rc)}")


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _load_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise TactixError(f"tactix: the CUDA driver library libcuda.so.1 cannot be loaded ({exc})") from None
            driver = _Driver(lib)
            driver.check(driver.init(0), "cuInit")
            _driver = driver
        return _driver


class Launcher:
    """One kernel loaded on one device: its arguments live in ctypes objects made once, which a
    call updates (an int each) before ``cuLaunchKernel``."""

    def __init__(self, driver: _Driver, context: int, function: int, argtypes: Sequence[Any]) -> None:
        self._driver, self._context, self._function = driver, context, function
        self._args = [t() for t in argtypes]
        self._params = (ctypes.c_void_p * len(self._args))(*(ctypes.addressof(a) for a in self._args))
        self._current = ctypes.c_void_p()
        # the holders are shared: one launch at a time sets them (cuLaunchKernel copies the values)
        self._lock = threading.Lock()

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], stream: int, *args: int,
                 smem: int = 0) -> None:  # fmt: skip
        d = self._driver
        with self._lock:
            for holder, value in zip(self._args, args, strict=True):
                holder.value = value
            d.current(ctypes.byref(self._current))
            foreign = self._current.value != self._context
            if foreign:  # (a thread that has not touched this device, or another device current)
                d.check(d.push(self._context), "cuCtxPushCurrent")
            try:
                rc = d.launch(self._function, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream,
                              self._params, None)  # fmt: skip
            finally:
                if foreign:
                    d.pop(ctypes.byref(self._current))
        if rc:
            d.check(rc, "cuLaunchKernel")


def _primary_context(d: _Driver, device_index: int) -> int:
    """The primary context of ``device_index`` (retained): the one torch's runtime calls use."""
    device, context = ctypes.c_int(), ctypes.c_void_p()
    d.check(d.device_get(ctypes.byref(device), device_index), "cuDeviceGet")
    d.check(d.retain(ctypes.byref(context), device.value), "cuDevicePrimaryCtxRetain")
    assert context.value is not None
    return context.value


def function_launcher(handle: int, device_index: int, argtypes: Sequence[Any], name: str, *,
                      library_kernel: bool = False) -> Launcher | None:  # fmt: skip
    """A `Launcher` for the loaded kernel ``handle`` on ``device_index``, or None where the driver
    cannot be used here (logged; the caller keeps its own launch path). ``handle`` is a
    ``CUfunction``, or with ``library_kernel`` a ``CUkernel`` (what ``cuda.core`` loads through
    ``cuLibraryLoadData``): resolved once here to the ``CUfunction`` of the device's primary
    context (``cuKernelGetFunction``), so a launch does not resolve it again; a driver without
    that entry point launches the ``CUkernel`` itself (``cuLaunchKernel`` takes both since CUDA
    12.0). The kernel's attributes (its dynamic shared memory limit) are the loader's business."""
    try:
        d = _load_driver()
        context = _primary_context(d, device_index)
        if library_kernel and d.kernel_function is not None:
            handle = _context_function(d, context, handle, name)
        return Launcher(d, context, handle, argtypes)
    except TactixError as exc:
        log.info("tactix: %s keeps its own launch path on cuda:%d: %s", name, device_index, exc)
        return None


def _context_function(d: _Driver, context: int, kernel: int, name: str) -> int:
    """The ``CUfunction`` of the library kernel ``kernel`` in ``context`` (loaded there if it is not yet)."""
    assert d.kernel_function is not None
    function, popped = ctypes.c_void_p(), ctypes.c_void_p()
    d.check(d.push(context), "cuCtxPushCurrent")
    try:
        d.check(d.kernel_function(ctypes.byref(function), kernel), f"cuKernelGetFunction ({name})")
    finally:
        d.pop(ctypes.byref(popped))
    assert function.value is not None
    return function.value


class Kernel:
    """One ``.entry`` of a PTX module, loaded per device on first use."""

    def __init__(self, ptx: str, name: str, argtypes: Sequence[Any]) -> None:
        self.ptx, self.name, self.argtypes = ptx, name, tuple(argtypes)
        self._launchers: dict[int, Launcher | None] = {}
        self._lock = threading.Lock()

    def launcher(self, device_index: int) -> Launcher | None:
        """The kernel on ``device_index``, or None where the driver cannot load it (logged once)."""
        found = self._launchers.get(device_index, False)
        if found is not False:
            return found  # type: ignore[return-value]
        with self._lock:
            if device_index not in self._launchers:
                try:
                    self._launchers[device_index] = self._load(device_index)
                except TactixError as exc:
                    log.info("tactix: %s stays on its torch path on cuda:%d: %s", self.name, device_index, exc)
                    self._launchers[device_index] = None
            return self._launchers[device_index]

    def disable(self, device_index: int, why: object) -> None:
        """Stop launching on ``device_index`` after a launch the driver refused (logged): callers
        take their torch path from then on."""
        with self._lock:
            self._launchers[device_index] = None
        log.warning("tactix: %s stays on its torch path on cuda:%d from now on: %s", self.name, device_index, why)

    def _load(self, device_index: int) -> Launcher:
        d = _load_driver()
        context = _primary_context(d, device_index)
        module, function, popped = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        d.check(d.push(context), "cuCtxPushCurrent")
        try:
            d.check(d.load(ctypes.byref(module), self.ptx.encode()), f"cuModuleLoadData ({self.name})")
            d.check(d.function(ctypes.byref(function), module, self.name.encode()), "cuModuleGetFunction")
        finally:
            d.pop(ctypes.byref(popped))
        assert function.value is not None
        return Launcher(d, context, function.value, self.argtypes)
