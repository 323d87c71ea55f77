"""cuDNN called by hand, without tactix: the reference ``tactix bench`` times the plugin against.

Written the way a user of the cuDNN frontend would write it for one batch, and sharing no code
with the plugin's graphs: exact sizes (no buckets), the page table built with torch ops, every
plan cuDNN's heuristics offer built and executed by index. Each plan is one reference variant,
so the bench reports the fastest plan of the direct call ("best plan", as the anchors in
../shared/BENCHMARKS.md were measured).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tactix_cudnn.library import frontend

__all__ = ["attention_references", "gemm_references"]


def _dtype(cudnn: Any, t: torch.dtype) -> Any:
    return {
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.float16: cudnn.data_type.HALF,
        torch.float32: cudnn.data_type.FLOAT,
        torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3,
    }[t]


class _Binder:
    """A direct graph's tensors bound to their data: uids from 100 in binding order, and the
    variant pack they make."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.pack: dict[int, torch.Tensor] = {}

    def bind(self, t: Any, data: torch.Tensor) -> Any:
        uid = 100 + len(self.pack)
        t.set_uid(uid)
        self.pack[uid] = data
        return t

    def i32(self, name: str, data: torch.Tensor) -> Any:
        """An int32 graph tensor of ``data``'s shape and strides, bound to it."""
        t = self.graph.tensor(name=name, dim=list(data.shape), stride=list(data.stride()),
                              data_type=frontend().data_type.INT32)  # fmt: skip
        return self.bind(t, data)


def _plans(graph: Any, pack: dict[int, torch.Tensor], handle: Any) -> list[tuple[str, Callable[[], object]]]:
    cudnn = frontend()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    calls: list[tuple[str, Callable[[], object]]] = []
    for index in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(index)
        except Exception:  # a plan that does not build for this graph is not a variant
            continue
        engine, knobs = graph.get_engine_and_knobs_at_index(index)
        label = f"engine {int(engine)} " + ",".join(f"{str(k).split('.')[-1]}={int(v)}" for k, v in knobs.items())
        workspace = torch.empty(
            max(int(graph.get_workspace_size_plan_at_index(index)), 1), dtype=torch.uint8, device="cuda"
        )

        def call(index: int = index, workspace: torch.Tensor = workspace) -> None:
            cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
            graph.execute_plan_at_index(pack, workspace, index, handle=handle)

        calls.append((label.strip(), call))
    return calls


