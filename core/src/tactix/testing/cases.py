"""Conformance cases generated from a backend's declared capabilities, and their inputs.

Cases vary one thing at a time from a base case (the Llama-3-8B-like shape the benchmarks use:
32 query heads, 8 KV heads, head dim 128, page size 16, HND, bf16), over the union of what the
backend declares and a standard set of values, so a feature the backend does not declare shows
up as a skip with its reason instead of silently not being asked about. Batches cover ragged
lengths, the edges of a page (1, page size - 1, page size, page size + 1, 2 page sizes), a long
32k-token request, a batch of one and a large batch.

Every case builds its inputs from its own seed: the cache holds the batch's pages in shuffled
order among unused pages, and every slot outside the batch (unused pages, the tail of each
request's last page) holds values far larger than real ones, so reading one changes the result.
The ``stale-nan`` and ``stale-inf`` cases hold NaN or infinities there instead, as a real cache
may (an earlier request's overflow, an uninitialised allocation): a backend must keep such slots
out of the output, or declare the cases as known failures and say what callers must guarantee.
GEMM's ``stale-nan`` cases place each operand inside a larger buffer that is NaN before and after
it, so a kernel that reads past an operand's end shows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, TypeVar

import torch

from tactix.dtypes import SHORT_NAMES, to_torch_dtype
from tactix.layouts import page_shape
from tactix.ops import (
    OPS,
    AttentionCapabilities,
    AttentionCapabilitiesBase,
    AttentionProblem,
    GemmCapabilities,
    GemmDTypes,
    GemmProblem,
)

__all__ = [
    "AttentionCase",
    "AttentionInputs",
    "GemmCase",
    "GemmInputs",
    "RaggedCase",
    "RaggedInputs",
    "attention_cases",
    "build_ragged_inputs",
    "gemm_cases",
    "ragged_cases",
]

_STANDARD_DTYPES = ("bfloat16", "float16", "float32")
_STANDARD_FP8_KV = ("float8_e4m3fn", "float8_e5m2")
_STANDARD_HEAD_DIMS = (64, 128, 256)
_STANDARD_PAGE_SIZES = (1, 16, 64)
OUTSIDE = 1000.0
"""Magnitude written to every cache slot that belongs to no request of the batch."""
Stale = Literal["large", "nan", "inf"]
_C = TypeVar("_C", "AttentionCase", "RaggedCase", "GemmCase", "MergeCase")
"""What the cache slots no request owns hold: ``OUTSIDE``-sized values, NaN, or infinities."""


@dataclass(frozen=True)
class _Case:
    """What the conformance cases of every attention op share (`AttentionCase` for the paged ops,
    `RaggedCase` for ragged-KV prefill): dtypes, heads, masking, the batch's lengths, run extras."""

    op: str  # an attention op of the registry (tactix.ops.OPS)
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim_qk: int = 128
    head_dim_vo: int = 128
    causal: bool = False
    window_left: int = -1
    logits_soft_cap: float = 0.0
    return_lse: bool = False
    batch: str = "ragged"
    kv_lens: tuple[int, ...] = (37, 100, 16, 300)
    q_lens: tuple[int, ...] = (1, 1, 1, 1)
    q_form: Literal["contiguous", "strided"] = "contiguous"  # strided: views of a fused QKV output
    stale: Stale = "large"
    k_scale: float = 1.0  # run extras: dequantization scales (1.0: not passed)
    v_scale: float = 1.0
    scale_form: Literal["float", "tensor"] = "float"  # tensor: one-element float32 tensors on the device
    sinks: bool = False  # run extra: a sink logit per query head (`_sinks`)
    seed: int = 0

    @property
    def run_extras(self) -> frozenset[str]:
        """The run extras this case passes (a backend that does not take them skips it)."""
        scales = frozenset(name for name in ("k_scale", "v_scale") if getattr(self, name) != 1.0)
        return scales | {"sinks"} if self.sinks else scales

    @property
    def ragged(self) -> bool:
        """Whether the op takes any number of query rows per request (prefill) or one (decode)."""
        return _ragged(self.op)

    @property
    def chunked(self) -> bool:
        return self.ragged and any(k > q for k, q in zip(self.kv_lens, self.q_lens, strict=True))

    @property
    def q_len_per_req(self) -> int:
        """Decode: the query rows of each request (``q_lens`` is uniform; more than one is a
        multi-token decode step, causal among the rows); prefill: 1 (rows are in ``q_lens``)."""
        return 1 if self.ragged else self.q_lens[0]

    @property
    def masked_causally(self) -> bool:
        """Whether rows attend causally: prefill as asked, decode with several rows per request."""
        return self.causal if self.ragged else self.q_len_per_req > 1

    @property
    def layout_args(self) -> tuple[Any, ...]:
        """The positional arguments of the op's wrapper (the paged ones: the cache layout)."""
        return ()

    def _keys(self) -> list[tuple[str, str]]:
        """(id part, feature tag) of where the keys are (paged: page size and layout)."""
        return []

    def _rows(self) -> list[tuple[str, str]]:
        """(id part, feature tag) of which keys each row attends beyond causal (decode's rows, a
        custom mask)."""
        return []

    def _forms(self) -> list[tuple[str, str]]:
        """(id part, feature tag) of how the tensors are handed over (a 5-D cache, views of a fused
        projection)."""
        return []

    @property
    def id(self) -> str:
        dtype = SHORT_NAMES[self.q_dtype]
        if self.kv_dtype != self.q_dtype:
            dtype += f"/{SHORT_NAMES[self.kv_dtype]}"
        if self.out_dtype != self.q_dtype:
            dtype += f"->{SHORT_NAMES[self.out_dtype]}"
        dims = (
            f"d{self.head_dim_qk}"
            if self.head_dim_qk == self.head_dim_vo
            else f"d{self.head_dim_qk}x{self.head_dim_vo}"
        )
        parts = [dtype, f"h{self.num_qo_heads}/{self.num_kv_heads}", dims, *(p for p, _ in self._keys())]
        if self.causal:
            parts.append("causal")
        parts += [p for p, _ in self._rows()]
        if self.window_left >= 0:
            parts.append(f"win{self.window_left}")
        if self.logits_soft_cap > 0:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.return_lse:
            parts.append("lse")
        parts += [p for p, _ in self._forms()]
        if self.sinks:  # (before the stale part: known-failure globs end at "stale-nan" / "stale-inf")
            parts.append("sinks")
        if self.batch != "ragged":
            parts.append(self.batch)
        if self.stale != "large":
            parts.append(f"stale-{self.stale}")
        if self.run_extras - {"sinks"}:
            parts.append(f"kscale{self.k_scale:g}-vscale{self.v_scale:g}")
            if self.scale_form == "tensor":
                parts.append("devscale")
        return f"{self.op}[{'-'.join(parts)}]"

    def features(self) -> list[str]:
        """Tags for the support matrix: each names one thing this case exercises."""
        tags = [
            f"dtype {SHORT_NAMES[self.q_dtype]}"
            + (f"/{SHORT_NAMES[self.kv_dtype]}" if self.kv_dtype != self.q_dtype else ""),
            f"head dim {self.head_dim_qk}" + (f"x{self.head_dim_vo}" if self.head_dim_vo != self.head_dim_qk else ""),
            *(tag for _, tag in self._keys()),
            f"GQA {self.num_qo_heads // self.num_kv_heads}",
            f"batch {self.batch}",
        ]
        if self.ragged:
            tags.append("causal" if self.causal else "non-causal")
            if self.chunked:
                tags.append("chunked prefill")
        tags += [tag for _, tag in self._rows()]
        if self.window_left >= 0:
            tags.append("sliding window")
        if self.logits_soft_cap > 0:
            tags.append("soft-cap")
        if self.return_lse:
            tags.append("LSE")
        tags += [tag for _, tag in self._forms()]
        if self.stale != "large":
            tags.append(f"{'NaN' if self.stale == 'nan' else 'Inf'} in slots no request owns")
        if self.run_extras - {"sinks"}:
            tags.append("k/v scales" + (" (device tensors)" if self.scale_form == "tensor" else ""))
        if self.sinks:
            tags.append("attention sinks")
        return tags

    def plan_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim_qk=self.head_dim_qk,
            head_dim_vo=self.head_dim_vo,
            window_left=self.window_left,
            logits_soft_cap=self.logits_soft_cap or None,
            q_data_type=to_torch_dtype(self.q_dtype),
            kv_data_type=to_torch_dtype(self.kv_dtype),
            o_data_type=to_torch_dtype(self.out_dtype),
            return_lse=self.return_lse,
        )
        if self.ragged:
            kw["causal"] = self.causal
        elif self.q_len_per_req > 1:
            kw["q_len_per_req"] = self.q_len_per_req
        return kw

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_qk)


