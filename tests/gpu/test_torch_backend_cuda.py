"""The torch backend on a CUDA GPU: every tactic, CUDA-graph capture and replay, no host sync."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tactix
from tactix.registry import get_registry
from tactix.testing import attention_reference, gemm_reference, relative_error, tolerance_for

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _paged_batch(lens: list[int], q_lens: list[int], page: int, gen: torch.Generator, spare: int = 5):
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per) + spare
    order = torch.randperm(total, generator=gen).tolist()
    indptr, indices = [0], []
    for n in pages_per:
        indices += [order.pop() for _ in range(n)]
        indptr.append(len(indices))
    last = [(n - 1) % page + 1 for n in lens]
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return total, as_i32(qo), as_i32(indptr), as_i32(indices), as_i32(last)


def _cache(total: int, heads: int, page: int, dim: int, layout: str, dtype: torch.dtype, gen: torch.Generator):
    shape = (total, heads, page, dim) if layout == "HND" else (total, page, heads, dim)
    return (
        torch.randn(shape, generator=gen).to(CUDA, dtype),
        torch.randn(shape, generator=gen).to(CUDA, dtype),
    )


@pytest.mark.parametrize("uniform", [False, True], ids=["ragged", "uniform"])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_every_listed_tactic_matches_the_oracle(op: str, uniform: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    page, hq, hkv, dim, dtype = 16, 32, 8, 128, torch.bfloat16
    lens = [300, 300, 300] if uniform else [1, 48, 517]
    q_lens = (lens if uniform else [1, 16, 200]) if op == "prefill" else [1, 1, 1]
    total, qo, kv_indptr, kv_indices, last = _paged_batch(lens, q_lens, page, gen)
    k, v = _cache(total, hkv, page, dim, "HND", dtype, gen)
    q = torch.randn(sum(q_lens), hq, dim, generator=gen).to(CUDA, dtype)
    causal = op == "prefill"
    ref, _ = attention_reference(
        q, k, v, qo, kv_indptr, kv_indices, last, kv_layout="HND", causal=causal, sm_scale=1 / math.sqrt(dim)
    )
    wrapper = tactix.PagedPrefill("HND", device=CUDA) if op == "prefill" else tactix.PagedDecode("HND", device=CUDA)

    def plan(**kw: object) -> None:
        if op == "prefill":
            wrapper.plan(qo, kv_indptr, kv_indices, last, hq, hkv, dim, page, causal=True, q_data_type=dtype, **kw)
        else:
            wrapper.plan(kv_indptr, kv_indices, last, hq, hkv, dim, page, q_data_type=dtype, **kw)

    plan(backend="torch")
    backend = get_registry().get("torch")
    tactics = backend.tactics(wrapper.problem)
    assert {t.params.get("impl") for t in tactics if t.kernel == "sdpa"} >= {"math", "efficient"}
    ran = []
    for tactic in tactics:
        if backend.check(wrapper.problem, tactic, wrapper._batch):
            continue
        plan(tactic=tactic)
        out = wrapper.run(q, (k, v))
        err = relative_error(out, ref)
        assert err < tolerance_for(dtype), f"{tactic}: relative error {err:.2e}"
        ran.append(str(wrapper.tactic))
    if uniform:
        assert any("flash" in t for t in ran), ran  # flash serves mask-free batches
    assert len(ran) >= 3, ran


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_captures_in_a_cuda_graph_and_replays_fresh_data_and_new_batches(layout: str) -> None:
    gen = torch.Generator().manual_seed(5)
    page, hq, hkv, dim, dtype, batch = 16, 32, 8, 128, torch.bfloat16, 8
    wrapper = tactix.PagedDecode(layout, device=CUDA, use_cuda_graph=True)
    total, _, kv_indptr, kv_indices, last = _paged_batch([700] * batch, [1] * batch, page, gen, spare=200)
    k, v = _cache(total, hkv, page, dim, layout, dtype, gen)
    q = torch.randn(batch, hq, dim, generator=gen).to(CUDA, dtype)
    out = torch.empty(batch, hq, dim, device=CUDA, dtype=dtype)
    wrapper.plan(kv_indptr, kv_indices, last, hq, hkv, dim, page, q_data_type=dtype)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, (k, v), out=out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, (k, v), out=out)

    qo = torch.arange(batch + 1, dtype=torch.int32)
    for step in range(3):
        if step == 2:  # a new batch in the same bucket: lengths 600..1000, other pages
            lens = [600 + 50 * i for i in range(batch)]
            _, _, new_indptr, new_indices, new_last = _paged_batch(lens, [1] * batch, page, gen, spare=0)
            kv_indptr, kv_indices, last = new_indptr, new_indices % total, new_last
            wrapper.plan(kv_indptr, kv_indices, last, hq, hkv, dim, page, q_data_type=dtype)
        q.copy_(torch.randn(q.shape, generator=gen).to(CUDA, dtype))
        k.copy_(torch.randn(k.shape, generator=gen).to(CUDA, dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(CUDA, dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_reference(
            q,
            k,
            v,
            qo,
            kv_indptr,
            kv_indices,
            last,
            kv_layout=layout,
            causal=False,
            sm_scale=1 / math.sqrt(dim),
        )
        err = relative_error(out, ref)
        assert err < tolerance_for(dtype), f"replay {step}: relative error {err:.2e}"


def test_run_with_out_makes_no_host_sync() -> None:
    gen = torch.Generator().manual_seed(3)
    total, qo, kv_indptr, kv_indices, last = _paged_batch([100, 37], [20, 37], 16, gen)
    k, v = _cache(total, 2, 16, 64, "NHD", torch.float16, gen)
    q = torch.randn(57, 8, 64, generator=gen).to(CUDA, torch.float16)
    out = torch.empty(57, 8, 64, device=CUDA, dtype=torch.float16)
    lse = torch.empty(57, 8, device=CUDA, dtype=torch.float32)
    for return_lse in (False, True):
        wrapper = tactix.PagedPrefill("NHD", device=CUDA)
        wrapper.plan(
            qo,
            kv_indptr,
            kv_indices,
            last,
            8,
            2,
            64,
            16,
            causal=True,
            q_data_type=torch.float16,
            return_lse=return_lse,
        )
        wrapper.run(q, (k, v), out=out, lse=lse if return_lse else None)  # first run checks page bounds
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            wrapper.run(q, (k, v), out=out, lse=lse if return_lse else None)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_device_resident_metadata_gives_the_same_result() -> None:
    gen = torch.Generator().manual_seed(9)
    total, qo, kv_indptr, kv_indices, last = _paged_batch([129, 16, 1], [5, 16, 1], 16, gen)
    k, v = _cache(total, 4, 16, 128, "HND", torch.bfloat16, gen)
    q = torch.randn(22, 16, 128, generator=gen).to(CUDA, torch.bfloat16)
    ref, _ = attention_reference(
        q, k, v, qo, kv_indptr, kv_indices, last, kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(128)
    )
    wrapper = tactix.PagedPrefill("HND")
    wrapper.plan(
        qo.to(CUDA),
        kv_indptr.to(CUDA),
        kv_indices.to(CUDA),
        last.to(CUDA),
        16,
        4,
        128,
        16,
        causal=True,
        q_data_type=torch.bfloat16,
    )
    assert relative_error(wrapper.run(q, (k, v)), ref) < tolerance_for(torch.bfloat16)


def test_out_of_range_device_page_index_stops_before_any_read() -> None:
    """A device-resident page index past the cache trips a device assertion, not a silent read."""
    code = textwrap.dedent(
        """
        import torch, tactix
        i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device="cuda")
        w = tactix.PagedDecode("NHD")
        w.plan(i32(0, 1), i32(4), i32(3), 4, 4, 64, 16, q_data_type=torch.float16)
        k = torch.randn(4, 16, 4, 64, device="cuda", dtype=torch.float16)
        out = w.run(torch.randn(1, 4, 64, device="cuda", dtype=torch.float16), (k, k))
        torch.cuda.synchronize()
        print("READ", out.float().sum().item())
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout
    assert "READ" not in done.stdout
    assert "assert" in done.stderr.lower() or "paged_kv_indices" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("kernel", ["matmul", "scaled_mm", "dequant"])