def attention_references(op: str, inputs: dict[str, Any]) -> list[tuple[str, Callable[[], object]]]:
    """Paged SDPA over an HND cache, one cuDNN graph for exactly this batch; none for a cache
    whose dtype is not q's (an fp8 cache: the graph's I/O type is q's, so it would read the cache
    as 16-bit values, past the end of its pages), none for a case with sinks or a window."""
    q, k, v, out = inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["out"]
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return []
    if op == "decode" and q.shape[0] != inputs["kv_indptr"].numel() - 1:
        return []  # a multi-token decode step: the decode graph here takes one row per request
    if inputs.get("sinks") is not None or int(inputs.get("window_left", -1)) >= 0:
        return []  # the graphs here take neither attention sinks nor a window (they would compute without them)
    if op == "ragged_prefill":
        return _ragged_references(inputs)
    cudnn = frontend()
    handle = cudnn.create_handle()
    qo, kv_indptr, indices, last = (inputs[n].long() for n in ("qo_indptr", "kv_indptr", "kv_indices",
                                                                 "kv_last_page_len"))  # fmt: skip
    device = q.device
    pages_total, hkv, page, d = k.shape
    hq = q.shape[1]
    b = kv_indptr.numel() - 1
    pages = kv_indptr[1:] - kv_indptr[:-1]
    kv_lens = (pages - 1) * page + last
    q_lens = qo[1:] - qo[:-1]
    width = int(pages.max())
    # page table [b, 1, width, 1]: each request's pages from the CSR list, zero-padded
    table = torch.zeros(b, width, dtype=torch.int32)
    for r in range(b):
        table[r, : int(pages[r])] = indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])].to(torch.int32)
    table = table.reshape(b, 1, width, 1).to(device)
    seq_q = q_lens.to(torch.int32).reshape(b, 1, 1, 1).to(device)
    seq_kv = kv_lens.to(torch.int32).reshape(b, 1, 1, 1).to(device)
    max_q = int(q_lens.max())
    io = _dtype(cudnn, q.dtype)
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    ragged = op == "prefill"
    q_dims, q_strides = [b, hq, max_q, d], [max_q * hq * d, d, hq * d, 1]
    binder = _Binder(g)
    bind, i32 = binder.bind, binder.i32

    tq = bind(g.tensor(name="q", dim=q_dims, stride=q_strides, data_type=io), q)
    if ragged:
        q_off = (qo * hq * d).to(torch.int32).reshape(b + 1, 1, 1, 1).to(device)
        tq.set_ragged_offset(i32("q_off", q_off))
    tk = bind(g.tensor(name="k", dim=[pages_total, hkv, page, d], stride=list(k.stride()), data_type=io), k)
    tv = bind(g.tensor(name="v", dim=[pages_total, hkv, page, d], stride=list(v.stride()), data_type=io), v)
    t_table, t_seq_q, t_seq_kv = i32("table", table), i32("seq_q", seq_q), i32("seq_kv", seq_kv)
    kwargs: dict[str, Any] = dict(
        name="sdpa", q=tq, k=tk, v=tv, attn_scale=float(inputs["sm_scale"]), generate_stats=False,
        use_padding_mask=True, seq_len_q=t_seq_q, seq_len_kv=t_seq_kv, paged_attention_k_table=t_table,
        paged_attention_v_table=t_table, paged_attention_max_seq_len_kv=int(kv_lens.max()),
        compute_data_type=cudnn.data_type.FLOAT,
    )  # fmt: skip
    if inputs["causal"]:
        kwargs.update(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
    to, _ = g.sdpa(**kwargs)
    bind(to, out).set_output(True).set_dim(q_dims).set_stride(q_strides)
    if ragged:
        to.set_ragged_offset(i32("o_off", q_off.clone()))
    g.validate()
    g.build_operation_graph()
    return _plans(g, binder.pack, handle)


def gemm_references(inputs: dict[str, Any]) -> list[tuple[str, Callable[[], object]]]:
    """``out = scale_a * scale_b * (a @ b)`` as one cuDNN matmul graph (2-D operands)."""
    cudnn = frontend()
    handle = cudnn.create_handle()
    a, b, out = inputs["a"], inputs["b"], inputs["out"]
    m, kk = a.shape
    n = b.shape[1]
    g = cudnn.pygraph(io_data_type=_dtype(cudnn, out.dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    binder = _Binder(g)
    bind = binder.bind

    ta = bind(g.tensor(name="a", dim=[1, m, kk], stride=[m * kk, *a.stride()], data_type=_dtype(cudnn, a.dtype)), a)
    tb = bind(g.tensor(name="b", dim=[1, kk, n], stride=[kk * n, *b.stride()], data_type=_dtype(cudnn, b.dtype)), b)
    tc = g.matmul(name="mm", A=ta, B=tb, compute_data_type=cudnn.data_type.FLOAT)
    if inputs.get("scale_a") is not None:
        for name in ("scale_a", "scale_b"):
            ts = g.tensor(name=name, dim=[1, 1, 1], stride=[1, 1, 1], data_type=cudnn.data_type.FLOAT)
            bind(ts, inputs[name].reshape(1, 1, 1))
            tc.set_data_type(cudnn.data_type.FLOAT)
            tc = g.mul(name=f"mul_{name}", a=tc, b=ts, compute_data_type=cudnn.data_type.FLOAT)
    bind(tc, out).set_output(True).set_data_type(_dtype(cudnn, out.dtype))
    tc.set_dim([1, m, n]).set_stride([m * n, n, 1])
    g.validate()
    g.build_operation_graph()
    return _plans(g, binder.pack, handle)


def _ragged_references(inputs: dict[str, Any]) -> list[tuple[str, Callable[[], object]]]:
    """SDPA over packed ``q``, ``k`` and ``v`` (``[tokens, heads, dim]``, request ``r``'s rows from
    its CSR offsets) through ragged offsets, one graph for exactly this batch; head dims may
    differ (DeepSeek's 192/128)."""
    q, k, v, out = inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["out"]
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return []  # the offsets below count packed rows
    cudnn = frontend()
    handle = cudnn.create_handle()
    qo, kv = inputs["qo_indptr"].long(), inputs["kv_indptr"].long()
    device, b = q.device, kv.numel() - 1
    hq, dq, hkv, dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    q_lens, kv_lens = qo[1:] - qo[:-1], kv[1:] - kv[:-1]
    sq, skv = int(q_lens.max()), int(kv_lens.max())
    io = _dtype(cudnn, q.dtype)
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    binder = _Binder(g)
    bind = binder.bind

    def i32(name: str, data: torch.Tensor) -> Any:  # one int32 per request, [n, 1, 1, 1] on the device
        return binder.i32(name, data.to(torch.int32).reshape(-1, 1, 1, 1).to(device))

    def packed(name: str, data: torch.Tensor, heads: int, dim: int, rows: int, offsets: torch.Tensor) -> Any:
        t = g.tensor(name=name, dim=[b, heads, rows, dim], stride=[rows * heads * dim, dim, heads * dim, 1],
                     data_type=io)  # fmt: skip
        bind(t, data).set_ragged_offset(i32(f"{name}_off", offsets * heads * dim))
        return t

    tq = packed("q", q, hq, dq, sq, qo)
    tk = packed("k", k, hkv, dq, skv, kv)
    tv = packed("v", v, hkv, dv, skv, kv)
    kwargs: dict[str, Any] = dict(
        name="sdpa", q=tq, k=tk, v=tv, attn_scale=float(inputs["sm_scale"]), generate_stats=False,
        use_padding_mask=True, seq_len_q=i32("seq_q", q_lens), seq_len_kv=i32("seq_kv", kv_lens),
        compute_data_type=cudnn.data_type.FLOAT,
    )  # fmt: skip
    if inputs["causal"]:
        kwargs.update(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
    to, _ = g.sdpa(**kwargs)
    bind(to, out).set_output(True).set_dim([b, hq, sq, dv]).set_stride([sq * hq * dv, dv, hq * dv, 1])
    to.set_ragged_offset(i32("o_off", qo * hq * dv))
    g.validate()
    g.build_operation_graph()
    return _plans(g, binder.pack, handle)
