"""The built-in ``torch`` backend: paged and ragged-KV attention and GEMM from plain PyTorch ops,
CPU and GPU.

Attention gathers each request's pages (ragged-KV prefill: its rows of the packed keys and values)
into a padded ``[batch, heads, kv_len, dim]`` view (index tensors computed once in plan), then
runs one of:

* ``explicit``: masked softmax attention computed in float32 by matmuls; serves every feature
  (GQA, bottom-right causal, window, soft-cap, LSE) on every device. The CPU default.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` restricted to one PyTorch
  implementation (``params.impl``: ``math``, ``flash``, ``efficient`` or ``cudnn``), so each is
  a separate tuning candidate. No soft-cap and no LSE; ``flash`` and ``cudnn`` also need a
  batch whose requests all have the same lengths and no window (no mask). On a GPU the default
  is ``efficient`` where it applies, else ``explicit``.

GEMM runs ``matmul`` (``torch.mm``/``addmm``/``bmm``) for 16- and 32-bit operands, and for fp8
either ``scaled_mm`` (``torch._scaled_mm``, both operands k-major, unbatched) or ``dequant``
(upcast to float32, multiply, scale; the default on the CPU and on GPUs without fp8 tensor
cores). All plans keep their index buffers at fixed addresses, so
``run`` captures in a CUDA graph; with ``use_cuda_graph`` a re-plan of the same shape bucket
rewrites those buffers in place, so a captured graph replays the new batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

import torch
import torch.nn.functional as F

import tactix
from tactix.batch import Batch, CustomMask, PagedBatch, RaggedBatch
from tactix.capabilities import BackendSpec
from tactix.dtypes import to_torch_dtype
from tactix.errors import UnsupportedProblemError
from tactix.hookspecs import PlanOptions, hookimpl
from tactix.ops import (
    AnyProblem,
    AttentionCapabilities,
    DecodeProblem,
    GemmCapabilities,
    GemmDTypes,
    GemmProblem,
    MergeCapabilities,
    MergeProblem,
    PrefillProblem,
    RaggedPrefillCapabilities,
    RaggedPrefillProblem,
)
from tactix.problems import bucket_size
from tactix.tactics import Tactic

NAME: Final = "torch"

_FLOAT_TYPES: Final = frozenset({"float16", "bfloat16", "float32"})
_FP8_TYPES: Final = frozenset({"float8_e4m3fn", "float8_e5m2"})
_SDPA_IMPLS: Final = ("math", "flash", "efficient", "cudnn")
_SDPA_CPU: Final = frozenset({"math", "flash"})

_RAGGED = RaggedPrefillCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    q_dtypes=_FLOAT_TYPES,
    kv_dtypes=_FLOAT_TYPES | _FP8_TYPES,
    out_dtypes=_FLOAT_TYPES,
    head_dims=None,
    different_vo_head_dim=True,
    causal=True,
    non_causal=True,
    chunked=True,
    sliding_window=True,
    logits_soft_cap=True,
    lse=True,
    keyless_rows=True,  # causal rows before a request's first key: the explicit kernel gives zeros, LSE -inf
    cuda_graph="fixed_buffers",
    run_extras=frozenset({"k_scale", "v_scale", "sinks"}),
)

_ATTENTION = AttentionCapabilities(
    **_RAGGED.model_dump(),
    page_sizes=None,
    kv_layouts=frozenset({"NHD", "HND"}),
    max_q_len_per_req=None,  # decode: any rows per request (the prefill path's masks)
    custom_mask=True,  # prefill: the explicit kernel
)

_GEMM = GemmCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset(
        [GemmDTypes(a=t, b=t, out=t) for t in ("float16", "bfloat16", "float32")]
        + [
            GemmDTypes(a="float8_e4m3fn", b="float8_e4m3fn", out=o, scale_mode="per_tensor")
            for o in ("bfloat16", "float16", "float32")
        ]
    ),
    a_m_major=True,
    b_n_major=True,
    bias=True,
    batched=True,
    cuda_graph="fixed_buffers",
)


_MERGE: Final = MergeCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    v_dtypes=frozenset({"float16", "bfloat16", "float32"}),
    cuda_graph="fixed_buffers",
)


@hookimpl
def tactix_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name=NAME,
            version=tactix.__version__,
            description="PyTorch ops (SDPA, matmul, _scaled_mm); runs wherever torch runs",
            prefill=_ATTENTION,
            decode=_ATTENTION,
            ragged_prefill=_RAGGED,
            gemm=_GEMM,
            merge_states=_MERGE,
            preference=-100,  # the fallback: every other backend is tried first
        )
    ]


@hookimpl
def tactix_environment() -> list[str] | None:
    return []


@hookimpl
def tactix_tactics(problem: AnyProblem) -> list[Tactic] | None:
    if isinstance(problem, MergeProblem):
        return [Tactic(backend=NAME, kernel="ops")]
    if isinstance(problem, GemmProblem):
        kernels = ["matmul"] if problem.scale_mode == "none" else ["scaled_mm", "dequant"]
        candidates = [Tactic(backend=NAME, kernel=k) for k in kernels]
    else:
        candidates = [Tactic(backend=NAME, kernel="explicit")] + [
            Tactic(backend=NAME, kernel="sdpa", params={"impl": impl}) for impl in _SDPA_IMPLS
        ]
    return [t for t in candidates if not _reasons(problem, t, None)]


@hookimpl
def tactix_check(problem: AnyProblem, tactic: Tactic, batch: Batch | None) -> list[str] | None:
    return _reasons(problem, tactic, batch)


# --------------------------------------------------------------------------------------------
# Support rules

_Attention = PrefillProblem | DecodeProblem | RaggedPrefillProblem


def _reasons(problem: AnyProblem, tactic: Tactic, batch: Batch | None) -> list[str]:
    if isinstance(problem, MergeProblem):
        ok = tactic.is_default or (tactic.kernel == "ops" and not tactic.params)
        return [] if ok else [f"merges take the kernel 'ops' without params (got {tactic})"]
    if isinstance(problem, GemmProblem):
        return _gemm_reasons(problem, tactic)
    return _attention_reasons(problem, tactic, batch)


def _attention_reasons(problem: _Attention, tactic: Tactic, batch: Batch | None) -> list[str]:
    out: list[str] = []
    if problem.kv_dtype != problem.q_dtype and problem.kv_dtype not in _FP8_TYPES:
        out.append(f"kv dtype {problem.kv_dtype} must equal q dtype {problem.q_dtype} (or be fp8)")
    if tactic.kernel in ("default", "explicit"):
        if tactic.params:
            out.append(f"kernel '{tactic.kernel}' takes no params (got {tactic.params})")
        return out
    if tactic.kernel != "sdpa":
        return [*out, f"unknown kernel '{tactic.kernel}' (known: default, explicit, sdpa)"]
    impl = tactic.params.get("impl")
    if impl not in _SDPA_IMPLS or set(tactic.params) != {"impl"}:
        return [*out, f"sdpa params must be {{'impl': one of {list(_SDPA_IMPLS)}}} (got {tactic.params})"]
    if getattr(problem, "custom_mask", False):
        out.append("SDPA gives NaN for a row a custom mask leaves no key: the explicit kernel serves custom masks")
    if getattr(problem, "keyless_rows", False):
        out.append("SDPA gives NaN for a causal row with no key: the explicit kernel serves such batches")
    if problem.logits_soft_cap > 0:
        out.append("SDPA has no logits soft-cap")
    if problem.return_lse:
        out.append("SDPA does not return the LSE")
    if problem.device_type == "cpu" and impl not in _SDPA_CPU:
        out.append(f"SDPA '{impl}' runs only on CUDA")
    if impl in ("flash", "cudnn"):
        if problem.q_dtype not in ("float16", "bfloat16"):
            out.append(f"SDPA '{impl}' needs float16 or bfloat16 (got {problem.q_dtype})")
        if problem.window_left >= 0:
            out.append(f"SDPA '{impl}' takes no mask, so no sliding window")
        if batch is not None and _needs_mask(problem, batch):
            out.append(f"SDPA '{impl}' takes no mask: the requests' lengths differ")
    if impl == "cudnn" and problem.head_dim_qk > 128:
        out.append("SDPA 'cudnn' supports head dims up to 128")
    if impl != "math" and problem.head_dim_qk != problem.head_dim_vo:
        out.append(f"SDPA '{impl}' needs head_dim_vo == head_dim_qk")
    if impl == "efficient" and problem.head_dim_qk % 8:
        out.append("SDPA 'efficient' needs a head dim that is a multiple of 8")
    return out


def _gemm_reasons(problem: GemmProblem, tactic: Tactic) -> list[str]:
    if tactic.params:
        return [f"kernel '{tactic.kernel}' takes no params (got {tactic.params})"]
    fp8 = problem.scale_mode == "per_tensor"
    if tactic.kernel == "default":
        return []
    if tactic.kernel == "matmul":
        return ["'matmul' does not apply scales; use 'scaled_mm' or 'dequant'"] if fp8 else []
    if tactic.kernel in ("scaled_mm", "dequant") and not fp8:
        return [f"'{tactic.kernel}' is for fp8 operands with per-tensor scales"]
    if tactic.kernel == "dequant":
        return []
    if tactic.kernel == "scaled_mm":
        out = []
        if not (problem.a_k_major and problem.b_k_major):
            out.append("'scaled_mm' needs both operands k-major")
        if problem.batched:
            out.append("'scaled_mm' is not batched")
        if problem.k % 16 or problem.n % 16:
            out.append(f"'scaled_mm' needs k and n divisible by 16 (got k={problem.k}, n={problem.n})")
        if problem.bias_dtype is not None and (
            problem.out_dtype == "float32" or problem.bias_dtype != problem.out_dtype
        ):
            out.append("'scaled_mm' needs a bias of the output dtype, and no bias with float32 out")
        return out
    return [f"unknown kernel '{tactic.kernel}' (known: default, matmul, scaled_mm, dequant)"]


def _needs_mask(problem: _Attention, batch: Batch) -> bool:
    """Whether the padded batch needs an explicit mask (ragged lengths, window, chunked causal)."""
    if problem.window_left >= 0 or (
        batch.batch_size > 1
        and (bool((batch.kv_lens != batch.max_kv_len).any()) or bool((batch.qo_lens != batch.max_qo_len).any()))
    ):
        return True
    causal = problem.causal
    # a uniform causal batch with q as long as kv is the one case is_causal expresses.
    return causal and batch.max_qo_len != batch.max_kv_len


def _concrete(problem: AnyProblem, tactic: Tactic, batch: Batch | None) -> Tactic:
    """Resolve the default tactic to the kernel it stands for on this problem."""
    if not tactic.is_default:
        return tactic
    if isinstance(problem, MergeProblem):
        return Tactic(backend=NAME, kernel="ops")
    if isinstance(problem, GemmProblem):
        if problem.scale_mode == "none":
            return Tactic(backend=NAME, kernel="matmul")
        # torch._scaled_mm where the GPU has fp8 tensor cores; elsewhere dequant: on the CPU
        # _scaled_mm is a slow reference loop (7.8 s a call at m=256, n=512, k=384, where dequant's
        # float32 matmul takes well under a second), so it stays a tuning candidate only
        scaled = Tactic(backend=NAME, kernel="scaled_mm")
        cc_ok = problem.device_type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
        if cc_ok and not _gemm_reasons(problem, scaled):
            return scaled
        return Tactic(backend=NAME, kernel="dequant")
    if problem.device_type == "cuda":
        efficient = Tactic(backend=NAME, kernel="sdpa", params={"impl": "efficient"})
        if not _attention_reasons(problem, efficient, batch):
            return efficient
    return Tactic(backend=NAME, kernel="explicit")


# --------------------------------------------------------------------------------------------
# Attention


@dataclass(frozen=True)
class _Geometry:
    batch_size: int
    tokens: int
    q_len: int  # padded query rows per request
    keys: int  # padded key slots per request (paged: whole pages)
    kv_tokens: int = 0  # rows of the packed k and v (ragged-KV prefill)

    def holds(self, other: _Geometry) -> bool:
        """Whether buffers of this geometry serve a batch of ``other``'s: the same batch size, token
        and packed-key counts, and at most as many query rows and key slots per request."""
        same = (self.batch_size, self.tokens, self.kv_tokens) == (other.batch_size, other.tokens, other.kv_tokens)
        return same and other.q_len <= self.q_len and other.keys <= self.keys


def _sdpa_backend(impl: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[impl]


class _AttentionPlan:
    """Padded-gather attention over the paged cache. All index tensors live on the device."""

    BUFFERS: ClassVar[tuple[str, ...]] = ("page_table", "q_index", "out_index", "mask", "key_valid")
    """The index tensors ``run`` reads: kept at their addresses by a CUDA-graph re-plan."""
    page_table: torch.Tensor  # [batch, pages] page of each request's slot
    q_index: torch.Tensor  # [batch * q_len] q row gathered into each padded row
    out_index: torch.Tensor  # [tokens] padded row that holds each output row
    mask: torch.Tensor  # [batch, 1, q_len, keys] keys each padded row attends
    key_valid: torch.Tensor  # [batch, 1, keys, 1] slots holding a key of the request

    def __init__(
        self,
        problem: _Attention,
        batch: Any,
        tactic: Tactic,
        options: PlanOptions,
    ) -> None:
        self.problem = problem
        self.tactic = tactic
        self.built = False
        self.device = options["device"]
        self._compute_dtype = to_torch_dtype(problem.q_dtype)  # an fp8 cache is read in the query dtype
        causal = problem.causal
        if options["use_cuda_graph"]:
            # shapes depend on the bucket only, so re-plans of the bucket keep them.
            q_len, kv_len = bucket_size(batch.max_qo_len), bucket_size(batch.max_kv_len)
        else:
            q_len, kv_len = batch.max_qo_len, batch.max_kv_len
        self.geometry = self._geometry(batch, max(q_len, 1), kv_len)
        previous = options["previous"]
        graph_previous = previous if options["use_cuda_graph"] and type(previous) is type(self) else None
        if graph_previous is not None and graph_previous.geometry.holds(self.geometry):
            # a shorter batch than the captured one: it keeps the captured buffers' shapes (as
            # FlashInfer's CUDA-graph wrappers serve any batch their buffers hold)
            self.geometry = graph_previous.geometry
        # rows that may attend no key: a custom mask's, or causal rows before a request's first key
        self._custom = bool(getattr(problem, "custom_mask", False) or getattr(problem, "keyless_rows", False))
        self.mask_needed = options["use_cuda_graph"] or self._custom or _needs_mask(problem, batch)
        self.is_causal = causal and not self.mask_needed
        self._sdpa = None
        if tactic.kernel == "sdpa":
            self._sdpa = _sdpa_backend(str(tactic.params["impl"]))
            self._gqa_native = tactic.params["impl"] in ("math", "flash")

        buffers = self._indices(batch, causal)
        if options["use_cuda_graph"] and previous is not None:
            if graph_previous is None or graph_previous.geometry != self.geometry:
                old = previous.geometry if isinstance(previous, _AttentionPlan) else previous
                raise UnsupportedProblemError(
                    NAME,
                    problem,
                    [
                        "in CUDA-graph mode a re-plan must keep the batch size and the token count and "
                        f"fit the captured length buckets, so captured graphs stay valid (planned {old}, "
                        f"now {self.geometry}); capture with the longest batch, or use one wrapper per "
                        "captured shape"
                    ],
                )
            # rewrite the captured buffers in place: same addresses, new batch.
            for name in self.BUFFERS:
                kept = getattr(previous, name)
                kept.copy_(buffers[name])
                buffers[name] = kept
        for name in self.BUFFERS:
            setattr(self, name, buffers[name])
        self._attn_mask = self.mask if self.mask_needed else None
        self._kv_len = batch.max_kv_len  # without a mask, keys past the longest request are cut

    def _geometry(self, batch: PagedBatch, q_len: int, kv_len: int) -> _Geometry:
        page = self.problem.page_size  # type: ignore[union-attr]
        return _Geometry(batch.batch_size, batch.num_qo_tokens, q_len, -(-kv_len // page) * page)

    def _indices(self, batch: PagedBatch, causal: bool) -> dict[str, torch.Tensor]:
        """Gather/scatter indices, the mask and the valid keys, built on the device with no host sync."""
        g = self.geometry
        dev = batch.on(self.device)
        out = self._rows_and_mask(dev.qo_indptr, dev.qo_lens, dev.kv_lens, causal, batch.custom_mask)
        rows = torch.arange(g.batch_size, device=self.device)
        num_pages = (dev.kv_indptr[1:] - dev.kv_indptr[:-1]).long()
        nnz = batch.num_page_entries
        req = torch.repeat_interleave(rows, num_pages, output_size=nnz)
        slot = torch.arange(nnz, device=self.device) - dev.kv_indptr[:-1].long()[req]
        page_table = torch.zeros(g.batch_size, g.keys // self.problem.page_size, dtype=torch.long,  # type: ignore[union-attr]
                                 device=self.device)  # fmt: skip
        page_table[req, slot] = dev.kv_indices.long()
        out["page_table"] = page_table
        return out

    def _rows_and_mask(self, qo_indptr: torch.Tensor, qo_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool,
                       custom: CustomMask | None) -> dict[str, torch.Tensor]:  # fmt: skip
        """The indices of the padded query rows and of the output rows, the mask and the valid keys."""
        g = self.geometry
        device = self.device
        problem = self.problem
        rows = torch.arange(g.batch_size, device=device)
        q_lens, kv_lens = qo_lens.long(), kv_lens.long()
        starts = qo_indptr[:-1].long()
        i = torch.arange(g.q_len, device=device)
        last_row = (q_lens - 1).clamp(min=0)
        q_index = starts[:, None] + torch.minimum(i[None, :], last_row[:, None])
        q_index = q_index.clamp(0, max(g.tokens - 1, 0)).reshape(-1)

        tok_req = torch.repeat_interleave(rows, q_lens, output_size=g.tokens)
        tok_pos = torch.arange(g.tokens, device=device) - starts[tok_req]
        out_index = tok_req * g.q_len + tok_pos

        j = torch.arange(g.keys, device=device)
        offset = (kv_lens - q_lens)[:, None, None]  # bottom-right alignment of q within kv
        qpos = i[None, :, None] + offset
        mask = j[None, None, :] < kv_lens[:, None, None]
        if causal:
            mask = mask & (j[None, None, :] <= qpos)
        if problem.window_left >= 0:
            mask = mask & (j[None, None, :] >= qpos - problem.window_left)
        if custom is not None:
            mask = mask & custom.dense(device, g.q_len, g.keys, q_lens, kv_lens)
        padded_row = (i[None, :] >= q_lens[:, None])[:, :, None]
        # padding rows attend key 0 only, so no row is empty (their output is discarded).
        mask = torch.where(padded_row, j[None, None, :] == 0, mask)
        key_valid = (j[None, :] < kv_lens[:, None])[:, None, :, None]
        return {"q_index": q_index, "out_index": out_index, "mask": mask[:, None], "key_valid": key_valid}

    def _padded(self, cache: torch.Tensor) -> torch.Tensor:
        """Pages of every request as ``[batch, kv_heads, pages * page_size, dim]``."""
        g = self.geometry
        pages = cache.index_select(0, self.page_table.view(-1))
        if self.problem.kv_layout == "NHD":  # type: ignore[union-attr]  # [B*P, S, H, D]
            s, h, d = pages.shape[1:]
            return pages.view(g.batch_size, g.keys, h, d).transpose(1, 2)
        h, s, d = pages.shape[1:]  # HND: [B*P, H, S, D]
        return pages.view(g.batch_size, g.keys // s, h, s, d).permute(0, 2, 1, 3, 4).reshape(g.batch_size, h, g.keys, d)

    def _gather(self, cache: torch.Tensor, explicit: bool = False) -> torch.Tensor:
        """The keys (or values) of every request as ``[batch, kv_heads, keys, dim]``.

        Slots that hold no key of the request (padding pages, the tail of the last page) are
        zeroed when a mask is in use: masking gives them probability 0, but 0 times a NaN left
        in unused cache memory would still be NaN. An fp8 cache is converted to the query dtype
        (exact: every fp8 value is a 16-bit one); the scales are applied by the caller.
        """
        out = self._padded(cache)
        if out.dtype != self._compute_dtype:
            out = out.to(self._compute_dtype)
        if self._attn_mask is None and self._sdpa is not None and not explicit:
            return out  # uniform lengths: keys past kv_len are cut, there is no padding page
        return out.masked_fill(~self.key_valid, 0)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        g = self.geometry
        p = self.problem
        hq = p.num_qo_heads
        qp = q.index_select(0, self.q_index).view(g.batch_size, g.q_len, hq, p.head_dim_qk).transpose(1, 2)
        explicit = self._sdpa is None or sinks is not None  # (SDPA has no sink term: sinks take the explicit path)
        kp = self._gather(k_cache, explicit)
        vp = self._gather(v_cache, explicit)
        if explicit:
            o, row_lse = self._explicit(qp, kp, vp, lse is not None, k_scale, v_scale, sinks)
        else:
            # dequantized in the cache dtype: sdpa's own scale is a Python float, a device scale is not
            if k_scale is not None:
                kp = kp * k_scale
            if v_scale is not None:
                vp = vp * v_scale
            o, row_lse = self._run_sdpa(qp, kp, vp), None
        rows = o.transpose(1, 2).reshape(g.batch_size * g.q_len, hq, p.head_dim_vo)
        torch.index_select(rows.to(out.dtype), 0, self.out_index, out=out)
        if lse is not None:
            assert row_lse is not None
            flat = row_lse.transpose(1, 2).reshape(g.batch_size * g.q_len, hq)
            torch.index_select(flat, 0, self.out_index, out=lse)

    def _explicit(
        self,
        qp: torch.Tensor,
        kp: torch.Tensor,
        vp: torch.Tensor,
        want_lse: bool,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = self.geometry
        p = self.problem
        hkv, group = p.num_kv_heads, p.gqa_ratio
        q32 = qp.float().reshape(g.batch_size, hkv, group * g.q_len, p.head_dim_qk)
        k32, v32 = kp.float(), vp.float()
        if k_scale is not None:
            k32 = k32 * k_scale
        if v_scale is not None:
            v32 = v32 * v_scale
        scores = torch.matmul(q32, k32.transpose(-1, -2)) * p.sm_scale
        if p.logits_soft_cap > 0:
            scores = torch.tanh(scores / p.logits_soft_cap) * p.logits_soft_cap
        scores = scores.view(g.batch_size, hkv, group, g.q_len, -1)
        scores = scores.masked_fill(~self.mask[:, :, None], float("-inf"))
        if sinks is not None:  # one more key per head, with no value: a column joining the softmax
            sink = sinks.view(1, hkv, group, 1, 1).expand(g.batch_size, hkv, group, g.q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
        row_lse = torch.logsumexp(scores, dim=-1) if want_lse else None
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        if self._custom:  # a row left no key: zeros (softmax over no key is NaN), LSE -inf
            probs = probs.masked_fill(~self.mask[:, :, None].any(-1, keepdim=True), 0.0)
        probs = probs.view(g.batch_size, hkv, group * g.q_len, -1)
        o = torch.matmul(probs, v32).view(g.batch_size, p.num_qo_heads, g.q_len, p.head_dim_vo)
        if row_lse is not None:
            row_lse = row_lse.reshape(g.batch_size, p.num_qo_heads, g.q_len)
        return o, row_lse

    def _run_sdpa(self, qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import sdpa_kernel

        p = self.problem
        if self._attn_mask is None:
            kp, vp = kp[:, :, : self._kv_len], vp[:, :, : self._kv_len]
        if not self._gqa_native and p.gqa_ratio > 1:
            kp = kp.repeat_interleave(p.gqa_ratio, dim=1)
            vp = vp.repeat_interleave(p.gqa_ratio, dim=1)
        assert self._sdpa is not None
        with sdpa_kernel(self._sdpa):
            return F.scaled_dot_product_attention(
                qp,
                kp,
                vp,
                attn_mask=self._attn_mask,
                is_causal=self.is_causal,
                scale=p.sm_scale,
                enable_gqa=self._gqa_native and p.gqa_ratio > 1,
            )


class _RaggedPlan(_AttentionPlan):
    """Padded-gather attention over keys and values packed per request (ragged-KV prefill)."""

    BUFFERS: ClassVar[tuple[str, ...]] = ("kv_index", "q_index", "out_index", "mask", "key_valid")
    kv_index: torch.Tensor  # [batch * keys] row of k and v gathered into each padded key slot

    def _geometry(self, batch: RaggedBatch, q_len: int, kv_len: int) -> _Geometry:  # type: ignore[override]
        return _Geometry(batch.batch_size, batch.num_qo_tokens, q_len, kv_len, batch.num_kv_tokens)

    def _indices(self, batch: RaggedBatch, causal: bool) -> dict[str, torch.Tensor]:  # type: ignore[override]
        g = self.geometry
        dev = batch.on(self.device)
        out = self._rows_and_mask(dev.qo_indptr, dev.qo_lens, dev.kv_lens, causal, None)
        j = torch.arange(g.keys, device=self.device)
        last_key = (dev.kv_lens.long() - 1).clamp(min=0)
        kv_index = dev.kv_indptr[:-1].long()[:, None] + torch.minimum(j[None, :], last_key[:, None])
        out["kv_index"] = kv_index.clamp(0, max(g.kv_tokens - 1, 0)).reshape(-1)
        return out

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        keys = rows.index_select(0, self.kv_index)  # [B*K, H, D]
        return keys.view(g.batch_size, g.keys, *keys.shape[1:]).transpose(1, 2)


def _plan_attention(
    problem: _Attention,
    batch: Batch,
    tactic: Tactic,
    options: PlanOptions,
    plan: type[_AttentionPlan] = _AttentionPlan,
) -> _AttentionPlan:
    concrete = _concrete(problem, tactic, batch)
    reasons = _attention_reasons(problem, concrete, batch)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return plan(problem, batch, concrete, options)


@hookimpl
def tactix_plan_prefill(
    problem: PrefillProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions
) -> _AttentionPlan | None:
    return _plan_attention(problem, batch, tactic, options)


@hookimpl
def tactix_plan_decode(
    problem: DecodeProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions
) -> _AttentionPlan | None:
    return _plan_attention(problem, batch, tactic, options)


@hookimpl
def tactix_plan_ragged_prefill(
    problem: RaggedPrefillProblem, batch: RaggedBatch, tactic: Tactic, options: PlanOptions
) -> _AttentionPlan | None:
    return _plan_attention(problem, batch, tactic, options, _RaggedPlan)


# --------------------------------------------------------------------------------------------
# GEMM


class _GemmPlan:
    def __init__(self, problem: GemmProblem, tactic: Tactic) -> None:
        self.problem = problem
        self.tactic = tactic
        self.built = False
        self._out_dtype = to_torch_dtype(problem.out_dtype)
        self.run = {  # type: ignore[method-assign]
            "matmul": self._matmul,
            "scaled_mm": self._scaled_mm,
            "dequant": self._dequant,
        }[tactic.kernel]

    def run(  # replaced per kernel in __init__; kept for the protocol
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        scale_a: torch.Tensor | None,
        scale_b: torch.Tensor | None,
    ) -> None:
        raise NotImplementedError

    def _matmul(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        scale_a: torch.Tensor | None,
        scale_b: torch.Tensor | None,
    ) -> None:
        if a.dim() == 2:
            if bias is None:
                torch.mm(a, b, out=out)
            else:
                torch.addmm(bias, a, b, out=out)
        elif bias is None:
            torch.bmm(a, b, out=out)
        else:
            torch.baddbmm(bias, a, b, out=out)

    def _scaled_mm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        scale_a: torch.Tensor | None,
        scale_b: torch.Tensor | None,
    ) -> None:
        assert scale_a is not None and scale_b is not None
        torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=self._out_dtype, out=out)

    def _dequant(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        scale_a: torch.Tensor | None,
        scale_b: torch.Tensor | None,
    ) -> None:
        assert scale_a is not None and scale_b is not None
        acc = torch.matmul(a.float(), b.float()) * (scale_a.float() * scale_b.float())
        if bias is not None:
            acc = acc + bias.float()
        out.copy_(acc)


@hookimpl
def tactix_plan_gemm(problem: GemmProblem, tactic: Tactic, options: PlanOptions) -> _GemmPlan | None:
    concrete = _concrete(problem, tactic, None)
    reasons = _gemm_reasons(problem, concrete)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return _GemmPlan(problem, concrete)


class _MergePlan:
    """The merge in torch ops (`tactix.merge.combine_states`), written into the caller's outputs."""

    def __init__(self, problem: MergeProblem, tactic: Tactic) -> None:
        self.problem = problem
        self.tactic = tactic
        self.built = False

    def run(self, vs: Any, ss: Any, out_v: torch.Tensor, out_s: torch.Tensor, mask: torch.Tensor | None) -> None:
        from tactix.merge import combine_states

        merged_v, merged_s = combine_states(vs, ss)
        if mask is not None:  # (out_v / out_s may be the first state's own tensors: the in-place form)
            merged_v = torch.where(mask[:, None, None], merged_v, out_v.float())
            merged_s = torch.where(mask[:, None], merged_s, out_s)
        out_v.copy_(merged_v)
        out_s.copy_(merged_s)


@hookimpl
def tactix_plan_merge_states(problem: MergeProblem, tactic: Tactic, options: PlanOptions) -> _MergePlan | None:
    concrete = _concrete(problem, tactic, None)
    reasons = _reasons(problem, concrete, None)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return _MergePlan(problem, concrete)
