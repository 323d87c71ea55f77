"""tactix hooks for the ``trtllm`` backend: TensorRT-LLM's attention kernels as flashinfer-python
ships them, on Hopper (SM90) — XQA for decode, FMHAv2 for prefill.

Tactics: decode ``Tactic(backend="trtllm", kernel="xqa", params={"multi_block": "auto", "pdl": True})``
(``multi_block``: how far XQA may split each sequence across CTAs, ``off`` / ``auto`` (flashinfer's
own choice: fill the SMs once) / ``x2`` (fill them twice; SM90 runs two XQA CTAs per SM); ``pdl``:
programmatic dependent launch); prefill ``Tactic(backend="trtllm", kernel="fmha_v2")`` (FMHAv2
picks its kernel itself; flashinfer exposes no variant knob). The default tactic is the library's
own choice.

``plan()`` turns the CSR metadata into block tables, kv lengths and cumulative lengths in one
device buffer; ``run()`` is one call of the compiled kernel's exported function (no host work
beyond reading a few cached attributes, no allocation once a cache has been seen), capturable in
a CUDA graph.

Determinism (established by reading flashinfer 0.7.2.post1's sources; the conformance kit's
run-twice check confirms it on the H200): XQA's multi-block mode splits a sequence over CTAs and
lets the last CTA to finish (elected with an atomic increment on a self-resetting semaphore)
merge the partial results, reading them in sub-sequence order, so the sum is always taken in the
same order (csrc/xqa/mha.cu, the ``isMultiBlock`` epilogue); the split count depends only on the
batch size, KV heads, table width and the tactic's SM budget, all fixed by the plan. FMHAv2's
multi-CTA reduction is disabled in flashinfer (``get_grid_size(..., false, ...)`` in
csrc/fmha_v2_run.cu) and its dynamic tile scheduler only changes which CTA computes a tile, not
how. No tactic is refused for ``deterministic=True``.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

import tactix
from tactix import (
    DecodeProblem,
    GemmProblem,
    InvalidArgumentError,
    PagedBatch,
    PlanOptions,
    PrefillProblem,
    Problem,
    Tactic,
    UnsupportedProblemError,
)
from tactix.plugin import (
    STALE_SLOTS,
    ReferenceCall,
    Sections,
    Staging,
    compute_capability,
    cuda_available,
    from_static,
    keep_static,
    stale_slot_failures,
)
from tactix_trtllm import __version__
from tactix_trtllm.library import ARCHES, FmhaKey, ModuleKey, XqaKey, compile_ahead, load, status, target
from tactix_trtllm.metadata import (
    Geometry,
    PoolMapping,
    expand_offsets,
    gather_offsets,
    geometry,
    metadata_entries,
    metadata_sections,
    pool_mapping,
    refit_reasons,
    table_on_host,
    write_metadata,
    xqa_cache_reasons,
)

log = logging.getLogger("tactix_trtllm")

NAME: Final = "trtllm"
DTYPES: Final = frozenset({"float16", "bfloat16"})
FP8_CACHE: Final = "float8_e4m3fn"
"""The fp8 cache format XQA serves (flashinfer 0.7.2's jit/xqa.py compiles e4m3 only; an e5m2
cache would be read as a 16-bit one)."""
FP8_PREFILL_UNSUPPORTED: Final = (
    "FMHAv2 (flashinfer 0.7.2) takes one dtype for q, k and v: its fp8 kernels need fp8 queries "
    "(gen_fmha_v2_module(input_dtype=e4m3)) and host-float scales, so a 16-bit q over an fp8 cache is not served"
)
HEAD_DIMS: Final = frozenset({64, 128, 256})
"""Head dims claimed (and so tested by the conformance kit). XQA compiles any multiple of 16 up to
512 and FMHAv2 has SM90 kernels for `FMHA_HEAD_DIMS`; the others are not tested here."""
FMHA_HEAD_DIMS: Final = (32, 40, 48, 64, 80, 96, 104, 128, 160, 192, 256)
"""Head dims flashinfer generates SM90 FMHAv2 kernels for (jit/attention/fmha_v2/fmha_library.py)."""
PAGE_SIZES: Final = frozenset({16, 32, 64, 128})
"""XQA is compiled for exactly these (flashinfer/jit/xqa.py); FMHAv2 takes any power of two, and
the same set is claimed for it."""
MAX_GROUP_SIZE: Final = 8
"""Largest GQA ratio claimed (tested): XQA compiles one module per ratio."""
MULTI_BLOCK: Final = ("off", "auto", "x2")

SERVED_CAPABILITY: Final = (9, 0)
UNTESTED_PATHS: Final[dict[int, str]] = {
    10: "SM100 trtllm-gen path: not tested on this project's hardware (flashinfer serves compute "
    "capability 10.x through trtllm-gen cubins; this plugin claims SM90 XQA/FMHAv2 only)",
    12: "SM120 XQA/FMHAv2 builds: not tested on this project's hardware (H200, SM90)",
}
"""Paths flashinfer has but this plugin does not claim: refused with these reasons, so a
conformance run on such a GPU reports skips that say so instead of claiming them."""
UNTESTED_DECLARED: Final[dict[str, str]] = {
    "compute capability 10.x (trtllm-gen decode and prefill cubins)": UNTESTED_PATHS[10],
    "compute capability 12.x (XQA/FMHAv2 builds)": UNTESTED_PATHS[12],
}
"""The same paths as declared in the backend's spec (`BackendSpec.untested`): the support matrix
lists them as declared but not tested."""

GEMM_UNSUPPORTED: Final = (
    "no TensorRT-LLM GEMM for SM90 is reachable through flashinfer-python 0.7.2.post1 that computes "
    "tactix's GEMM: fp8_blockscale_gemm_sm90 quantises bf16 operands to fp8 internally and takes block "
    "scales, not per-tensor ones; trtllm-gen GEMMs (mm_fp4, tgv_gemm_sm100, trtllm_gemm_runner) need SM100"
)


def _attention_capabilities(prefill: bool) -> tactix.AttentionCapabilities:
    return tactix.AttentionCapabilities(
        devices=frozenset({"cuda"}),
        compute_capabilities=frozenset({"9.0"}),
        q_dtypes=DTYPES,
        kv_dtypes=DTYPES if prefill else DTYPES | {FP8_CACHE},
        # XQA reads the scales on the device (one for K and V: k_scale joins the q scale) and takes
        # attention sinks ([kv heads, group] float32: tactix's [qo heads] as they lie)
        run_extras=frozenset() if prefill else frozenset({"k_scale", "v_scale", "sinks"}),
        out_dtypes=DTYPES,
        head_dims=HEAD_DIMS,
        page_sizes=PAGE_SIZES,
        kv_layouts=frozenset({"NHD", "HND"}),
        max_gqa_ratio=MAX_GROUP_SIZE,
        causal=True,
        non_causal=True,
        chunked=prefill,
        sliding_window=True,
        logits_soft_cap=prefill,  # FMHAv2 has one; XQA has none
        lse=False,  # XQA returns none; FMHAv2 only for contiguous (not paged) K/V
        cuda_graph="fixed_buffers",
    )


@tactix.hookimpl
def tactix_backends() -> list[tactix.BackendSpec]:
    return [
        tactix.BackendSpec(
            name=NAME,
            version=__version__,
            description="TensorRT-LLM attention kernels via flashinfer-python: XQA decode and FMHAv2 prefill "
            "on SM90; trtllm-gen (SM100) not claimed: untested here",
            prefill=_attention_capabilities(prefill=True),
            decode=_attention_capabilities(prefill=False),
            gemm=None,
            preference=0,  # no default position: tuning decides where it wins
            untested=UNTESTED_DECLARED,
        )
    ]


@tactix.hookimpl
def tactix_environment() -> list[str] | None:
    reasons = []
    if not cuda_available():
        reasons.append("no CUDA GPU is visible")
    st = status()
    if not st.usable:
        reasons.append(st.error or "flashinfer-python is not usable")
    return reasons


def _capability() -> tuple[int, int] | None:
    """The current GPU's compute capability (None without a GPU: the environment already says
    why nothing runs)."""
    return compute_capability()


def capability_reasons(capability: tuple[int, int] | None) -> list[str]:
    """Why the GPU of ``capability`` is not served (empty: it is, or there is no GPU to ask)."""
    if capability is None or capability == SERVED_CAPABILITY:
        return []
    major, minor = capability
    untested = UNTESTED_PATHS.get(major)
    if untested is not None:
        return [f"compute capability {major}.{minor}: {untested}"]
    if major > SERVED_CAPABILITY[0]:
        return [f"compute capability {major}.{minor}: flashinfer's XQA/FMHAv2 builds for it are not tested on "
                "this project's hardware (H200, SM90)"]  # fmt: skip
    return [f"compute capability {major}.{minor}: XQA and FMHAv2 need SM90 (Hopper); flashinfer builds no "
            "FMHAv2 kernels below it and XQA refuses it"]  # fmt: skip


# -- tactics -----------------------------------------------------------------------------------


def xqa_tactic(multi_block: str = "auto", pdl: bool = True, fp8_mma: bool | None = None) -> Tactic:
    """An XQA tactic; ``fp8_mma`` (fp8 caches only) picks flashinfer's Hopper fp8 kernel
    (mha_sm90.cu: q and P rounded to e4m3 for fp8 tensor cores) over the one that widens the
    cache to 16 bits (mha.cu, the default: q and P stay 16-bit)."""
    params: dict[str, object] = {"multi_block": multi_block, "pdl": pdl}
    if fp8_mma is not None:
        params["fp8_mma"] = fp8_mma
    return Tactic(backend=NAME, kernel="xqa", params=params)


FMHA_TACTIC: Final = Tactic(backend=NAME, kernel="fmha_v2")


def params_reasons(tactic: Tactic, op: str) -> list[str]:
    """Why ``tactic`` is not a well-formed tactic of this backend for ``op`` (empty: it is)."""
    if tactic.is_default:
        return [] if not tactic.params else [f"the default tactic takes no params (got {tactic.params})"]
    own = "xqa" if op == "decode" else "fmha_v2"
    if tactic.kernel != own:
        if tactic.kernel in ("xqa", "fmha_v2"):
            return [f"kernel '{tactic.kernel}' is not this op's (this op's: default, {own})"]
        return [f"unknown kernel '{tactic.kernel}' (known: default, xqa, fmha_v2)"]
    if own == "fmha_v2":
        return [] if not tactic.params else [f"fmha_v2 takes no params (got {tactic.params})"]
    extra = set(tactic.params) - {"multi_block", "pdl", "fp8_mma"}
    if extra:
        return [f"unknown params {sorted(extra)} (xqa takes multi_block, pdl and, for fp8 caches, fp8_mma)"]
    out = []
    if tactic.params.get("multi_block") not in MULTI_BLOCK:
        out.append(f"params.multi_block must be one of {list(MULTI_BLOCK)} (got {tactic.params.get('multi_block')!r})")
    if not isinstance(tactic.params.get("pdl"), bool):
        out.append(f"params.pdl must be true or false (got {tactic.params.get('pdl')!r})")
    if "fp8_mma" in tactic.params and not isinstance(tactic.params["fp8_mma"], bool):
        out.append(f"params.fp8_mma must be true or false (got {tactic.params['fp8_mma']!r})")
    return out


# -- support check -----------------------------------------------------------------------------


def attention_reasons(
    problem: PrefillProblem | DecodeProblem, capability: tuple[int, int] | None, batch: PagedBatch | None = None
) -> list[str]:
    """Everything XQA / FMHAv2 (as flashinfer builds them) refuse about ``problem`` on ``capability``."""
    out = capability_reasons(capability)
    decode = isinstance(problem, DecodeProblem)
    kernel = "XQA" if decode else "FMHAv2"
    fp8 = problem.kv_dtype == FP8_CACHE
    if not decode and fp8:
        out.append(FP8_PREFILL_UNSUPPORTED)
    elif (problem.q_dtype not in DTYPES or problem.out_dtype != problem.q_dtype
          or (problem.kv_dtype != problem.q_dtype and not fp8)):  # fmt: skip
        out.append(f"{kernel} here takes q and out of one dtype, float16 or bfloat16, and a kv cache of that "
                   f"dtype{' or float8_e4m3fn' if decode else ''} (got q {problem.q_dtype}, kv {problem.kv_dtype}, "
                   f"out {problem.out_dtype})")  # fmt: skip
    if problem.head_dim_vo != problem.head_dim_qk:
        out.append(f"head_dim_vo must equal head_dim_qk ({kernel} is built with one head dim)")
    d = problem.head_dim_qk
    if problem.gqa_ratio > MAX_GROUP_SIZE:
        out.append(f"GQA ratio {problem.gqa_ratio} above {MAX_GROUP_SIZE} (larger {kernel} groups are not tested)")
    if problem.return_lse:
        out.append("XQA returns no LSE" if decode else
                   "FMHAv2 returns softmax statistics only for contiguous K/V, not for a paged cache")  # fmt: skip
    if decode:
        if problem.page_size not in PAGE_SIZES:
            out.append(f"page size {problem.page_size}: XQA is compiled for page sizes 16, 32, 64 and 128 only")
        if d % 16 or not 16 <= d <= 512:
            out.append(f"head dim {d}: XQA needs a multiple of 16 in [16, 512]")
        elif d not in HEAD_DIMS:
            out.append(f"head dim {d}: not tested with XQA here (served: {sorted(HEAD_DIMS)})")
        if problem.logits_soft_cap > 0:
            out.append("XQA has no logits soft-cap")
        return out
    assert isinstance(problem, PrefillProblem)
    page = problem.page_size
    if page & (page - 1):
        out.append(f"page size {page}: FMHAv2 needs a power of two (it splits pages into TMA loads)")
    elif page not in PAGE_SIZES:
        out.append(f"page size {page}: not tested with FMHAv2 here (served: {sorted(PAGE_SIZES)})")
    if d not in FMHA_HEAD_DIMS:
        out.append(f"head dim {d}: flashinfer builds SM90 FMHAv2 kernels for head dims {list(FMHA_HEAD_DIMS)} only")
    elif d not in HEAD_DIMS:
        out.append(f"head dim {d}: not tested with FMHAv2 here (served: {sorted(HEAD_DIMS)})")
    if problem.window_left >= 0 and not problem.causal:
        out.append("FMHAv2's sliding window is causal only")
    longer = (
        any(q > kv for q, kv in zip(batch.qo_lens_list, batch.kv_lens_list, strict=True))
        if batch is not None
        else problem.max_qo_len > problem.max_kv_len
    )
    if longer:
        out.append("FMHAv2 needs every request's kv length >= its query length (queries are the end of the sequence)")
    return out


@tactix.hookimpl
def tactix_check(problem: Problem, tactic: Tactic, batch: PagedBatch | None) -> list[str] | None:
    if isinstance(problem, GemmProblem):
        return [GEMM_UNSUPPORTED]
    out = params_reasons(tactic, problem.op) + attention_reasons(problem, _capability(), batch)
    if "fp8_mma" in tactic.params and problem.kv_dtype != FP8_CACHE:
        out.append("params.fp8_mma is for fp8 caches only")
    return out


@tactix.hookimpl
def tactix_tactics(problem: Problem) -> list[Tactic] | None:
    if isinstance(problem, GemmProblem) or tactix_environment() or attention_reasons(problem, _capability()):
        return []
    if isinstance(problem, DecodeProblem):
        # fp8_mma=true is not offered (tuning never picks it): it reads whole pages, so a NaN in a
        # cache slot no request owns reaches the output (measured on the H200: the kit's
        # stale-nan case); it serves callers that keep unowned slots finite and ask for it
        fp8 = False if problem.kv_dtype == FP8_CACHE else None
        return [xqa_tactic(m, pdl, fp8) for m in MULTI_BLOCK for pdl in (True, False)]
    return [FMHA_TACTIC]


# -- plans -------------------------------------------------------------------------------------

_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _sm_counts.get(index)
    if found is None:
        found = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return found


class _Plan:
    """What both plans share: the metadata (block table, kv lengths, cumulative lengths) in a
    slot of the wrapper's staging (`tactix.plugin.Staging`, handed from plan to plan), the
    workspace, a packed-q buffer, and the caches run() has accepted."""

    tactic: Tactic
    built: bool
    geometry: Geometry
    _requested: Tactic  # the tactic the plan was made for (the default, or a tuned one): what `replan` makes
    _graph: bool  # made for CUDA-graph mode
    _staging: Staging
    _workspace: torch.Tensor
    _q_packed: torch.Tensor | None

    def _setup(self, problem: PrefillProblem | DecodeProblem, batch: PagedBatch, options: PlanOptions,
               decode: bool, workspace_bytes: int, zero: bool = True) -> _Plan | None:  # fmt: skip
        """Geometry, metadata, workspace and q buffer; returns the plan this one takes buffers from.
        ``zero=False``: a reused workspace already holds zeros wherever this plan needs them."""
        self.problem = problem
        self.device = options["device"]
        graph = self._graph = bool(options["use_cuda_graph"])
        previous = options["previous"] if graph else None
        if previous is not None and not isinstance(previous, type(self)):
            previous = None
        if previous is not None:
            assert isinstance(previous, _Plan)
            reasons = refit_reasons(previous.geometry, batch, decode=decode)
            if reasons:
                raise UnsupportedProblemError(NAME, problem, [
                    "in CUDA-graph mode a re-plan must fit the captured launch sizes and buffers: " + "; ".join(reasons)
                    + " (use one wrapper per captured shape)"])  # fmt: skip
            self.geometry = previous.geometry
        else:
            self.geometry = geometry(batch, decode=decode, graph=graph)
        old = getattr(options["previous"], "_staging", None)
        self._fill_metadata(problem, batch, old if isinstance(old, Staging) else None, graph, previous, decode)
        # Zeroed: XQA's semaphores and FMHAv2's tile counter must start at 0 (each launch leaves them
        # at 0 again). A previous plan's workspace is reused (stream-ordered: this plan replaces it)
        # and zeroed again, since its scratch may now lie where this plan keeps its semaphores
        # (unless ``zero`` is False: XqaDecodePlan knows when the previous semaphores cover its own).
        old_ws = getattr(options["previous"], "_workspace", None)
        if isinstance(old_ws, torch.Tensor) and old_ws.device == self.device and old_ws.numel() >= workspace_bytes:
            self._workspace = old_ws.zero_() if zero else old_ws
        else:
            self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # made at the first run with a strided q (a captured graph keeps reading the same one)
        self._q_packed = previous._q_packed if previous is not None else None
        return previous

    def replan(self, problem: Problem, batch: PagedBatch, options: PlanOptions) -> _Plan | None:
        """The plan of a new batch with this plan's static problem and tactic (the core's fast
        re-plan, `tactix.selection.replan_selection`): made as the plan hook would make it, without
        the selection, the check and the hook dispatch in front of it. ``tactix_check``'s answer
        depends on the static problem and the tactic, except FMHAv2's rule that every request holds
        at least its query rows as keys, checked here; None for such a batch, another device or
        another mode (the full path decides, and says why)."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph:
            return None
        if isinstance(problem, PrefillProblem) and any(map(operator.gt, batch.qo_lens_list, batch.kv_lens_list)):
            return None
        return type(self)(problem, batch, self._requested, {**options, "previous": self})  # type: ignore[arg-type, call-arg]

    def _packed(self, q: torch.Tensor) -> torch.Tensor:
        """A strided q (a view of a fused QKV output) copied into packed rows: the kernels read
        q with row strides derived from its shape."""
        buf = self._q_packed
        if buf is None or buf.shape != q.shape:
            buf = self._q_packed = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        buf.copy_(q)
        return buf

    def _fill_metadata(self, problem: PrefillProblem | DecodeProblem, batch: PagedBatch, old: Staging | None,
                       graph: bool, previous: _Plan | None, decode: bool = False) -> None:  # fmt: skip
        """The metadata written into a pinned buffer of the wrapper's staging with C-level copies
        and sent in one transfer into a slot (`metadata.write_metadata`): the block table laid out
        on the host for host page indices of a few rows (`metadata.table_on_host`), else gathered
        on the device from the CSR indices, sent in the same transfer (host) or copied after it
        (device: `Staging.gather`'s kernel reads them in place). Eager
        plans alternate between the two slots (the slot the previous plan's runs read is left
        alone); CUDA-graph plans keep slot 0, sized by the captured geometry, whose addresses the
        captured kernels read. XQA (``decode``) reads no cumulative lengths: their sections stay
        zero."""
        g = self.geometry
        layout = metadata_sections(g)
        on_host = batch.indices_on_host
        host_table = table_on_host(batch, g)
        staging = Staging.reuse(old, self.device, layout.total, 0 if host_table else g.rows * g.width)
        if previous is not None and staging is not previous._staging:
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the metadata buffers of the captured kernels"])  # fmt: skip
        self._staging = staging
        indices = batch.kv_indices
        if on_host and not indices.is_contiguous():
            indices = indices.contiguous()
        at = indices.data_ptr() if on_host else None
        slot = staging.slot(graph)
        staging.send(slot, metadata_entries(layout, g, batch, host_table),
                     functools.partial(_fill, batch, g, layout, at, host_table, decode))  # fmt: skip
        pages = layout.offset("pages")
        if host_table:
            table = staging.view(slot, pages, g.rows * g.width).view(g.rows, g.width)
        else:
            # (device indices: read in place by the gather's kernel, after the transfer on its stream)
            staging.gather(slot, pages, g.rows, g.width, layout.offset("row_starts"), batch.num_page_entries,
                           None if on_host else indices)  # fmt: skip
            table = staging.gathered(slot, g.rows, g.width)
        self._table = table
        self._seq_lens = staging.view(slot, layout.offset("seq_lens"), g.rows)
        if not decode:  # (FMHAv2's)
            self._cum_q = staging.view(slot, layout.offset("cum_q"), g.rows + 1)
            self._cum_kv = staging.view(slot, layout.offset("cum_kv"), g.rows + 1)


