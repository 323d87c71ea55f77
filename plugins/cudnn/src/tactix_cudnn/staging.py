"""How the cudnn plugin's plans get their metadata to the device.

`Staging`: per wrapper, two device slots and a ring of pinned host buffers (`HostBuffer`) with
an event each; `write_table` lays the padded page table out on the host with C-level copies,
`gather_table` gathers it on the device from the CSR indices. See the plugin's README, "Plan path".
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import Any

import torch

from tactix_cudnn import cudart

__all__ = ["HostBuffer", "Staging", "gather_table", "write_table"]


def write_table(dst: int, src: int, indptr: list[int], rows: int, width: int) -> None:
    """Write the padded page table ``[rows, width]`` at address ``dst`` from the int32 CSR indices
    at ``src``: zeros (page 0, a valid page) everywhere, then each request's pages, one C-level
    copy per request."""
    ctypes.memset(dst, 0, 4 * rows * width)
    for r in range(len(indptr) - 1):
        start = indptr[r]
        ctypes.memmove(dst + 4 * r * width, src + 4 * start, 4 * (indptr[r + 1] - start))


def gather_table(ext: torch.Tensor, row_starts: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] = ext[row_starts[r] : row_starts[r] + width]``: the padded page table from CSR indices.

    ``ext`` is the page indices followed by ``width`` valid filler entries, so every row is in
    bounds; entries past a request's own pages hold other requests' pages and are never read.
    """
    width = out.shape[1]
    torch.index_select(ext.unfold(0, width, 1), 0, row_starts, out=out)


class HostBuffer:
    """A pinned int32 buffer and the event recorded after the last transfer that read it."""

    def __init__(self, capacity: int, device_index: int) -> None:
        self.tensor = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.ptr = self.tensor.data_ptr()
        rt = cudart.runtime()
        self.event: Any = rt.event(device_index) if rt is not None else torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.pending = False

    def free(self) -> bool:
        if not self.pending:
            return True
        rt = cudart.runtime()
        self.pending = not (rt.done(self.event) if rt is not None else self.event.query())
        return not self.pending

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


class Staging:
    """The device metadata buffers one wrapper's plans reuse, and their transfers.

    Two device slots of ``capacity`` int32 (plus, for batches gathered on the device, a table
    buffer each): successive eager plans alternate between them, so a slot is rewritten two plans
    later, by a transfer enqueued on the current stream after the runs enqueued before that plan
    (as FlashInfer's plan rewrites its workspace: plan and run on one stream, or synchronise).
    CUDA-graph plans always use slot 0, whose addresses the captured graph reads.

    Transfers come from a ring of pinned host buffers, each with an event recorded after its
    transfer: a buffer is written again only once its last transfer has run, and when every one
    is still waiting (the host far ahead of the GPU) the ring grows instead of waiting. The copy
    and the events go straight to the CUDA runtime torch loaded (`cudart`), else through torch.
    """

    def __init__(self, device: torch.device, capacity: int, table: int) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
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

    def __del__(self) -> None:
        for buffer in getattr(self, "_host", []) + getattr(self, "_retired", []):
            with contextlib.suppress(Exception):  # interpreter shutdown or a broken context
                buffer.release()

    @classmethod
    def reuse(cls, old: Staging | None, device: torch.device, size: int, table: int) -> Staging:
        """``old`` when it holds ``size`` entries (and a gathered table of ``table``) on ``device``;
        in CUDA-graph mode it always does (the buckets, which fix both, cannot change)."""
        if old is not None and old.device == device and size <= old.capacity and table <= old.table_capacity:
            return old
        grow = 2 * old.capacity if old is not None else 0
        new = cls(device, max(size + (-size % 1024), grow), max(table, old.table_capacity if old else 0))
        if old is not None:  # its pinned buffers may still feed transfers: released once those ran
            new._retired, old._host, old._retired = old._host + old._retired, [], []
        return new

    def slot(self, graph: bool) -> int:
        chosen = 0 if graph else self._next
        self._next = 1 - chosen
        return chosen

    def _free_host(self) -> HostBuffer:
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
        buffer = HostBuffer(self.capacity, self.index)
        ring.insert(self._host_next, buffer)
        self._host_next = (self._host_next + 1) % len(ring)
        return buffer

    def send(self, slot: int, size: int, fill: Callable[[int], None]) -> int:
        """``size`` int32 written by ``fill(address)`` into a free pinned buffer, then copied to the
        slot (enqueued on the current stream); the slot's device address."""
        buffer = self._free_host()
        fill(buffer.ptr)
        rt = cudart.runtime()
        if rt is not None:
            stream = cudart.raw_stream(self.index)
            rt.copy_to_device(self._dev_ptr[slot], buffer.ptr, 4 * size, stream)
            rt.record(buffer.event, stream)
        else:
            self._dev[slot][:size].copy_(buffer.tensor[:size], non_blocking=True)
            buffer.event.record(torch.cuda.current_stream(self.device))
        buffer.pending = True
        return self._dev_ptr[slot]

    def gather(self, slot: int, count: int, rows: int, width: int, starts_at: int) -> int:
        """The page table ``[rows, width]`` gathered on the device from the CSR indices that
        ``send`` put at ``count`` (``starts_at``: the rows' first entries); its device address."""
        key = (slot, count, rows, width, starts_at)
        views = self._views.get(key)
        if views is None:  # the offsets are fixed by the buckets: a few sets per wrapper
            if len(self._views) >= 64:
                self._views.clear()
            packed = self._dev[slot]
            views = self._views[key] = (packed[count:].unfold(0, width, 1), packed[starts_at : starts_at + rows],
                                        self._tables[slot][: rows * width].view(rows, width))  # fmt: skip
        windows, starts, table = views
        torch.index_select(windows, 0, starts, out=table)
        return table.data_ptr()
