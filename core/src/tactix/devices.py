"""Which device a plan runs on: always a concrete device (``cuda:0``, never a bare ``cuda``)."""

from __future__ import annotations

import torch

from tactix import cudart
from tactix.errors import InvalidArgumentError

__all__ = ["checked_device", "compute_capability", "cuda_available", "named_device", "resolve_device"]

_cuda_seen = False


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, remembered once true (a GPU does not go away; asking costs
    microseconds on every plan otherwise). Never initialises CUDA."""
    global _cuda_seen
    if not _cuda_seen:
        _cuda_seen = torch.cuda.is_available()
    return _cuda_seen


_capabilities: dict[int, tuple[int, int]] = {}


def compute_capability(index: int | None = None) -> tuple[int, int] | None:
    """The compute capability of GPU ``index`` (default: the current one) as ``(major, minor)``,
    asked once per device; None where no GPU is visible. Call it at plan time, not at import:
    it initialises CUDA."""
    if not cuda_available():
        return None
    if index is None:
        index = torch.cuda.current_device()
    found = _capabilities.get(index)
    if found is None:
        found = _capabilities[index] = torch.cuda.get_device_capability(index)
    return found


_cuda_devices: dict[int, torch.device] = {}


def _cuda(index: int) -> torch.device:
    """``torch.device("cuda", index)``, made once per index (plans resolve a device every call)."""
    found = _cuda_devices.get(index)
    if found is None:
        found = _cuda_devices[index] = torch.device("cuda", index)
    return found


def resolve_device(explicit: torch.device | str | None, *tensors: object) -> torch.device:
    """The explicit device, else the first non-CPU tensor's, else the current GPU, else the CPU.

    A bare ``cuda`` becomes ``cuda:<current device>``, so comparing it with a tensor's device
    (which always carries an index) is meaningful.
    """
    if explicit is not None:
        device = torch.device(explicit)
        if device.type == "cuda" and device.index is None:
            return _cuda(_current_cuda_device())
        return device
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_cpu:
            return t.device
    if cuda_available():
        return _cuda(_current_cuda_device())
    return torch.device("cpu")


def checked_device(argument: str, value: object) -> torch.device | None:
    """The device a caller named (a `torch.device`, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a GPU
    index as torch takes it; None stays None), refused with an `InvalidArgumentError` naming
    ``argument`` when it is not a device or this machine has no such device: a wrapper checks it
    once, when it is made, instead of each plan failing later with torch's error. A bare
    ``cuda`` stays bare (`resolve_device` binds it to the current GPU at each plan)."""
    if value is None:
        return None
    count = torch.cuda.device_count() if cuda_available() else 0
    expected = f"'cpu' or 'cuda[:N]' with N < {count}" if count else "'cpu' (no CUDA GPU is visible)"
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise InvalidArgumentError(argument, expected, f"{type(value).__name__} {value!r}")
    got = repr(str(value)) if isinstance(value, torch.device) else repr(value)
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(argument, expected, got) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda" or not count or (device.index is not None and device.index >= count):
        raise InvalidArgumentError(argument, expected, got)
    return device


def named_device(argument: str, value: str | None) -> torch.device:
    """The device a user typed (``cpu``, ``cuda``, ``cuda:N``; None: the default of
    `resolve_device`), checked as `checked_device` checks it: a command checks it once, before
    any work, instead of failing every case later with torch's error."""
    return resolve_device(checked_device(argument, value))


_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_cuda_device() -> int:
    """What ``torch.cuda.current_device()`` answers. Once CUDA is initialised (`cudart.runtime`
    does it) torch's own C entry point answers without the Python lazy-init check in front of it
    (0.16 us on an H200 host, where ``torch.cuda.current_device()`` costs 0.4 and a ctypes
    ``cudaGetDevice`` 1.2: benchmarks/results/h200-current-device-cost.txt)."""
    if _get_device is not None and cudart.runtime() is not None:
        return int(_get_device())
    return torch.cuda.current_device()
