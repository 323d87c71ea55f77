"""The plan-path helpers plugins share (`tactix.staging`, `tactix.cudart`), on the CPU.

What needs no GPU: the section layout and its C-level writer, the page-table layout on the host
and its gather (CPU tensors), the staging's sizing rules, and its slot and pinned-ring
bookkeeping with a stand-in for the pinned buffer (copies that complete when the test says so):
the transfers themselves, the events and the CUDA runtime calls are covered by the GPU tests
(tests/gpu/test_cudnn_gpu.py, tests/gpu/test_cuda_native_gpu.py: plans far ahead of the GPU).
"""

from __future__ import annotations

import array
import ctypes
import gc
import itertools
import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tactix import TactixError, cudadrv, cudart
from tactix.staging import ALIGN, HostBuffer, Staging, gather_table, sections, write_int32, write_table


def test_the_plan_path_finds_the_cuda_runtime_torch_mapped(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /site/nvidia/cu13/lib/libcudart.so.13\n"
        "7f04-7f05 rw-p 00000000 00:00 0\n"
    )
    assert cudart._loaded_cudart(str(maps)) == "/site/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert cudart._loaded_cudart(str(maps)) is None
    assert cudart._loaded_cudart(str(tmp_path / "missing")) is None
    if not torch.cuda.is_available():
        assert cudart.runtime() is None  # then staging uses torch's copy and events


def test_sections_are_aligned_named_and_memoised() -> None:
    layout = sections(("items", 40), ("count", 1), ("empty", 0), ("indices", 64))
    assert layout.names == ("items", "count", "empty", "indices")
    assert layout.offsets == (0, 64, 96, 128) and layout.capacities == (40, 1, 1, 64)
    assert layout.total == 192 and all(o % ALIGN == 0 for o in layout.offsets)
    assert layout.offset("indices") == 128
    assert sections(("items", 40), ("count", 1), ("empty", 0), ("indices", 64)) is layout


def test_sections_write_every_entry_from_lists_arrays_and_tensors() -> None:
    layout = sections(("a", 5), ("b", 3), ("c", 40), ("d", 2))
    host = torch.full((layout.total,), -7, dtype=torch.int32)
    strided = torch.arange(100, 180, dtype=torch.int64)[::2]  # int64, not contiguous: converted
    layout.write(host.data_ptr(), [[1, -2, 2**31 - 1], array.array("i", [9, 8, 7]), strided, []])
    want = [1, -2, 2**31 - 1] + [0] * 29 + [9, 8, 7] + [0] * 29 + list(range(100, 180, 2)) + [0] * 24 + [0] * 32
    assert host.tolist() == want  # pieces in place, the rest of every section zero: no entry left over
    layout.write(host.data_ptr(), [range(5), (4,), torch.ones(40, dtype=torch.int32), array.array("i")])
    assert host[:5].tolist() == [0, 1, 2, 3, 4] and host[32:34].tolist() == [4, 0] and host[-32:].sum() == 0
    # all lists (one packed write): the same entries as the piece-by-piece path gives
    lists = [[1, -2, 2**31 - 1], [9, 8, 7], list(range(100, 180, 2)), []]
    host.fill_(-7)
    layout.write(host.data_ptr(), lists)
    assert host.tolist() == want
    for _ in range(2):  # (again with the memoised packer, over other contents)
        host.fill_(-7)
        layout.write(host.data_ptr(), [[5, 5, 5], [1, 1, 1], [3] * 40, []])
        assert host.tolist() == [5] * 3 + [0] * 29 + [1] * 3 + [0] * 29 + [3] * 40 + [0] * 24 + [0] * 32


def test_sections_refuse_what_does_not_fit() -> None:
    layout = sections(("a", 2), ("b", 1))
    host = torch.zeros(layout.total, dtype=torch.int32)
    with pytest.raises(TactixError, match="section 'a' holds 2 entries"):
        layout.write(host.data_ptr(), [[1, 2, 3], [0]])
    with pytest.raises(TactixError, match="section 'b' holds 1 entries"):
        layout.write(host.data_ptr(), [[1], torch.zeros(2, dtype=torch.int32)])
    with pytest.raises(TactixError, match="take one piece each"):
        layout.write(host.data_ptr(), [[1]])
    with pytest.raises(TactixError, match="int32"):
        layout.write(host.data_ptr(), [[2**31], [0]])
    with pytest.raises(TactixError, match="section 'b' holds 1 entries"):
        layout.write(host.data_ptr(), [[1], [0, 1]])  # (all lists: the packed path)
    with pytest.raises(TactixError, match="4-byte ints"):
        layout.write(host.data_ptr(), [array.array("q", [1]), [0]])


