"""FlashInfer's own wrappers as anchor rows of ``tactix bench`` (when flashinfer is installed).

The rows are FlashInfer called as a FlashInfer user calls it, on the same inputs as the tactix
rows (the same HND paged cache, pages in random order, the same fp8 cache and scales), checked
against the same float64 oracle and timed by the same timer:

- decode: ``BatchDecodeWithPagedKVCacheWrapper`` without tensor cores (``flashinfer fa2``) and
  with them (``flashinfer tc``); multi-token decode (``q_len_per_req`` above 1) only with them, as
  FlashInfer documents, so the ``fa2`` row of such a case says it is not served (`NotServed`);
- prefill: ``BatchPrefillWithPagedKVCacheWrapper`` with ``backend="fa2"`` and ``"fa3"``;
- ragged prefill: ``BatchPrefillWithRaggedKVCacheWrapper`` (keys and values packed per request,
  NHD rows) with ``backend="fa2"`` and ``"fa3"``.

A case's window goes to ``plan(window_left=...)`` and its sinks to ``run(sinks=...)``, as
FlashInfer takes them.

flashinfer is never a dependency of tactix: without it (or without a GPU) there are no rows, and
`version` says why. Scales go to FlashInfer as Python floats, the form its ``run`` takes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import torch

__all__ = ["WORKSPACE_BYTES", "Anchor", "NotServed", "calls", "version"]

WORKSPACE_BYTES: Final = 128 * 1024 * 1024
"""FlashInfer's recommended float workspace (split-KV partial results)."""

_DECODE: Final = (("flashinfer fa2", {"use_tensor_cores": False}), ("flashinfer tc", {"use_tensor_cores": True}))
_PREFILL: Final = (("flashinfer fa2", {"backend": "fa2"}), ("flashinfer fa3", {"backend": "fa3"}))

Call = Callable[[], object]


class NotServed(Exception):
    """A FlashInfer wrapper that does not serve the case by FlashInfer's own documentation (its
    row is "unsupported", not "failed")."""


class Anchor(NamedTuple):
    """One FlashInfer wrapper planned for a case: ``run`` writes the output; ``plan(last_page_len)``
    plans it again for the case's pages with those last-page lengths (int32, host or device: the
    plan host-cost column)."""

    name: str
    run: Call
    plan: Callable[[torch.Tensor], None]


def version(device: torch.device) -> str | None:
    """flashinfer's version when its wrappers can run on ``device``, else None."""
    if device.type != "cuda":
        return None
    try:
        module = importlib.import_module("flashinfer")
    except Exception:  # not installed, or its import fails on this machine: no anchor rows
        return None
    return str(getattr(module, "__version__", "unknown"))


def calls(op: str, inputs: dict[str, Any]) -> list[Anchor | tuple[str, Exception]]:
    """An `Anchor` (or ``(row name, the error that stopped its plan)``) for each FlashInfer wrapper
    of ``op``.

    ``inputs`` holds what the bench gives every implementation: ``q``, ``k_cache``/``v_cache``
    (HND), ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, ``causal``,
    ``q_len_per_req`` (decode), ``sm_scale``, ``out``, and for an fp8 cache ``k_scale``/``v_scale``
    (0-d device tensors).
    Each call writes ``inputs["out"]``.
    """
    flashinfer = importlib.import_module("flashinfer")
    q, k, v, out = inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["out"]
    device = q.device
    hkv, dim, dim_vo = k.shape[1], k.shape[-1], v.shape[-1]  # (paged HND and packed rows alike)
    page = 0 if op == "ragged_prefill" else k.shape[2]
    hq = q.shape[1]
    extras: dict[str, Any] = {name: float(inputs[name]) for name in ("k_scale", "v_scale")
                              if inputs.get(name) is not None}  # fmt: skip
    if inputs.get("sinks") is not None:
        extras["sinks"] = inputs["sinks"]
    # as an engine passes them (and as tactix's rows get them): the CSR offsets and last-page
    # lengths on the host, the page indices on the device
    indptr = inputs["kv_indptr"].to(device="cpu", dtype=torch.int32)
    indices = inputs["kv_indices"].to(device=device, dtype=torch.int32)
    last = inputs["kv_last_page_len"].to(device="cpu", dtype=torch.int32)
    common: dict[str, Any] = {"q_data_type": q.dtype, "kv_data_type": k.dtype, "sm_scale": inputs["sm_scale"]}
    if int(inputs.get("window_left", -1)) >= 0:
        common["window_left"] = int(inputs["window_left"])
    rows = int(inputs.get("q_len_per_req", 1))
    found: list[Anchor | tuple[str, Exception]] = []
    variants = _DECODE if op == "decode" else _PREFILL
    for name, options in variants:
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if op == "decode" and rows > 1 and not options["use_tensor_cores"]:
            found.append((name, NotServed("multi-token decode (q_len_per_req > 1) needs use_tensor_cores=True")))
            continue
        try:
            if op == "ragged_prefill":
                wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", **options)
                qo_r = inputs["qo_indptr"].to(device="cpu", dtype=torch.int32)

                def plan_ragged(lengths: torch.Tensor, w: Any = wrapper, qo: torch.Tensor = qo_r) -> None:
                    w.plan(qo, indptr, hq, hkv, dim, head_dim_vo=dim_vo, causal=inputs["causal"], **common)

                plan: Callable[[torch.Tensor], None] = plan_ragged
                plan(last)
                found.append(Anchor(name, _ragged_runner(wrapper, q, k, v, out, extras), plan))
                continue
            if op == "decode":
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", **options)
                multi = {"q_len_per_req": rows} if rows > 1 else {}  # multi-token decode (tensor cores only)

                def plan_decode(lengths: torch.Tensor, w: Any = wrapper, extra: dict[str, Any] = multi) -> None:
                    w.plan(indptr, indices, lengths, hq, hkv, dim, page, **common, **extra)

                plan = plan_decode
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", **options)
                qo = inputs["qo_indptr"].to(device="cpu", dtype=torch.int32)

                def plan_prefill(lengths: torch.Tensor, w: Any = wrapper, qo: torch.Tensor = qo) -> None:
                    w.plan(qo, indptr, indices, lengths, hq, hkv, dim, page, causal=inputs["causal"], **common)

                plan = plan_prefill

            plan(last)
        except Exception as exc:  # this FlashInfer build refuses the problem: a row that says so
            found.append((name, exc))
            continue
        found.append(Anchor(name, _runner(wrapper, q, (k, v), out, extras), plan))
    return found


def _runner(wrapper: Any, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
            extras: dict[str, Any]) -> Call:  # fmt: skip
    def call() -> object:
        return wrapper.run(q, cache, out=out, **extras)

    return call


def _ragged_runner(wrapper: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   extras: dict[str, Any]) -> Call:  # fmt: skip
    def call() -> object:
        return wrapper.run(q, k, v, out=out, **extras)

    return call
