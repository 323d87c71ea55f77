"""tactix hooks for the ``cudnn`` backend: paged prefill and decode through cuDNN frontend graphs.

Tactics are cuDNN execution plans named by engine id and knob settings
(``Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"KERNEL_CFG": 35}})``);
the default tactic is cuDNN's heuristic first choice. A tactic is mapped back to a plan by its
engine and knobs, never by a plan index. GEMM (``kernel="matmul"``) is a matmul graph with
fp8 per-tensor scales and bias fused as pointwise nodes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
from typing import Any, Final

import torch

import tactix
from tactix import (
    DecodeProblem,
    GemmProblem,
    PagedBatch,
    PlanOptions,
    PrefillProblem,
    Problem,
    RaggedBatch,
    RaggedPrefillProblem,
    Tactic,
    UnsupportedProblemError,
)
from tactix.plugin import (
    CacheAxes,
    ReferenceCall,
    Staging,
    bucket_size,
    cache_axes,
    compute_capability,
    cuda_available,
    dense_strides,
    gather_table,
    raw_stream,
    stale_slot_failures,
    write_int32,
    write_table,
)
from tactix_cudnn import __version__, ragged
from tactix_cudnn.graphs import (
    UID_A,
    UID_B,
    UID_BIAS,
    UID_C,
    UID_K,
    UID_O,
    UID_O_OFF,
    UID_Q,
    UID_Q_OFF,
    UID_SCALE_A,
    UID_SCALE_B,
    UID_SEQ_KV,
    UID_SEQ_Q,
    UID_SINKS,
    UID_STATS,
    UID_STATS_OFF,
    UID_TABLE,
    UID_V,
    BuiltGraph,
    GemmKey,
    GraphKey,
    enumerate_plans,
    excluded_plans,
    exclusion,
    graph_cache,
)
from tactix_cudnn.library import feature_reasons, frontend, status

NAME: Final = "cudnn"
_DTYPES: Final = frozenset({"float16", "bfloat16"})

_ATTENTION = tactix.AttentionCapabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=_DTYPES,
    kv_dtypes=_DTYPES,
    out_dtypes=_DTYPES,
    head_dims=None,  # any multiple of 8 up to 256 (checked)
    page_sizes=None,  # any power of two (checked)
    kv_layouts=frozenset({"NHD", "HND"}),
    causal=True,
    non_causal=True,
    chunked=True,
    sliding_window=True,
    logits_soft_cap=False,
    lse=True,
    cuda_graph="fixed_buffers",
)
_PREFILL = _ATTENTION.model_copy(update={"different_vo_head_dim": True, "run_extras": frozenset({"sinks"})})
"""Prefill also takes a value head dim other than the query/key one (DeepSeek's 192/128: cuDNN's
SDPA graph has separate dims for K and V), and attention sinks (cuDNN's ``sink_token``, library
9.13 and newer). Decode keeps the dims equal and takes no sinks: cuDNN 9.19 offers no engine for a
graph with one query row and a sink token ("decode only mode ... not supported with sink_token",
`benchmarks/cudnn_sinks_probe.py`, results in ``benchmarks/results/cudnn-sinks-probe-*.json``)."""


_RAGGED = tactix.RaggedPrefillCapabilities.model_validate(
    {name: value for name, value in _PREFILL.model_dump().items()
     if name in tactix.RaggedPrefillCapabilities.model_fields}
)  # fmt: skip
"""Ragged-KV prefill: what paged prefill declares, with K and V packed like the queries (ragged
offsets, no page table: `tactix_cudnn.ragged`)."""

_GEMM = tactix.GemmCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset(
        [tactix.GemmDTypes(a=t, b=t, out=t) for t in ("float16", "bfloat16")]
        + [
            tactix.GemmDTypes(a="float8_e4m3fn", b="float8_e4m3fn", out=o, scale_mode="per_tensor")
            for o in ("float16", "bfloat16")
        ]
    ),
    a_m_major=True,
    b_n_major=True,
    bias=True,
    batched=True,
    cuda_graph="fixed_buffers",
)


@tactix.hookimpl
def tactix_backends() -> list[tactix.BackendSpec]:
    return [
        tactix.BackendSpec(
            name=NAME,
            version=__version__,
            description="cuDNN frontend graphs (paged SDPA); tactics are cuDNN engines and knobs",
            prefill=_PREFILL,
            decode=_ATTENTION,
            ragged_prefill=_RAGGED,
            gemm=_GEMM,
            preference=10,
        )
    ]


def _capability() -> tuple[int, int]:
    """The current GPU's compute capability ((99, 0) without a GPU: no capability reason then;
    the environment already says there is no GPU)."""
    return compute_capability() or (99, 0)


@tactix.hookimpl
def tactix_environment() -> list[str] | None:
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU is visible")
    st = status()
    if not st.usable:
        reasons.append(st.error or "cuDNN is not usable")
    return reasons


def _params_reasons(tactic: Tactic, kernel: str = "sdpa") -> list[str]:
    if tactic.is_default:
        return [] if not tactic.params else [f"the default tactic takes no params (got {tactic.params})"]
    if tactic.kernel != kernel:
        if tactic.kernel in ("sdpa", "matmul"):
            return [f"kernel '{tactic.kernel}' is not this op's (this op's: default, {kernel})"]
        return [f"unknown kernel '{tactic.kernel}' (known: default, sdpa, matmul)"]
    engine, knobs = tactic.params.get("engine"), tactic.params.get("knobs", {})
    if not isinstance(engine, int) or isinstance(engine, bool) or engine < 0:
        return [f"params.engine must be a cuDNN engine id (got {engine!r})"]
    if not isinstance(knobs, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in knobs.items()):
        return [f"params.knobs must map knob names to ints (got {knobs!r})"]
    if set(tactic.params) - {"engine", "knobs"}:
        return [f"unknown params {sorted(set(tactic.params) - {'engine', 'knobs'})}"]
    return []


AttentionProblem = PrefillProblem | DecodeProblem | RaggedPrefillProblem


def _static_sig(problem: AttentionProblem) -> tuple[Any, ...]:
    """Every field of an attention problem but its batch sizes (what reasons and graph keys read)."""
    paged = not isinstance(problem, RaggedPrefillProblem)
    return (problem.__class__, problem.q_dtype, problem.kv_dtype, problem.out_dtype, problem.num_qo_heads,
            problem.num_kv_heads, problem.head_dim_qk, problem.head_dim_vo, problem.page_size if paged else 0,  # type: ignore[union-attr]
            problem.kv_layout if paged else None,  # type: ignore[union-attr]
            problem.window_left, problem.sm_scale, problem.logits_soft_cap, problem.return_lse,
            problem.deterministic, problem.causal, problem.run_extras)  # fmt: skip


_reasons_memo: dict[tuple[Any, ...], tuple[str, ...]] = {}


def _attention_reasons(problem: AttentionProblem) -> list[str]:
    """Why cuDNN cannot serve ``problem`` (none of it depends on the batch), remembered per set of
    static fields and device: checks and plans ask for every batch."""
    sig = (_static_sig(problem), torch.cuda.current_device() if cuda_available() else -1)
    found = _reasons_memo.get(sig)
    if found is None:
        if len(_reasons_memo) >= 1024:
            _reasons_memo.clear()
        found = _reasons_memo[sig] = tuple(_attention_reasons_now(problem))
    return list(found)


def _attention_reasons_now(problem: AttentionProblem) -> list[str]:
    out = []
    if problem.kv_dtype != problem.q_dtype or problem.out_dtype != problem.q_dtype:
        out.append("q, kv and out dtypes must be the same")
    for name in ("head_dim_qk", "head_dim_vo"):
        d = getattr(problem, name)
        if d % 8 or d > 256:
            out.append(f"{name} {d} must be a multiple of 8 up to 256")
    paged = not isinstance(problem, RaggedPrefillProblem)
    if not isinstance(problem, RaggedPrefillProblem) and problem.page_size & (problem.page_size - 1):
        out.append(f"page size {problem.page_size} must be a power of two")
    if isinstance(problem, DecodeProblem) and problem.return_lse and problem.gqa_ratio > 1:
        # seen on an H200 with cuDNN 9.19 (conformance kit): its only decode engine (8) leaves the
        # LSE of all but one query head per GQA group unwritten
        out.append("LSE from GQA decode: cuDNN's decode engine writes it for one query head per group only")
    features = ["sdpa", "paged_kv", "ragged_paged"] if paged else ["sdpa", "ragged_kv"]
    if "sinks" in problem.run_extras:
        features.append("attention_sinks")
    if problem.causal or problem.window_left >= 0:
        features.append("bottom_right_causal")
    if problem.window_left >= 0:
        features.append("sliding_window")
    out += feature_reasons(*features)
    st = status()
    if st.library_version in (91000, 91001):
        out.append("cuDNN 9.10.0 and 9.10.1 disable fp16/bf16 SDPA; use 9.10.2 or newer")
    if _capability() < (8, 0):
        out.append("cuDNN paged SDPA needs compute capability 8.0 or newer")
    return out


@tactix.hookimpl
def tactix_check(problem: Problem, tactic: Tactic) -> list[str] | None:
    if isinstance(problem, GemmProblem):
        return _params_reasons(tactic, "matmul") + _gemm_reasons(problem)
    reasons = _params_reasons(tactic) + _attention_reasons(problem)
    if not reasons and not tactic.is_default:
        probe = _probe_key(problem)
        why = exclusion(excluded_plans(probe), int(tactic.params["engine"]), _knob_items(tactic))  # type: ignore[arg-type]
        if why:
            reasons.append(why)
    return reasons


_ALIGN_BYTES: Final = 16


def _gemm_reasons(problem: GemmProblem) -> list[str]:
    out = []
    fp8 = problem.scale_mode == "per_tensor"
    operand_bytes = 1 if fp8 else 2
    a_dense = ("k", problem.k) if problem.a_k_major or problem.m == 1 else ("m", problem.m)
    b_dense = ("k", problem.k) if problem.b_k_major or problem.n == 1 else ("n", problem.n)
    # the rows cuDNN reads and writes must start 16-byte aligned
    for what, (name, extent), size in (("a", a_dense, operand_bytes), ("b", b_dense, operand_bytes),
                                       ("out", ("n", problem.n), 2)):  # fmt: skip
        multiple = _ALIGN_BYTES // size
        if extent % multiple:
            out.append(f"cuDNN matmul needs 16-byte aligned rows of {what}: {name} must be a multiple of "
                       f"{multiple} (got {extent})")  # fmt: skip
    if fp8:
        if a_dense[0] != "k" or b_dense[0] != "k":
            out.append("fp8 matmul needs both operands k-major (a row-major [m, k], b a transposed [n, k])")
        if _capability() < (8, 9):
            out.append("fp8 matmul needs compute capability 8.9 or newer")
        out += feature_reasons("fp8_matmul")
    else:
        out += feature_reasons("matmul")
    return out


# -- handles and keys --------------------------------------------------------------------------

_handles: dict[int, Any] = {}
_bound_stream: dict[int, int] = {}  # id(handle) -> the stream it is bound to
_handles_lock = threading.Lock()


def handle_for(device: torch.device) -> Any:
    """One cuDNN handle per device (bound to torch's current stream before each execution)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _handles_lock:
        h = _handles.get(index)
        if h is None:
            with torch.cuda.device(index):
                h = _handles[index] = frontend().create_handle()
    return h


def _bind_stream(handle: Any, device: torch.device) -> None:
    """Point the handle at torch's current stream (a set_stream call only when it changed)."""
    stream = raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    if _bound_stream.get(id(handle)) != stream:
        frontend().set_stream(handle, stream)
        _bound_stream[id(handle)] = stream


def _container(axes: CacheAxes) -> tuple[int, int, int, int]:
    """Strides in the order of the graph's logical [pages, heads, page, dim] container."""
    return (axes.page, axes.head, axes.token, axes.dim)


def _container_strides(t_stride: tuple[int, ...], layout: str) -> tuple[int, int, int, int]:
    """Strides of the logical [pages, heads, page, dim] container of a cache tensor."""
    return _container(cache_axes(t_stride, layout))


def _contiguous_strides(problem: PrefillProblem | DecodeProblem, dim: int) -> tuple[int, int, int, int]:
    return _container(dense_strides(problem.kv_layout, problem.page_size, problem.num_kv_heads, dim))


Strides = tuple[int, int, int, int]


def _knob_items(tactic: Tactic) -> tuple[tuple[str, int], ...]:
    knobs = tactic.params.get("knobs", {})
    assert isinstance(knobs, dict)  # _params_reasons refused anything else before a plan is made
    return tuple(sorted((str(k), int(v)) for k, v in knobs.items()))  # type: ignore[arg-type]


_keys_memo: dict[tuple[Any, ...], tuple[Tactic, GraphKey]] = {}


def _graph_max_q(decode: bool, max_q: int, sinks: bool) -> int:
    """The graph's query rows per request: the bucket of the longest request's; at least 2 with
    sinks (cuDNN has no engine for one query row with a sink token; the padding mask leaves the
    rows past a request's own untouched, as for every request shorter than the bucket)."""
    if decode:
        return 1
    rows = bucket_size(max(max_q, 1))
    return max(rows, 2) if sinks else rows


NO_STRIDES: Final = (0, 0, 0, 0)
"""The cache strides of a key whose K and V are packed rows (ragged-KV prefill: no container)."""


def _key(problem: AttentionProblem, batch_size: int, max_q: int, max_kv: int, pages: int,
         k_strides: Strides, v_strides: Strides, tactic: Tactic, sinks: bool | None = None) -> GraphKey:  # fmt: skip
    """The graph key of a batch's buckets, remembered (a 21-field frozen dataclass costs microseconds).
    ``sinks``: whether the graph takes them (None: if the problem plans for them). Ragged-KV
    prefill has no pages: ``pages`` 0 and `NO_STRIDES`."""
    decode = isinstance(problem, DecodeProblem)
    if sinks is None:
        sinks = "sinks" in problem.run_extras
    sig = (_static_sig(problem), batch_size if decode else bucket_size(batch_size),
           _graph_max_q(decode, max_q, sinks), bucket_size(max_kv), bucket_size(pages), k_strides, v_strides,
           id(tactic), sinks)  # fmt: skip
    found = _keys_memo.get(sig)
    if found is not None and found[0] is tactic:  # the entry holds the tactic: its id is not reused
        return found[1]
    key = _make_key(problem, batch_size, max_q, max_kv, pages, k_strides, v_strides, tactic, sinks)
    if len(_keys_memo) >= 4096:
        _keys_memo.clear()
    _keys_memo[sig] = (tactic, key)
    return key


def _make_key(problem: AttentionProblem, batch_size: int, max_q: int, max_kv: int, pages: int,
              k_strides: Strides, v_strides: Strides, tactic: Tactic, sinks: bool) -> GraphKey:  # fmt: skip
    max_kv_b = bucket_size(max(max_kv, 1))
    decode = isinstance(problem, DecodeProblem)
    page = 0 if isinstance(problem, RaggedPrefillProblem) else problem.page_size
    return GraphKey(
        dtype=problem.q_dtype,
        num_qo_heads=problem.num_qo_heads,
        num_kv_heads=problem.num_kv_heads,
        head_dim_qk=problem.head_dim_qk,
        head_dim_vo=problem.head_dim_vo,
        page_size=page,
        k_strides=k_strides,
        v_strides=v_strides,
        container_pages=bucket_size(pages),
        # decode reads q in place, one row per request: its batch is exact, not bucketed
        batch=batch_size if decode else bucket_size(batch_size),
        max_q=_graph_max_q(decode, max_q, sinks),
        max_kv=max_kv_b,
        table_width=-(-max_kv_b // page) if page else 0,
        causal=problem.causal,
        window=problem.window_left,
        scale=problem.sm_scale,
        lse=problem.return_lse,
        engine=None if tactic.is_default else int(tactic.params["engine"]),  # type: ignore[arg-type]
        knobs=() if tactic.is_default else _knob_items(tactic),
        ragged_q=not decode,
        deterministic=problem.deterministic,
        sinks=sinks,
        ragged_kv=not page,
    )


@tactix.hookimpl
def tactix_tactics(problem: Problem) -> list[Tactic] | None:
    if isinstance(problem, GemmProblem):
        if tactix_environment() or _gemm_reasons(problem):
            return []
        a_strides, b_strides = _gemm_strides(problem)
        gemm_key = _gemm_key(problem, a_strides, b_strides, Tactic.default(NAME))
        return _tactics("matmul", gemm_key)
    if tactix_environment() or _attention_reasons(problem):
        return []
    if isinstance(problem, RaggedPrefillProblem):
        return _tactics("sdpa", _probe_key(problem))
    key = _key(problem, problem.batch_size, problem.max_qo_len, problem.max_kv_len,
               problem.batch_size * -(-problem.max_kv_len // problem.page_size),
               _contiguous_strides(problem, problem.head_dim_qk), _contiguous_strides(problem, problem.head_dim_vo),
               Tactic.default(NAME))  # fmt: skip
    return _tactics("sdpa", key)


def _probe_key(problem: AttentionProblem) -> GraphKey:
    """A graph key of the problem's sizes with the default tactic (what the exclusions and
    cuDNN's plan list depend on)."""
    pages = 0 if isinstance(problem, RaggedPrefillProblem) else 1
    return _key(problem, problem.batch_size, problem.max_qo_len, problem.max_kv_len, pages, NO_STRIDES, NO_STRIDES,
                Tactic.default(NAME))  # fmt: skip


def _tactics(kernel: str, key: GraphKey | GemmKey) -> list[Tactic]:
    """One tactic per distinct (engine, knobs) that cuDNN offers for ``key``."""
    found = enumerate_plans(key, handle_for(torch.device("cuda", torch.cuda.current_device())))
    return list(dict.fromkeys(Tactic(backend=NAME, kernel=kernel, params={"engine": e, "knobs": k}) for e, k in found))


# -- plans -----------------------------------------------------------------------------------


_ALIGN: Final = 32  # int32 elements: 128 bytes


@functools.lru_cache(maxsize=64)
def _zeros(n: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def _span(n: int) -> int:
    """Entries a section of ``n`` takes: ``n`` rounded up to the 128-byte alignment."""
    return n + (-n % _ALIGN)


@functools.lru_cache(maxsize=256)
def metadata_offsets(batch: int, ragged: bool, lse: bool, starts: bool = True) -> tuple[int, ...]:
    """Where each section of `host_metadata` starts (int32 entries), for a key of ``batch``
    requests: q lengths, kv lengths, row starts (-1 without them), then for ragged q the q, out
    and (with ``lse``) stats offsets."""
    sizes = [batch, batch, batch if starts else 0]
    if ragged:
        sizes += [batch + 1] * (3 if lse else 2)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at if n else -1)
        at += _span(n)
    return tuple(offsets)


_NO_PAGES: Final = [0] * 4096  # sliced for padding (list slices are C-level copies)


def host_metadata(problem: PrefillProblem | DecodeProblem, batch: PagedBatch, key: GraphKey, *,
                  starts: bool = True) -> tuple[list[int], tuple[int, ...]]:  # fmt: skip
    """The small int32 metadata of a plan as one flat list, and where each section starts.

    Sections (each 128-byte aligned, `metadata_offsets`; ``key.batch`` entries, requests past the
    real batch empty): q lengths, kv lengths, each request's first entry in the page indices
    (only with ``starts``: a table gathered on the device reads them; requests past the real
    batch start at the number of entries, as `Staging.gather` requires), and for ragged q the
    element offsets of q, out and (with LSE) the stats rows (``key.batch + 1`` entries each).
    A re-plan pays for this every batch: a few list concatenations and comprehensions.
    """
    b, real = key.batch, batch.batch_size
    span = _span(b)
    pad = _NO_PAGES[: span - real] if span - real <= len(_NO_PAGES) else [0] * (span - real)
    flat = (batch.qo_lens_list + pad) if key.ragged_q else ([1] * real + pad)  # decode: one row each
    flat += batch.kv_lens_list
    flat += pad
    if starts:
        # rows past the batch start at the last entry (`Staging.gather`'s kernel ends each row
        # at the next row's start: a padding row starting at 0 would end the last request there)
        flat += batch.kv_indptr_list
        del flat[-1]
        flat += [batch.num_page_entries] * (span - real)
    if key.ragged_q:
        qo = batch.qo_indptr_list
        rows = qo + [qo[-1]] * (b - real) if b > real else qo
        tail = [0] * (_span(b + 1) - b - 1)
        hq = problem.num_qo_heads
        q_row, o_row = hq * problem.head_dim_qk, hq * problem.head_dim_vo
        flat += [s * q_row for s in rows]
        flat += tail
        flat += [s * o_row for s in rows]
        flat += tail
        if key.lse:
            flat += [s * hq for s in rows]
            flat += tail
    return flat, metadata_offsets(b, key.ragged_q, key.lse, starts)


_HOST_TABLE_ENTRIES: Final = 1 << 20
"""Up to this many page entries host indices go through the wrapper's staging slots (`Staging`);
larger batches send the CSR indices in a buffer of their own and gather the table on the device."""


_HOST_ROWS: Final = 16
"""Up to this many table rows the page table is laid out on the host (one C-level copy per row);
larger batches send the CSR indices in the same transfer and gather the rows on the device (one
kernel, whatever the batch size)."""


@functools.lru_cache(maxsize=256)
def _fixed_addresses(base: int, table: int, offsets: tuple[int, ...], ragged: bool, lse: bool) -> dict[int, int]:
    """The metadata addresses a graph reads, by tensor uid, for metadata staged at ``base``.
    Shared between plans: never modified (run() copies it)."""
    fixed = {UID_SEQ_Q: base + 4 * offsets[0], UID_SEQ_KV: base + 4 * offsets[1], UID_TABLE: table}
    if ragged:
        fixed[UID_Q_OFF] = base + 4 * offsets[3]
        fixed[UID_O_OFF] = base + 4 * offsets[4]
        if lse:
            fixed[UID_STATS_OFF] = base + 4 * offsets[5]
    return fixed


def _held_shape(batch: PagedBatch, pages: int,
                captured: tuple[int, int, int, int] | None) -> tuple[int, int, int, int]:  # fmt: skip
    """A plan's (batch size, longest q, longest kv, container pages): the batch's own, or in
    CUDA-graph mode at least the captured plan's, so a shorter batch keeps the captured graph (as
    FlashInfer's CUDA-graph wrappers serve any batch their buffers hold)."""
    if captured is None:
        return batch.batch_size, batch.max_qo_len, batch.max_kv_len, pages
    _, q, kv, container = captured
    return batch.batch_size, max(batch.max_qo_len, q), max(batch.max_kv_len, kv), max(pages, container)


class CudnnAttentionPlan:
    """Device metadata for one batch plus the graph(s) that read it.

    The graph for contiguous (k, v) caches is built in plan; a cache with other strides (one
    5-D tensor whose k and v interleave) gets its graph at its first run, outside any capture.

    Plan does little host work: the per-request lengths and offsets are packed from the batch's
    Python lists into one int32 array; the page indices travel to the device as given (CSR) in
    the same transfer, and the padded page table cuDNN reads is gathered from them on the
    device by one ``index_select`` over a sliding-window view (row ``r`` = the ``width``
    entries from ``kv_indptr[r]``; entries past a request's own pages are never read).
    """

    _shape: tuple[int, int, int, int]  # batch size, longest q, longest kv, container pages
    _small: torch.Tensor | None  # device: lengths, offsets and row starts (None: in the staging slot)
    _table: torch.Tensor | None  # device: the padded page table [batch, width] (None: in the staging slot)
    _base_key: GraphKey
    handle: Any  # the device's cuDNN handle (`handle_for`)

    def __init__(self, problem: PrefillProblem | DecodeProblem, batch: PagedBatch, tactic: Tactic,
                 options: PlanOptions) -> None:  # fmt: skip
        self.problem = problem
        self.device = options["device"]
        previous = options["previous"]
        prev = previous if isinstance(previous, CudnnAttentionPlan) and previous.device == self.device else None
        self.handle = prev.handle if prev is not None else handle_for(self.device)
        max_page = batch.max_page_index
        # device-resident indices, eager: the container the replaced plan held, grown by run() to
        # the cache's pages (`_fit_cache`); the first plan, and every CUDA-graph plan (whose
        # captured graph no run() can grow), read the largest index (one host sync)
        self._fit_to_cache = max_page is None and prev is not None and not options["use_cuda_graph"]
        if max_page is not None:
            pages = max_page + 1
        elif self._fit_to_cache:
            assert prev is not None
            pages = prev._shape[3]
        else:
            pages = int(batch.kv_indices.max()) + 1 if batch.num_page_entries else 1
        graph_mode = options["use_cuda_graph"] and isinstance(previous, CudnnAttentionPlan)
        captured = previous._shape if isinstance(previous, CudnnAttentionPlan) and graph_mode else None
        self._shape = _held_shape(batch, pages, captured)
        self._requested = tactic
        base = self._key(_contiguous_strides(problem, problem.head_dim_qk),
                         _contiguous_strides(problem, problem.head_dim_vo))  # fmt: skip
        if graph_mode and (prev is None or prev._base_key is not base):
            assert isinstance(previous, CudnnAttentionPlan)
            # the re-plan names the concrete plan the first one chose: compare shapes, not tactics
            if dataclasses.replace(previous._base_key, engine=None, knobs=()) != dataclasses.replace(
                base, engine=None, knobs=()
            ):
                raise UnsupportedProblemError(NAME, problem, [
                    "in CUDA-graph mode a re-plan must keep the batch size and fit the captured graph's "
                    "buckets (lengths, pages): capture with the longest batch, or use one wrapper per "
                    "captured shape"])  # fmt: skip
        self._base_key = base
        self._graph_mode = bool(options["use_cuda_graph"])
        self._staging: Staging | None = previous._staging if isinstance(previous, CudnnAttentionPlan) else None
        self._small: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        self._fill_metadata(batch, base, previous if graph_mode else None)  # type: ignore[arg-type]
        graph, self.built = graph_cache.get(base, self.handle)
        # by (container strides, sinks); _by_strides by the tensors' own strides and sinks
        self._graphs: dict[tuple[tuple[int, ...], tuple[int, ...], bool], BuiltGraph] = {}
        self._graphs[(base.k_strides, base.v_strides, base.sinks)] = graph
        self._by_strides: dict[tuple[tuple[int, ...], tuple[int, ...], bool], BuiltGraph] = {}
        self.tactic = graph.tactic
        workspace = getattr(previous, "_workspace", None)
        if not isinstance(workspace, torch.Tensor) or workspace.numel() < graph.workspace_size:
            workspace = torch.empty(max(graph.workspace_size, 1), dtype=torch.uint8, device=self.device)
        self._workspace = workspace  # stream-ordered reuse: the previous plan is replaced by this one
        # for a strided q (a view of a fused QKV projection); taken over from the replaced plan, as the
        # workspace is (a captured CUDA graph keeps reading the buffer it was captured with)
        self._q_packed: torch.Tensor | None = prev._q_packed if prev is not None else None

    def replan(self, problem: PrefillProblem | DecodeProblem, batch: PagedBatch,
               options: PlanOptions) -> CudnnAttentionPlan | None:  # fmt: skip
        """This plan, made the plan of a new batch of its graph buckets (the core's fast re-plan,
        see `tactix.selection.replan_selection`; ``problem`` has this plan's static fields): the
        same graph, handle, workspace and staging, new metadata. None (and this plan unchanged)
        for a batch of other buckets, another device or mode, or device-resident indices in
        CUDA-graph mode. Eager device-resident indices keep this plan's container (run() grows it
        to the cache's pages). What ``tactix_check`` says depends on the static fields, the
        tactic and these buckets only."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph_mode:
            return None
        max_page = batch.max_page_index
        fit_to_cache = max_page is None
        if fit_to_cache and self._graph_mode:
            return None  # the full plan reads the largest index: a captured graph's container cannot grow
        key = self._base_key
        pages = self._shape[3] if max_page is None else max_page + 1
        shape = _held_shape(batch, pages, self._shape if self._graph_mode else None)
        b, longest_q, longest_kv, pages = shape
        if key.ragged_q:
            same = key.batch == bucket_size(b) and key.max_q == _graph_max_q(False, longest_q, key.sinks)
        else:
            same = key.batch == b
        if not (same and key.max_kv == bucket_size(longest_kv) and key.container_pages == bucket_size(pages)):
            return None
        # this plan becomes the new batch's (the wrapper replaces its plan by the one returned):
        # graph(s), handle, workspace, staging and tactic stay, the metadata is the batch's
        self._fill_metadata(batch, key, self if self._graph_mode else None)
        self.problem = problem
        self._shape = shape
        self._fit_to_cache = fit_to_cache
        self.built = False
        return self

    def _key(self, k_strides: tuple[int, int, int, int], v_strides: tuple[int, int, int, int],
             sinks: bool | None = None) -> GraphKey:  # fmt: skip
        b, q, kv, pages = self._shape
        return _key(self.problem, b, q, kv, pages, k_strides, v_strides, self._requested, sinks)

    def _fill_metadata(self, batch: PagedBatch, key: GraphKey, previous: CudnnAttentionPlan | None) -> None:
        b, width, nnz = key.batch, key.table_width, batch.num_page_entries
        indices = batch.kv_indices
        if nnz <= _HOST_TABLE_ENTRIES:
            # host indices: laid out on the host for a few rows, else sent as CSR and gathered;
            # device indices: gathered on the device, read where they are
            from_device = not indices.is_cpu
            on_host = b <= _HOST_ROWS and not from_device
            flat, offsets = host_metadata(self.problem, batch, key, starts=not on_host)  # no gather: no row starts
            n = len(flat)
            # one pinned buffer written with C-level copies and one transfer into the wrapper's
            # staging slot: [small | the page table] for a few rows, else [small | the CSR
            # indices | width zeros] and one gather on the device (torch.tensor(list) costs
            # ~90 ns per element; this ~1); device indices are read in place by the gather's
            # kernel (no host read, no sync)
            if previous is not None and previous._staging is None:
                raise UnsupportedProblemError(NAME, self.problem, [
                    "in CUDA-graph mode a re-plan must keep the graph's buckets (page entries)"])  # fmt: skip
            # sized by the buckets alone (nnz <= rows x width), so that CUDA-graph re-plans of the
            # same buckets keep the slot and its addresses
            size = n + b * width + (0 if on_host else width)
            mine = Staging.reuse(self._staging, self.device, size, 0 if on_host else b * width)
            if previous is not None and mine is not self._staging:
                raise UnsupportedProblemError(NAME, self.problem, [
                    "in CUDA-graph mode a re-plan must keep the graph's buckets (metadata size)"])  # fmt: skip
            self._staging = mine
            if not from_device and (indices.dtype != torch.int32 or not indices.is_contiguous()):
                indices = indices.to(torch.int32).contiguous()
            src = 0 if from_device else indices.data_ptr()
            indptr = batch.kv_indptr_list

            def fill(dst: int) -> None:
                write_int32(dst, flat)
                if on_host:
                    write_table(dst + 4 * n, src, indptr, b, width)
                    return
                if src:  # (device indices overwrite their entries after the transfer)
                    ctypes.memmove(dst + 4 * n, src, 4 * nnz)
                ctypes.memset(dst + 4 * (n + nnz), 0, 4 * width)

            slot = mine.slot(self._graph_mode)
            base = mine.send(slot, n + (b * width if on_host else nnz + width), fill)
            # device indices go to the gather, stream-ordered after the transfer (nnz entries:
            # PagedBatch.build narrowed them)
            table_ptr = base + 4 * n if on_host else mine.gather(slot, n, b, width, offsets[2], nnz,
                                                                  indices if from_device else None)  # fmt: skip
            # the same slot and table give the same addresses: one dict per (slot, table), kept
            # across re-plans (run() copies it before adding the tensors' addresses)
            self._fixed = _fixed_addresses(base, table_ptr, offsets, key.ragged_q, key.lse)
            return
        else:
            flat, offsets = host_metadata(self.problem, batch, key)
            n = len(flat)
            small_host = torch.tensor(flat, dtype=torch.int32)
            if indices.device.type == "cpu":
                # one pinned buffer and one transfer: [small | page indices | width zeros]
                packed = torch.cat([small_host, indices, _zeros(width)]).pin_memory().to(self.device, non_blocking=True)
                small, ext = packed[:n], packed[n:]
            else:
                small = small_host.pin_memory().to(self.device, non_blocking=True)
                ext = torch.cat([indices, _zeros(width, self.device)])
            if previous is not None:  # CUDA-graph mode: same addresses, new contents
                if previous._small is None or previous._table is None:
                    raise UnsupportedProblemError(NAME, self.problem, [
                        "in CUDA-graph mode a re-plan must keep the graph's buckets (page entries)"])  # fmt: skip
                previous._small.copy_(small)
                small, table = previous._small, previous._table
            else:
                table = torch.empty(b, width, dtype=torch.int32, device=self.device)
            gather_table(ext[: nnz + width], small[offsets[2] : offsets[2] + b], out=table)
        self._small, self._table = small, table
        self._fixed = _fixed_addresses(small.data_ptr(), table.data_ptr(), offsets, key.ragged_q, key.lse)

    def _graph_for(self, k: torch.Tensor, v: torch.Tensor, sinks: bool) -> BuiltGraph:
        seen = (k.stride(), v.stride(), sinks)
        graph = self._by_strides.get(seen)  # (run() asks every call: the raw strides, no conversion)
        if graph is not None:
            return graph
        strides = (_container_strides(seen[0], self.problem.kv_layout),
                   _container_strides(seen[1], self.problem.kv_layout), sinks)  # fmt: skip
        graph = self._graphs.get(strides)
        if graph is None:
            # other strides, or sinks the plan was not told of (run_extras): built at this run
            graph, _ = graph_cache.get(self._key(strides[0], strides[1], sinks), self.handle)
            if graph.workspace_size > self._workspace.numel():
                self._workspace = torch.empty(graph.workspace_size, dtype=torch.uint8, device=self.device)
            self._graphs[strides] = graph
        if len(self._by_strides) >= 16:
            self._by_strides.clear()
        self._by_strides[seen] = graph
        return graph

    def _fit_cache(self, pages: int) -> None:
        """Make the graphs' container hold a cache of ``pages`` pages (device-resident indices: the
        plan did not read the largest index; the core checks them against the cache on the device,
        and the graph's container must cover what they may name). Builds, or finds in the graph
        cache, the graph of the larger container: once per wrapper and cache size, at a run outside
        any CUDA-graph capture (engines warm up before capturing)."""
        b, q, kv, _ = self._shape
        self._shape = (b, q, kv, pages)
        base = self._key(_contiguous_strides(self.problem, self.problem.head_dim_qk),
                         _contiguous_strides(self.problem, self.problem.head_dim_vo))  # fmt: skip
        graph, _ = graph_cache.get(base, self.handle)
        if graph.workspace_size > self._workspace.numel():
            self._workspace = torch.empty(graph.workspace_size, dtype=torch.uint8, device=self.device)
        self._base_key = base
        self._graphs = {(base.k_strides, base.v_strides, base.sinks): graph}
        self._by_strides = {}

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        if self._fit_to_cache and k_cache.shape[0] > self._base_key.container_pages:
            self._fit_cache(k_cache.shape[0])
        graph = self._graph_for(k_cache, v_cache, sinks is not None)
        if not q.is_contiguous():  # the graph reads packed rows: copy a strided view once per call
            if self._q_packed is None or self._q_packed.shape != q.shape:
                self._q_packed = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._q_packed.copy_(q)
            q = self._q_packed
        execute_sdpa(graph, self._fixed, self.handle, self.device, self._workspace, q, k_cache, v_cache, out, lse,
                     sinks)  # fmt: skip


def execute_sdpa(graph: BuiltGraph, fixed: dict[int, int], handle: Any, device: torch.device,
                 workspace: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, sinks: torch.Tensor | None) -> None:  # fmt: skip
    """Execute an attention graph: the plan's metadata addresses (``fixed``, by uid, not modified)
    plus the tensors' own, on torch's current stream."""
    pack = dict(fixed)
    pack[UID_Q] = q.data_ptr()
    pack[UID_K] = k.data_ptr()
    pack[UID_V] = v.data_ptr()
    pack[UID_O] = out.data_ptr()
    if lse is not None:
        pack[UID_STATS] = lse.data_ptr()
    if sinks is not None:
        pack[UID_SINKS] = sinks.data_ptr()
    _bind_stream(handle, device)
    graph.execute(pack, workspace, handle)


def _plan(problem: PrefillProblem | DecodeProblem, batch: PagedBatch, tactic: Tactic,
          options: PlanOptions) -> CudnnAttentionPlan | None:  # fmt: skip
    reasons = _params_reasons(tactic) + _attention_reasons(problem)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudnnAttentionPlan(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Tactic,
                        options: PlanOptions) -> CudnnAttentionPlan | None:  # fmt: skip
    return _plan(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_ragged_prefill(problem: RaggedPrefillProblem, batch: RaggedBatch, tactic: Tactic,
                               options: PlanOptions) -> ragged.CudnnRaggedPrefillPlan | None:  # fmt: skip
    reasons = _params_reasons(tactic) + _attention_reasons(problem)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return ragged.CudnnRaggedPrefillPlan(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Tactic,
                       options: PlanOptions) -> CudnnAttentionPlan | None:  # fmt: skip
    return _plan(problem, batch, tactic, options)


# -- GEMM ---------------------------------------------------------------------------------------

Strides3 = tuple[int, int, int]


def _gemm_strides(problem: GemmProblem) -> tuple[Strides3, Strides3]:
    """Strides of the logical ``[batch, m, k]`` and ``[batch, k, n]`` operands in the planned layouts
    (a dimension of size 1 has no layout: it is read k-major)."""
    m, n, k = problem.m, problem.n, problem.k
    a = (m * k, k, 1) if problem.a_k_major or m == 1 else (m * k, 1, m)
    b = (k * n, 1, k) if problem.b_k_major or n == 1 else (k * n, n, 1)
    return a, b


def _normalised(t: torch.Tensor, canonical: Strides3) -> Strides3:
    """A tensor's [batch, rows, cols] strides, with the canonical stride where a size is 1."""
    strides = t.stride()
    if t.dim() == 2:
        strides = (canonical[0], *strides)
    shape = (1, *t.shape) if t.dim() == 2 else tuple(t.shape)
    s0, s1, s2 = (c if size == 1 else s for s, size, c in zip(strides, shape, canonical, strict=True))
    return (s0, s1, s2)


def _gemm_key(problem: GemmProblem, a_strides: Strides3, b_strides: Strides3, tactic: Tactic) -> GemmKey:
    return GemmKey(
        a_dtype=problem.a_dtype,
        b_dtype=problem.b_dtype,
        out_dtype=problem.out_dtype,
        batch=problem.batch,
        m=problem.m,
        n=problem.n,
        k=problem.k,
        a_strides=a_strides,
        b_strides=b_strides,
        bias=problem.bias_dtype is not None,
        scaled=problem.scale_mode == "per_tensor",
        engine=None if tactic.is_default else int(tactic.params["engine"]),  # type: ignore[arg-type]
        knobs=() if tactic.is_default else _knob_items(tactic),
    )


class CudnnGemmPlan:
    """A matmul graph (plus scales and bias where asked) for one exact GEMM shape.

    The graph for the planned layout is built in plan; operands with other strides (a batch
    slice, say) get their own graph at their first run, outside any capture.
    """

    def __init__(self, problem: GemmProblem, tactic: Tactic, options: PlanOptions) -> None:
        self.problem = problem
        self.device = options["device"]
        self.handle = handle_for(self.device)
        self._requested = tactic
        self._canonical = _gemm_strides(problem)
        graph, self.built = graph_cache.get(_gemm_key(problem, *self._canonical, tactic), self.handle)
        self.tactic = graph.tactic
        self._workspace = torch.empty(max(graph.workspace_size, 1), dtype=torch.uint8, device=self.device)
        self._by_strides: dict[tuple[tuple[int, ...], tuple[int, ...]], BuiltGraph] = {}
        self._graph = graph

    def _graph_for(self, a: torch.Tensor, b: torch.Tensor) -> BuiltGraph:
        seen = (a.stride(), b.stride())
        graph = self._by_strides.get(seen)
        if graph is None:
            strides = (_normalised(a, self._canonical[0]), _normalised(b, self._canonical[1]))
            if strides == self._canonical:
                graph = self._graph
            else:
                graph, _ = graph_cache.get(_gemm_key(self.problem, *strides, self._requested), self.handle)
                if graph.workspace_size > self._workspace.numel():
                    self._workspace = torch.empty(graph.workspace_size, dtype=torch.uint8, device=self.device)
            self._by_strides[seen] = graph
        return graph

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
            scale_a: torch.Tensor | None, scale_b: torch.Tensor | None) -> None:  # fmt: skip
        graph = self._graph_for(a, b)
        pack = {UID_A: a.data_ptr(), UID_B: b.data_ptr(), UID_C: out.data_ptr()}
        if bias is not None:
            pack[UID_BIAS] = bias.data_ptr()
        if scale_a is not None and scale_b is not None:
            pack[UID_SCALE_A] = scale_a.data_ptr()
            pack[UID_SCALE_B] = scale_b.data_ptr()
        _bind_stream(self.handle, self.device)
        graph.execute(pack, self._workspace, self.handle)


@tactix.hookimpl
def tactix_plan_gemm(problem: GemmProblem, tactic: Tactic, options: PlanOptions) -> CudnnGemmPlan | None:
    reasons = _params_reasons(tactic, "matmul") + _gemm_reasons(problem)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudnnGemmPlan(problem, tactic, options)


@tactix.hookimpl
def tactix_references(op: str, inputs: dict[str, Any]) -> list[ReferenceCall] | None:
    """cuDNN called by hand (`tactix_cudnn.direct`), one variant per plan, for ``tactix bench``."""
    if tactix_environment():
        return None
    from tactix_cudnn import direct

    if op == "gemm":
        return direct.gemm_references(inputs)
    return direct.attention_references(op, inputs)


# cuDNN's paged SDPA loads whole pages and masks scores past a request's length, so a NaN or an infinity in
# such a slot still reaches the output through P @ V (0 x NaN is NaN): measured on an H200
# (cuDNN 9.19), every prefill case with NaN or Inf in a page tail. Decode and GEMM keep them out.


@tactix.hookimpl
def tactix_known_failures() -> dict[str, str] | None:
    return stale_slot_failures("prefill")
