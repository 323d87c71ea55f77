"""Whether cuDNN's SDPA (this machine's cuDNN and frontend) serves a paged fp8 KV cache under
16-bit queries, the way tactix's fp8-KV semantics ask; and, for comparison, the all-fp8 form.

    python benchmarks/cudnn_fp8_kv_probe.py [--json PATH]

Builds a paged decode-like SDPA graph (4 requests, 32/8 heads, d128, page 16, kv 1024) for each
variant and reports how far it gets: ``validate``, ``build_operation_graph``,
``create_execution_plans``, ``check_support``, ``build_plans``, with cuDNN's message where it
stops. Variants:

* ``sdpa bf16 q, e4m3 kv, bf16 out``: ``g.sdpa`` with fp8 K/V tensors (what tactix would need);
* ``sdpa_fp8 e4m3 q/k/v, bf16 out``: cuDNN's fp8 SDPA with descale/scale tensors and bf16 output;
* ``sdpa_fp8 e4m3 q/k/v, e4m3 out``: the all-fp8 form (fp8 queries and output: other semantics).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

B, HQ, HKV, D, PAGE, KV = 4, 32, 8, 128, 16, 1024
STAGES = ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans")


def graph(cudnn: Any, handle: Any, variant: str) -> tuple[Any, list[str]]:
    fp8 = cudnn.data_type.FP8_E4M3
    bf16 = cudnn.data_type.BFLOAT16
    q_dt = bf16 if variant.startswith("sdpa bf16") else fp8
    out_dt = fp8 if variant.endswith("e4m3 out") else bf16
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    pages = B * KV // PAGE
    width = KV // PAGE

    def t(name: str, dims: list[int], strides: list[int], dtype: Any) -> Any:
        return g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)

    def i32(name: str, dims: list[int]) -> Any:
        return t(name, dims, list(torch.empty(dims, device="meta").stride()), cudnn.data_type.INT32)

    q = t("q", [B, HQ, 1, D], [HQ * D, D, HQ * D, 1], q_dt)
    k = t("k", [pages, HKV, PAGE, D], [HKV * PAGE * D, PAGE * D, D, 1], fp8)
    v = t("v", [pages, HKV, PAGE, D], [HKV * PAGE * D, PAGE * D, D, 1], fp8)
    table = i32("table", [B, 1, width, 1])
    seq_q, seq_kv = i32("seq_q", [B, 1, 1, 1]), i32("seq_kv", [B, 1, 1, 1])
    common = dict(q=q, k=k, v=v, attn_scale=D**-0.5, use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                  paged_attention_k_table=table, paged_attention_v_table=table,
                  paged_attention_max_seq_len_kv=KV)  # fmt: skip
    if variant.startswith("sdpa bf16"):
        o, _ = g.sdpa(name="sdpa", generate_stats=False, compute_data_type=cudnn.data_type.FLOAT, **common)
    else:

        def scale(name: str) -> Any:
            return t(name, [1, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.FLOAT)

        o, _, _, _ = g.sdpa_fp8(name="sdpa_fp8", generate_stats=False, descale_q=scale("dq"), descale_k=scale("dk"),
                                descale_v=scale("dv"), descale_s=scale("ds"), scale_s=scale("ss"),
                                scale_o=scale("so"), **common)  # fmt: skip
    o.set_output(True).set_dim([B, HQ, 1, D]).set_stride([HQ * D, D, HQ * D, 1]).set_data_type(out_dt)
    return g, []


def run_stages(cudnn: Any, g: Any) -> dict[str, str]:
    """Take a graph through cuDNN's stages (`STAGES`): how far it got, and where it failed with
    cuDNN's message (also used by cudnn_sinks_probe.py)."""
    reached = "graph construction"
    for stage in STAGES:
        try:
            if stage == "create_execution_plans":
                g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            elif stage == "build_plans":
                g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
            else:
                getattr(g, stage)()
        except Exception as exc:
            return {"reached": reached, "failed_at": stage, "error": f"{type(exc).__name__}: {exc}"[:400]}
        reached = stage
    return {"reached": reached, "error": ""}


def probe(cudnn: Any, handle: Any, variant: str) -> dict[str, str]:
    try:
        g, _ = graph(cudnn, handle, variant)
    except Exception as exc:  # the frontend refuses the node itself
        return {"reached": "graph construction", "error": f"{type(exc).__name__}: {exc}"[:400]}
    return run_stages(cudnn, g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cudnn_fp8_kv_probe.py needs a CUDA device")
    import cudnn

    handle = cudnn.create_handle()
    variants = ("sdpa bf16 q, e4m3 kv, bf16 out", "sdpa_fp8 e4m3 q/k/v, bf16 out", "sdpa_fp8 e4m3 q/k/v, e4m3 out")
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "cudnn_backend": str(cudnn.backend_version()),
        "cudnn_frontend": getattr(cudnn, "__version__", "?"),
        "variants": {v: probe(cudnn, handle, v) for v in variants},
    }
    for name, found in result["variants"].items():
        stop = found.get("failed_at", "")
        outcome = f"FAILED at {stop}" if stop else "ok"
        print(f"{name:<34} reached {found['reached']:<24} {outcome}  {found['error'][:160]}")
    print(f"cuDNN {result['cudnn_backend']}, frontend {result['cudnn_frontend']}, {result['gpu']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