@dataclass(frozen=True)
class AttentionCase(_Case):
    """One prefill or decode conformance case."""

    page_size: int = 16
    kv_layout: Literal["NHD", "HND"] = "HND"
    cache_form: Literal["tuple", "tensor"] = "tuple"
    mask: Literal["", "tree", "random"] = ""  # prefill: a custom mask (tree attention, or random with empty rows)
    mask_form: Literal["bool", "packed"] = "bool"  # packed: bit-packed (packed_custom_mask)
    # device: the offsets, page indices and last-page lengths on the case's device, as FlashInfer's
    # callers pass them (plans read them there: a page table gathered on the GPU)
    index_form: Literal["host", "device"] = "host"

    @property
    def layout_args(self) -> tuple[Any, ...]:
        return (self.kv_layout,)

    def _keys(self) -> list[tuple[str, str]]:
        return [(f"p{self.page_size}", f"page size {self.page_size}"), (self.kv_layout, f"layout {self.kv_layout}")]

    def _rows(self) -> list[tuple[str, str]]:
        rows = [(f"q{self.q_len_per_req}", "multi-token decode")] if self.q_len_per_req > 1 else []
        if self.mask:
            packed = self.mask_form == "packed"
            rows.append((f"mask-{self.mask}" + ("-packed" if packed else ""),
                         "custom mask" + (" (bit-packed)" if packed else "")))  # fmt: skip
        return rows

    def _forms(self) -> list[tuple[str, str]]:
        return (
            ([("5d", "5-D cache tensor")] if self.cache_form == "tensor" else [])
            + ([("qview", "strided q (QKV view)")] if self.q_form == "strided" else [])
            + ([("devidx", "page indices on the device")] if self.index_form == "device" else [])
        )

    def plan_kwargs(self) -> dict[str, Any]:
        return {**super().plan_kwargs(), "page_size": self.page_size}


@dataclass(frozen=True)
class RaggedCase(_Case):
    """One ragged-KV prefill conformance case: request ``b``'s ``q_lens[b]`` query rows over its
    ``kv_lens[b]`` rows of packed keys and values."""

    @property
    def ragged(self) -> bool:
        return True

    def _forms(self) -> list[tuple[str, str]]:
        return [("qkvview", "strided q, k, v (views of fused projections)")] if self.q_form == "strided" else []


def _run_extra_values(case: _Case, device: torch.device) -> dict[str, Any]:
    """The run extras ``run()`` receives: floats, or one-element float32 tensors on ``device``."""
    extras: dict[str, Any] = {}
    for name in sorted(case.run_extras - {"sinks"}):
        value = getattr(case, name)
        extras[name] = torch.tensor(value, dtype=torch.float32, device=device) if case.scale_form == "tensor" else value
    if case.sinks:
        extras["sinks"] = _sinks(case, device)
    return extras


def _sinks(case: _Case, device: torch.device) -> torch.Tensor:
    """A case's sink logits, float32 ``[num_qo_heads]``: spread over [-1, 6], from below to above
    the log-sum-exp of a row's logits over its keys (about log(kv_len) for these inputs), so the
    sinks take from a negligible to most of each row's probability."""
    generator = torch.Generator().manual_seed(case.seed + 7919)
    return (torch.rand(case.num_qo_heads, generator=generator) * 7 - 1).to(device)


