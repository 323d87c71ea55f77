"""Ragged-KV prefill (``tactix.RaggedPrefill``) through cuDNN's SDPA with packed K and V.

Queries, keys and values are all packed ``[tokens, heads, dim]`` rows; the graph reads each
request's rows through ragged offsets (element offsets of its first row, ``batch + 1`` of them
per tensor) and its lengths through the padding mask, so there is no page table at all
(`graphs.GraphKey.ragged_kv`). Sizes are bucketed as for paged prefill: the batch, the longest
query and the longest key run round up to powers of two, and requests past the real batch have
length 0.

A plan sends one int32 block (lengths, then the q, out, stats, k and v offsets, each section
128-byte aligned) through the wrapper's staging slots (`tactix.plugin.Staging`), exactly as the
paged plans do; ``run`` adds the tensors' addresses and executes. Strided views (``q``, ``k`` or
``v`` of a fused QKV projection) are copied into packed buffers first: the offsets count packed
rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import torch

from tactix import PlanOptions, RaggedBatch, RaggedPrefillProblem, Tactic, UnsupportedProblemError
from tactix.plugin import Staging, write_int32
from tactix_cudnn import plugin  # (plugin imports this module: attributes are read at call time)
from tactix_cudnn.graphs import (
    UID_K_OFF,
    UID_O_OFF,
    UID_Q_OFF,
    UID_SEQ_KV,
    UID_SEQ_Q,
    UID_STATS_OFF,
    UID_V_OFF,
    BuiltGraph,
    GraphKey,
    graph_cache,
)

__all__ = ["CudnnRaggedPrefillPlan", "ragged_metadata"]

_ALIGN: Final = 32  # int32 entries: 128 bytes
_INT32_MAX: Final = 2**31 - 1
_NO_ROWS: Final = [0] * 4096


def _span(n: int) -> int:
    return n + (-n % _ALIGN)


def ragged_metadata(problem: RaggedPrefillProblem, batch: RaggedBatch,
                    key: GraphKey) -> tuple[list[int], dict[int, int]]:  # fmt: skip
    """The plan's int32 block as one flat list, and where each tensor's section starts (entries,
    by graph uid): q lengths, kv lengths (``key.batch`` each, requests past the real batch 0),
    then element offsets of q, out, (LSE) stats, k and v rows (``key.batch + 1`` each)."""
    b, real = key.batch, batch.batch_size
    pad = _NO_ROWS[: _span(b) - real]
    flat = batch.qo_lens_list + pad
    flat += batch.kv_lens_list
    flat += pad
    at = {UID_SEQ_Q: 0, UID_SEQ_KV: _span(b)}
    qo, kv = batch.qo_indptr_list, batch.kv_indptr_list
    if b > real:
        qo, kv = qo + [qo[-1]] * (b - real), kv + [kv[-1]] * (b - real)
    tail = [0] * (_span(b + 1) - b - 1)
    hq, hkv = problem.num_qo_heads, problem.num_kv_heads
    dq, dv = problem.head_dim_qk, problem.head_dim_vo
    sections = [(UID_Q_OFF, qo, hq * dq), (UID_O_OFF, qo, hq * dv)]
    if key.lse:
        sections.append((UID_STATS_OFF, qo, hq))
    sections += [(UID_K_OFF, kv, hkv * dq), (UID_V_OFF, kv, hkv * dv)]
    for uid, rows, row in sections:
        at[uid] = len(flat)
        flat += [s * row for s in rows]
        flat += tail
    return flat, at


def _offsets_reasons(problem: RaggedPrefillProblem, batch: RaggedBatch) -> list[str]:
    """cuDNN's ragged offsets are int32 element offsets: the packed tensors must stay below 2**31
    elements."""
    widest = max(problem.head_dim_qk, problem.head_dim_vo)
    sizes = {"q/out": batch.num_qo_tokens * problem.num_qo_heads * widest,
             "k/v": batch.num_kv_tokens * problem.num_kv_heads * widest}  # fmt: skip
    return [f"the packed {name} tensor has {n} elements; cuDNN's int32 ragged offsets address at most {_INT32_MAX}"
            for name, n in sizes.items() if n > _INT32_MAX]  # fmt: skip


class CudnnRaggedPrefillPlan:
    """Device metadata for one ragged batch plus the graph(s) that read it: one without sinks or
    with them (built in plan when the problem's ``run_extras`` name them, else at the first run
    that passes them)."""

    handle: Any  # the device's cuDNN handle
    _shape: tuple[int, int, int]  # batch size, longest q, longest kv
    _base_key: GraphKey
    _workspace: torch.Tensor
    _fixed: dict[int, int]  # metadata addresses by graph uid

    def __init__(self, problem: RaggedPrefillProblem, batch: RaggedBatch, tactic: Tactic,
                 options: PlanOptions) -> None:  # fmt: skip
        reasons = _offsets_reasons(problem, batch)
        if reasons:
            raise UnsupportedProblemError("cudnn", problem, reasons)
        self.problem = problem
        self.device = options["device"]
        previous = options["previous"]
        prev = previous if isinstance(previous, CudnnRaggedPrefillPlan) and previous.device == self.device else None
        self.handle = prev.handle if prev is not None else plugin.handle_for(self.device)
        self._graph_mode = bool(options["use_cuda_graph"])
        self._requested = tactic
        held = prev._shape if prev is not None and self._graph_mode else None
        self._shape = self._held(batch, held)
        base = self._key("sinks" in problem.run_extras)
        if held is not None and prev is not None:
            same = dataclasses.replace(prev._base_key, engine=None, knobs=())
            if same != dataclasses.replace(base, engine=None, knobs=()):
                raise UnsupportedProblemError("cudnn", problem, [
                    "in CUDA-graph mode a re-plan must keep the graph's buckets (batch size, longest query and "
                    "key runs): capture with the longest batch, or use one wrapper per captured shape"])  # fmt: skip
        self._base_key = base
        self._staging: Staging | None = prev._staging if prev is not None else None
        self._fill(batch, base, graph_replan=held is not None)
        graph, self.built = graph_cache.get(base, self.handle)
        self._graphs: dict[bool, BuiltGraph] = {base.sinks: graph}
        self.tactic = graph.tactic
        workspace = prev._workspace if prev is not None else None
        if workspace is None or workspace.numel() < graph.workspace_size:
            workspace = torch.empty(max(graph.workspace_size, 1), dtype=torch.uint8, device=self.device)
        self._workspace = workspace
        # packed copies of strided views, by argument: taken over from the replaced plan, as the
        # workspace is (a captured CUDA graph keeps reading the buffers it was captured with)
        self._packed: dict[str, torch.Tensor] = prev._packed if prev is not None else {}

    @staticmethod
    def _held(batch: RaggedBatch, held: tuple[int, int, int] | None) -> tuple[int, int, int]:
        """(batch size, longest q, longest kv): the batch's own, or in CUDA-graph mode at least the
        captured plan's (a shorter batch keeps the captured graph)."""
        if held is None:
            return batch.batch_size, batch.max_qo_len, batch.max_kv_len
        return batch.batch_size, max(batch.max_qo_len, held[1]), max(batch.max_kv_len, held[2])

    def _key(self, sinks: bool) -> GraphKey:
        b, q, kv = self._shape
        return plugin._key(self.problem, b, q, kv, 0, plugin.NO_STRIDES, plugin.NO_STRIDES, self._requested, sinks)

    def _fill(self, batch: RaggedBatch, key: GraphKey, graph_replan: bool) -> None:
        flat, at = ragged_metadata(self.problem, batch, key)
        mine = Staging.reuse(self._staging, self.device, len(flat))
        if graph_replan and mine is not self._staging:
            raise UnsupportedProblemError("cudnn", self.problem, [
                "in CUDA-graph mode a re-plan must keep the graph's buckets (metadata size)"])  # fmt: skip
        self._staging = mine

        def fill(dst: int) -> None:
            write_int32(dst, flat)

        base = mine.send(mine.slot(self._graph_mode), len(flat), fill)
        self._fixed = {uid: base + 4 * entry for uid, entry in at.items()}

    def replan(self, problem: RaggedPrefillProblem, batch: RaggedBatch,
               options: PlanOptions) -> CudnnRaggedPrefillPlan | None:  # fmt: skip
        """This plan, made the plan of a new batch of the same buckets (the core's fast re-plan):
        the same graph(s), handle, workspace and staging, new metadata; None for other buckets,
        another device or mode (the full plan then)."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph_mode:
            return None
        if _offsets_reasons(problem, batch):
            return None
        previous_shape = self._shape
        self._shape = self._held(batch, previous_shape if self._graph_mode else None)
        key = self._key(self._base_key.sinks)
        if key != self._base_key:
            self._shape = previous_shape
            return None
        self.problem = problem
        self._fill(batch, key, graph_replan=self._graph_mode)
        self.built = False
        return self

    def _graph(self, sinks: bool) -> BuiltGraph:
        graph = self._graphs.get(sinks)
        if graph is None:  # sinks the plan was not told of (run_extras): built at this run
            graph, _ = graph_cache.get(self._key(sinks), self.handle)
            if graph.workspace_size > self._workspace.numel():
                self._workspace = torch.empty(graph.workspace_size, dtype=torch.uint8, device=self.device)
            self._graphs[sinks] = graph
        return graph

    def _dense(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when packed, else a copy in a buffer kept for the next runs."""
        if t.is_contiguous():
            return t
        buffer = self._packed.get(name)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = self._packed[name] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        buffer.copy_(t)
        return buffer

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        graph = self._graph(sinks is not None)
        plugin.execute_sdpa(graph, self._fixed, self.handle, self.device, self._workspace, self._dense("q", q),
                     self._dense("k", k), self._dense("v", v), out, lse, sinks)  # fmt: skip