def _fill(batch: PagedBatch, g: Geometry, layout: Sections, indices_at: int | None, host_table: bool,
          decode: bool, dst: int) -> None:  # fmt: skip
    """`Staging.send`'s fill: the plan's metadata at ``dst`` (`metadata.write_metadata`)."""
    write_metadata(dst, batch, g, layout, indices_at, host_table, decode)


_MEMO_LIMIT: Final = 1024


def _alias(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``t``'s memory with the given geometry that, unlike a view, holds no reference
    to ``t`` itself: what run() remembers about a cache must not keep the cache object alive."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), size, stride)
    return out


def _remember(memo: dict[int, Any], k: torch.Tensor, v: torch.Tensor, value: Any) -> None:
    """Keep what run() derived from a (k, v) pair until either tensor dies (caches are reused)."""
    if len(memo) >= _MEMO_LIMIT:
        memo.clear()
    key = id(k)

    def forget(_: object, key: int = key) -> None:
        memo.pop(key, None)

    memo[key] = (weakref.ref(k, forget), weakref.ref(v, forget), value)


class XqaDecodePlan(_Plan):
    """A decode batch for XQA: run() is one call of the module's exported ``xqa_wrapper``.

    What depends only on the static problem and the tactic (the tactic object, the loaded module,
    the scales, the caches run() has accepted) is made once and copied by `replan`, which makes
    only the batch's part: metadata, workspace split and the launch's trailing arguments."""

    _semaphore_bytes: int
    _ws_parts: tuple[torch.Tensor, torch.Tensor]  # the workspace's semaphores and scratch
    _static: dict[str, Any]

    def __init__(self, problem: DecodeProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions) -> None:
        device = options["device"]
        sms = _sm_count(device)
        fp8 = problem.kv_dtype == FP8_CACHE
        self._requested = tactic
        if tactic.is_default:  # flashinfer's own choice: split to fill the SMs once, PDL on SM90+
            multi_block, pdl, fp8_mma = "auto", True, False
        else:
            multi_block, pdl = str(tactic.params["multi_block"]), bool(tactic.params["pdl"])
            fp8_mma = bool(tactic.params.get("fp8_mma", False))
        self.tactic = xqa_tactic(multi_block, pdl, fp8_mma if fp8 else None)
        # XQA splits a sequence into min(sm_count // (batch * kv_heads), ...) parts: the SM budget
        # passed as sm_count is the tactic's split knob (1: never split).
        sm_budget = {"off": 1, "auto": sms, "x2": 2 * sms}[multi_block]
        # partial rows, maxima and sums of each sub-sequence: well under 64 KiB for group sizes up
        # to 8 and head dims up to 256; at most sm_budget sub-sequences exist when XQA splits
        self._scratch_bytes = max(1 << 20, sm_budget * (64 << 10))
        self._pdl = pdl
        d = problem.head_dim_qk
        key = XqaKey(problem.q_dtype, problem.page_size, d, problem.gqa_ratio, problem.window_left >= 0,
                     FP8_CACHE if fp8 else "")  # fmt: skip
        module, self.built = load(key)
        self._fn: Callable[..., Any] = module.xqa_wrapper
        window = problem.window_left + 1 if problem.window_left >= 0 else 0
        # XQA applies q_scale / sqrt(head_dim) to Q.K (csrc/xqa/mha.cu: qkScale), and with a
        # quantized cache its one kv_scale to Q.K and to the output (mha.cu: voScale)
        q_scale = problem.sm_scale * math.sqrt(d)
        self._q_scale, self._fp8 = q_scale, fp8
        # the device q scale of device k/v scales: made here, so run() allocates nothing (a graph
        # captures its address)
        old_buf = getattr(options["previous"], "_q_buf", None)  # (a captured graph reads its address)
        if isinstance(old_buf, torch.Tensor) and old_buf.device == device:
            self._q_buf: torch.Tensor = old_buf
        else:
            self._q_buf = torch.empty(1, dtype=torch.float32, device=device)
        # xqa_wrapper(run_sm90_fp8_mha, sm_count, num_kv_heads, sliding_win_size, q_scale, q_scale_tensor,
        #             out, rcp_out_scale, q, sinks, k, v, k_sf, v_sf, page_table, max_seq_len, seq_lens,
        #             batch_size, kv_scale, kv_scale_tensor, q_seq_len, q_cu_seq_lens, mask, semaphores,
        #             scratch, enable_pdl)            (csrc/flashinfer_xqa_binding.cu)
        self._head = (fp8 and fp8_mma, sm_budget, problem.num_kv_heads, window, q_scale, None)
        self._layout = problem.kv_layout
        # k views by cache (`_accept`): they depend on the cache alone, so every re-plan keeps them
        self._caches: dict[int, Any] = {}
        keep_static(self)  # what `replan` starts from
        self._plan_batch(problem, batch, options)

    def replan(self, problem: Problem, batch: PagedBatch, options: PlanOptions) -> _Plan | None:
        """The fast re-plan (`_Plan.replan`) that copies the static part and plans only the batch."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph:
            return None
        assert isinstance(problem, DecodeProblem)
        plan = from_static(self)
        plan.built = False
        plan._plan_batch(problem, batch, {**options, "previous": self})
        return plan

    def _plan_batch(self, problem: DecodeProblem, batch: PagedBatch, options: PlanOptions) -> None:
        """The batch's part: metadata, workspace (semaphores, then scratch) and the launch's tail."""
        rows = batch.batch_size
        semaphore_bytes = -(-4 * rows * problem.num_kv_heads // 4096) * 4096
        # XQA leaves its semaphores at 0 after each launch: a previous XQA plan's workspace needs
        # no zeroing when its semaphore region covers this one's (its scratch lies past it)
        before = options["previous"]
        zero = not (isinstance(before, XqaDecodePlan) and before._semaphore_bytes >= semaphore_bytes)
        previous = self._setup(problem, batch, options, decode=True,
                               workspace_bytes=semaphore_bytes + self._scratch_bytes, zero=zero)  # fmt: skip
        if isinstance(previous, XqaDecodePlan):
            semaphore_bytes = previous._semaphore_bytes  # the captured split of the workspace
        self._semaphore_bytes = semaphore_bytes
        g, ws = self.geometry, self._workspace
        if isinstance(before, XqaDecodePlan) and before._workspace is ws and before._semaphore_bytes == semaphore_bytes:
            self._ws_parts = before._ws_parts  # the same split of the same workspace (two slices cost ~3 us)
        else:
            self._ws_parts = (ws[:semaphore_bytes], ws[semaphore_bytes:])
        self._tail = (None, None, self._table, g.width * problem.page_size, self._seq_lens, rows, 1.0, None, 1,
                      None, None, *self._ws_parts, self._pdl)  # fmt: skip

    def _accept(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        reasons = xqa_cache_reasons(k.stride(), v.stride(), self._layout, self.problem.head_dim_qk)
        if reasons:
            raise InvalidArgumentError("paged_kv_cache", "caches XQA can read in place: " + "; ".join(reasons),
                                       f"k strides {k.stride()}, v strides {v.stride()}")  # fmt: skip
        # XQA reads K through [pages, page_size, heads, dim] strides: an HND cache is passed transposed
        size, stride = tuple(k.shape), k.stride()
        if self._layout == "HND":
            size, stride = (size[0], size[2], size[1], size[3]), (stride[0], stride[2], stride[1], stride[3])
        view = _alias(k, size, stride)
        _remember(self._caches, k, v, view)
        return view

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None, k_scale: float | torch.Tensor | None = None,
            v_scale: float | torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """Launch XQA; ``sinks`` (a run extra, a contiguous float32 ``[num_qo_heads]`` the core
        checked) is XQA's ``[num_kv_heads, group]`` attention-sink array: the same floats."""
        seen = self._caches.get(id(k_cache))
        if seen is not None and seen[0]() is k_cache and seen[1]() is v_cache:
            k_view = seen[2]
        else:
            k_view = self._accept(k_cache, v_cache)
        if not q.is_contiguous():
            q = self._packed(q)
        if k_scale is None and v_scale is None:
            self._fn(*self._head, out, 1.0, q, sinks, k_view, v_cache, *self._tail)
            return
        head, tail, after = self._scaled(k_scale, v_scale)
        self._fn(*head, out, 1.0, q, sinks, k_view, v_cache, *tail)
        if after is not None:  # a 16-bit cache: XQA applies no V scale
            out.mul_(after)

    def _scaled(self, k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None
                ) -> tuple[tuple[Any, ...], tuple[Any, ...], float | torch.Tensor | None]:  # fmt: skip
        """XQA's arguments for dequantization scales: with an fp8 cache its one kv_scale is
        v_scale and the q scale carries k_scale / v_scale; with a 16-bit cache (no kv_scale) the
        q scale carries k_scale and the output is multiplied by v_scale afterwards. Device scales
        stay on the device (a q-scale buffer of the plan's, computed in the stream)."""
        base = self._q_scale
        head: list[Any] = list(self._head)
        tail: list[Any] = list(self._tail)
        k = 1.0 if k_scale is None else k_scale
        v = 1.0 if v_scale is None else v_scale
        after: float | torch.Tensor | None = None
        if not self._fp8:
            after, v = v_scale, 1.0
        elif isinstance(v, torch.Tensor):
            tail[6], tail[7] = 1.0, v
        else:
            tail[6] = v
        if not isinstance(k, torch.Tensor) and not isinstance(v, torch.Tensor):
            head[4] = base * k / v
            return tuple(head), tuple(tail), after
        buf = self._q_buf
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            torch.div(k.view(1), v.view(1), out=buf)
            buf.mul_(base)
        elif isinstance(k, torch.Tensor):
            torch.mul(k.view(1), base / v, out=buf)  # type: ignore[operator]
        else:
            torch.reciprocal(v.view(1), out=buf)  # type: ignore[union-attr]
            buf.mul_(base * k)
        head[4], head[5] = 1.0, buf
        if head[0]:
            # the fp8 kernel reads the scale pointers before it waits for the previous kernel
            # (mha_sm90.cu: griddepcontrol.wait comes later), so no programmatic dependent launch
            tail[13] = False
        return tuple(head), tuple(tail), after


@dataclass
class _Pool:
    """How run() passes one (k, v) pair to FMHAv2 (holding no reference to the pair itself, so a
    cache that is dropped is freed and forgotten)."""

    mapping: PoolMapping
    table: torch.Tensor  # [rows, width] page indices (shared) or [rows, 2, width] block offsets
    staging: tuple[torch.Tensor, torch.Tensor] | None = None  # gather mode: where run() copies pages to


_gather_warned = False


class FmhaPrefillPlan(_Plan):
    """A prefill batch for FMHAv2 over a paged cache: run() is one call of the module's ``run``."""

    _caches: dict[int, Any]
    WORKSPACE_BYTES: Final = 4 << 20  # FMHAv2 keeps a tile counter there (multi-CTA reduction is off)

    def __init__(self, problem: PrefillProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions) -> None:
        self.tactic = FMHA_TACTIC
        self._requested = tactic
        previous = self._setup(problem, batch, options, decode=False, workspace_bytes=self.WORKSPACE_BYTES)
        module, self.built = load(FmhaKey(problem.kv_layout, problem.q_dtype))
        self._fn: Callable[..., Any] = module.run
        g = self.geometry
        # a window makes FMHAv2's SLIDING_OR_CHUNKED_CAUSAL mask (window_left + 1 keys)
        mask = "sliding_window" if problem.window_left >= 0 else "causal" if problem.causal else "padding"
        ws = self._workspace
        # run(q, k, v, o, workspace, workspace_bytes, block_tables, page_size, seq_lens, cum_q, cum_kv,
        #     input_layout, max_q_len, max_kv_len, batch_size, mask_mode, scale_softmax, scale_bmm1,
        #     scale_bmm2, window_left, chunked_attention_size, has_alibi, softcapping_scale,
        #     skip_softmax_threshold_scale_factor, softmax_stats, sinks)      (csrc/fmha_v2_jit_binding.cu)
        self._mid = (ws, ws.numel())
        self._tail = (problem.page_size, self._seq_lens, self._cum_q, self._cum_kv,
                      f"q_paged_kv_{problem.kv_layout.lower()}", g.max_q, g.max_kv, g.rows, mask,
                      1.0, problem.sm_scale, 1.0, problem.window_left, 0, False, float(problem.logits_soft_cap),
                      0.0, None, None)  # fmt: skip
        self._layout = problem.kv_layout
        self._pages = self._table.view(-1)  # gather mode: the pages copied to the staging pool, row by row
        if previous is not None:
            assert isinstance(previous, FmhaPrefillPlan)
            self._caches = previous._caches  # the captured graph reads these tables and staging pools
            for ref_k, ref_v, pool in list(self._caches.values()):
                if ref_k() is not None and ref_v() is not None and pool.mapping.mode == "offsets":
                    expand_offsets(self._table, pool.mapping, out=pool.table)
        else:
            self._caches = {}

    def _accept(self, k: torch.Tensor, v: torch.Tensor) -> _Pool:
        mapping = pool_mapping(k.data_ptr(), v.data_ptr(), k.stride(), v.stride(), tuple(k.shape), self._layout,
                               k.element_size())  # fmt: skip
        g = self.geometry
        if mapping.mode == "shared":
            pool = _Pool(mapping, self._table)
        elif mapping.mode == "offsets":
            table = torch.empty(g.rows, 2, g.width, dtype=torch.int32, device=self.device)
            expand_offsets(self._table, mapping, out=table)
            pool = _Pool(mapping, table)
        else:
            global _gather_warned
            level = logging.DEBUG if _gather_warned else logging.WARNING
            _gather_warned = True
            log.log(level, "trtllm: FMHAv2 cannot address this (k, v) pair in place (%s); each run copies the "
                    "batch's pages into a staging pool (pass one [pages, 2, ...] cache tensor to avoid it)",
                    mapping.why)  # fmt: skip
            stage = torch.empty((2, g.rows * g.width, *k.shape[1:]), dtype=k.dtype, device=self.device)
            pool = _Pool(mapping, gather_offsets(g.rows, g.width, self.device), (stage[0], stage[1]))
        _remember(self._caches, k, v, pool)
        return pool

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None) -> None:  # fmt: skip
        seen = self._caches.get(id(k_cache))
        if seen is not None and seen[0]() is k_cache and seen[1]() is v_cache:
            pool: _Pool = seen[2]
        else:
            pool = self._accept(k_cache, v_cache)
        # FMHAv2 addresses every page from its k argument's address and reads only the shape of v
        if pool.staging is not None:
            base, other = pool.staging
            torch.index_select(k_cache, 0, self._pages, out=base)
            torch.index_select(v_cache, 0, self._pages, out=other)
        elif pool.mapping.base_is_v:
            base, other = v_cache, k_cache
        else:
            base, other = k_cache, v_cache
        if not q.is_contiguous():
            q = self._packed(q)
        self._fn(q, base, other, out, *self._mid, pool.table, *self._tail)