def _outputs(case: _Case, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` (and ``lse``, if the case asks for it) filled with NaN, so unwritten elements show."""
    out = torch.full((rows, case.num_qo_heads, case.head_dim_vo), float("nan"), device=device,
                     dtype=to_torch_dtype(case.out_dtype))  # fmt: skip
    lse = (
        torch.full((rows, case.num_qo_heads), float("nan"), device=device, dtype=torch.float32)
        if case.return_lse
        else None
    )
    return out, lse


@dataclass
class AttentionInputs:
    """Metadata (host), tensors (on the device) and the poisoned output buffers of a case."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache: Any  # what run() receives: (k, v) or the 5-D tensor whose views k_cache and v_cache are
    out: torch.Tensor
    lse: torch.Tensor | None
    outside: torch.Tensor = field(repr=False)  # bool [pages, page_size]: slots that belong to no request
    extras: dict[str, Any] = field(default_factory=dict)  # the run extras run() receives (k_scale, ...)
    custom_mask: torch.Tensor | None = None  # bool, flattened (FlashInfer's layout): what the oracle reads
    mask_kwargs: dict[str, Any] = field(default_factory=dict)  # what plan() receives: custom_mask or packed_custom_mask

    def plan_args(self, op: str) -> tuple[torch.Tensor, ...]:
        meta = (self.kv_indptr, self.kv_indices, self.kv_last_page_len)
        return ((self.qo_indptr, *meta)) if _ragged(op) else meta

    def empty_plan_args(self, op: str) -> tuple[torch.Tensor, ...]:
        """`plan_args` of an empty batch: the same requests and pages with no query row
        (prefill), or no request at all (decode, whose every request has one row)."""
        if _ragged(op):
            return (torch.zeros_like(self.qo_indptr), self.kv_indptr, self.kv_indices, self.kv_last_page_len)
        return (self.kv_indptr[:1], self.kv_indices[:0], self.kv_last_page_len[:0])

    def run_args(self) -> tuple[Any, ...]:
        """What ``run()`` receives before its keywords."""
        return (self.q, self.cache)

    def out_of_bounds(self) -> tuple[AttentionInputs, str]:
        """These inputs with a page one past the cache (another request's memory, or none), which
        ``run()`` must refuse before reading it, and the argument its error names."""
        bad = replace(self, kv_indices=self.kv_indices.clone())
        bad.kv_indices[-1] = self.k_cache.shape[0]
        return bad, "paged_kv_indices"

    def shortened(self, case: AttentionCase) -> tuple[AttentionInputs, AttentionCase]:
        """The same tensors (q, cache, outputs) with every request's keys cut to a quarter (at
        least its query rows): a shorter batch, of smaller length buckets, than the one planned
        first. Each request keeps its first pages; the slots it no longer owns count as outside
        (`refill` poisons them), so a kernel that reads past the new lengths spoils the result."""
        page = case.page_size
        kv_lens = tuple(max(q_len, n // 4, 1) for q_len, n in zip(case.q_lens, case.kv_lens, strict=True))
        indptr, indices = [0], []
        outside = torch.ones_like(self.outside)
        old_indptr, old_indices = self.kv_indptr.tolist(), self.kv_indices.tolist()
        for r, n in enumerate(kv_lens):
            mine = old_indices[old_indptr[r] : old_indptr[r] + -(-n // page)]
            for i, p in enumerate(mine):
                outside[p, : min(page, n - i * page)] = False
            indices += mine
            indptr.append(len(indices))
        short = replace(case, kv_lens=kv_lens)
        as_int = dict(dtype=torch.int32, device=self.kv_indptr.device)
        inputs = replace(self, kv_indptr=torch.tensor(indptr, **as_int),  # type: ignore[arg-type]
                         kv_indices=torch.tensor(indices, **as_int),  # type: ignore[arg-type]
                         kv_last_page_len=torch.tensor([(n - 1) % page + 1 for n in kv_lens], **as_int),  # type: ignore[arg-type]
                         outside=outside)  # fmt: skip
        return inputs, short

    def refill(self, case: AttentionCase, generator: torch.Generator) -> None:
        """New random q and cache contents (same metadata), poisoned outputs again."""
        dtype_q, dtype_kv = to_torch_dtype(case.q_dtype), to_torch_dtype(case.kv_dtype)
        self.q.copy_(_randn(self.q.shape, generator).to(self.q.device, dtype_q))
        for cache in (self.k_cache, self.v_cache):
            fresh = _randn(cache.shape, generator)
            fresh = _poison_outside(fresh, self.outside, case.kv_layout, case.stale, dtype_kv)
            cache.copy_(fresh.to(cache.device, dtype_kv))
        self.poison()

    def poison(self) -> None:
        self.out.fill_(float("nan"))
        if self.lse is not None:
            self.lse.fill_(float("nan"))


@dataclass
class RaggedInputs:
    """Metadata (host), packed q, k and v (on the device) and the poisoned outputs of a ragged case."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    extras: dict[str, Any] = field(default_factory=dict)
    mask_kwargs: dict[str, Any] = field(default_factory=dict)  # none: ragged-KV prefill has no custom mask

    def plan_args(self, op: str) -> tuple[torch.Tensor, ...]:
        del op
        return (self.qo_indptr, self.kv_indptr)

    def empty_plan_args(self, op: str) -> tuple[torch.Tensor, ...]:
        """`plan_args` of an empty batch: the same requests and keys with no query row."""
        del op
        return (torch.zeros_like(self.qo_indptr), self.kv_indptr)

    def run_args(self) -> tuple[Any, ...]:
        return (self.q, self.k, self.v)

    def out_of_bounds(self) -> tuple[RaggedInputs, str]:
        """These inputs with a ``k`` one row short of ``kv_indptr[-1]`` (a kernel would read past
        its end), which ``run()`` must refuse, and the argument its error names."""
        return replace(self, k=self.k[:-1]), "'k'"

    def refill(self, case: RaggedCase, generator: torch.Generator) -> None:
        """New random q, k and v (same metadata), poisoned outputs again."""
        for t, dtype in ((self.q, case.q_dtype), (self.k, case.kv_dtype), (self.v, case.kv_dtype)):
            t.copy_(_randn(t.shape, generator).to(t.device, to_torch_dtype(dtype)))
        self.poison()

    def poison(self) -> None:
        self.out.fill_(float("nan"))
        if self.lse is not None:
            self.lse.fill_(float("nan"))


def _randn(shape: Iterable[int], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator)


def _poison_outside(cache: torch.Tensor, outside: torch.Tensor, layout: str, stale: Stale,
                    dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``cache`` (float32) with the slots no request owns set as ``stale`` says, in values
    ``dtype`` holds: ``OUTSIDE``, or the largest finite value of a narrower format (e4m3's 448:
    a conversion that overflows may give NaN on a GPU, and large means finite)."""
    mask = outside.view(outside.shape[0], *page_shape(layout, outside.shape[1], 1, 1))
    if stale == "nan":
        return torch.where(mask, float("nan"), cache)
    magnitude = math.inf if stale == "inf" else min(OUTSIDE, torch.finfo(dtype).max)
    signs = torch.where(cache >= 0, magnitude, -magnitude)
    return torch.where(mask, signs, cache)


def build_attention_inputs(case: AttentionCase, device: torch.device) -> AttentionInputs:
    gen = torch.Generator().manual_seed(case.seed)
    page = case.page_size
    pages_per = [-(-n // page) for n in case.kv_lens]
    spare = max(3, sum(pages_per) // 4)
    total = sum(pages_per) + spare
    order = torch.randperm(total, generator=gen).tolist()
    indptr, indices = [0], []
    outside = torch.ones(total, page, dtype=torch.bool)
    for n, count in zip(case.kv_lens, pages_per, strict=True):
        mine = [order.pop() for _ in range(count)]
        for i, p in enumerate(mine):
            used = min(page, n - i * page)
            outside[p, :used] = False
        indices += mine
        indptr.append(len(indices))
    last = [(n - 1) % page + 1 for n in case.kv_lens]
    qo = [0]
    for n in case.q_lens:
        qo.append(qo[-1] + n)

    hkv = case.num_kv_heads
    shape_k = (total, *page_shape(case.kv_layout, page, hkv, case.head_dim_qk))
    shape_v = (total, *page_shape(case.kv_layout, page, hkv, case.head_dim_vo))
    dtype_q, dtype_kv = to_torch_dtype(case.q_dtype), to_torch_dtype(case.kv_dtype)
    k = _poison_outside(_randn(shape_k, gen), outside, case.kv_layout, case.stale, dtype_kv).to(device, dtype_kv)
    v = _poison_outside(_randn(shape_v, gen), outside, case.kv_layout, case.stale, dtype_kv).to(device, dtype_kv)
    if case.cache_form == "tensor":
        cache: Any = torch.stack([k, v], dim=1)
        k, v = cache[:, 0], cache[:, 1]
    else:
        cache = (k, v)
    rows = qo[-1]
    q = _randn((rows, case.num_qo_heads, case.head_dim_qk), gen).to(device, dtype_q)
    if case.q_form == "strided":  # q as a slice of a fused [rows, (hq + 2 hkv) * d] projection
        q = _view_of_fused(q, (case.num_qo_heads + 2 * hkv) * case.head_dim_qk)
    out, lse = _outputs(case, rows, device)
    extras = _run_extra_values(case, device)
    mask, mask_kwargs = None, {}
    if case.mask:
        parts = [_mask(case.mask, q_len, kv_len, gen) for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)]
        mask = torch.cat([m.reshape(-1) for m in parts])
        if case.mask_form == "packed":
            mask_kwargs = {"packed_custom_mask": torch.cat([_packbits(m.reshape(-1)) for m in parts]).to(device)}
        else:
            mask_kwargs = {"custom_mask": mask.to(device)}
    at = device if case.index_form == "device" else torch.device("cpu")
    qo_t, indptr_t, indices_t, last_t = (_i32(x).to(at) for x in (qo, indptr, indices, last))
    return AttentionInputs(qo_t, indptr_t, indices_t, last_t, q, k, v, cache, out, lse, outside, extras, mask,
                           mask_kwargs)  # fmt: skip


def _view_of_fused(t: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """A copy of ``t`` ``[rows, heads, dim]`` that is a strided view: columns ``offset:`` of a
    ``[rows, width]`` buffer (a fused projection's output, the rest of which is zeros)."""
    rows, heads, dim = t.shape
    fused = torch.zeros(rows, width, device=t.device, dtype=t.dtype)
    view = fused[:, offset : offset + heads * dim].view(rows, heads, dim)
    view.copy_(t)
    return view


def build_ragged_inputs(case: RaggedCase, device: torch.device) -> RaggedInputs:
    """Packed q, k and v of a ragged case (with ``q_form="strided"``: each a strided view into a
    wider buffer, as the outputs of fused projections are), NaN-filled outputs."""
    gen = torch.Generator().manual_seed(case.seed)
    qo, kv = [0], [0]
    for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True):
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + kv_len)
    hq, hkv, dqk, dvo = case.num_qo_heads, case.num_kv_heads, case.head_dim_qk, case.head_dim_vo
    dtype_q, dtype_kv = to_torch_dtype(case.q_dtype), to_torch_dtype(case.kv_dtype)
    q = _randn((qo[-1], hq, dqk), gen).to(device, dtype_q)
    k = _randn((kv[-1], hkv, dqk), gen).to(device, dtype_kv)
    v = _randn((kv[-1], hkv, dvo), gen).to(device, dtype_kv)
    if case.q_form == "strided":
        q = _view_of_fused(q, (hq + 2 * hkv) * dqk)
        k = _view_of_fused(k, hkv * (dqk + dvo))
        v = _view_of_fused(v, hkv * (dqk + dvo), offset=hkv * dqk)
    out, lse = _outputs(case, qo[-1], device)
    return RaggedInputs(_i32(qo), _i32(kv), q, k, v, out, lse, _run_extra_values(case, device))


def _mask(kind: str, q_len: int, kv_len: int, gen: torch.Generator) -> torch.Tensor:
    """A ``q_len x kv_len`` custom mask: ``tree``, the new tokens as a random tree over the cached
    prefix (each attends the prefix, itself and its ancestors: tree attention for speculative
    decoding); ``random``, half the pairs, with the first row attending no key."""
    if kind == "random":
        mask = torch.rand(q_len, kv_len, generator=gen) < 0.5
        if q_len:
            mask[0] = False
        return mask
    prefix = kv_len - q_len
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(q_len):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        if parent >= 0:
            mask[i, prefix:] = mask[parent, prefix:]
        mask[i, prefix + i] = True
    return mask


def _packbits(bits: torch.Tensor) -> torch.Tensor:
    """``bits`` (bool, 1-D) packed little-endian into bytes, the last one zero-padded."""
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits.to(torch.uint8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unique(cases: list[_C], first_seed: int) -> list[_C]:
    """``cases`` without repeated ids, each seeded by its place in the list (so adding a case at the
    end leaves the others' inputs as they were)."""
    seen: set[str] = set()
    unique = []
    for index, case in enumerate(cases):
        if case.id not in seen:
            seen.add(case.id)
            unique.append(replace(case, seed=first_seed + index))
    return unique


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _values(declared: Iterable[Any] | None, standard: Iterable[Any]) -> list[Any]:
    merged = set(standard) | set(declared or ())
    return sorted(merged, key=lambda x: (str(type(x)), x))


def _ragged(op: str) -> bool:
    problem = OPS[op].problem
    assert issubclass(problem, AttentionProblem), f"{op} is not a paged-attention op"
    return problem.ragged_queries


def _base(op: str, caps: AttentionCapabilities) -> AttentionCase:
    dtype = "bfloat16" if "bfloat16" in caps.q_dtypes else sorted(caps.q_dtypes)[0]
    kv = dtype if dtype in caps.kv_dtypes else sorted(caps.kv_dtypes)[0]
    out = dtype if dtype in caps.out_dtypes else sorted(caps.out_dtypes)[0]
    head = 128 if caps.head_dims is None or 128 in caps.head_dims else sorted(caps.head_dims)[0]
    page = 16 if caps.page_sizes is None or 16 in caps.page_sizes else sorted(caps.page_sizes)[0]
    layout: Literal["NHD", "HND"] = "HND" if "HND" in caps.kv_layouts else "NHD"
    if _ragged(op):
        return AttentionCase(
            op,
            dtype,
            kv,
            out,
            head_dim_qk=head,
            head_dim_vo=head,
            page_size=page,
            kv_layout=layout,
            causal=True,
            kv_lens=(37, 100, 16, 300),
            q_lens=(37, 100, 16, 300),
        )
    return AttentionCase(op, dtype, kv, out, head_dim_qk=head, head_dim_vo=head, page_size=page, kv_layout=layout)


def _batches(op: str, page: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Named batch shapes: name -> (kv lengths, q lengths)."""
    edge_kv = tuple(sorted({1, max(page - 1, 1), page, page + 1, 2 * page, 3 * page + 1}))
    if not _ragged(op):
        return {
            "edge": (edge_kv, (1,) * len(edge_kv)),
            "long": ((32768, 5), (1, 1)),
            "one": ((513,), (1,)),
            "large": (tuple(16 + 9 * i for i in range(64)), (1,) * 64),
        }
    q_pattern = (1, max(page - 1, 1), page, page + 1, 2, 1)
    edge_q = tuple(min(n, q_pattern[i % len(q_pattern)]) for i, n in enumerate(edge_kv))
    return {
        # q length 1, page - 1, page and page + 1 over kv lengths at the edges of a page
        "edge": (edge_kv, edge_q),
        "long": ((32768,), (64,)),
        "one": ((700,), (700,)),
        "large": (tuple(16 + 9 * i for i in range(24)), tuple(16 + 9 * i for i in range(24))),
    }


def attention_cases(op: str, caps: AttentionCapabilities) -> list[AttentionCase]:
    """The cases for ``op`` (one factor at a time from the base case, plus combinations that matter)."""
    base = _base(op, caps)
    cases: list[AttentionCase] = [base]

    def add(**changes: Any) -> None:
        cases.append(replace(base, **changes))

    for dtype in _values(caps.q_dtypes, _STANDARD_DTYPES):
        if dtype != base.q_dtype:
            add(q_dtype=dtype, kv_dtype=dtype, out_dtype="bfloat16" if dtype.startswith("float8") else dtype)
    for out in sorted(caps.out_dtypes - {base.out_dtype}):
        add(out_dtype=out)
    for head in _values(caps.head_dims, _STANDARD_HEAD_DIMS):
        if head != base.head_dim_qk:
            add(head_dim_qk=head, head_dim_vo=head)
    add(head_dim_qk=base.head_dim_qk, head_dim_vo=base.head_dim_qk // 2)
    for page in _values(caps.page_sizes, _STANDARD_PAGE_SIZES):
        if page != base.page_size:
            edge_kv, edge_q = _batches(op, page)["edge"]
            add(page_size=page, batch="edge", kv_lens=edge_kv, q_lens=edge_q)
    other_layout: Literal["NHD", "HND"] = "NHD" if base.kv_layout == "HND" else "HND"
    add(kv_layout=other_layout)
    add(cache_form="tensor")
    add(kv_layout=other_layout, cache_form="tensor")
    add(q_form="strided")
    for qo_heads, kv_heads in ((8, 8), (32, 4), (8, 1)):
        add(num_qo_heads=qo_heads, num_kv_heads=kv_heads)
    for name, (kv_lens, q_lens) in _batches(op, base.page_size).items():
        add(batch=name, kv_lens=kv_lens, q_lens=q_lens)
    # the batch's arrays on the device, as FlashInfer's callers pass them: a batch that is no
    # bucket size (padding rows past the last request) and one of more rows than a host lays out
    for name in ("edge", "large"):
        kv_lens, q_lens = _batches(op, base.page_size)[name]
        add(index_form="device", batch=name, kv_lens=kv_lens, q_lens=q_lens)
    if _ragged(op):
        add(causal=False)
        add(causal=False, batch="q-longer", kv_lens=(40, 8), q_lens=(64, 16))
        # causal with more rows than keys: each request's first rows come before its first key
        # (zeros, LSE -inf; AttentionCapabilities.keyless_rows)
        add(batch="q-longer", kv_lens=(40, 8), q_lens=(64, 16), return_lse=True)
        chunked_kv, chunked_q = (1061, 530, 48), (37, 530, 17)
        add(batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q)
        add(batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q, window_left=100)
        add(window_left=64)
        add(causal=False, window_left=64)
        # custom masks (tree attention over a cached prefix; random masks with a row that attends
        # no key), bool and bit-packed
        tree_kv, tree_q = (301, 130, 48), (37, 130, 17)  # drafts of 17-130 tokens over cached prefixes
        add(causal=False, mask="tree", batch="chunked", kv_lens=tree_kv, q_lens=tree_q)
        add(causal=False, mask="tree", mask_form="packed", batch="chunked", kv_lens=tree_kv, q_lens=tree_q,
            return_lse=True)  # fmt: skip
        add(causal=False, mask="random", return_lse=True)
        add(causal=False, mask="random", mask_form="packed", window_left=64, stale="nan")
    else:
        add(window_left=64)
        # multi-token decode (speculative decoding's verify step): N rows per request, causal among
        # them; GQA groups of 8 with 3 rows, the LSE, a window, NaN in unowned slots, an fp8 cache
        rows = {n: (n,) * len(base.kv_lens) for n in (2, 3, 4)}
        add(q_lens=rows[4])
        add(q_lens=rows[2], return_lse=True, kv_layout=other_layout)
        add(q_lens=rows[3], num_qo_heads=32, num_kv_heads=4, window_left=64)
        add(q_lens=rows[4], stale="nan", logits_soft_cap=30.0)
        add(q_lens=rows[4], kv_dtype=_STANDARD_FP8_KV[0], k_scale=0.5, v_scale=2.0)
    add(logits_soft_cap=30.0)
    add(return_lse=True)
    add(return_lse=True, logits_soft_cap=30.0, kv_layout=other_layout)
    # NaN and infinities in the slots no request owns: page tails (the base batch's last pages
    # are partial) and pages no request references
    edge_kv, edge_q = _batches(op, base.page_size)["edge"]
    for stale in ("nan", "inf"):
        add(stale=stale)
        add(stale=stale, batch="edge", kv_lens=edge_kv, q_lens=edge_q)
        add(stale=stale, return_lse=True, kv_layout=other_layout)
        if _ragged(op):  # long non-causal requests with partial last pages of 32 slots
            add(stale=stale, causal=False, batch="2x3000", kv_lens=(3000, 3000), q_lens=(3000, 3000), page_size=32,
                num_qo_heads=4, num_kv_heads=1)  # fmt: skip
            add(stale=stale, batch="chunked", kv_lens=(1061, 530, 48), q_lens=(37, 530, 17))
    # dequantization scales (run extras), as floats and as device tensors, with the LSE (which
    # k_scale changes and v_scale does not)
    add(k_scale=0.5, v_scale=2.0)
    add(k_scale=0.25, v_scale=0.5, scale_form="tensor", return_lse=True)
    # attention sinks (a logit per head joining the softmax; the LSE includes it), with a window,
    # a soft-cap, NaN in unowned slots, and (prefill) rows a custom mask leaves no key
    add(sinks=True)
    add(sinks=True, return_lse=True, window_left=64, kv_layout=other_layout)
    add(sinks=True, logits_soft_cap=30.0, stale="nan")
    if _ragged(op):
        add(sinks=True, causal=False, mask="random", return_lse=True)
        add(sinks=True, batch="chunked", kv_lens=(1061, 530, 48), q_lens=(37, 530, 17))
    else:
        add(sinks=True, q_lens=(2,) * len(base.kv_lens), return_lse=True)
    # quantized caches under 16-bit queries (fp8: the standard two and any other declared kv dtype),
    # with the scales that dequantize them; the large values in unowned slots stay finite (448 is
    # e4m3's largest)
    other_layout_edge = _batches(op, base.page_size)["edge"]
    for kv_dtype in sorted(set(_STANDARD_FP8_KV) | (caps.kv_dtypes - set(_STANDARD_DTYPES))):
        add(kv_dtype=kv_dtype)
        add(kv_dtype=kv_dtype, k_scale=0.5, v_scale=2.0, return_lse=True)
        if kv_dtype == _STANDARD_FP8_KV[0]:
            add(kv_dtype=kv_dtype, k_scale=0.25, v_scale=0.5, scale_form="tensor", kv_layout=other_layout,
                cache_form="tensor")  # fmt: skip
            add(kv_dtype=kv_dtype, q_dtype="float16", out_dtype="float16")
            add(kv_dtype=kv_dtype, batch="edge", kv_lens=other_layout_edge[0], q_lens=other_layout_edge[1])
            add(kv_dtype=kv_dtype, stale="nan")
            if _ragged(op):
                add(kv_dtype=kv_dtype, batch="chunked", kv_lens=(1061, 530, 48), q_lens=(37, 530, 17))
    return _unique(cases, first_seed=1000 * _ragged(op))


def _ragged_base(op: str, caps: AttentionCapabilitiesBase) -> RaggedCase:
    dtype = "bfloat16" if "bfloat16" in caps.q_dtypes else sorted(caps.q_dtypes)[0]
    kv = dtype if dtype in caps.kv_dtypes else sorted(caps.kv_dtypes)[0]
    out = dtype if dtype in caps.out_dtypes else sorted(caps.out_dtypes)[0]
    head = 128 if caps.head_dims is None or 128 in caps.head_dims else sorted(caps.head_dims)[0]
    # a chunk's new tokens attending themselves: as many keys as query rows, causal; GQA 4 with
    # fewer heads than the paged base, so that the whole family costs CPUs a few seconds
    lens = (37, 100, 16, 130)
    return RaggedCase(op, dtype, kv, out, num_qo_heads=8, num_kv_heads=2, head_dim_qk=head,
                      head_dim_vo=head, causal=True, kv_lens=lens, q_lens=lens)  # fmt: skip


def ragged_cases(op: str, caps: AttentionCapabilitiesBase) -> list[RaggedCase]:
    """The cases of ragged-KV prefill: one factor at a time from a causal bf16 base of a chunk's new
    tokens, kept small (the kit runs them on CPUs too), over the declared and the standard values."""
    base = _ragged_base(op, caps)
    cases: list[RaggedCase] = [base]

    def add(**changes: Any) -> None:
        cases.append(replace(base, **changes))

    for dtype in _values(caps.q_dtypes, _STANDARD_DTYPES):
        if dtype != base.q_dtype and not dtype.startswith("float8"):
            add(q_dtype=dtype, kv_dtype=dtype, out_dtype=dtype)
    for head in _values(caps.head_dims, (64, 128)):
        if head != base.head_dim_qk:
            add(head_dim_qk=head, head_dim_vo=head)
    add(head_dim_qk=192, head_dim_vo=128)  # MLA's expanded prefill
    for qo_heads, kv_heads in ((4, 4), (16, 2)):
        add(num_qo_heads=qo_heads, num_kv_heads=kv_heads)
    add(causal=False)
    add(causal=False, batch="q-longer", kv_lens=(40, 8), q_lens=(64, 16))
    add(batch="q-longer", kv_lens=(40, 8), q_lens=(64, 16), return_lse=True)  # causal: rows before the first key
    # chunked prefill (MLA: the whole prefix expanded), requests with no query row (one with keys,
    # one with none), edges of the lengths, many short requests, a long prefix
    chunked_kv, chunked_q = (301, 130, 48), (37, 130, 17)
    add(batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q)
    add(batch="empty-requests", kv_lens=(37, 0, 16, 5), q_lens=(37, 0, 16, 0))
    add(batch="edge", kv_lens=(1, 2, 15, 16, 17, 33), q_lens=(1, 1, 15, 3, 17, 1))
    add(batch="many", kv_lens=tuple(16 + 9 * i for i in range(32)), q_lens=tuple(1 + i % 4 for i in range(32)))
    add(batch="long", kv_lens=(8192,), q_lens=(64,), num_kv_heads=1)
    add(window_left=64)
    add(batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q, window_left=100)
    add(causal=False, window_left=64)
    add(logits_soft_cap=30.0)
    add(return_lse=True)
    add(return_lse=True, logits_soft_cap=30.0, batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q)
    add(q_form="strided")
    add(q_form="strided", head_dim_qk=192, head_dim_vo=128, batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q)
    # dequantization scales, as floats and as device tensors, and an fp8 k and v they dequantize
    add(k_scale=0.5, v_scale=2.0, return_lse=True)
    add(k_scale=0.25, v_scale=0.5, scale_form="tensor")
    add(kv_dtype=_STANDARD_FP8_KV[0], k_scale=0.5, v_scale=2.0)
    add(sinks=True, return_lse=True)
    add(sinks=True, batch="chunked", kv_lens=chunked_kv, q_lens=chunked_q, window_left=100)
    return _unique(cases, first_seed=3000)


# --------------------------------------------------------------------------------------------
# GEMM


@dataclass(frozen=True)
class GemmCase:
    a_dtype: str
    b_dtype: str
    out_dtype: str
    m: int = 64
    n: int = 256
    k: int = 128
    batch: int | None = None
    a_k_major: bool = True
    b_k_major: bool = True
    bias: bool = False
    stale: bool = False  # operands inside larger buffers that hold NaN before and after them
    label: str = ""
    seed: int = 0

    op: ClassVar[str] = GemmProblem.op

    @property
    def fp8(self) -> bool:
        return self.a_dtype.startswith("float8")

    @property
    def id(self) -> str:
        dtype = SHORT_NAMES[self.a_dtype] + ("" if self.b_dtype == self.a_dtype else f"x{SHORT_NAMES[self.b_dtype]}")
        parts = [f"{dtype}->{SHORT_NAMES[self.out_dtype]}", f"m{self.m}n{self.n}k{self.k}",
                 ("A-k" if self.a_k_major else "A-m") + ("B-k" if self.b_k_major else "B-n")]  # fmt: skip
        if self.batch is not None:
            parts.append(f"batch{self.batch}")
        if self.bias:
            parts.append("bias")
        if self.stale:
            parts.append("stale-nan")
        return f"gemm[{'-'.join(parts)}]"

    def features(self) -> list[str]:
        tags = [f"dtype {SHORT_NAMES[self.a_dtype]}->{SHORT_NAMES[self.out_dtype]}"]
        tags.append("A " + ("k-major" if self.a_k_major else "m-major"))
        tags.append("B " + ("k-major" if self.b_k_major else "n-major"))
        tags.append("m = 1" if self.m == 1 else ("m <= 64" if self.m <= 64 else "m > 64"))
        if self.n % 16 or self.k % 16:
            tags.append("odd n/k")
        if self.batch is not None:
            tags.append("batched")
        if self.bias:
            tags.append("bias")
        if self.fp8:
            tags.append("fp8 per-tensor scales")
        if self.stale:
            tags.append("NaN around the operands")
        return tags


@dataclass
class GemmInputs:
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    scale_a: torch.Tensor | None
    scale_b: torch.Tensor | None
    out: torch.Tensor

    def run_kwargs(self) -> dict[str, Any]:
        return dict(bias=self.bias, scale_a=self.scale_a, scale_b=self.scale_b)


def _operand(
    rows: int,
    cols: int,
    lead: tuple[int, ...],
    contiguous_in_cols: bool,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    scale: float,
    stale: bool = False,
) -> torch.Tensor:
    """A logical ``[*lead, rows, cols]`` operand stored dense along cols (or along rows); with
    ``stale``, in the middle of a buffer whose other elements are NaN."""
    shape = (*lead, rows, cols) if contiguous_in_cols else (*lead, cols, rows)
    data = (_randn(shape, gen) * scale).to(device).to(dtype)
    if stale:
        pad = 256  # elements: keeps the operand's start 16-byte aligned for every dtype
        buffer = torch.full((pad + data.numel() + pad,), float("nan"), device=device).to(dtype)
        buffer[pad : pad + data.numel()].copy_(data.reshape(-1))
        data = buffer[pad : pad + data.numel()].view(shape)
    return data if contiguous_in_cols else data.transpose(-1, -2)


def build_gemm_inputs(case: GemmCase, device: torch.device) -> GemmInputs:
    gen = torch.Generator().manual_seed(case.seed)
    lead = () if case.batch is None else (case.batch,)
    a_dtype, b_dtype, out_dtype = (to_torch_dtype(case.a_dtype), to_torch_dtype(case.b_dtype),
                                   to_torch_dtype(case.out_dtype))  # fmt: skip
    a = _operand(case.m, case.k, lead, case.a_k_major, a_dtype, device, gen, 1.0, case.stale)
    # b is [k, n]: k-major means dense along k, i.e. along rows of the logical [k, n]
    b = _operand(case.k, case.n, lead, not case.b_k_major, b_dtype, device, gen, 1.0 / math.sqrt(case.k),
                 case.stale)  # fmt: skip
    bias = _randn((case.n,), gen).to(device, out_dtype) if case.bias else None
    scale_a = torch.tensor(0.75, device=device) if case.fp8 else None
    scale_b = torch.tensor(1.5, device=device) if case.fp8 else None
    out = torch.full((*lead, case.m, case.n), float("nan"), device=device, dtype=out_dtype)
    return GemmInputs(a, b, bias, scale_a, scale_b, out)


def gemm_cases(op: str, caps: GemmCapabilities) -> list[GemmCase]:
    """The cases of a GEMM op (``op`` names it, as for `attention_cases`)."""
    del op
    combos = set(caps.dtypes) | {GemmDTypes(a=t, b=t, out=t) for t in _STANDARD_DTYPES}
    combos.add(GemmDTypes(a="float8_e4m3fn", b="float8_e4m3fn", out="bfloat16", scale_mode="per_tensor"))
    cases: list[GemmCase] = []
    for combo in sorted(combos, key=str):
        base = GemmCase(combo.a, combo.b, combo.out)
        cases.append(base)
        if combo.a == combo.b == combo.out == "bfloat16" or (combo.a.startswith("float8") and combo.out == "bfloat16"):
            # the full set of shapes and layouts for the main 16-bit and fp8 combinations
            for m in (1, 16, 127):
                cases.append(replace(base, m=m))
            cases.append(replace(base, m=5, n=33, k=17, label="odd"))
            cases.append(replace(base, m=256, n=512, k=384))
            cases.append(replace(base, a_k_major=False))
            cases.append(replace(base, b_k_major=False))
            cases.append(replace(base, a_k_major=False, b_k_major=False, m=1))
            cases.append(replace(base, bias=True))
            cases.append(replace(base, batch=3))
            cases.append(replace(base, batch=2, bias=True, b_k_major=False))
        else:
            cases.append(replace(base, m=1, bias=True))
            cases.append(replace(base, b_k_major=False))
        if combo.a == combo.b == combo.out == "bfloat16" or combo.a.startswith("float8"):
            # NaN right before and after each operand: tiles that overhang an odd shape or an
            # operand's end must not read it
            cases.append(replace(base, m=5, n=33, k=17, label="odd", stale=True))
            cases.append(replace(base, m=127, stale=True))
            cases.append(replace(base, a_k_major=False, b_k_major=False, m=1, stale=True))
    return _unique(cases, first_seed=2000)


# -- merging attention states (`tactix.ops.merge_states`) ---------------------------------------


@dataclass(frozen=True)
class MergeCase:
    """States to merge: ``num_states`` outputs ``[rows, heads, head_dim]`` in ``v_dtype`` with their
    float32 LSEs. ``empty``: some states are over no key (LSE -inf), one row's states all are;
    ``form``: ``"separate"`` tensors (merge_state's), ``"stacked"`` views of one ``[rows, n, heads,
    dim]`` tensor (merge_states'), ``"in_place"`` (the first state's tensors are the outputs,
    ``masked``: only the rows of a mask are merged)."""

    v_dtype: str
    num_states: int = 2
    rows: int = 37
    heads: int = 8
    head_dim: int = 128
    form: Literal["separate", "stacked", "in_place"] = "separate"
    empty: bool = False
    masked: bool = False
    seed: int = 0

    op: ClassVar[str] = "merge_states"

    @property
    def id(self) -> str:
        parts = [SHORT_NAMES[self.v_dtype], f"n{self.num_states}", f"r{self.rows}", f"h{self.heads}",
                 f"d{self.head_dim}", self.form]  # fmt: skip
        if self.empty:
            parts.append("empty")
        if self.masked:
            parts.append("masked")
        return "merge_states[" + "-".join(parts) + "]"

    def features(self) -> list[str]:
        """Tags for the support matrix."""
        form = {"separate": "separate states", "stacked": "stacked states", "in_place": "in place"}[self.form]
        tags = [f"dtype {SHORT_NAMES[self.v_dtype]}", f"head dim {self.head_dim}", f"{self.num_states} states", form]
        if self.empty:
            tags.append("empty states")
        if self.masked:
            tags.append("masked rows")
        return tags


@dataclass
class MergeInputs:
    vs: tuple[torch.Tensor, ...]
    ss: tuple[torch.Tensor, ...]
    mask: torch.Tensor | None


def build_merge_inputs(case: MergeCase, device: torch.device) -> MergeInputs:
    """The case's states on ``device`` (drawn on the CPU from its seed), LSEs spread over a few
    units so that every state weighs in; stacked cases are views of one tensor."""
    gen = torch.Generator().manual_seed(case.seed)
    n, shape = case.num_states, (case.rows, case.heads, case.head_dim)
    dtype = to_torch_dtype(case.v_dtype)
    v = torch.randn(case.rows, n, case.heads, case.head_dim, generator=gen)
    s = torch.randn(case.rows, n, case.heads, generator=gen) * 3
    if case.empty:
        s[:, 0, : case.heads // 2] = float("-inf")  # the first state is over no key for half the heads
        s[min(3, case.rows - 1)] = float("-inf")  # and one row has no key in any state
    v, s = v.to(device, dtype), s.to(device)
    if case.form == "stacked":
        return MergeInputs(tuple(v[:, i] for i in range(n)), tuple(s[:, i] for i in range(n)), None)
    vs = tuple(v[:, i].contiguous() for i in range(n))
    ss = tuple(s[:, i].contiguous() for i in range(n))
    mask = None
    if case.masked:
        mask = (torch.rand(case.rows, generator=gen) < 0.6).to(device)
    assert all(t.shape == shape for t in vs)
    return MergeInputs(vs, ss, mask)


def merge_cases(op: str, caps: Any) -> list[MergeCase]:
    """The cases of the state-merge op: every declared v dtype, two to five states, separate,
    stacked and in-place forms, empty states, masks, small and large head dims and a single row."""
    del op
    cases: list[MergeCase] = []
    for dtype in sorted(set(caps.v_dtypes) | set(_STANDARD_DTYPES)):
        base = MergeCase(dtype)
        cases += [base, replace(base, empty=True), replace(base, form="stacked", num_states=3),
                  replace(base, form="in_place"), replace(base, form="in_place", masked=True, empty=True)]  # fmt: skip
    bf16 = MergeCase("bfloat16")
    cases += [replace(bf16, head_dim=64, heads=32), replace(bf16, head_dim=256, rows=5),
              replace(bf16, head_dim=512, rows=3, heads=2), replace(bf16, rows=1),
              replace(bf16, form="stacked", num_states=5, empty=True), replace(bf16, rows=1000, heads=4)]  # fmt: skip
    return _unique(cases, first_seed=5000)
