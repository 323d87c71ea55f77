"""Whether cuDNN's SDPA (this machine's cuDNN and frontend) serves attention sinks on the paged
graphs the cudnn plugin builds: issue 24's open question for prefill (decode, s_q = 1, is refused
by cuDNN's support surface for every backend engine; probed here too, to keep the answer current).

    python benchmarks/cudnn_sinks_probe.py [--json PATH]

For each variant it builds a paged SDPA graph like the cudnn plugin's (bf16, 32/8 heads, d128,
page 16, padding mask and bottom-right diagonal bounds; a sink logit per query head,
``sink_token`` ``[1, heads, 1, 1]`` float32) and reports how far it gets through
cudnn_fp8_kv_probe.py's stages (validate ... build_plans), with cuDNN's message where it stops.
Where every stage passes, the graph runs once on random data and its output is compared with
tactix's float64 oracle (the sink term in each row's softmax denominator:
`tactix.testing.attention_reference`), so a graph cuDNN accepts but computes differently shows
as a wrong result, not as support. Variants:

* ``prefill causal``: 4 requests of 256 new tokens over 256 cached (q 256, kv 512);
* ``prefill causal, window 127``: the same with a sliding window (gpt-oss's alternate layers);
* ``decode``: 4 requests, one query row each, kv 512.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from cudnn_fp8_kv_probe import run_stages

HQ, HKV, D, PAGE, B, KV = 32, 8, 128, 16, 4, 512
VARIANTS = {"prefill causal": (256, -1), "prefill causal, window 127": (256, 127), "decode": (1, -1)}


def build(cudnn: Any, handle: Any, q_len: int, window: int) -> tuple[Any, dict[str, Any]]:
    """The graph (stages not yet run) and its tensors by name."""
    bf16, i32_t = cudnn.data_type.BFLOAT16, cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    pages, width = B * KV // PAGE, KV // PAGE

    def t(name: str, dims: list[int], strides: list[int], dtype: Any) -> Any:
        return g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)

    def i32(name: str, dims: list[int]) -> Any:
        return t(name, dims, list(torch.empty(dims, device="meta").stride()), i32_t)

    q = t("q", [B, HQ, q_len, D], [q_len * HQ * D, D, HQ * D, 1], bf16)
    k = t("k", [pages, HKV, PAGE, D], [HKV * PAGE * D, PAGE * D, D, 1], bf16)
    v = t("v", [pages, HKV, PAGE, D], [HKV * PAGE * D, PAGE * D, D, 1], bf16)
    tensors = {
        "q": q, "k": k, "v": v, "table": i32("table", [B, 1, width, 1]),
        "seq_q": i32("seq_q", [B, 1, 1, 1]), "seq_kv": i32("seq_kv", [B, 1, 1, 1]),
        "sinks": t("sinks", [1, HQ, 1, 1], [HQ, 1, 1, 1], cudnn.data_type.FLOAT),
    }  # fmt: skip
    kwargs: dict[str, Any] = dict(
        name="sdpa", q=q, k=k, v=v, attn_scale=D**-0.5, generate_stats=False, use_padding_mask=True,
        seq_len_q=tensors["seq_q"], seq_len_kv=tensors["seq_kv"], paged_attention_k_table=tensors["table"],
        paged_attention_v_table=tensors["table"], paged_attention_max_seq_len_kv=KV,
        compute_data_type=cudnn.data_type.FLOAT, sink_token=tensors["sinks"],
    )  # fmt: skip
    if q_len > 1:
        kwargs["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        kwargs["diagonal_band_right_bound"] = 0
    if window >= 0:
        kwargs["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        kwargs["diagonal_band_left_bound"] = window + 1
    o, _ = g.sdpa(**kwargs)
    o.set_output(True).set_dim([B, HQ, q_len, D]).set_stride([q_len * HQ * D, D, HQ * D, 1])
    tensors["o"] = o
    return g, tensors


def run_and_check(cudnn: Any, handle: Any, g: Any, tensors: dict[str, Any], q_len: int, window: int) -> dict[str, Any]:
    """One run on random data against the float64 oracle with the sinks."""
    from tactix.testing import attention_reference, relative_error, tolerance_for

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    pages = B * KV // PAGE
    k = torch.randn(pages, HKV, PAGE, D, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(pages, HKV, PAGE, D, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(B * q_len, HQ, D, generator=gen).to(dev, torch.bfloat16)
    sinks = (torch.rand(HQ, generator=gen) * 4 + 4).to(dev)
    order = torch.randperm(pages, generator=gen).to(torch.int32)
    table = order.view(B, KV // PAGE).to(dev)
    out = torch.full((B * q_len, HQ, D), float("nan"), device=dev, dtype=torch.bfloat16)
    seq_q = torch.full((B, 1, 1, 1), q_len, dtype=torch.int32, device=dev)
    seq_kv = torch.full((B, 1, 1, 1), KV, dtype=torch.int32, device=dev)
    pack = {tensors["q"]: q, tensors["k"]: k, tensors["v"]: v, tensors["table"]: table.view(B, 1, -1, 1),
            tensors["seq_q"]: seq_q, tensors["seq_kv"]: seq_kv, tensors["sinks"]: sinks.view(1, HQ, 1, 1),
            tensors["o"]: out}  # fmt: skip
    workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=dev)
    g.execute(pack, workspace, handle=handle)
    torch.cuda.synchronize()
    i32 = torch.int32
    qo = torch.arange(0, (B + 1) * q_len, q_len, dtype=i32)
    indptr = torch.arange(0, pages + 1, KV // PAGE, dtype=i32)
    last = torch.full((B,), PAGE, dtype=i32)
    ref, _ = attention_reference(q, k, v, qo, indptr, order, last, kv_layout="HND", causal=q_len > 1,
                                 sm_scale=1 / math.sqrt(D), window_left=window, sinks=sinks)  # fmt: skip
    err = relative_error(out, ref)
    return {"rel_error": err, "within_tolerance": err <= tolerance_for(torch.bfloat16)}


def probe(cudnn: Any, handle: Any, q_len: int, window: int) -> dict[str, Any]:
    try:
        g, tensors = build(cudnn, handle, q_len, window)
    except Exception as exc:  # the frontend refuses the node itself
        return {"reached": "graph construction", "failed_at": "sdpa", "error": f"{type(exc).__name__}: {exc}"[:400]}
    staged = run_stages(cudnn, g)
    if "failed_at" in staged:
        return staged
    reached = staged["reached"]
    try:
        checked = run_and_check(cudnn, handle, g, tensors, q_len, window)
    except Exception as exc:
        return {"reached": reached, "failed_at": "execute", "error": f"{type(exc).__name__}: {exc}"[:400]}
    return {"reached": "execute", "error": "", **checked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cudnn_sinks_probe.py needs a CUDA device")
    import cudnn

    handle = cudnn.create_handle()
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "cudnn_backend": str(cudnn.backend_version()),
        "cudnn_frontend": getattr(cudnn, "__version__", "?"),
        "variants": {name: probe(cudnn, handle, *shape) for name, shape in VARIANTS.items()},
    }
    for name, found in result["variants"].items():
        stop = found.get("failed_at", "")
        if stop:
            print(f"{name:<28} reached {found['reached']:<24} FAILED at {stop}  {found['error'][:160]}")
        else:
            ok = "within" if found["within_tolerance"] else "OUTSIDE"
            print(f"{name:<28} ran: relative error {found['rel_error']:.1e} ({ok} the bf16 tolerance)")
    print(f"cuDNN {result['cudnn_backend']}, frontend {result['cudnn_frontend']}, {result['gpu']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
