"""Validated metadata of a paged-KV batch, shared by every backend's plan.

The engine describes a batch with FlashInfer's CSR arrays: ``qo_indptr`` (query rows of each
request), ``paged_kv_indptr`` / ``paged_kv_indices`` (each request's pages) and
``paged_kv_last_page_len`` (valid tokens in each request's last page). `PagedBatch.build`
checks them once per batch, in ``plan()``, and derives the per-request lengths. Host metadata
is checked completely on the host with no device sync. For device-resident index arrays the
page-range check is enqueued on the device (`check_page_bounds`), so no host sync is needed and
an out-of-range page is never read: the device assertion stops the stream before any attention
kernel that follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tactix.errors import InvalidArgumentError

__all__ = ["DeviceBatch", "PagedBatch"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _index_array(value: object, argument: str, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(argument, "a 1-D int32 or int64 torch.Tensor", type(value).__name__)
    if value.dtype not in _INDEX_DTYPES:
        raise InvalidArgumentError(argument, "of dtype int32 or int64", value.dtype)
    if value.dim() != 1:
        raise InvalidArgumentError(argument, "1-D", f"shape {tuple(value.shape)}")
    if value.device.type != "cpu" and value.device != device:
        raise InvalidArgumentError(argument, f"on the CPU or on {device}", value.device)
    return value


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
class PagedBatch:
    """A validated paged batch. Host arrays are int32 CPU tensors; lengths are per request."""

    page_size: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    """The page indices as given (int32), on the CPU or on the device."""
    kv_last_page_len: torch.Tensor
    qo_lens: torch.Tensor
    kv_lens: torch.Tensor
    batch_size: int
    num_qo_tokens: int
    max_qo_len: int
    max_kv_len: int
    num_page_entries: int
    max_page_index: int | None
    """Largest page index used, when the indices are on the host; None for device indices."""
    _device_copies: dict[torch.device, DeviceBatch] = field(default_factory=dict, repr=False)

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
        kv_indptr_name: str = "paged_kv_indptr",
        kv_indices_name: str = "paged_kv_indices",
        last_page_len_name: str = "paged_kv_last_page_len",
    ) -> PagedBatch:
        """Check the CSR arrays of a batch. ``qo_indptr=None`` means decode (one row each)."""
        kv_indptr_t = _index_array(kv_indptr, kv_indptr_name, device)
        indices_t = _index_array(kv_indices, kv_indices_name, device)
        last_t = _index_array(kv_last_page_len, last_page_len_name, device)
        qo_t = None if qo_indptr is None else _index_array(qo_indptr, "qo_indptr", device)

        # One transfer brings device-resident indptrs to the host (their values decide shapes).
        small = [kv_indptr_t, last_t] + ([] if qo_t is None else [qo_t])
        if any(t.device.type != "cpu" for t in small):
            sizes = [t.numel() for t in small]
            host = torch.cat([t.to(device, torch.int32) for t in small]).cpu()
            small = list(torch.split(host, sizes))
        kv_indptr_h = small[0].to(torch.int32)
        last_h = small[1].to(torch.int32)

        batch_size = kv_indptr_h.numel() - 1
        if batch_size < 1:
            raise InvalidArgumentError(kv_indptr_name, "of length batch_size + 1 >= 2", f"length {kv_indptr_h.numel()}")
        if qo_t is None:
            qo_indptr_h = torch.arange(batch_size + 1, dtype=torch.int32)
        else:
            qo_indptr_h = small[2].to(torch.int32)
            if qo_indptr_h.numel() != batch_size + 1:
                raise InvalidArgumentError(
                    "qo_indptr",
                    f"of length batch_size + 1 = {batch_size + 1} like {kv_indptr_name}",
                    f"length {qo_indptr_h.numel()}",
                )
        if last_h.numel() != batch_size:
            raise InvalidArgumentError(
                last_page_len_name, f"of length batch_size = {batch_size}", f"length {last_h.numel()}"
            )
        for name, indptr in (("qo_indptr", qo_indptr_h), (kv_indptr_name, kv_indptr_h)):
            if int(indptr[0]) != 0:
                raise InvalidArgumentError(name, "a CSR offset array starting at 0", f"{name}[0] = {int(indptr[0])}")
            steps = indptr[1:] - indptr[:-1]
            if bool((steps < 0).any()):
                i = int(torch.nonzero(steps < 0)[0])
                raise InvalidArgumentError(
                    name,
                    "non-decreasing",
                    f"{name}[{i}] = {int(indptr[i])} > {name}[{i + 1}] = {int(indptr[i + 1])}",
                )
        num_pages = kv_indptr_h[1:] - kv_indptr_h[:-1]
        if bool((num_pages < 1).any()):
            i = int(torch.nonzero(num_pages < 1)[0])
            raise InvalidArgumentError(
                kv_indptr_name, "to give every request at least one page", f"request {i} has none"
            )
        bad_last = (last_h < 1) | (last_h > page_size)
        if bool(bad_last.any()):
            i = int(torch.nonzero(bad_last)[0])
            raise InvalidArgumentError(f"{last_page_len_name}[{i}]", f"in [1, page_size={page_size}]", int(last_h[i]))
        nnz = int(kv_indptr_h[-1])
        if nnz > indices_t.numel():
            raise InvalidArgumentError(
                kv_indices_name,
                f"at least {kv_indptr_name}[-1] = {nnz} entries long",
                f"{indices_t.numel()} entries",
            )
        qo_lens = qo_indptr_h[1:] - qo_indptr_h[:-1]
        kv_lens = (num_pages - 1) * page_size + last_h
        if causal:
            short = kv_lens < qo_lens
            if bool(short.any()):
                i = int(torch.nonzero(short)[0])
                raise InvalidArgumentError(
                    "paged_kv_last_page_len",
                    f"to give request {i} at least as many kv tokens as query tokens "
                    "(causal attention aligns q to the end of kv)",
                    f"kv length {int(kv_lens[i])} for {int(qo_lens[i])} query tokens",
                )

        indices_t = indices_t[:nnz]
        max_page_index: int | None = None
        if indices_t.device.type == "cpu":
            indices_t = indices_t.to(torch.int32)
            if nnz:
                lo, hi = int(indices_t.min()), int(indices_t.max())
                if lo < 0:
                    raise InvalidArgumentError(kv_indices_name, "non-negative page indices", f"index {lo}")
                max_page_index = hi
        else:
            indices_t = indices_t.to(torch.int32)

        return cls(
            page_size=page_size,
            qo_indptr=qo_indptr_h,
            kv_indptr=kv_indptr_h,
            kv_indices=indices_t,
            kv_last_page_len=last_h,
            qo_lens=qo_lens,
            kv_lens=kv_lens,
            batch_size=batch_size,
            num_qo_tokens=int(qo_indptr_h[-1]),
            max_qo_len=int(qo_lens.max()),
            max_kv_len=int(kv_lens.max()),
            num_page_entries=nnz,
            max_page_index=max_page_index,
        )

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
        elif self.num_page_entries:
            idx = self.kv_indices
            ok = (idx.min() >= 0) & (idx.max() < num_pages)
            torch._assert_async(ok, f"'{argument}' must hold page indices in [0, {num_pages})")

    def on(self, device: torch.device) -> DeviceBatch:
        """The metadata on ``device`` (copied once per device, without a device sync)."""
        got = self._device_copies.get(device)
        if got is None:
            if device.type == "cpu":
                got = DeviceBatch(
                    self.qo_indptr,
                    self.kv_indptr,
                    self.kv_indices,
                    self.kv_last_page_len,
                    self.qo_lens,
                    self.kv_lens,
                )
            else:
                host = [self.qo_indptr, self.kv_indptr, self.kv_last_page_len, self.qo_lens, self.kv_lens]
                sizes = [t.numel() for t in host]
                packed = torch.cat(host).pin_memory().to(device, non_blocking=True)
                qo, kv, last, qo_lens, kv_lens = torch.split(packed, sizes)
                indices = self.kv_indices
                if indices.device != device:
                    indices = indices.pin_memory().to(device, non_blocking=True)
                got = DeviceBatch(qo, kv, indices, last, qo_lens, kv_lens)
            self._device_copies[device] = got
        return got
