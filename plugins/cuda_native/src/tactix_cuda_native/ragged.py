"""Ragged-KV prefill (``tactix.RaggedPrefill``): the paged prefill kernel over pages of one token.

Packed ``k`` and ``v`` (``[kv_tokens, kv_heads, head_dim]``, each request's keys contiguous rows)
are an NHD paged cache of one-token pages whose page table is the identity: page ``i`` is row
``i`` (`tactix.RaggedBatch.paged`, `tactix.RaggedPrefillProblem.as_paged_prefill`). So the plan
is `prefill.CudaNativePrefillPlan` of that paged problem and batch, and ``run`` hands it
``k.unsqueeze(1)`` and ``v.unsqueeze(1)``: every prefill kernel and tactic (wgmma on Hopper,
mma.sync elsewhere), fp8 caches, windows, the soft cap, the LSE, scales and sinks, as paged
prefill serves them at page size 1. The table costs 4 bytes a key, sent with the plan's metadata.
On Hopper with 16-bit K and V the wgmma kernel skips the table: its keys are rows of the packed
tensors, loaded a tile at a time through tensor maps (``kv_tma``, `prefill.ragged_tma`).
"""

from __future__ import annotations

import torch

from tactix import PlanOptions, RaggedBatch, RaggedPrefillProblem, Tactic
from tactix_cuda_native import prefill

__all__ = ["CudaNativeRaggedPrefillPlan", "plan_ragged_prefill"]


class CudaNativeRaggedPrefillPlan:
    """A planned ragged-KV prefill batch: the paged prefill plan of its one-token pages."""

    def __init__(self, paged: prefill.CudaNativePrefillPlan, problem: RaggedPrefillProblem) -> None:
        self.paged = paged
        self.problem = problem
        self.device = paged.device
        self.tactic = paged.tactic
        self.built = paged.built
        self._run = paged.run

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """The paged plan's run over ``k`` and ``v`` as one-token NHD pages (views: no copy)."""
        self._run(q, k.unsqueeze(1), v.unsqueeze(1), out, lse, k_scale=k_scale, v_scale=v_scale, sinks=sinks)

    def replan(self, problem: RaggedPrefillProblem, batch: RaggedBatch,
               options: PlanOptions) -> CudaNativeRaggedPrefillPlan | None:  # fmt: skip
        """The core's fast re-plan (`tactix.selection.replan_selection`), through the paged plan's."""
        made = self.paged.replan(problem.as_paged_prefill(), batch.paged, options)
        return None if made is None else CudaNativeRaggedPrefillPlan(made, problem)  # type: ignore[arg-type]


def plan_ragged_prefill(problem: RaggedPrefillProblem, batch: RaggedBatch, tactic: Tactic,
                        options: PlanOptions) -> CudaNativeRaggedPrefillPlan:  # fmt: skip
    """The plan hook's work: the paged prefill plan of the problem's one-token pages (its reasons,
    as the paged plan hook gives them, for a problem it refuses)."""
    previous = options["previous"]
    inner = previous.paged if isinstance(previous, CudaNativeRaggedPrefillPlan) else None
    paged = prefill.plan_prefill(problem.as_paged_prefill(), batch.paged, tactic, {**options, "previous": inner},
                                 kv_tma=prefill.ragged_tma())  # fmt: skip
    return CudaNativeRaggedPrefillPlan(paged, problem)
