"""Getting a plan's metadata to the device fast: for plugins whose plans send int32 metadata.

A plan that builds its metadata with ``torch.tensor(list)`` (about 90 ns an element), pins a
fresh tensor (allocating pinned memory right after it fed a copy costs 30-40 us) and copies it
with ``Tensor.to(device, non_blocking=True)`` spends hundreds of microseconds on a batch of a
few thousand entries. The pieces here do the same in a few:

* `Staging`: one per wrapper, handed from each plan to the next (``options["previous"]``):
  two device slots and a ring of pinned host buffers (`HostBuffer`). ``Staging.reuse(old,
  device, size)`` keeps ``old`` when it is big enough; ``slot(graph)`` picks the slot a plan
  writes; ``send(slot, size, fill)`` lets ``fill(address)`` write ``size`` int32 into a free
  pinned buffer, enqueues one copy into the slot on torch's current stream and returns the
  slot's device address; ``copy_in(slot, start, src)`` copies a device int32 tensor (the
  caller's page indices) into a slot after ``send``'s transfer, on the same stream;
  ``view(slot, start, count)`` is a device tensor over part of a slot; ``gather(...)`` builds a
  padded page table in the slot's table buffer from CSR indices that ``send`` put there or the
  caller's device indices, with one kernel launched through the driver (`tactix.cudadrv`)
  (``gathered(...)``: that table as a tensor).
* `sections(("name", capacity), ...)`: a layout of named, 128-byte aligned int32 sections in
  one buffer (memoised); ``Sections.write(address, pieces)`` writes each piece (a list of ints,
  an ``array``, or an int32 CPU tensor) at its section with one C-level copy and zeroes the
  rest of the section, so a buffer sized for a capacity never holds stale entries.
* `write_int32(address, values)`: a list of ints written as int32 with one C-level call
  (``struct.pack_into``: about 8 ns an element; ``array("i", list)`` costs twice that).
* `write_table` / `gather_table`: a padded ``[rows, width]`` page table from CSR page indices,
  laid out on the host, or gathered on the device.

The copies and events go straight to the CUDA runtime torch loaded (`tactix.cudart`), else
through torch's API. Errors are `tactix.TactixError`.

What makes the reuse safe (keep it when using these):

1. A device slot is rewritten only by a transfer enqueued on the current stream. Successive
   eager plans alternate between the two slots, so a slot is rewritten two plans later, after
   the runs enqueued before that plan (as FlashInfer's plan rewrites its workspace: plan and run
   on one stream, or synchronise). A plan that raises before ``send`` leaves both slots alone.
2. A pinned buffer is written again only once the event recorded after its last transfer shows
   that the transfer ran; when every buffer of the ring still waits (the host far ahead of the
   GPU) the ring grows by one instead of waiting.
3. CUDA-graph plans always use slot 0, sized by the buckets (which cannot change between
   re-plans of a captured wrapper), so a captured graph keeps reading the same addresses and a
   re-plan rewrites them with new contents (one transfer, stream-ordered before the replays that
   follow it).
4. When ``reuse`` replaces a staging by a bigger one, the old ring's buffers are kept until
   their transfers ran (their memory goes back to torch's pinned allocator, which does not know
   about these copies).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import itertools
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import torch

from tactix import cudadrv, cudart
from tactix.errors import TactixError

__all__ = [
    "ALIGN",
    "HostBuffer",
    "Piece",
    "Sections",
    "Staging",
    "csr_table",
    "gather_table",
    "sections",
    "write_int32",
    "write_table",
]

ALIGN: Final = 32
"""int32 entries (128 bytes) every section of `sections` starts at a multiple of."""

Piece: TypeAlias = "Sequence[int] | array.array[int] | torch.Tensor"
"""What `Sections.write` takes for a section: ints, an ``array("i")``, or an int32 CPU tensor."""


@functools.lru_cache(maxsize=256)
def _int32_struct(n: int) -> struct.Struct:
    return struct.Struct(f"={n}i")


@functools.lru_cache(maxsize=64)
def _bytes_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address`` (it owns nothing: the same as making it
    again, so views of the few staging buffers a process writes are kept)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def write_int32(dst: int, values: Sequence[int]) -> int:
    """Write ``values`` as int32 at address ``dst`` with one C-level call; how many were written.

    A value outside the int32 range raises `TactixError`."""
    n = len(values)
    if n:
        try:
            _int32_struct(n).pack_into(_bytes_at(dst, 4 * n), 0, *values)
        except struct.error as exc:
            raise TactixError(f"staging: metadata must be int32 values ({exc})") from None
    return n


def _int32_source(piece: torch.Tensor | array.array[int]) -> tuple[int, int, Any]:
    """(address, count, the object that holds them) of a tensor (made a contiguous int32 CPU one
    first where it is not) or an ``array("i")``."""
    if isinstance(piece, torch.Tensor):
        if piece.device.type != "cpu" or piece.dtype != torch.int32 or not piece.is_contiguous():
            piece = piece.to("cpu", torch.int32).contiguous()
        return piece.data_ptr(), piece.numel(), piece
    if piece.itemsize != 4:
        raise TactixError(f"staging: an array piece must hold 4-byte ints (typecode 'i'; got {piece.typecode!r})")
    return piece.buffer_info()[0], len(piece), piece


def _check_fits(name: str, capacity: int, count: int) -> None:
    if count > capacity:
        raise TactixError(f"staging: section {name!r} holds {capacity} entries (got {count})")


@dataclass(frozen=True)
class Sections:
    """Named int32 sections of one buffer, each starting 128-byte aligned (make with `sections`)."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    """Where each section starts (int32 entries from the buffer's start)."""
    capacities: tuple[int, ...]
    """Entries each section holds (at least 1)."""
    total: int
    """Entries of the whole buffer (the sections and their padding): what ``send`` copies."""
    _packers: dict[tuple[int, ...], struct.Struct] = field(default_factory=dict, compare=False, repr=False)
    """One `struct.Struct` per set of list lengths (`write`'s fast path): the lists and the zero
    padding of every section, packed by one call."""

    def offset(self, name: str) -> int:
        return self.offsets[self.names.index(name)]

    def _packer(self, counts: tuple[int, ...]) -> struct.Struct:
        found = self._packers.get(counts)
        if found is None:
            ends = (*self.offsets[1:], self.total)
            parts = []
            for name, start, end, capacity, count in zip(self.names, self.offsets, ends, self.capacities, counts,
                                                         strict=True):  # fmt: skip
                _check_fits(name, capacity, count)
                parts.append(f"{count}i{4 * (end - start - count)}x")
            if len(self._packers) >= 64:
                self._packers.clear()
            found = self._packers[counts] = struct.Struct("=" + "".join(parts))
        return found

    def write(self, dst: int, pieces: Sequence[Piece]) -> None:
        """Write one piece per section at address ``dst`` (C-level copies) and zero every entry past
        a piece up to the next section, so the whole ``total`` entries are defined."""
        if len(pieces) != len(self.names):
            raise TactixError(f"staging: {len(self.names)} sections {self.names} take one piece each "
                              f"(got {len(pieces)})")  # fmt: skip
        # one byte view of the whole buffer (memoised: a process writes few staging buffers)
        view = _bytes_at(dst, 4 * self.total)
        for piece in pieces:  # (a loop: a generator in all() costs a third of a microsecond more)
            if type(piece) is not list:
                break
        else:
            # every piece a list (a plan's usual metadata): pieces and padding in one C-level
            # pack (~2 us for four sections of 64 requests, where the loop below takes ~3.8)
            packer = self._packer(tuple(map(len, pieces)))
            try:
                packer.pack_into(view, 0, *itertools.chain.from_iterable(pieces))
            except struct.error as exc:
                raise TactixError(f"staging: metadata must be int32 values ({exc})") from None
            return
        ends = (*self.offsets[1:], self.total)
        # list pieces are packed into the view and padding is zeroed by slice assignment, each
        # ~0.2 us where a ctypes call costs ~0.5-1
        for name, start, end, capacity, piece in zip(self.names, self.offsets, ends, self.capacities, pieces,
                                                     strict=True):  # fmt: skip
            if isinstance(piece, (torch.Tensor, array.array)):
                src, count, _alive = _int32_source(piece)
                _check_fits(name, capacity, count)
                ctypes.memmove(dst + 4 * start, src, 4 * count)
            else:
                count = len(piece)
                _check_fits(name, capacity, count)
                if count:
                    try:
                        _int32_struct(count).pack_into(view, 4 * start, *piece)
                    except struct.error as exc:
                        raise TactixError(f"staging: metadata must be int32 values ({exc})") from None
            pad = 4 * (end - start - count)
            if pad > 0:
                at = 4 * (start + count)
                if pad <= len(_ZERO_BYTES):
                    view[at : at + pad] = _ZERO_BYTES[:pad]
                else:
                    ctypes.memset(dst + at, 0, pad)


_ZERO_BYTES: Final = memoryview(bytes(1 << 16))
"""Zeros to pad sections from (larger padding takes a memset)."""


@functools.lru_cache(maxsize=256)
def sections(*capacities: tuple[str, int]) -> Sections:
    """The layout of ``(name, capacity)`` sections in order, each padded to 128 bytes (a capacity
    of 0 still takes one entry, so every section has an address of its own). Memoised."""
    names, offsets, sizes, offset = [], [], [], 0
    for name, capacity in capacities:
        size = max(capacity, 1)
        names.append(name)
        offsets.append(offset)
        sizes.append(size)
        offset += size + (-size % ALIGN)
    return Sections(tuple(names), tuple(offsets), tuple(sizes), offset)


def write_table(dst: int, src: int, indptr: list[int], rows: int, width: int) -> None:
    """Write the padded page table ``[rows, width]`` at address ``dst`` from the int32 CSR indices
    at ``src``: zeros (page 0, a valid page) everywhere, then each request's pages, one C-level
    copy per request (``indptr``: the CSR offsets, ``len(indptr) - 1 <= rows``)."""
    size, nnz = rows * width, indptr[-1] if indptr else 0
    if size == 0:
        return
    # slice assignment between byte views: ~0.1 us a row, where a ctypes.memmove call costs ~0.5
    table = _bytes_at(dst, 4 * size)
    table[:] = _zero_view(size)
    if nnz == 0:
        return
    pages = _bytes_at(src, 4 * nnz)
    # (rows past the batch, if any, keep their zeros: the shortest of the three ends the loop)
    for at, start, end in zip(range(0, 4 * size, 4 * width), indptr, itertools.islice(indptr, 1, None), strict=False):
        table[at : at + 4 * (end - start)] = pages[4 * start : 4 * end]


@functools.lru_cache(maxsize=32)
def _zero_view(size: int) -> memoryview:
    """``size`` int32 zeros to copy from (a table's size is fixed by its buckets: a few per process)."""
    return memoryview(bytes(4 * size))


# The page table from CSR indices on the device, one launch (`gather`):
#
#   extern "C" __global__ void tx_csr_to_table(const int* __restrict__ indices, const int* __restrict__ starts,
#                                              int nnz, int rows, int width, int* __restrict__ table) {
#     const int r = blockIdx.y;  // row r: its pages indices[starts[r] .. the next row's start or nnz)
#     const int s = starts[r];
#     const int n = (r + 1 < rows ? starts[r + 1] : nnz) - s;
#     int* row = table + (long long)r * width;
#     for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < width; j += gridDim.x * blockDim.x) {
#       row[j] = j < n ? indices[s + j] : 0;  // page 0 (a valid page, never read) past them
#     }
#   }
#
# compiled with `nvcc -ptx -arch=compute_75 -O3` (CUDA 13.0), the ISA version lowered to 7.0 (its
# instructions are all older), see `tactix.cudadrv`.
_CSR_TO_TABLE_PTX: Final = """\
.version 7.0
.target sm_75
.address_size 64

	// .globl	tx_csr_to_table

.visible .entry tx_csr_to_table(
	.param .u64 tx_csr_to_table_param_0,
	.param .u64 tx_csr_to_table_param_1,
	.param .u32 tx_csr_to_table_param_2,
	.param .u32 tx_csr_to_table_param_3,
	.param .u32 tx_csr_to_table_param_4,
	.param .u64 tx_csr_to_table_param_5
)
{
	.reg .pred 	%p<5>;
	.reg .b32 	%r<25>;
	.reg .b64 	%rd<18>;


	ld.param.u64 	%rd6, [tx_csr_to_table_param_0];
	ld.param.u64 	%rd8, [tx_csr_to_table_param_1];
	ld.param.u32 	%r22, [tx_csr_to_table_param_2];
	ld.param.u32 	%r14, [tx_csr_to_table_param_3];
	ld.param.u32 	%r13, [tx_csr_to_table_param_4];
	ld.param.u64 	%rd7, [tx_csr_to_table_param_5];
	mov.u32 	%r15, %ctaid.y;
	cvt.s64.s32 	%rd1, %r15;
	cvta.to.global.u64 	%rd9, %rd8;
	mul.wide.s32 	%rd10, %r15, 4;
	add.s64 	%rd2, %rd9, %rd10;
	ld.global.nc.u32 	%r1, [%rd2];
	add.s32 	%r16, %r15, 1;
	setp.ge.s32 	%p1, %r16, %r14;
	@%p1 bra 	$L__BB0_2;

	ld.global.nc.u32 	%r22, [%rd2+4];

$L__BB0_2:
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r17, %ctaid.x;
	mov.u32 	%r18, %tid.x;
	mad.lo.s32 	%r23, %r17, %r4, %r18;
	setp.ge.s32 	%p2, %r23, %r13;
	@%p2 bra 	$L__BB0_7;

	mov.u32 	%r19, %nctaid.x;
	mul.lo.s32 	%r6, %r19, %r4;
	cvta.to.global.u64 	%rd3, %rd7;
	cvta.to.global.u64 	%rd4, %rd6;
	cvt.s64.s32 	%rd11, %r13;
	mul.lo.s64 	%rd5, %rd11, %rd1;
	sub.s32 	%r7, %r22, %r1;

$L__BB0_4:
	setp.ge.s32 	%p3, %r23, %r7;
	mov.u32 	%r24, 0;
	@%p3 bra 	$L__BB0_6;

	add.s32 	%r21, %r23, %r1;
	mul.wide.s32 	%rd12, %r21, 4;
	add.s64 	%rd13, %rd4, %rd12;
	ld.global.nc.u32 	%r24, [%rd13];

$L__BB0_6:
	cvt.s64.s32 	%rd14, %r23;
	add.s64 	%rd15, %rd5, %rd14;
	shl.b64 	%rd16, %rd15, 2;
	add.s64 	%rd17, %rd3, %rd16;
	st.global.u32 	[%rd17], %r24;
	add.s32 	%r23, %r23, %r6;
	setp.lt.s32 	%p4, %r23, %r13;
	@%p4 bra 	$L__BB0_4;

$L__BB0_7:
	ret;

}
"""
_CSR_TO_TABLE = cudadrv.Kernel(_CSR_TO_TABLE_PTX, "tx_csr_to_table",
                               (cudadrv.POINTER, cudadrv.POINTER, cudadrv.INT, cudadrv.INT, cudadrv.INT,
                                cudadrv.POINTER))  # fmt: skip
TABLE_KERNEL_ENV: Final = "TACTIX_PAGE_TABLE_KERNEL"
_table_kernel_on = os.environ.get(TABLE_KERNEL_ENV, "1") != "0"
"""Whether `Staging.gather` launches the kernel (the default) or takes the torch path
(``TACTIX_PAGE_TABLE_KERNEL=0``: to compare the two, or should a driver misbehave)."""
_TABLE_THREADS: Final = 128
_MAX_GRID_Y: Final = 65535


def gather_table(ext: torch.Tensor, row_starts: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] = ext[row_starts[r] : row_starts[r] + width]``: the padded page table from CSR indices.

    ``ext`` is the page indices followed by ``width`` valid filler entries, so every row is in
    bounds; entries past a request's own pages hold other requests' pages and are never read.
    """
    width = out.shape[1]
    torch.index_select(ext.unfold(0, width, 1), 0, row_starts, out=out)


def csr_table(indices: torch.Tensor, starts: list[int], nnz: int, width: int) -> torch.Tensor:
    """What `Staging.gather`'s kernel writes, computed on the host (the rule a plugin's metadata
    must satisfy, checked on a machine without a GPU): row ``r`` holds
    ``indices[starts[r] : end]``, ``end`` the next row's start (the last row's: ``nnz``), and page
    0 past them. Rows past a batch must therefore start at ``nnz``: one starting at 0 ends the
    request before it there, which then reads page 0 for every page (`gather_table`, the torch
    path, reads a fixed window instead and does not show it)."""
    table = torch.zeros(len(starts), width, dtype=torch.int32)
    for r, s in enumerate(starts):
        n = min((starts[r + 1] if r + 1 < len(starts) else nnz) - s, width)
        if n > 0:
            table[r, :n] = indices[s : s + n]
    return table


class HostBuffer:
    """A pinned int32 buffer and the event recorded after the last transfer that read it."""

    def __init__(self, capacity: int, device_index: int) -> None:
        self.tensor = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.ptr = self.tensor.data_ptr()
        rt = cudart.runtime()
        self.event: Any = rt.event(device_index) if rt is not None else torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.pending = False

    def free(self) -> bool:
        """Whether the buffer may be written (its last transfer ran, or it never fed one)."""
        if not self.pending:
            return True
        rt = cudart.runtime()
        self.pending = not (rt.done(self.event) if rt is not None else self.event.query())
        return not self.pending

    def transfer(self, dst: torch.Tensor, dst_ptr: int, size: int, device_index: int) -> None:
        """Copy the first ``size`` entries to ``dst`` (at ``dst_ptr``), enqueued on torch's current
        stream, and record the event after the copy."""
        rt = cudart.runtime()
        if rt is not None:
            stream = cudart.raw_stream(device_index)
            rt.copy_to_device(dst_ptr, self.ptr, 4 * size, stream)
            rt.record(self.event, stream)
        else:
            dst[:size].copy_(self.tensor[:size], non_blocking=True)
            self.event.record(torch.cuda.current_stream(device_index))
        self.pending = True

    def release(self) -> None:
        """Wait for the last transfer (the pinned memory goes back to torch's allocator next)."""
        rt = cudart.runtime()
        if rt is not None:
            if self.pending:
                rt.synchronize(self.event)
            rt.destroy(self.event)
        elif self.pending:
            self.event.synchronize()
        self.pending = False


_dropped: list[HostBuffer] = []
"""Pinned buffers of stagings that were dropped (`Staging.__del__`), released by a later plan
once their transfers ran."""


def _release_dropped() -> None:
    global _dropped
    pending, _dropped = _dropped, []  # a collection that drops a staging meanwhile appends to `pending`
    for buffer in pending:
        try:
            if not buffer.free():
                _dropped.append(buffer)
                continue
            buffer.release()
        except TactixError:  # its context is gone: the memory went with it
            pass


class Staging:
    """The device metadata buffers one wrapper's plans reuse, and their transfers.

    Two device slots of ``capacity`` int32 (plus, for batches gathered on the device, a table
    buffer of ``table`` int32 each): successive eager plans alternate between them, so a slot is
    rewritten two plans later, by a transfer enqueued on the current stream after the runs
    enqueued before that plan. CUDA-graph plans always use slot 0, whose addresses the captured
    graph reads.

    Transfers come from a ring of pinned host buffers, each with an event recorded after its
    transfer: a buffer is written again only once its last transfer has run, and when every one
    is still waiting (the host far ahead of the GPU) the ring grows instead of waiting. The copy
    and the events go straight to the CUDA runtime torch loaded (`tactix.cudart`), else through
    torch. See the module's docstring for the rules a plan keeps.
    """

    def __init__(self, device: torch.device, capacity: int, table: int = 0) -> None:
        self.device = device
        if device.index is not None:
            self.index = device.index
        else:
            self.index = torch.cuda.current_device() if device.type == "cuda" else -1
        self.capacity = capacity
        self.table_capacity = table
        self._dev = [torch.empty(capacity, dtype=torch.int32, device=device) for _ in range(2)]
        self._dev_ptr = [t.data_ptr() for t in self._dev]
        self._tables = [torch.empty(max(table, 1), dtype=torch.int32, device=device) for _ in range(2)]
        self._host: list[HostBuffer] = []
        self._retired: list[HostBuffer] = []  # a replaced staging's buffers whose transfer may not have run
        self._host_next = 0
        self._next = 0
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._slices: dict[tuple[int, int, int], torch.Tensor] = {}

    def __del__(self) -> None:
        # No CUDA call here: the garbage collector may run this anywhere, a CUDA-graph capture
        # included, where an event query or synchronisation invalidates the capture. The next
        # plan's transfer releases them (`_release_dropped`).
        with contextlib.suppress(Exception):  # interpreter shutdown
            _dropped.extend(getattr(self, "_host", []) + getattr(self, "_retired", []))

    @staticmethod
    def sized(old_capacity: int, old_table: int, size: int, table: int) -> tuple[int, int]:
        """The (capacity, table) of a staging that replaces one of ``old_capacity`` / ``old_table``
        (0, 0: none) for ``size`` entries and a table of ``table``: ``size`` rounded up to 1024
        entries, at least twice the old capacity (a growing batch reallocates a few times only);
        the table at least the old one."""
        return max(size + (-size % 1024), 2 * old_capacity), max(table, old_table)

    @classmethod
    def reuse(cls, old: Staging | None, device: torch.device, size: int, table: int = 0) -> Staging:
        """``old`` when it holds ``size`` entries (and a gathered table of ``table``) on ``device``,
        else a bigger one that takes over ``old``'s pinned buffers until their transfers ran. In
        CUDA-graph mode it always does (the buckets, which fix both, cannot change)."""
        if old is not None and old.device == device and size <= old.capacity and table <= old.table_capacity:
            return old
        if old is not None and old.device == device:
            grown = cls.sized(old.capacity, old.table_capacity, size, table)
        else:
            grown = cls.sized(0, 0, size, table)
        new = cls(device, *grown)
        if old is not None:  # its pinned buffers may still feed transfers: released once those ran
            new._retired, old._host, old._retired = old._host + old._retired, [], []
        return new

    def slot(self, graph: bool) -> int:
        """The slot the next ``send`` writes: 0 in CUDA-graph mode, else the other one than last time."""
        chosen = 0 if graph else self._next
        self._next = 1 - chosen
        return chosen

    def _new_host(self) -> HostBuffer:
        return HostBuffer(self.capacity, self.index)

    def _free_host(self) -> HostBuffer:
        if _dropped:
            _release_dropped()
        if self._retired:
            for buffer in self._retired:
                if buffer.free():
                    buffer.release()
            self._retired = [b for b in self._retired if b.pending]
        ring = self._host
        for step in range(len(ring)):
            at = (self._host_next + step) % len(ring)
            if ring[at].free():
                self._host_next = (at + 1) % len(ring)
                return ring[at]
        buffer = self._new_host()
        ring.insert(self._host_next, buffer)
        self._host_next = (self._host_next + 1) % len(ring)
        return buffer

    def send(self, slot: int, size: int, fill: Callable[[int], None]) -> int:
        """``size`` int32 written by ``fill(address)`` into a free pinned buffer, then copied to the
        slot (enqueued on the current stream); the slot's device address."""
        if size > self.capacity:
            raise TactixError(f"staging: {size} entries do not fit a slot of {self.capacity} (use Staging.reuse)")
        buffer = self._free_host()
        fill(buffer.ptr)
        buffer.transfer(self._dev[slot], self._dev_ptr[slot], size, self.index)
        return self._dev_ptr[slot]

    def copy_in(self, slot: int, start: int, src: torch.Tensor) -> None:
        """Copy the int32 device tensor ``src`` into entries ``[start, start + src.numel())`` of a
        slot, enqueued on the current stream (after ``send``'s transfer into the slot): one
        ``cudaMemcpyAsync`` (about a microsecond of host time) where ``src`` is contiguous, else
        torch's ``copy_`` (which also converts another dtype)."""
        count = src.numel()
        if count == 0:
            return
        if start + count > self.capacity:
            raise TactixError(f"staging: {count} entries at {start} do not fit a slot of {self.capacity}")
        rt = cudart.runtime() if self.device.type == "cuda" else None
        if rt is not None and src.dtype == torch.int32 and src.is_contiguous() and src.get_device() == self.index:
            rt.copy_on_device(self._dev_ptr[slot] + 4 * start, src.data_ptr(), 4 * count, cudart.raw_stream(self.index))
        else:
            self._dev[slot][start : start + count].copy_(src, non_blocking=True)

    def view(self, slot: int, start: int, count: int) -> torch.Tensor:
        """Entries ``[start, start + count)`` of a slot, as a device tensor (to copy device-resident
        data into it after ``send``, on the same stream). The same tensor for the same arguments
        (a slice costs ~1.5 us; a plan's sections are fixed by its buckets): callers write its
        contents, never its shape."""
        key = (slot, start, count)
        found = self._slices.get(key)
        if found is None:
            if len(self._slices) >= 256:
                self._slices.clear()
            found = self._slices[key] = self._dev[slot][start : start + count]
        return found

    def gather(self, slot: int, count: int, rows: int, width: int, starts_at: int, nnz: int,
               indices: torch.Tensor | None = None) -> int:  # fmt: skip
        """The page table ``[rows, width]`` built on the device from CSR page indices, in the slot's
        table buffer; its device address. ``starts_at``: where the rows' first entries lie in the
        slot; rows past the batch must start at ``nnz``: the kernel ends each row at the next
        row's start, `csr_table` is its rule on the host). The ``nnz`` indices are ``indices`` (the
        caller's device tensor, read in place) or, when None, the entries ``send`` put at
        ``count``; ``send`` also wrote ``width`` zeros after those ``count + nnz`` entries.

        One kernel launched through the driver (`tactix.cudadrv`, ~8 us of host time on an H100
        host), writing page 0 past each row's pages; with ``TACTIX_PAGE_TABLE_KERNEL=0`` and
        where the driver cannot load it, ``copy_in`` of
        ``indices`` to ``count`` and a ``torch.index_select`` over windows of the slot (each
        row's pages followed by the next rows'), ~18-20 us
        (benchmarks/results/h100-gather-probe-session31.json)."""
        launch = None
        if _table_kernel_on and self.device.type == "cuda" and rows <= _MAX_GRID_Y:
            launch = _CSR_TO_TABLE.launcher(self.index)
        if launch is not None:
            if indices is None:
                src = self._dev_ptr[slot] + 4 * count
            elif indices.dtype == torch.int32 and indices.is_contiguous() and indices.get_device() == self.index:
                src = indices.data_ptr()
            else:
                self.copy_in(slot, count, indices)
                src = self._dev_ptr[slot] + 4 * count
            table = self._tables[slot].data_ptr()
            blocks = min(8, -(-width // _TABLE_THREADS))
            try:
                launch((blocks, rows, 1), (_TABLE_THREADS, 1, 1), cudart.raw_stream(self.index),
                       src, self._dev_ptr[slot] + 4 * starts_at, nnz, rows, width, table)  # fmt: skip
                return table
            except TactixError as exc:  # refused before it ran (nothing enqueued): the torch path, from now on
                _CSR_TO_TABLE.disable(self.index, exc)
                if indices is not None and src != indices.data_ptr():
                    indices = None  # (copied into the slot above)
        if indices is not None and nnz:
            self.copy_in(slot, count, indices)
        key = (slot, count, rows, width, starts_at)
        views = self._views.get(key)
        if views is None:  # the offsets are fixed by the buckets: a few sets per wrapper
            if len(self._views) >= 64:
                self._views.clear()
            packed = self._dev[slot]
            views = self._views[key] = (packed[count:].unfold(0, width, 1), packed[starts_at : starts_at + rows],
                                        self._tables[slot][: rows * width].view(rows, width))  # fmt: skip
        windows, starts, table_t = views
        torch.index_select(windows, 0, starts, out=table_t)
        return table_t.data_ptr()

    def gathered(self, slot: int, rows: int, width: int) -> torch.Tensor:
        """The page table ``gather`` writes for ``slot`` (``[rows, width]``), as a device tensor (for
        kernels whose bindings take tensors rather than addresses; the same tensor for the same
        arguments, as `view`)."""
        key = (-1 - slot, rows, width)
        found = self._slices.get(key)
        if found is None:
            if len(self._slices) >= 256:
                self._slices.clear()
            found = self._slices[key] = self._tables[slot][: rows * width].view(rows, width)
        return found
