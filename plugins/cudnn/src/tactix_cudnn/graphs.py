"""cuDNN frontend graphs for paged attention, and the bounded cache that keeps them.

One graph serves prefill and decode: ragged (packed) queries ``[tokens, heads, dim]`` with
per-request offsets, K/V read through page tables (or, for ragged-KV prefill, packed like the
queries, with offsets of their own), a padding mask from per-request lengths,
bottom-right causal alignment, optional sliding window and attention sinks, and softmax stats
(natural-log LSE) written packed ``[tokens, heads]``. What a built graph bakes in — batch size, maximum query and
kv lengths, page-table width, container page count, strides, dtypes, masks, the scale — is the
graph key. Dynamic sizes enter it bucketed (next power of two): a new batch of the same bucket
reuses the graph; requests past the real batch get length 0 and are skipped. (cuDNN's shape
override, which would avoid buckets, needs library 9.21 or newer for graphs; see
`library.FEATURES`.)
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import torch

from tactix import Tactic
from tactix_cudnn.library import frontend

__all__ = [
    "BuiltGraph",
    "GemmKey",
    "GraphKey",
    "build_attention_graph",
    "build_gemm_graph",
    "enumerate_plans",
    "graph_cache",
]

_CACHE_SIZE: Final = 64

UID_Q, UID_K, UID_V, UID_O, UID_STATS = 1, 2, 3, 4, 5
UID_SEQ_Q, UID_SEQ_KV, UID_TABLE, UID_Q_OFF, UID_O_OFF, UID_STATS_OFF = 6, 7, 8, 9, 10, 11
UID_SINKS = 12
UID_K_OFF, UID_V_OFF = 13, 14  # ragged (packed) K and V: per-request element offsets


@dataclass(frozen=True)
class GraphKey:
    """Everything a built attention graph depends on."""

    dtype: str  # q / kv / out (one dtype: the plugin declares no mixed precision)
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    k_strides: tuple[int, int, int, int]  # of the logical [pages, heads, page, dim] container
    v_strides: tuple[int, int, int, int]
    container_pages: int
    batch: int
    max_q: int
    max_kv: int
    table_width: int
    causal: bool
    window: int  # window_left, -1: none
    scale: float
    lse: bool
    engine: int | None  # None: cuDNN's heuristic choice
    knobs: tuple[tuple[str, int], ...]
    ragged_q: bool = True  # decode reads q [batch, heads, dim] directly (exact batch, no offsets)
    deterministic: bool = True  # plans that reduce in a run-dependent order are excluded
    sinks: bool = False  # a sink logit per query head in each row's softmax (cuDNN's sink_token)
    ragged_kv: bool = False  # K and V packed [tokens, heads, dim] with per-request offsets (no page table)


def _cudnn_dtype(cudnn: Any, name: str) -> Any:
    return {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}[name]


EXECUTE_ENV: Final = "TACTIX_CUDNN_EXECUTE"
"""Set to ``public``: every graph runs through the frontend's public ``execute_plan_at_index``
(what ``cudnn (direct)`` calls), not the backend plan's own entry (`BuiltGraph.execute`)."""


class BuiltGraph:
    """A built graph with its workspace size and the (engine, knobs) of the plan it runs."""

    def __init__(self, key: GraphKey | GemmKey, graph: Any, engine: int, knobs: dict[str, int], workspace: int,
                 kernel: str = "sdpa", index: int = 0) -> None:  # fmt: skip
        self.key = key
        self.graph = graph
        self.engine = engine
        self.knobs = knobs
        self.workspace_size = workspace
        self.index = index
        self.tactic = Tactic(backend="cudnn", kernel=kernel, params={"engine": engine, "knobs": knobs})
        self._backend_entry = _backend_entry(graph, index)

    def execute(self, pack: dict[int, int], workspace: torch.Tensor, handle: Any) -> None:
        """Run the built plan on ``pack`` (uid -> device address) on the handle's stream.

        The frontend's public ``execute`` and ``execute_plan_at_index`` (1.32) walk the variant
        pack in Python on every call (uid lookups, a native pack, layout checks: tens of
        microseconds of host time, NVIDIA/cudnn-frontend#1086). A plan of a backend engine is
        run here through the lowered graph's own execute-by-index entry with the uid -> address
        map, which is what the public call ends in; anything else (a Python engine, a frontend
        without that entry, `EXECUTE_ENV`) takes the public call."""
        entry = self._backend_entry
        if entry is not None:
            call, cpp_index = entry
            try:
                call(pack, workspace.data_ptr(), cpp_index, getattr(handle, "backend_handle", handle))
                return
            except TypeError:  # the entry takes other arguments here (raised before anything ran)
                self._backend_entry = None
        self.graph.execute_plan_at_index(pack, workspace, self.index, handle=handle)