def test_write_int32_is_one_copy_of_the_values() -> None:
    host = torch.full((8,), -1, dtype=torch.int32)
    assert write_int32(host.data_ptr() + 4, [3, -4, 5]) == 3
    assert write_int32(host.data_ptr(), []) == 0
    assert host.tolist() == [-1, 3, -4, 5, -1, -1, -1, -1]


def test_page_table_on_the_host_and_gathered_agree() -> None:
    """The padded [rows, width] table from CSR indices: laid out on the host (zeros past each
    request and in padding rows) and gathered (whatever past each request: never read)."""
    pages = [1, 4, 2, 3]
    rows, width = 6, 4  # two padding rows, as a bucketed batch has
    gen = torch.Generator().manual_seed(0)
    indices = torch.randperm(40, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = [0, *itertools.accumulate(pages)]
    host = torch.full((rows * width,), -1, dtype=torch.int32)
    write_table(host.data_ptr(), indices.data_ptr(), indptr, rows, width)
    table = host.view(rows, width)
    ext = torch.cat([indices, torch.zeros(width, dtype=torch.int32)])
    starts = torch.tensor(indptr[:-1] + [indptr[-1]] * (rows - len(pages)), dtype=torch.int32)
    gathered = torch.full((rows, width), -1, dtype=torch.int32)
    gather_table(ext, starts, out=gathered)
    for r in range(rows):
        n = pages[r] if r < len(pages) else 0
        mine = indices[indptr[r] : indptr[r] + n].tolist() if n else []
        assert table[r, :n].tolist() == mine == gathered[r, :n].tolist()
        assert not table[r, n:].any()
    assert int(gathered.min()) >= 0  # every gathered entry is a real page
    # a batch of empty requests (no page entries at all): zeros, nothing read from the indices
    write_table(host.data_ptr(), 0, [0, 0, 0], rows, width)
    assert not host.any()


def test_staging_sizes_round_up_and_grow_by_doubling() -> None:
    assert Staging.sized(0, 0, 1, 0) == (1024, 0)
    assert Staging.sized(0, 0, 1024, 300) == (1024, 300)
    assert Staging.sized(0, 0, 1025, 0) == (2048, 0)
    assert Staging.sized(1024, 300, 1100, 10) == (2048, 300)  # twice the old one: a few reallocations only
    assert Staging.sized(1024, 0, 9000, 0) == (9216, 0)


class _Pinned:
    """Stands in for a pinned `HostBuffer`: its copy lands at once, and counts as still queued (its
    event not reached) until the test calls ``ran()``."""

    made: ClassVar[list[_Pinned]] = []

    def __init__(self, capacity: int) -> None:
        self.tensor = torch.zeros(capacity, dtype=torch.int32)
        self.ptr = self.tensor.data_ptr()
        self.pending = False
        self.done = False
        self.released = False
        _Pinned.made.append(self)

    def free(self) -> bool:
        if self.pending and self.done:
            self.pending = False
        return not self.pending

    def ran(self) -> None:
        self.done = True

    def transfer(self, dst: torch.Tensor, dst_ptr: int, size: int, device_index: int) -> None:
        assert dst.data_ptr() == dst_ptr
        dst[:size].copy_(self.tensor[:size])
        self.pending, self.done = True, False

    def release(self) -> None:
        assert not self.pending or self.done, "released while its transfer may still read it"
        self.released = True
        self.pending = False


class _CpuStaging(Staging):
    """A staging whose slots are CPU tensors and whose pinned buffers are `_Pinned`."""

    def _new_host(self) -> HostBuffer:
        return _Pinned(self.capacity)  # type: ignore[return-value]


def _send(staging: Staging, slot: int, values: list[int]) -> int:
    def fill(dst: int) -> None:
        buffer = next(b for b in staging._host if b.ptr == dst)
        assert buffer.free(), "a pinned buffer was written while its transfer was still queued"
        write_int32(dst, values)

    return staging.send(slot, len(values), fill)


def test_staging_alternates_slots_and_grows_its_ring_while_transfers_wait() -> None:
    _Pinned.made.clear()
    cpu = torch.device("cpu")
    staging = _CpuStaging.reuse(None, cpu, 100)
    assert isinstance(staging, _CpuStaging) and staging.capacity == 1024
    assert [staging.slot(False) for _ in range(3)] == [0, 1, 0]
    assert [staging.slot(True) for _ in range(2)] == [0, 0]  # CUDA-graph plans: always slot 0
    # the GPU held back: every transfer still queued, so each plan takes a new pinned buffer
    addresses = [_send(staging, staging.slot(False), [i] * 10) for i in range(3)]
    assert addresses == [staging._dev_ptr[1], staging._dev_ptr[0], staging._dev_ptr[1]]
    assert len(staging._host) == 3
    assert staging.view(1, 0, 3).tolist() == [2, 2, 2] and staging.view(0, 0, 3).tolist() == [1, 1, 1]
    # once the first transfer ran its buffer is written again, and no other is
    _Pinned.made[0].ran()
    _send(staging, staging.slot(False), [7] * 10)
    assert len(staging._host) == 3 and _Pinned.made[0].tensor[0] == 7 and len(_Pinned.made) == 3
    with pytest.raises(TactixError, match="do not fit a slot of 1024"):
        staging.send(0, 1025, lambda dst: None)


def test_a_grown_staging_keeps_the_old_buffers_until_their_transfers_ran() -> None:
    _Pinned.made.clear()
    cpu = torch.device("cpu")
    old = _CpuStaging.reuse(None, cpu, 1000)
    assert _CpuStaging.reuse(old, cpu, 1024) is old  # fits: the same slots and ring
    for i in range(2):
        _send(old, old.slot(False), [i] * 8)
    first, second = _Pinned.made
    new = _CpuStaging.reuse(old, cpu, 1500)
    assert new is not old and new.capacity == 2048 and old._host == []
    assert {id(b) for b in new._retired} == {id(first), id(second)}
    first.ran()
    _send(new, new.slot(False), [5] * 1500)  # frees what ran, keeps what may still be read
    assert first.released and not second.released and new._retired == [second]
    assert len(new._host) == 1 and new._host[0].tensor.numel() == 2048


def test_a_dropped_staging_makes_no_cuda_call_and_a_later_plan_releases_its_buffers() -> None:
    """The garbage collector may drop a staging during a CUDA-graph capture, where an event query
    or synchronisation would invalidate the capture: its buffers wait for the next transfer."""
    _Pinned.made.clear()
    cpu = torch.device("cpu")
    dropped = _CpuStaging.reuse(None, cpu, 100)
    for i in range(2):
        _send(dropped, dropped.slot(False), [i] * 8)
    first, second = _Pinned.made
    calls: list[str] = []
    for buffer in (first, second):  # any query or release now would be a CUDA call
        buffer.free = lambda: bool(calls.append("free"))  # type: ignore[method-assign]
        buffer.release = lambda: calls.append("release")  # type: ignore[method-assign]
    del dropped
    gc.collect()
    assert calls == []
    for buffer in (first, second):
        del buffer.free, buffer.release  # back to the class's methods
    assert not first.released and not second.released
    first.ran()
    other = _CpuStaging.reuse(None, cpu, 100)
    _send(other, other.slot(False), [9] * 8)  # releases what ran, keeps what may still be read
    assert first.released and not second.released
    second.ran()
    _send(other, other.slot(False), [9] * 8)
    assert second.released


def test_copy_in_puts_device_entries_after_the_transfer_into_the_slot() -> None:
    """Device page indices take their place in a slot after the metadata's transfer (on the GPU one
    device-to-device copy; here the torch path, which also converts int64), next to what the
    transfer wrote, and never past the slot."""
    _Pinned.made.clear()
    cpu = torch.device("cpu")
    staging = _CpuStaging.reuse(None, cpu, 100)
    slot = staging.slot(False)
    _send(staging, slot, [7] * 10)
    staging.copy_in(slot, 4, torch.tensor([1, 2, 3], dtype=torch.int64))
    staging.copy_in(slot, 8, torch.arange(10, dtype=torch.int32)[::5])  # strided
    staging.copy_in(slot, 0, torch.empty(0, dtype=torch.int32))
    assert staging.view(slot, 0, 10).tolist() == [7, 7, 7, 7, 1, 2, 3, 7, 0, 5]
    with pytest.raises(TactixError, match="do not fit a slot of 1024"):
        staging.copy_in(slot, 1020, torch.zeros(5, dtype=torch.int32))


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine whose CUDA driver library cannot be loaded."""

    def refuse() -> None:
        raise TactixError("tactix: the CUDA driver library libcuda.so.1 cannot be loaded (test)")

    monkeypatch.setattr(cudadrv, "_load_driver", refuse)


@pytest.mark.usefixtures("no_driver")
def test_a_kernel_the_driver_cannot_load_leaves_the_torch_path_with_its_reason_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kernel = cudadrv.Kernel(".version 7.0\n", "tx_nothing", (cudadrv.INT,))
    with caplog.at_level(logging.INFO, logger="tactix"):
        assert kernel.launcher(0) is None
        assert kernel.launcher(0) is None  # decided once per device
    [record] = [r for r in caplog.records if "tx_nothing" in r.getMessage()]
    assert "libcuda.so.1 cannot be loaded" in record.getMessage()


@pytest.mark.usefixtures("no_driver")
def test_a_plugins_kernel_keeps_its_own_launch_path_where_the_driver_cannot_be_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="tactix"):
        assert cudadrv.function_launcher(0x1234, 0, (cudadrv.POINTER, cudadrv.INT64), "tx_plugin_kernel") is None
    [record] = [r for r in caplog.records if "tx_plugin_kernel" in r.getMessage()]
    assert "keeps its own launch path" in record.getMessage() and "cannot be loaded" in record.getMessage()


class _RecordingDriver:
    """The driver entry points a `cudadrv.Launcher` calls, recording what a launch passes (no GPU)."""

    def __init__(self, current: int) -> None:
        self.current_context, self.calls = current, []  # type: ignore[var-annotated]

    def current(self, ref: Any) -> int:
        ref._obj.value = self.current_context
        return 0

    def push(self, context: int) -> int:
        self.calls.append(("push", context))
        return 0

    def pop(self, ref: Any) -> int:
        self.calls.append(("pop",))
        return 0

    def launch(self, function: int, *rest: Any) -> int:
        *dims, smem, stream, params, _extra = rest
        self.calls.append(("launch", function, tuple(dims), smem, stream, params))
        return 0

    def check(self, rc: int, what: str) -> None:
        assert rc == 0, what


class _LibraryDriver(_RecordingDriver):
    """A driver whose ``cuKernelGetFunction`` gives ``0xF00 + kernel`` in the pushed context (or,
    with ``resolves`` False, a driver older than CUDA 12.0 without that entry point)."""

    def __init__(self, current: int, resolves: bool) -> None:
        super().__init__(current)
        self.pushed: list[int] = []
        self.kernel_function = self._resolve if resolves else None

    def push(self, context: int) -> int:
        self.pushed.append(context)
        return super().push(context)

    def _resolve(self, ref: Any, kernel: int) -> int:
        self.calls.append(("resolve", kernel, self.pushed[-1]))
        ref._obj.value = 0xF00 + kernel
        return 0


@pytest.mark.parametrize(("library_kernel", "resolves", "launched"),
                         [(True, True, 0xF00 + 0x42), (False, True, 0x42), (True, False, 0x42)],
                         ids=["library kernel", "function handle", "driver without the entry"])  # fmt: skip
def test_a_library_kernel_is_resolved_to_its_context_function_once_not_per_launch(
    monkeypatch: pytest.MonkeyPatch, library_kernel: bool, resolves: bool, launched: int
) -> None:
    """``function_launcher(..., library_kernel=True)`` turns a ``cuda.core`` ``CUkernel`` into the
    primary context's ``CUfunction`` once (pushed there), and every launch passes that function;
    a plain ``CUfunction``, or a driver that predates ``cuKernelGetFunction``, is launched as given."""
    primary = 0x1000
    driver = _LibraryDriver(current=primary, resolves=resolves)
    monkeypatch.setattr(cudadrv, "_load_driver", lambda: driver)
    monkeypatch.setattr(cudadrv, "_primary_context", lambda d, index: primary)
    launch = cudadrv.function_launcher(0x42, 0, (cudadrv.INT,), "tx_library_kernel", library_kernel=library_kernel)
    assert launch is not None
    for value in (1, 2, 3):
        launch((1, 1, 1), (32, 1, 1), 0x77, value)
    resolved = [c for c in driver.calls if c[0] == "resolve"]
    assert resolved == ([("resolve", 0x42, primary)] if library_kernel and resolves else [])
    assert [c[1] for c in driver.calls if c[0] == "launch"] == [launched] * 3


@pytest.mark.parametrize("foreign", [False, True], ids=["primary current", "another context current"])
def test_a_launcher_passes_each_argument_at_its_type_and_the_shared_memory(foreign: bool) -> None:
    """What `cudadrv.Launcher` hands ``cuLaunchKernel``: one pointer per argument to a value of the
    declared type (a 64-bit int read as such, a negative 32-bit int kept), the grid, block, dynamic
    shared memory and stream; the device's primary context pushed only where another is current."""
    primary = 0x1000
    driver = _RecordingDriver(current=0x2000 if foreign else primary)
    argtypes = (cudadrv.POINTER, cudadrv.INT64, cudadrv.INT)
    launch = cudadrv.Launcher(driver, primary, 0xF00, argtypes)  # type: ignore[arg-type]
    launch((3, 2, 1), (256, 1, 1), 0x77, 0xDEAD0000, 2**40 + 5, -7, smem=34816)
    launched = [c for c in driver.calls if c[0] == "launch"]
    assert len(launched) == 1
    _, function, dims, smem, stream, params = launched[0]
    assert (function, dims, smem, stream) == (0xF00, (3, 2, 1, 256, 1, 1), 34816, 0x77)
    values = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(argtypes)]
    assert values == [0xDEAD0000, 2**40 + 5, -7]
    assert [c[0] for c in driver.calls] == (["push", "launch", "pop"] if foreign else ["launch"])
    if foreign:
        assert driver.calls[0] == ("push", primary)