def _refuse(problem: PrefillProblem | DecodeProblem, tactic: Tactic, batch: PagedBatch) -> None:
    reasons = params_reasons(tactic, problem.op) + attention_reasons(problem, _capability(), batch)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)


@tactix.hookimpl
def tactix_plan_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Tactic,
                       options: PlanOptions) -> XqaDecodePlan | None:  # fmt: skip
    _refuse(problem, tactic, batch)
    return XqaDecodePlan(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Tactic,
                        options: PlanOptions) -> FmhaPrefillPlan | None:  # fmt: skip
    _refuse(problem, tactic, batch)
    return FmhaPrefillPlan(problem, batch, tactic, options)


# -- warm-up -----------------------------------------------------------------------------------

WARMUP_DEFAULTS: Final[dict[str, tuple[str, ...]]] = {
    "ops": ("decode", "prefill"),
    "dtypes": ("bfloat16", "float16"),
    "layouts": ("HND", "NHD"),
    "head_dims": ("128",),
    "page_sizes": ("16",),
    "group_sizes": ("1", "4", "8"),
    "windows": ("no",),
}
WARMUP_ENV: Final = "TACTIX_TRTLLM_WARMUP"


def warmup_keys(text: str | None = None) -> list[ModuleKey]:
    """The modules `tactix warmup trtllm` compiles.

    ``text`` (the ``TACTIX_TRTLLM_WARMUP`` variable) overrides any of `WARMUP_DEFAULTS` with
    ``name=v1,v2`` items separated by ``;``, e.g. ``dtypes=bfloat16;group_sizes=4,8``. XQA needs
    one module per dtype, page size, head dim, GQA ratio and window flag (seconds each); FMHAv2 one
    per layout and dtype (minutes each).
    """
    chosen = dict(WARMUP_DEFAULTS)
    for item in (text or "").split(";"):
        if not item.strip():
            continue
        name, _, listed = item.partition("=")
        name = name.strip()
        if name not in chosen or not listed.strip():
            raise InvalidArgumentError(WARMUP_ENV, f"'name=v1,v2' items with names from {sorted(chosen)}", item)
        chosen[name] = tuple(v.strip() for v in listed.split(",") if v.strip())
    allowed = {
        "ops": {"decode", "prefill"},
        "dtypes": set(DTYPES),
        "layouts": {"HND", "NHD"},
        "head_dims": {str(d) for d in HEAD_DIMS},
        "page_sizes": {str(p) for p in PAGE_SIZES},
        "group_sizes": {str(g) for g in range(1, MAX_GROUP_SIZE + 1)},
        "windows": {"no", "yes"},
    }
    for name, values in chosen.items():
        bad = sorted(set(values) - allowed[name])
        if bad:
            raise InvalidArgumentError(f"{WARMUP_ENV} ({name})", f"values from {sorted(allowed[name])}", bad)
    keys: list[ModuleKey] = []
    if "decode" in chosen["ops"]:
        keys += [XqaKey(dt, int(p), int(d), int(g), w == "yes") for dt in chosen["dtypes"]
                 for p in chosen["page_sizes"] for d in chosen["head_dims"] for g in chosen["group_sizes"]
                 for w in chosen["windows"]]  # fmt: skip
    if "prefill" in chosen["ops"]:
        keys += [FmhaKey(layout, dt) for dt in chosen["dtypes"] for layout in chosen["layouts"]]
    return keys


