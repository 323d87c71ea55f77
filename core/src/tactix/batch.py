"""Validated metadata of an attention batch, shared by every backend's plan.

The engine describes a batch with FlashInfer's CSR arrays: ``qo_indptr`` (query rows of each
request), ``paged_kv_indptr`` / ``paged_kv_indices`` (each request's pages) and
``paged_kv_last_page_len`` (valid tokens in each request's last page). `PagedBatch.build`
checks them once per batch, in ``plan()``, and derives the per-request lengths. Host metadata
is checked completely on the host with no device sync. For device-resident index arrays the
page-range check is enqueued on the device (`check_page_bounds`), so no host sync is needed and
an out-of-range page is never read: the device assertion stops the stream before any attention
kernel that follows it.

Ragged-KV prefill has no pages: ``kv_indptr`` gives each request's rows of packed keys and
values (`RaggedBatch`). What both kinds of batch hold, the query rows and key count of each
request, is `Batch`.
"""

from __future__ import annotations

import functools
import operator
import threading
from dataclasses import dataclass, field

import torch

from tactix.errors import InvalidArgumentError

__all__ = ["Batch", "CustomMask", "DeviceBatch", "PagedBatch", "RaggedBatch", "RaggedDeviceBatch"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


def _index_array(value: object, argument: str, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(argument, "a 1-D int32 or int64 torch.Tensor", type(value).__name__)
    if value.dtype not in _INDEX_DTYPES:
        raise InvalidArgumentError(argument, "of dtype int32 or int64", value.dtype)
    if value.dim() != 1:
        raise InvalidArgumentError(argument, "1-D", f"shape {tuple(value.shape)}")
    if not value.is_cpu and value.device != device:
        raise InvalidArgumentError(argument, f"on the CPU or on {device}", value.device)
    return value


_outs = threading.local()


def _extrema(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty int32/int64 CPU tensor, into per-thread 0-d outputs (a third
    cheaper than ``aminmax()`` allocating two tensors)."""
    outs = getattr(_outs, "by_dtype", None)
    if outs is None:
        outs = _outs.by_dtype = {d: (torch.empty((), dtype=d), torch.empty((), dtype=d)) for d in _INDEX_DTYPES}
    lo, hi = outs[t.dtype]
    torch.aminmax(t, out=(lo, hi))
    return lo.item(), hi.item()  # type: ignore[return-value]


def _check_offsets(name: str, indptr: list[int], steps: list[int], fewest: int) -> None:
    """Refuse a CSR offset array that does not start at 0 or decreases (``steps``: its differences)."""
    if indptr[0] != 0:
        raise InvalidArgumentError(name, "a CSR offset array starting at 0", f"{name}[0] = {indptr[0]}")
    if fewest < 0:
        i = next(i for i, step in enumerate(steps) if step < 0)
        raise InvalidArgumentError(
            name, "non-decreasing", f"{name}[{i}] = {indptr[i]} > {name}[{i + 1}] = {indptr[i + 1]}"
        )


def _host_lists(arrays: list[torch.Tensor], device: torch.device) -> list[list[int]]:
    """The values of small index arrays as Python lists; device-resident ones come to the host in
    one transfer (their values decide shapes)."""
    for t in arrays:  # (a loop: a generator in all() costs a third of a microsecond more)
        if not t.is_cpu:
            break
    else:
        return [t.tolist() for t in arrays]
    sizes = [t.numel() for t in arrays]  # some on the device
    host = torch.cat([t.to(device, torch.int64) for t in arrays]).cpu()
    return [t.tolist() for t in torch.split(host, sizes)]


def _check_qo_length(qo_list: list[int], batch_size: int, kv_indptr_name: str) -> None:
    if len(qo_list) != batch_size + 1:
        raise InvalidArgumentError(
            "qo_indptr",
            f"of length batch_size + 1 = {batch_size + 1} like {kv_indptr_name}",
            f"length {len(qo_list)}",
        )


def _query_rows(qo_list: list[int], batch_size: int) -> tuple[list[int], int]:
    """Each request's query rows from ``qo_indptr`` (as a list, of the batch's length) and the most
    of them; an error for a ``qo_indptr`` that is not a CSR offset array, goes beyond int32, or
    gives an empty batch."""
    qo_lens_list = list(map(operator.sub, qo_list[1:], qo_list))
    _check_offsets("qo_indptr", qo_list, qo_lens_list, min(qo_lens_list))
    max_qo_len = max(qo_lens_list)
    if max_qo_len == 0:
        # Refused here, for every backend: an empty batch leaves nothing to compute, and
        # kernels that size their grid or gathers by the rows fail on zero of them.
        raise InvalidArgumentError(
            "qo_indptr",
            "the offsets of at least one query row (an empty batch has nothing to compute: skip the call)",
            f"qo_indptr[-1] = 0 for {batch_size} requests",
        )
    if qo_list[-1] > _INT32_MAX:
        raise InvalidArgumentError("qo_indptr", f"offsets up to {_INT32_MAX} (kernels index query "
                                   "rows with int32)", f"qo_indptr[-1] = {qo_list[-1]}")  # fmt: skip
    return qo_lens_list, max_qo_len


def _on_device(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int32 tensors on ``device``: themselves on the CPU, else one pinned, non-blocking copy."""
    if device.type == "cpu":
        return host
    sizes = [t.numel() for t in host]
    packed = torch.cat(host).pin_memory().to(device, non_blocking=True)
    return list(torch.split(packed, sizes))


@dataclass(frozen=True)
class DeviceBatch:
    """Device copies of a batch's metadata (int32)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    qo_lens: torch.Tensor
    kv_lens: torch.Tensor


@dataclass(frozen=True, eq=False)
class CustomMask:
    """A prefill batch's custom attention mask in FlashInfer's layout: request ``r``'s mask is its
    ``q_len x kv_len`` matrix, row-major (True: the row attends the key), requests one after
    another. Held as given: ``flat`` (bool, ``offsets[-1]`` elements) or ``packed`` (uint8, each
    request's bits little-endian from its own byte: ``byte_offsets``)."""

    offsets: list[int]
    byte_offsets: list[int]
    flat: torch.Tensor | None
    packed: torch.Tensor | None

    @classmethod
    def build(
        cls,
        custom_mask: object,
        packed_custom_mask: object,
        qo_lens: list[int],
        kv_lens: list[int],
        device: torch.device,
    ) -> CustomMask:
        """Check a mask against the batch's lengths (``packed_custom_mask`` wins when both are given,
        as in FlashInfer)."""
        offsets, byte_offsets = [0], [0]
        for q, kv in zip(qo_lens, kv_lens, strict=True):
            offsets.append(offsets[-1] + q * kv)
            byte_offsets.append(byte_offsets[-1] + -(-(q * kv) // 8))
        if packed_custom_mask is not None:
            packed = _mask_tensor(packed_custom_mask, "packed_custom_mask", torch.uint8, byte_offsets[-1],
                                  "sum over requests of ceil(q_len * kv_len / 8) bytes", device)  # fmt: skip
            return cls(offsets, byte_offsets, None, packed)
        flat = _mask_tensor(custom_mask, "custom_mask", torch.bool, offsets[-1],
                            "sum over requests of q_len * kv_len elements", device)  # fmt: skip
        return cls(offsets, byte_offsets, flat, None)

    def unpacked(self, device: torch.device) -> torch.Tensor:
        """The mask as one flat bool tensor on ``device`` (unpacking the bits if packed)."""
        if self.flat is not None:
            return self.flat.to(device)
        assert self.packed is not None
        lengths = torch.tensor([b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False)], device=device)
        total = self.offsets[-1]
        req = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
        local = torch.arange(total, device=device) - torch.tensor(self.offsets[:-1], device=device)[req]
        byte = torch.tensor(self.byte_offsets[:-1], device=device)[req] + local // 8
        bits = self.packed.to(device)[byte].to(torch.int32)
        return ((bits >> (local % 8).to(torch.int32)) & 1).bool()

    def dense(self, device: torch.device, q_len: int, kv_len: int, qo_lens: torch.Tensor,
              kv_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """``[batch, q_len, kv_len]`` bool on ``device``: each request's mask, False past its rows and keys."""
        flat = self.unpacked(device)
        i = torch.arange(q_len, device=device)[None, :, None]
        j = torch.arange(kv_len, device=device)[None, None, :]
        q_r, kv_r = qo_lens.to(device).long()[:, None, None], kv_lens.to(device).long()[:, None, None]
        start = torch.tensor(self.offsets[:-1], device=device)[:, None, None]
        valid = (i < q_r) & (j < kv_r)
        index = (start + i * kv_r + j).clamp(0, max(flat.numel() - 1, 0))
        return valid & flat[index]


def _mask_tensor(value: object, argument: str, dtype: torch.dtype, numel: int, what: str,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(argument, f"a 1-D {dtype} torch.Tensor", type(value).__name__)
    if value.dtype != dtype or value.dim() != 1:
        raise InvalidArgumentError(argument, f"a 1-D {dtype} tensor", f"{value.dtype} of shape {tuple(value.shape)}")
    if value.numel() != numel:
        raise InvalidArgumentError(argument, f"{numel} long (the {what})", f"{value.numel()}")
    if value.device.type != "cpu" and value.device != device:
        raise InvalidArgumentError(argument, f"on the CPU or on the plan's device {device}", f"on {value.device}")
    return value


@dataclass(frozen=True, eq=False)
class Batch:
    """What every attention batch holds: the query rows and keys of each request.

    The small arrays are kept as Python lists (``*_list``) and turned into int32 CPU tensors
    only when a backend asks for them (``qo_indptr``, ``kv_lens``, ...): a backend that packs its
    own metadata from the lists pays for no tensor it does not use.
    """

    qo_indptr_list: list[int]
    qo_lens_list: list[int]
    kv_lens_list: list[int]
    batch_size: int
    num_qo_tokens: int
    max_qo_len: int
    max_kv_len: int

    @functools.cached_property
    def qo_indptr(self) -> torch.Tensor:
        return torch.tensor(self.qo_indptr_list, dtype=torch.int32)

    @functools.cached_property
    def qo_lens(self) -> torch.Tensor:
        return torch.tensor(self.qo_lens_list, dtype=torch.int32)

    @functools.cached_property
    def kv_lens(self) -> torch.Tensor:
        return torch.tensor(self.kv_lens_list, dtype=torch.int32)


@dataclass(frozen=True, eq=False)
class PagedBatch(Batch):
    """A validated paged batch. Lengths are per request; ``kv_indptr`` counts pages."""

    page_size: int
    kv_indptr_list: list[int]
    kv_indices: torch.Tensor
    """The page indices as given (int32), on the CPU or on the device."""
    kv_last_page_len_list: list[int]
    num_page_entries: int
    max_page_index: int | None
    """Largest page index used, when the indices are on the host; None for device indices."""
    custom_mask: CustomMask | None = None
    """Prefill: the custom attention mask given at plan (`with_custom_mask`), else None."""
    keyless_rows: bool = False
    """Causal prefill: some request has more query rows than keys (its first rows attend none)."""
    _device_copies: dict[torch.device, DeviceBatch] = field(default_factory=dict, repr=False)
    _bounds_checked: set[int] = field(default_factory=set, repr=False)
    """Cache sizes (pages) device indices were checked against (`check_page_bounds`)."""

    @functools.cached_property
    def kv_indptr(self) -> torch.Tensor:
        return torch.tensor(self.kv_indptr_list, dtype=torch.int32)

    @functools.cached_property
    def kv_last_page_len(self) -> torch.Tensor:
        return torch.tensor(self.kv_last_page_len_list, dtype=torch.int32)

    @property
    def indices_on_host(self) -> bool:
        return self.kv_indices.device.type == "cpu"

    @classmethod
    def build(
        cls,
        *,
        qo_indptr: torch.Tensor | None,
        kv_indptr: object,
        kv_indices: object,
        kv_last_page_len: object,
        page_size: int,
        device: torch.device,
        causal: bool,
        q_len_per_req: int = 1,
        kv_indptr_name: str = "paged_kv_indptr",
        kv_indices_name: str = "paged_kv_indices",
        last_page_len_name: str = "paged_kv_last_page_len",
    ) -> PagedBatch:
        """Check the CSR arrays of a batch. ``qo_indptr=None`` means decode: ``q_len_per_req`` rows
        each (one, or the rows of a multi-token decode step, causal among them: each request
        must then hold at least that many keys)."""
        decode = qo_indptr is None
        kv_indptr_t = _index_array(kv_indptr, kv_indptr_name, device)
        indices_t = _index_array(kv_indices, kv_indices_name, device)
        last_t = _index_array(kv_last_page_len, last_page_len_name, device)
        qo_t = None if decode else _index_array(qo_indptr, "qo_indptr", device)

        # The small arrays are checked as Python lists: a few microseconds for hundreds of
        # requests, where a chain of small torch ops costs tens.
        if decode and kv_indptr_t.is_cpu and last_t.is_cpu:  # the common decode re-plan, inline
            small = [kv_indptr_t.tolist(), last_t.tolist()]
        else:
            small = _host_lists([kv_indptr_t, last_t] if qo_t is None else [kv_indptr_t, last_t, qo_t], device)
        kv_list, last_list = small[0], small[1]
        batch_size = len(kv_list) - 1
        if batch_size < 1:
            raise InvalidArgumentError(kv_indptr_name, "of length batch_size + 1 >= 2", f"length {len(kv_list)}")
        if decode:
            qo_list = list(range(0, (batch_size + 1) * q_len_per_req, q_len_per_req))
        else:
            qo_list = small[2]
            _check_qo_length(qo_list, batch_size, kv_indptr_name)
        if len(last_list) != batch_size:
            raise InvalidArgumentError(
                last_page_len_name, f"of length batch_size = {batch_size}", f"length {len(last_list)}"
            )
        # each check is one C-level min/max over the list; the loop that names the culprit runs
        # only when a check fails
        num_pages = list(map(operator.sub, kv_list[1:], kv_list))
        fewest_pages = min(num_pages)
        _check_offsets(kv_indptr_name, kv_list, num_pages, fewest_pages)
        if decode:
            qo_lens_list = [q_len_per_req] * batch_size
            max_qo_len = q_len_per_req
        else:
            qo_lens_list, max_qo_len = _query_rows(qo_list, batch_size)
        if fewest_pages < 1:
            i = num_pages.index(fewest_pages)
            raise InvalidArgumentError(
                kv_indptr_name, "to give every request at least one page", f"request {i} has none"
            )
        if min(last_list) < 1 or max(last_list) > page_size:
            i, n = next((i, n) for i, n in enumerate(last_list) if not 1 <= n <= page_size)
            raise InvalidArgumentError(f"{last_page_len_name}[{i}]", f"in [1, page_size={page_size}]", n)
        nnz = kv_list[-1]
        if nnz > _INT32_MAX:
            raise InvalidArgumentError(kv_indptr_name, f"offsets up to {_INT32_MAX} (kernels index pages "
                                       "with int32)", f"{kv_indptr_name}[-1] = {nnz}")  # fmt: skip
        if nnz > indices_t.numel():
            raise InvalidArgumentError(
                kv_indices_name,
                f"at least {kv_indptr_name}[-1] = {nnz} entries long",
                f"{indices_t.numel()} entries",
            )
        kv_lens_list = [(n - 1) * page_size + last for n, last in zip(num_pages, last_list, strict=True)]
        max_kv_len = max(kv_lens_list)
        if max_kv_len > _INT32_MAX:
            i = kv_lens_list.index(max_kv_len)
            raise InvalidArgumentError(
                kv_indptr_name,
                f"offsets that give kv lengths up to {_INT32_MAX} tokens (kernels index keys with int32)",
                f"request {i}: kv length {max_kv_len}",
            )
        keyless_rows = False
        if decode and q_len_per_req > 1:
            for i, (q, kv) in enumerate(zip(qo_lens_list, kv_lens_list, strict=True)):
                if kv < q:
                    raise InvalidArgumentError(
                        "q_len_per_req",
                        "at most each request's kv length (the rows are the requests' last tokens)",
                        f"{q_len_per_req} rows per request; request {i} has {kv} kv tokens",
                    )
        elif causal and not decode:
            # the queries are aligned with the last keys: a request with more rows than keys has
            # rows before its first key, which attend none (zeros, LSE -inf: the problem says so)
            keyless_rows = any(map(operator.lt, kv_lens_list, qo_lens_list))
        if indices_t.numel() != nnz:
            indices_t = indices_t[:nnz]
        max_page_index: int | None = None
        if indices_t.is_cpu:
            if nnz:  # checked before narrowing to int32, so a huge int64 index cannot wrap into range
                lo, hi = _extrema(indices_t)
                if lo < 0:
                    raise InvalidArgumentError(kv_indices_name, "non-negative page indices", f"index {lo}")
                if hi > _INT32_MAX:
                    raise InvalidArgumentError(kv_indices_name, f"page indices up to {_INT32_MAX}", f"index {hi}")
                max_page_index = hi
            if indices_t.dtype != torch.int32:
                indices_t = indices_t.to(torch.int32)
        else:
            if indices_t.dtype == torch.int64 and nnz:  # no wrap-around on the narrowing below
                ok = (indices_t.min() >= 0) & (indices_t.max() <= _INT32_MAX)
                torch._assert_async(ok, f"'{kv_indices_name}' must hold page indices in [0, {_INT32_MAX}]")
            indices_t = indices_t.to(torch.int32)

        # the fields set straight into a new instance: a frozen dataclass's __init__ sets each
        # through object.__setattr__ (about 2 us for these); same fields, same values
        batch = cls.__new__(cls)
        batch.__dict__.update(
            page_size=page_size,
            qo_indptr_list=qo_list,
            kv_indptr_list=kv_list,
            kv_indices=indices_t,
            kv_last_page_len_list=last_list,
            qo_lens_list=qo_lens_list,
            kv_lens_list=kv_lens_list,
            batch_size=batch_size,
            num_qo_tokens=qo_list[-1],
            max_qo_len=max_qo_len,
            max_kv_len=max_kv_len,
            num_page_entries=nnz,
            max_page_index=max_page_index,
            custom_mask=None,
            keyless_rows=keyless_rows,
            _device_copies={},
            _bounds_checked=set(),
        )
        return batch

    def with_custom_mask(self, custom_mask: object, packed_custom_mask: object, device: torch.device) -> PagedBatch:
        """This batch with a custom mask (`CustomMask.build` checks it against the lengths)."""
        mask = CustomMask.build(custom_mask, packed_custom_mask, self.qo_lens_list, self.kv_lens_list, device)
        batch = type(self).__new__(type(self))
        batch.__dict__.update(self.__dict__, custom_mask=mask, _device_copies={}, _bounds_checked=set())
        return batch

    def check_page_bounds(self, num_pages: int, argument: str = "paged_kv_indices") -> None:
        """Refuse page indices outside a cache of ``num_pages`` pages.

        Host indices are compared on the host. Device indices are checked by an assertion
        enqueued on the device: no host sync, and the stream stops before any read.
        """
        if self.max_page_index is not None:
            if self.max_page_index >= num_pages:
                raise InvalidArgumentError(
                    argument,
                    f"page indices below the cache's {num_pages} pages",
                    f"index {self.max_page_index}",
                )
        elif self.num_page_entries and num_pages not in self._bounds_checked:
            # once per batch and cache size: the layers of a step run one plan over caches of the
            # same number of pages, and each layer's first run() would otherwise enqueue the
            # same reduction again (six launches, ~20 us of host time a layer)
            lo, hi = torch.aminmax(self.kv_indices)
            ok = (lo >= 0) & (hi < num_pages)
            torch._assert_async(ok, f"'{argument}' must hold page indices in [0, {num_pages})")
            self._bounds_checked.add(num_pages)

    def on(self, device: torch.device) -> DeviceBatch:
        """The metadata on ``device`` (copied once per device, without a device sync)."""
        got = self._device_copies.get(device)
        if got is None:
            host = [self.qo_indptr, self.kv_indptr, self.kv_last_page_len, self.qo_lens, self.kv_lens]
            qo, kv, last, qo_lens, kv_lens = _on_device(host, device)
            indices = self.kv_indices
            if indices.device != device:
                indices = indices.pin_memory().to(device, non_blocking=True)
            got = self._device_copies[device] = DeviceBatch(qo, kv, indices, last, qo_lens, kv_lens)
        return got


@dataclass(frozen=True)
class RaggedDeviceBatch:
    """Device copies of a ragged batch's metadata (int32)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    qo_lens: torch.Tensor
    kv_lens: torch.Tensor


_IDENTITY: list[torch.Tensor] = [torch.arange(0, dtype=torch.int32)]


def _identity_pages(n: int) -> torch.Tensor:
    """``arange(n)`` as int32 on the CPU: a view of one shared tensor, grown (doubling) when asked
    for more (read-only by contract: `PagedBatch.kv_indices` is never written)."""
    found = _IDENTITY[0]
    if found.numel() < n:
        found = _IDENTITY[0] = torch.arange(max(n, 2 * found.numel()), dtype=torch.int32)
    return found[:n]


@dataclass(frozen=True, eq=False)
class RaggedBatch(Batch):
    """A validated ragged-KV batch: request ``b``'s keys and values are rows
    ``kv_indptr[b]:kv_indptr[b + 1]`` of packed ``[num_kv_tokens, num_kv_heads, head_dim]`` tensors,
    its query rows ``qo_indptr[b]:qo_indptr[b + 1]`` of ``q``. A request may have no query row
    (and then no key); one with query rows has at least one key."""

    kv_indptr_list: list[int]
    num_kv_tokens: int
    keyless_rows: bool = False
    """Causal: some request has more query rows than keys (its first rows attend none)."""
    _device_copies: dict[torch.device, RaggedDeviceBatch] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def kv_indptr(self) -> torch.Tensor:
        return torch.tensor(self.kv_indptr_list, dtype=torch.int32)

    @classmethod
    def build(cls, *, qo_indptr: object, kv_indptr: object, device: torch.device, causal: bool) -> RaggedBatch:
        """Check the two CSR arrays of a batch (``causal``: the query rows sit at the end of the
        request's keys; a request with more rows than keys has rows that attend none:
        ``keyless_rows``)."""
        qo_t = _index_array(qo_indptr, "qo_indptr", device)
        kv_t = _index_array(kv_indptr, "kv_indptr", device)
        qo_list, kv_list = _host_lists([qo_t, kv_t], device)
        batch_size = len(kv_list) - 1
        if batch_size < 1:
            raise InvalidArgumentError("kv_indptr", "of length batch_size + 1 >= 2", f"length {len(kv_list)}")
        _check_qo_length(qo_list, batch_size, "kv_indptr")
        qo_lens_list, max_qo_len = _query_rows(qo_list, batch_size)
        kv_lens_list = list(map(operator.sub, kv_list[1:], kv_list))
        _check_offsets("kv_indptr", kv_list, kv_lens_list, min(kv_lens_list))
        if kv_list[-1] > _INT32_MAX:
            raise InvalidArgumentError("kv_indptr", f"offsets up to {_INT32_MAX} (kernels index keys with int32)",
                                       f"kv_indptr[-1] = {kv_list[-1]}")  # fmt: skip
        # one C-level pass each; the loop that names the request runs only when a check fails
        keyless_rows = causal and min(map(operator.sub, kv_lens_list, qo_lens_list)) < 0
        if 0 in kv_lens_list:
            for i, (q, kv) in enumerate(zip(qo_lens_list, kv_lens_list, strict=True)):
                if q and not kv:
                    raise InvalidArgumentError("kv_indptr", "to give every request with query rows at least one "
                                               "key", f"request {i}: {q} query rows, no key")  # fmt: skip
        batch = cls.__new__(cls)  # as in PagedBatch.build: the fields set straight into the instance
        batch.__dict__.update(
            qo_indptr_list=qo_list,
            qo_lens_list=qo_lens_list,
            kv_lens_list=kv_lens_list,
            batch_size=batch_size,
            num_qo_tokens=qo_list[-1],
            max_qo_len=max_qo_len,
            max_kv_len=max(kv_lens_list),
            kv_indptr_list=kv_list,
            num_kv_tokens=kv_list[-1],
            keyless_rows=keyless_rows,
            _device_copies={},
            _bounds_checked=set(),
        )
        return batch

    @functools.cached_property
    def paged(self) -> PagedBatch:
        """This batch read as a paged one with pages of one token: page ``i`` is row ``i`` of the
        packed k and v (the identity page table, ``kv_indptr`` as the page offsets), so that a
        paged prefill that takes page size 1 computes it from ``k.unsqueeze(1)`` and
        ``v.unsqueeze(1)`` (an NHD cache; `RaggedPrefillProblem.as_paged_prefill` is the problem).
        A request without keys (and so without query rows) has no page."""
        nnz = self.num_kv_tokens
        batch = PagedBatch.__new__(PagedBatch)  # the fields of PagedBatch.build, for these values
        batch.__dict__.update(
            qo_indptr_list=self.qo_indptr_list,
            qo_lens_list=self.qo_lens_list,
            kv_lens_list=self.kv_lens_list,
            batch_size=self.batch_size,
            num_qo_tokens=self.num_qo_tokens,
            max_qo_len=self.max_qo_len,
            max_kv_len=self.max_kv_len,
            page_size=1,
            kv_indptr_list=self.kv_indptr_list,
            kv_indices=_identity_pages(nnz),
            kv_last_page_len_list=[1] * self.batch_size,
            num_page_entries=nnz,
            max_page_index=nnz - 1,
            custom_mask=None,
            keyless_rows=self.keyless_rows,
            _device_copies={},
        )
        return batch

    def on(self, device: torch.device) -> RaggedDeviceBatch:
        """The metadata on ``device`` (copied once per device, without a device sync)."""
        got = self._device_copies.get(device)
        if got is None:
            qo, kv, qo_lens, kv_lens = _on_device([self.qo_indptr, self.kv_indptr, self.qo_lens, self.kv_lens], device)
            got = self._device_copies[device] = RaggedDeviceBatch(qo, kv, qo_lens, kv_lens)
        return got