def test_gemm_kernels_on_cuda(kernel: str) -> None:
    gen = torch.Generator().manual_seed(1)
    m, n, k = 64, 4096, 4096
    if kernel == "matmul":
        a = torch.randn(m, k, generator=gen).to(CUDA, torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) / 64).to(CUDA, torch.bfloat16)
        out = tactix.gemm(a, w.t(), backend="torch", tactic=tactix.Tactic(backend="torch", kernel=kernel))
        ref = gemm_reference(a, w.t())
    else:
        a = torch.randn(m, k, generator=gen).to(CUDA).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, generator=gen).to(CUDA).to(torch.float8_e4m3fn)
        sa = torch.tensor(0.5, device=CUDA)
        sb = torch.tensor(0.02, device=CUDA)
        out = tactix.gemm(
            a,
            w.t(),
            scale_a=sa,
            scale_b=sb,
            out_dtype=torch.bfloat16,
            tactic=tactix.Tactic(backend="torch", kernel=kernel),
        )
        ref = gemm_reference(a, w.t(), scale_a=sa, scale_b=sb)
    assert relative_error(out, ref) < tolerance_for(torch.bfloat16)


def test_demo_runs_the_llama_layer_on_the_gpu(tmp_path: Path) -> None:
    """The demo on the GPU: every op checked, and timed eagerly and as a CUDA-graph replay (each
    op's run() captures), so the eager cost over the graph is reported per op."""
    report = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, "-m", "tactix", "demo", "--device", "cuda", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ops within tolerance" in done.stdout and "of their CUDA-graph replay when called eagerly" in done.stdout
    rows = json.loads(report.read_text())["rows"]
    assert all(r["graph_us"] and r["graph_us"] > 0 and r["eager_over_graph"] > 0 for r in rows), rows


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_wrappers_made_for_a_bare_cuda_device_accept_its_tensors(device: str) -> None:
    """'cuda' means the current GPU: tensors on cuda:0 must be accepted (regression)."""
    g = tactix.Gemm(device=device)
    g.plan(8, 64, 32, a_dtype=torch.bfloat16)
    a = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    assert relative_error(g.run(a, w.t()), gemm_reference(a, w.t())) < tolerance_for(torch.bfloat16)
    wrapper = tactix.PagedDecode("NHD", device=device)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.plan(i32(0, 1), i32(0), i32(5), 4, 4, 64, 16, q_data_type=torch.bfloat16)
    k = torch.randn(1, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    out = wrapper.run(torch.randn(1, 4, 64, device="cuda", dtype=torch.bfloat16), (k, k))
    assert bool(torch.isfinite(out).all())