@tactix.hookimpl
def tactix_warmup(arch: str | None, progress: Callable[[int, int, str], None] | None) -> int | None:
    if arch is not None and arch not in ARCHES:
        raise InvalidArgumentError("--arch", f"one of {sorted(ARCHES)} (the targets this backend serves)", arch)
    if arch is None and not cuda_available() and "FLASHINFER_CUDA_ARCH_LIST" not in os.environ:
        raise InvalidArgumentError("--arch", "given on a machine without a GPU (sm_90)", None)
    keys = warmup_keys(os.environ.get(WARMUP_ENV))
    try:
        target(arch)  # before flashinfer is imported: it reads its target list once
    except ValueError as exc:
        raise InvalidArgumentError("--arch", str(exc), arch) from None
    st = status()
    if not st.usable:
        raise tactix.BackendUnavailableError(f"backend '{NAME}' cannot compile its kernels: {st.error}")
    try:
        return compile_ahead(keys, arch, progress)
    except Exception as exc:  # nvcc or ninja failed: name the backend, keep the cause
        raise tactix.BackendError(NAME, "compile its kernels ahead of time", exc) from exc


@tactix.hookimpl
def tactix_references(op: str, inputs: dict[str, Any]) -> list[ReferenceCall] | None:
    """flashinfer's public TensorRT-LLM entry points called by hand, for ``tactix bench``."""
    if op == "gemm" or tactix_environment():
        return None
    from tactix_trtllm import direct

    return direct.attention_references(op, inputs)


# FMHAv2 loads whole pages and masks scores past a request's length, so a NaN or an infinity in
# such a slot still reaches the output through P @ V (0 x NaN is NaN): measured on an H200
# (flashinfer-python 0.7.2.post1), every prefill case with NaN or Inf in a page tail, and the
# multi-token decode cases (``q2``..``q4``, served by FMHAv2 too; session 13). XQA decode keeps them out.


@tactix.hookimpl
def tactix_known_failures() -> dict[str, str] | None:
    multi_token = {f"decode[*-q?-*stale-{value}]": STALE_SLOTS for value in ("nan", "inf")}
    return {**stale_slot_failures("prefill"), **multi_token}
