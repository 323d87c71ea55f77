"""A naive paged-decode backend for tactix: the smallest complete plugin.

Registered through the entry point ``naive`` in the ``tactix.backends`` group (see
pyproject.toml). It implements decode only, and declares exactly what it supports: no sliding
window, no soft-cap, equal qk/vo head dims. The conformance kit skips everything else with
these reasons and holds the rest to the float64 oracle.
"""

from __future__ import annotations

import torch

import tactix

NAME = "naive"
__version__ = "0.1.0"

_FLOATS = frozenset({"float16", "bfloat16", "float32"})

LOOP = tactix.Tactic(backend=NAME, kernel="loop")
"""The one kernel. Plans report it as their tactic, so it must be accepted when asked for too."""


@tactix.hookimpl
def tactix_backends() -> list[tactix.BackendSpec]:
    # Importing this module must stay cheap and must not touch CUDA: `tactix backends` imports it.
    return [
        tactix.BackendSpec(
            name=NAME,
            version=__version__,
            description="naive paged decode, one request at a time (example plugin)",
            decode=tactix.AttentionCapabilities(
                devices=frozenset({"cpu", "cuda"}),
                q_dtypes=_FLOATS,
                kv_dtypes=_FLOATS,
                out_dtypes=_FLOATS,
                head_dims=None,  # any
                page_sizes=None,  # any
                kv_layouts=frozenset({"NHD", "HND"}),
                lse=True,
            ),
            # below the built-in torch backend: an example must never win untuned `auto`
            preference=-200,
        )
    ]


@tactix.hookimpl
def tactix_check(problem: tactix.Problem, tactic: tactix.Tactic) -> list[str] | None:
    # Capabilities are checked before this hook; only what they cannot express goes here.
    reasons = []
    if isinstance(problem, tactix.DecodeProblem) and problem.kv_dtype != problem.q_dtype:
        reasons.append("kv dtype must equal q dtype")
    if not tactic.is_default and tactic != LOOP:
        reasons.append(f"the only kernel is {LOOP} (got {tactic})")
    return reasons


class NaiveDecodePlan:
    """Keeps each request's page list on the device; run() loops over the requests."""

    built = False

    def __init__(self, problem: tactix.DecodeProblem, batch: tactix.PagedBatch, device: torch.device) -> None:
        self.problem = problem
        self.tactic = LOOP
        indptr = batch.kv_indptr.tolist()
        indices = batch.kv_indices.to(device=device, dtype=torch.long)  # a copy once per plan
        self.requests = [(indices[indptr[r] : indptr[r + 1]], int(batch.kv_lens[r])) for r in range(batch.batch_size)]

    def run(self, q, k_cache, v_cache, out, lse) -> None:  # type: ignore[no-untyped-def]
        p = self.problem
        group = p.num_qo_heads // p.num_kv_heads
        for r, (pages, length) in enumerate(self.requests):
            k = self._tokens(k_cache, pages, length)  # [length, kv_heads, dim]
            v = self._tokens(v_cache, pages, length)
            k = k.repeat_interleave(group, dim=1)  # one kv head per query head
            v = v.repeat_interleave(group, dim=1)
            logits = torch.einsum("hd,khd->hk", q[r].float(), k) * p.sm_scale
            row_lse = torch.logsumexp(logits, dim=-1)
            out[r] = torch.einsum("hk,khd->hd", torch.exp(logits - row_lse[:, None]), v).to(out.dtype)
            if lse is not None:
                lse[r] = row_lse

    def _tokens(self, cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
        blocks = cache.index_select(0, pages)  # [pages, page, heads, dim] (NHD) or [pages, heads, page, dim]
        if self.problem.kv_layout == "HND":
            blocks = blocks.transpose(1, 2)
        return blocks.reshape(-1, blocks.shape[2], blocks.shape[3])[:length].float()


@tactix.hookimpl
def tactix_plan_decode(
    problem: tactix.DecodeProblem,
    batch: tactix.PagedBatch,
    tactic: tactix.Tactic,
    options: tactix.PlanOptions,
) -> NaiveDecodePlan | None:
    return NaiveDecodePlan(problem, batch, options["device"])