def _backend_entry(graph: Any, index: int) -> tuple[Any, int] | None:
    """The lowered graph's execute-by-index call and the backend's index of plan ``index``, when
    the plan is a backend engine's and this frontend has them (else None: the public call)."""
    if os.environ.get(EXECUTE_ENV) == "public":
        return None
    try:
        lowered = graph.__dict__.get("_lowered_graph")
        call = getattr(lowered, "_execute_plan_at_index", None)
        if call is None or not getattr(graph, "_planning_done", False) or graph._engine_for(graph._plans[index]):
            return None
        cpp_index = graph._materialize_backend_plan(index).cpp_index
    except Exception:  # another frontend's internals: the public call serves
        return None
    return (call, int(cpp_index)) if isinstance(cpp_index, int) else None


def _operation_graph(key: GraphKey, handle: Any) -> Any:
    cudnn = frontend()
    io = _cudnn_dtype(cudnn, key.dtype)
    g = cudnn.pygraph(
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    b, hq, hkv = key.batch, key.num_qo_heads, key.num_kv_heads
    dq, dv, sq = key.head_dim_qk, key.head_dim_vo, key.max_q

    def tensor(uid: int, name: str, dims: tuple[int, ...], strides: tuple[int, ...], dtype: Any) -> Any:
        t = g.tensor(name=name, dim=list(dims), stride=list(strides), data_type=dtype)
        t.set_uid(uid)
        return t

    def i32(uid: int, name: str, dims: tuple[int, ...]) -> Any:
        strides = tuple(int(x) for x in torch.empty(dims, device="meta").stride())
        return tensor(uid, name, dims, strides, cudnn.data_type.INT32)

    # packed queries: token t of request r at offset q_off[r] + t * hq * dq
    q = tensor(UID_Q, "q", (b, hq, sq, dq), (sq * hq * dq, dq, hq * dq, 1), io)
    if key.ragged_q:
        q.set_ragged_offset(i32(UID_Q_OFF, "q_offsets", (b + 1, 1, 1, 1)))
    seq_q = i32(UID_SEQ_Q, "seq_len_q", (b, 1, 1, 1))
    seq_kv = i32(UID_SEQ_KV, "seq_len_kv", (b, 1, 1, 1))
    kwargs: dict[str, Any] = dict(
        name="sdpa",
        q=q,
        attn_scale=key.scale,
        generate_stats=key.lse,
        use_padding_mask=True,
        seq_len_q=seq_q,
        seq_len_kv=seq_kv,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    if key.ragged_kv:  # packed rows: key t of request r at offset k_off[r] + t * hkv * dq, as q
        skv = key.max_kv
        k = tensor(UID_K, "k", (b, hkv, skv, dq), (skv * hkv * dq, dq, hkv * dq, 1), io)
        v = tensor(UID_V, "v", (b, hkv, skv, dv), (skv * hkv * dv, dv, hkv * dv, 1), io)
        k.set_ragged_offset(i32(UID_K_OFF, "k_offsets", (b + 1, 1, 1, 1)))
        v.set_ragged_offset(i32(UID_V_OFF, "v_offsets", (b + 1, 1, 1, 1)))
    else:
        k = tensor(UID_K, "k", (key.container_pages, hkv, key.page_size, dq), key.k_strides, io)
        v = tensor(UID_V, "v", (key.container_pages, hkv, key.page_size, dv), key.v_strides, io)
        table = i32(UID_TABLE, "page_table", (b, 1, key.table_width, 1))
        kwargs.update(paged_attention_k_table=table, paged_attention_v_table=table,
                      paged_attention_max_seq_len_kv=key.max_kv)  # fmt: skip
    kwargs.update(k=k, v=v)
    if key.causal or key.window >= 0:
        kwargs["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
    if key.causal:
        kwargs["diagonal_band_right_bound"] = 0
    if key.window >= 0:
        kwargs["diagonal_band_left_bound"] = key.window + 1  # cuDNN counts the diagonal itself
    if key.sinks:  # float32 [1, heads, 1, 1]: cuDNN's only layout for it
        kwargs["sink_token"] = tensor(UID_SINKS, "sinks", (1, hq, 1, 1), (hq, 1, 1, 1), cudnn.data_type.FLOAT)
    o, stats = g.sdpa(**kwargs)
    o.set_uid(UID_O).set_output(True).set_dim([b, hq, sq, dv]).set_stride([sq * hq * dv, dv, hq * dv, 1])
    if key.ragged_q:
        o.set_ragged_offset(i32(UID_O_OFF, "o_offsets", (b + 1, 1, 1, 1)))
    if key.lse:
        stats.set_uid(UID_STATS).set_output(True).set_data_type(cudnn.data_type.FLOAT)
        stats.set_dim([b, hq, sq, 1]).set_stride([sq * hq, 1, hq, 1])
        if key.ragged_q:
            stats.set_ragged_offset(i32(UID_STATS_OFF, "stats_offsets", (b + 1, 1, 1, 1)))
    g.validate()
    g.build_operation_graph()
    return g


Knobs = tuple[tuple[str, int], ...]
Excluded = dict[tuple[int, Knobs | None], str]
"""(engine, knobs) -> why that plan must not serve; knobs None: every plan of the engine."""


def excluded_plans(key: GraphKey) -> Excluded:
    """Plans known to compute something else for this key, or to break a promise it makes.

    Seen with cuDNN 9.19 (conformance kit, tests/gpu; H200, and H100 for the sinks):

    * engine 8 (cuDNN's decode kernel) writes the softmax stats of only one query head per KV
      head group when GQA is used, leaving the others unwritten; its attention output is right;
    * engine 8 with ``KERNEL_CFG`` 35, the split-KV configuration that makes single long
      requests fast, is not run-to-run deterministic: at batch sizes of 64 and more a few
      output elements differ in the last bit between identical runs (the split results are
      combined in a varying order). ``KERNEL_CFG`` 3 is deterministic. Excluded unless the
      problem allows non-determinism.
    """
    out: Excluded = {}
    if key.sinks:
        # seen on an H100 with cuDNN 9.19 (conformance kit, session 23): the runtime-compiled
        # engine fails NVRTC compilation for every SDPA graph with a sink token
        out[(2, None)] = "engine 2 (runtime-compiled) fails to compile SDPA with a sink token (NVRTC error)"
    if key.lse and key.num_qo_heads != key.num_kv_heads:
        out[(8, None)] = "engine 8 writes the LSE of one query head per GQA group only"
    if key.deterministic and not key.ragged_q:
        out[(8, (("KERNEL_CFG", 35),))] = (
            "engine 8 with KERNEL_CFG 35 (split-KV decode) is not run-to-run deterministic "
            "(plan with deterministic=False to allow it)"
        )
    return out


def exclusion(excluded: Excluded, engine: int, knobs: Knobs) -> str | None:
    """Why (engine, knobs) is excluded, or None."""
    return excluded.get((engine, None)) or excluded.get((engine, knobs))


def _knob_type(cudnn: Any, name: str) -> Any:
    return getattr(cudnn.knob_type, name)


def _knob_name(knob: Any) -> str:
    text = str(knob)
    return text.split(".")[-1]


def enumerate_plans(key: GraphKey | GemmKey, handle: Any) -> list[tuple[int, dict[str, int]]]:
    """The (engine, knobs) of every plan cuDNN's heuristics offer for ``key``, minus the excluded
    ones (nothing is built)."""
    cudnn = frontend()
    if isinstance(key, GraphKey):
        g, excluded = _operation_graph(key, handle), excluded_plans(key)
    else:
        g, excluded = _gemm_graph(key, handle), {}
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    out = []
    for i in range(g.get_execution_plan_count()):
        engine, knobs = _plan_at(g, i)
        if not exclusion(excluded, engine, knobs):
            out.append((engine, dict(knobs)))
    return out


def _plan_at(g: Any, index: int) -> tuple[int, Knobs]:
    engine, knobs = g.get_engine_and_knobs_at_index(index)
    return int(engine), tuple(sorted((_knob_name(k), int(v)) for k, v in knobs.items()))


def _choose_plan(g: Any, engine: int | None, knobs: Knobs, excluded: Excluded) -> tuple[int, int, dict[str, int]]:
    """Build the plan that (engine, knobs) name, or cuDNN's first heuristic choice not excluded;
    returns its index, engine and knobs."""
    cudnn = frontend()
    if engine is None:
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        candidates = [i for i in range(g.get_execution_plan_count()) if not exclusion(excluded, *_plan_at(g, i))]
        if not candidates:
            raise RuntimeError(f"cuDNN offers no plan for this graph but excluded ones: {sorted(excluded.values())}")
        # the first that builds, in the heuristic's order (as cuDNN's own build_plans does): a plan
        # may fail to build where it is proposed (a runtime compilation that fails)
        failures = []
        for index in candidates:
            try:
                g.build_plan_at_index(index)
            except Exception as exc:  # cuDNN's errors have no common base class here
                failures.append(f"engine {_plan_at(g, index)[0]}: {type(exc).__name__}: {exc}"[:300])
                continue
            chosen_engine, chosen_knobs = _plan_at(g, index)
            return index, chosen_engine, dict(chosen_knobs)
        raise RuntimeError(f"no plan cuDNN proposes for this graph builds: {'; '.join(failures)}")
    why = exclusion(excluded, engine, knobs)
    if why:
        raise ValueError(why)
    g.create_execution_plan(engine, {_knob_type(cudnn, name): value for name, value in knobs})
    g.check_support()
    index = g.get_execution_plan_count() - 1
    g.build_plan_at_index(index)
    return index, engine, dict(knobs)


def build_attention_graph(key: GraphKey, handle: Any) -> BuiltGraph:
    """Build the graph for ``key`` with the plan its (engine, knobs) name, or cuDNN's first choice."""
    g = _operation_graph(key, handle)
    index, engine, knobs = _choose_plan(g, key.engine, key.knobs, excluded_plans(key))
    workspace = int(g.get_workspace_size_plan_at_index(index))
    return BuiltGraph(key, g, engine, knobs, workspace, index=index)


# -- GEMM --------------------------------------------------------------------------------------

UID_A, UID_B, UID_C, UID_BIAS, UID_SCALE_A, UID_SCALE_B = 21, 22, 23, 24, 25, 26


@dataclass(frozen=True)
class GemmKey:
    """Everything a built matmul graph depends on (all sizes exact: a GEMM plan is per shape)."""

    a_dtype: str
    b_dtype: str
    out_dtype: str
    batch: int
    m: int
    n: int
    k: int
    a_strides: tuple[int, int, int]  # of the logical [batch, m, k] operand
    b_strides: tuple[int, int, int]  # of the logical [batch, k, n] operand
    bias: bool
    scaled: bool  # fp8 per-tensor scales: out = scale_a * scale_b * (a @ b) (+ bias)
    engine: int | None
    knobs: tuple[tuple[str, int], ...]


_GEMM_DTYPES: Final = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT", "float8_e4m3fn": "FP8_E4M3"}


def _gemm_graph(key: GemmKey, handle: Any) -> Any:
    cudnn = frontend()

    def dt(name: str) -> Any:
        return getattr(cudnn.data_type, _GEMM_DTYPES[name])

    g = cudnn.pygraph(
        io_data_type=dt(key.out_dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )

    def tensor(uid: int, name: str, dims: tuple[int, ...], strides: tuple[int, ...], dtype: Any) -> Any:
        t = g.tensor(name=name, dim=list(dims), stride=list(strides), data_type=dtype)
        t.set_uid(uid)
        return t

    b, m, n, k = key.batch, key.m, key.n, key.k
    a = tensor(UID_A, "a", (b, m, k), key.a_strides, dt(key.a_dtype))
    w = tensor(UID_B, "b", (b, k, n), key.b_strides, dt(key.b_dtype))
    acc = g.matmul(name="matmul", A=a, B=w, compute_data_type=cudnn.data_type.FLOAT)
    if key.scaled:
        for uid, name in ((UID_SCALE_A, "scale_a"), (UID_SCALE_B, "scale_b")):
            scale = tensor(uid, name, (1, 1, 1), (1, 1, 1), cudnn.data_type.FLOAT)
            acc.set_data_type(cudnn.data_type.FLOAT)
            acc = g.mul(name=f"mul_{name}", a=acc, b=scale, compute_data_type=cudnn.data_type.FLOAT)
    if key.bias:
        bias = tensor(UID_BIAS, "bias", (1, 1, n), (n, n, 1), dt(key.out_dtype))
        acc.set_data_type(cudnn.data_type.FLOAT)
        acc = g.add(name="add_bias", a=acc, b=bias, compute_data_type=cudnn.data_type.FLOAT)
    acc.set_uid(UID_C).set_output(True).set_data_type(dt(key.out_dtype))
    acc.set_dim([b, m, n]).set_stride([m * n, n, 1])
    g.validate()
    g.build_operation_graph()
    return g


def build_gemm_graph(key: GemmKey, handle: Any) -> BuiltGraph:
    g = _gemm_graph(key, handle)
    index, engine, knobs = _choose_plan(g, key.engine, key.knobs, {})
    workspace = int(g.get_workspace_size_plan_at_index(index))
    return BuiltGraph(key, g, engine, knobs, workspace, kernel="matmul", index=index)


class GraphCache:
    """At most ``size`` built graphs, least recently used evicted; ``builds`` counts builds."""

    def __init__(self, size: int = _CACHE_SIZE) -> None:
        self.size = size
        self._graphs: OrderedDict[GraphKey | GemmKey, BuiltGraph] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0

    def get(self, key: GraphKey | GemmKey, handle: Any) -> tuple[BuiltGraph, bool]:
        """The graph for ``key`` and whether it had to be built now."""
        with self._lock:
            found = self._graphs.get(key)
            if found is not None:
                self._graphs.move_to_end(key)
                return found, False
        built = build_attention_graph(key, handle) if isinstance(key, GraphKey) else build_gemm_graph(key, handle)
        with self._lock:
            self._graphs[key] = built
            self.builds += 1
            while len(self._graphs) > self.size:
                self._graphs.popitem(last=False)
        return built, True

    def __len__(self) -> int:
        return len(self._graphs)


graph_cache = GraphCache()
