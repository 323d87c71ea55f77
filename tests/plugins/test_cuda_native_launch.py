"""cuda_native's launch path (`tactix_cuda_native.launch`) without a GPU: the parameter buffer a
``cuLaunchKernel`` call receives holds exactly the run's arguments (read back through the
pointer array as the driver reads it), a change of argument types lays it out again, anything
that is not an int or a float goes through ``cuda.core``, and a driver error is a TactixError.
The driver call itself is replaced by a reader of what it was handed; the GPU kits run the real
one."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

pytest.importorskip("tactix_cuda_native", reason="plugins/cuda_native is not installed (scripts/setup.sh installs it)")

from tactix_cuda_native import launch as launch_mod
from tactix_cuda_native.launch import Launch

from tactix import TactixError


class _Kernel:
    handle = 0x7F00_1234_5000


class _Driver:
    """Stands in for ``cuLaunchKernel``: records what the driver would read from the call."""

    def __init__(self, kinds: list[str], result: int = 0) -> None:
        self.kinds, self.result = kinds, result
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, func: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int, stream: int,
                 params: int, extra: Any) -> int:  # fmt: skip
        slots = (ctypes.c_void_p * len(self.kinds)).from_address(params)
        values = [
            (ctypes.c_double if kind == "d" else ctypes.c_int64).from_address(slots[i]).value
            for i, kind in enumerate(self.kinds)
        ]
        self.calls.append(((func, gx, gy, gz, bx, by, bz, smem, stream, extra), values))
        return self.result


def _launch(driver: _Driver) -> Launch:
    launch = Launch(_Kernel(), (132, 8, 1), 256, 99 * 1024, config=None, device_index=0)
    launch._fn = driver  # type: ignore[assignment]
    return launch


def test_the_driver_reads_the_run_arguments_the_grid_and_the_stream() -> None:
    args = (0x7F00_0000_1000, 4096, 128, -1, 0, 2.5e-3, 1.0, 0x7F00_0000_2000)
    driver = _Driver(["q", "q", "q", "q", "q", "d", "d", "q"])
    launch = _launch(driver)
    launch(0xABC0, *args)
    second = (0x7F00_0000_3000, 8192, 64, 3, 1, 0.125, 0.5, 0)
    launch(0, *second)  # the same layout, new values
    (meta1, values1), (meta2, values2) = driver.calls
    assert meta1 == (_Kernel.handle, 132, 8, 1, 256, 1, 1, 99 * 1024, 0xABC0, None)
    assert meta2[8] == 0
    assert values1 == list(args) and values2 == list(second)


def test_a_float_where_an_int_was_lays_the_buffer_out_again() -> None:
    launch = _launch(_Driver(["q", "q"]))
    launch(0, 7, 9)
    changed = _Driver(["q", "d", "q"])
    launch._fn = changed  # type: ignore[assignment]
    launch(0, 7, 0.75, 11)
    assert changed.calls[0][1] == [7, 0.75, 11]


def test_an_argument_that_is_neither_int_nor_float_goes_through_cuda_core(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(Launch, "_through_cuda_core", lambda self, stream, args: seen.append((stream, args)))
    driver = _Driver(["q"])
    launch = _launch(driver)
    descriptor = object()  # a tensor map, say
    launch(5, descriptor, 1)
    launch(5, 2)  # the launch stays with cuda.core
    assert seen == [(5, (descriptor, 1)), (5, (2,))]
    assert driver.calls == []


def test_a_driver_error_is_a_tactix_error_naming_the_call() -> None:
    launch = _launch(_Driver(["q"], result=1))
    with pytest.raises(TactixError, match="cuLaunchKernel failed"):
        launch(0, 1)


def test_the_environment_variable_sends_every_launch_through_cuda_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch_mod.LAUNCH_ENV, "cuda.core")
    launch_mod._driver.cache_clear()
    try:
        assert "asks for cuda.core" in (launch_mod.direct_launch_status() or "")
        assert Launch(_Kernel(), (1, 1, 1), 32, 0, None, 0)._fn is None
    finally:
        monkeypatch.delenv(launch_mod.LAUNCH_ENV)
        launch_mod._driver.cache_clear()
