"""The cudnn plugin's CPU-side contract: tactics, version gates, graph keys, import without a GPU."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("tactix_cudnn", reason="plugins/cudnn is not installed (scripts/setup.sh installs it)")

from tactix_cudnn import plugin
from tactix_cudnn.graphs import GraphKey, excluded_plans, exclusion
from tactix_cudnn.library import FEATURES, feature_reasons

import tactix
from tactix.ops import DecodeProblem, PrefillProblem
from tactix.staging import csr_table, gather_table, write_table

BASE = dict(
    device_type="cuda", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=16,
    kv_layout="HND", q_dtype="bfloat16", kv_dtype="bfloat16", out_dtype="bfloat16", sm_scale=0.088,
    window_left=-1, logits_soft_cap=0.0, return_lse=False, batch_size=8, max_kv_len=2048,
)  # fmt: skip


def prefill(**changes: object) -> PrefillProblem:
    fields = dict(BASE, causal=True, num_qo_tokens=4000, max_qo_len=1000)
    fields.update(changes)
    return PrefillProblem(**fields)  # type: ignore[arg-type]


def key_of(problem: PrefillProblem | DecodeProblem, **sizes: int) -> GraphKey:
    batch = sizes.get("batch", problem.batch_size)
    max_q = sizes.get("max_q", getattr(problem, "max_qo_len", 1))
    max_kv = sizes.get("max_kv", problem.max_kv_len)
    strides = plugin._contiguous_strides(problem, problem.head_dim_qk)
    return plugin._key(problem, batch, max_q, max_kv, 100, strides, strides, tactix.Tactic.default("cudnn"))


def test_engine_and_knob_tactics_round_trip_and_are_validated() -> None:
    tactic = tactix.Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"KERNEL_CFG": 35}})
    again = tactix.tactics.parse_tactic(tactic.to_json())
    assert again == tactic and again.digest() == tactic.digest()
    assert plugin._params_reasons(tactic) == []
    for bad in ({"engine": "8"}, {"engine": -1}, {"engine": 8, "knobs": {"KERNEL_CFG": "35"}},
                {"engine": 8, "plan_index": 3}):  # fmt: skip
        reasons = plugin._params_reasons(tactix.Tactic(backend="cudnn", kernel="sdpa", params=bad))
        assert reasons, bad
    with pytest.raises(tactix.TacticError, match="bare plan indices"):
        tactix.tactics.parse_tactic(3)


def test_version_gates() -> None:
    assert feature_reasons("sdpa", "paged_kv", "ragged_paged", library=91900) == []
    old = feature_reasons("paged_kv", "sliding_window", library=90400)
    assert old == ["paged kv needs cuDNN >= 9.5.0 (this library is 9.4.0)",
                   "sliding window needs cuDNN >= 9.6.0 (this library is 9.4.0)"]  # fmt: skip
    assert all(isinstance(v, int) and v >= 90000 for v in FEATURES.values())


def test_every_baked_in_property_reaches_the_graph_key() -> None:
    base = key_of(prefill())
    changes = {
        "q_dtype": dict(q_dtype="float16", kv_dtype="float16", out_dtype="float16"),
        "num_qo_heads": dict(num_qo_heads=16),
        "num_kv_heads": dict(num_kv_heads=4),
        "head_dim": dict(head_dim_qk=64, head_dim_vo=64),
        "page_size": dict(page_size=32),
        "kv_layout": dict(kv_layout="NHD"),
        "causal": dict(causal=False),
        "window": dict(window_left=127),
        "scale": dict(sm_scale=0.1),
        "lse": dict(return_lse=True),
        "deterministic": dict(deterministic=False),
    }
    for name, change in changes.items():
        assert key_of(prefill(**change)) != base, f"{name} does not reach the graph key"
    # sizes inside one bucket share a graph; the next bucket does not
    assert key_of(prefill(), batch=7, max_q=600, max_kv=1100) == base
    assert key_of(prefill(), max_kv=2049) != base
    assert key_of(prefill(), batch=9) != base
    # decode reads q in place: its batch is exact
    decode = DecodeProblem(**BASE)  # type: ignore[arg-type]
    assert key_of(decode, batch=7) != key_of(decode)
    assert dataclasses.replace(base, engine=8, knobs=(("KERNEL_CFG", 35),)) != base


def test_prefill_takes_a_value_head_dim_of_its_own_and_decode_does_not() -> None:
    """DeepSeek-style prefill (192/128) is declared and reaches the graph key with both dims;
    decode's declaration refuses it (core enforces the declaration)."""
    spec = tactix.get_registry().get("cudnn").spec
    assert spec.prefill is not None and spec.decode is not None
    deepseek = prefill(head_dim_qk=192, head_dim_vo=128, num_qo_heads=16, num_kv_heads=16)
    assert spec.prefill.reasons(deepseek) == []
    assert any("head_dim_vo" in r for r in spec.decode.reasons(DecodeProblem(**{**BASE, "head_dim_vo": 64})))
    key = key_of(deepseek)
    assert (key.head_dim_qk, key.head_dim_vo) == (192, 128) and key != key_of(prefill(head_dim_qk=192,
                                                                                  head_dim_vo=192))  # fmt: skip


def test_known_bad_plans_are_excluded_only_where_they_break_a_promise() -> None:
    gqa_lse = dataclasses.replace(key_of(prefill()), lse=True)
    assert exclusion(excluded_plans(gqa_lse), 8, (("KERNEL_CFG", 3),))  # every plan of engine 8
    assert excluded_plans(key_of(prefill())) == {}
    assert excluded_plans(dataclasses.replace(gqa_lse, num_kv_heads=32)) == {}
    decode = key_of(DecodeProblem(**BASE))  # type: ignore[arg-type]
    split_kv = (("KERNEL_CFG", 35),)
    assert "not run-to-run deterministic" in (exclusion(excluded_plans(decode), 8, split_kv) or "")
    assert exclusion(excluded_plans(decode), 8, (("KERNEL_CFG", 3),)) is None
    relaxed = key_of(DecodeProblem(**BASE, deterministic=False))  # type: ignore[arg-type]
    assert exclusion(excluded_plans(relaxed), 8, split_kv) is None
    # the check names the reason for an explicit tactic, and only where it applies
    tactic = tactix.Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"KERNEL_CFG": 35}})
    problem = DecodeProblem(**BASE)  # type: ignore[arg-type]
    if plugin._attention_reasons(problem) == []:  # with a usable cuDNN library only
        assert any("deterministic" in r for r in plugin.tactix_check(problem, tactic))


def test_imports_cleanly_and_says_why_it_cannot_run_here() -> None:
    code = (
        "import torch, tactix\n"
        "import tactix_cudnn.plugin as p\n"
        "b = tactix.get_registry().get('cudnn')\n"
        "print(b.environment() if not torch.cuda.is_available() else 'gpu')\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() != "gpu":
        assert "no CUDA GPU is visible" in done.stdout


def test_plan_metadata_and_page_table_match_the_batch() -> None:
    """What cuDNN reads for a ragged batch, padded to its bucket: lengths, offsets, page rows."""
    page = 16
    kv_lens, q_lens = [1, 16, 17, 100, 33], [1, 5, 17, 2, 33]
    pages = [-(-n // page) for n in kv_lens]
    gen = torch.Generator().manual_seed(0)
    indices = torch.randperm(sum(pages) + 7, generator=gen)[: sum(pages)].to(torch.int32)
    kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in kv_lens], dtype=torch.int32)
    batch = tactix.PagedBatch.build(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=indices,
                                    kv_last_page_len=last, page_size=page, device=torch.device("cpu"),
                                    causal=True)  # fmt: skip
    problem = prefill(batch_size=5, max_kv_len=100, num_qo_tokens=58, max_qo_len=33, return_lse=True)
    key = key_of(problem)
    assert key.batch == 8 and key.table_width == 128 // page  # bucketed: 5 -> 8 requests, 100 -> 128 kv
    flat, offsets = plugin.host_metadata(problem, batch, key)
    assert all(o % 32 == 0 for o in offsets)  # 128-byte aligned sections
    section = lambda i, n: flat[offsets[i] : offsets[i] + n]  # noqa: E731
    assert section(0, 8) == [*q_lens, 0, 0, 0] and section(1, 8) == [*kv_lens, 0, 0, 0]
    starts = [*qo_indptr.tolist(), 58, 58, 58]
    assert section(3, 9) == [s * 32 * 128 for s in starts]  # q element offsets, padded requests empty
    assert section(4, 9) == [s * 32 * 128 for s in starts] and section(5, 9) == [s * 32 for s in starts]
    ext = torch.cat([indices, torch.zeros(key.table_width, dtype=torch.int32)])
    table = torch.full((key.batch, key.table_width), -1, dtype=torch.int32)
    gather_table(ext, torch.tensor(section(2, 8), dtype=torch.int32), out=table)
    for r, n in enumerate(pages):
        assert table[r, :n].tolist() == indices[kv_indptr[r] : kv_indptr[r] + n].tolist()
    assert int(table.min()) >= 0 and int(table.max()) < len(indices) + 7  # every entry a valid page
    # the device kernel ends each row at the next row's start (`csr_table`): the last request keeps
    # its pages only if the padded rows start past the last entry (they started at 0 once, and
    # FlashInfer's own prefill tests caught the last request of 12 or 17 reading page 0 throughout)
    assert section(2, 8) == [*kv_indptr.tolist()[:-1], *[len(indices)] * 3]
    kernel = csr_table(indices, section(2, 8), len(indices), key.table_width)
    for r, n in enumerate(pages):
        assert kernel[r, :n].tolist() == indices[kv_indptr[r] : kv_indptr[r] + n].tolist(), f"request {r}"
    assert not kernel[len(pages) :].any()
    # without row starts (a table laid out on the host): the same sections, none for the starts
    lean, lean_offsets = plugin.host_metadata(problem, batch, key, starts=False)
    assert lean_offsets[2] == -1 and len(lean) == len(flat) - 32
    for i in (0, 1, 3, 4, 5):
        n = 8 if i < 2 else 9
        assert lean[lean_offsets[i] : lean_offsets[i] + n] == section(i, n)
    # small batches lay the table out on the host instead: the same rows, zeros past each request
    host = torch.full((key.batch * key.table_width,), -1, dtype=torch.int32)
    src = indices.to(torch.int32).contiguous()
    write_table(host.data_ptr(), src.data_ptr(), kv_indptr.tolist(), key.batch, key.table_width)
    host = host.view(key.batch, key.table_width)
    for r in range(key.batch):
        n = pages[r] if r < len(pages) else 0
        assert host[r, :n].tolist() == table[r, :n].tolist() and not host[r, n:].any()


def test_decode_metadata_gives_every_request_one_query_row() -> None:
    """Decode graphs read q lengths too: one row per request, the kv lengths, no offsets."""
    kv_lens = [5, 40, 16, 1, 33]
    pages = [-(-n // 16) for n in kv_lens]
    kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
    last = torch.tensor([(n - 1) % 16 + 1 for n in kv_lens], dtype=torch.int32)
    batch = tactix.PagedBatch.build(qo_indptr=None, kv_indptr=kv_indptr, kv_indices=torch.arange(sum(pages)),
                                    kv_last_page_len=last, page_size=16, device=torch.device("cpu"),
                                    causal=False)  # fmt: skip
    problem = DecodeProblem(**dict(BASE, batch_size=5, max_kv_len=40))  # type: ignore[arg-type]
    key = key_of(problem)
    assert not key.ragged_q and key.batch == 5
    for starts in (True, False):
        flat, offsets = plugin.host_metadata(problem, batch, key, starts=starts)
        assert len(offsets) == 3 and all(o % 32 == 0 for o in offsets if o >= 0)
        assert flat[offsets[0] : offsets[0] + 32] == [1] * 5 + [0] * 27
        assert flat[offsets[1] : offsets[1] + 32] == kv_lens + [0] * 27
        if starts:
            assert flat[offsets[2] : offsets[2] + 5] == kv_indptr[:-1].tolist()
        else:
            assert offsets[2] == -1 and len(flat) == 64


def gemm(**changes: object) -> tactix.GemmProblem:
    fields: dict[str, object] = dict(device_type="cuda", m=64, n=256, k=128, a_dtype="bfloat16", b_dtype="bfloat16",
                                     out_dtype="bfloat16")  # fmt: skip
    fields.update(changes)
    return tactix.GemmProblem(**fields)  # type: ignore[arg-type]


def gemm_key_of(problem: tactix.GemmProblem, tactic: tactix.Tactic | None = None) -> object:
    return plugin._gemm_key(problem, *plugin._gemm_strides(problem), tactic or tactix.Tactic.default("cudnn"))


def test_every_gemm_property_reaches_the_graph_key() -> None:
    base = gemm_key_of(gemm())
    changes = {
        "m": dict(m=65), "n": dict(n=264), "k": dict(k=136), "batch": dict(batch=3, batched=True),
        "a layout": dict(a_k_major=False), "b layout": dict(b_k_major=False),
        "dtype": dict(a_dtype="float16", b_dtype="float16", out_dtype="float16"),
        "bias": dict(bias_dtype="bfloat16"),
        "fp8 scales": dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", scale_mode="per_tensor"),
    }  # fmt: skip
    for name, change in changes.items():
        assert gemm_key_of(gemm(**change)) != base, f"{name} does not reach the GEMM graph key"
    tactic = tactix.Tactic(backend="cudnn", kernel="matmul", params={"engine": 0, "knobs": {"TILE_SIZE": 3}})
    assert gemm_key_of(gemm(), tactic) != base


def test_gemm_operand_strides_follow_the_layout_and_ignore_size_one_dims() -> None:
    a_k, b_k = plugin._gemm_strides(gemm())
    assert a_k == (64 * 128, 128, 1) and b_k == (128 * 256, 1, 128)
    a_m, b_n = plugin._gemm_strides(gemm(a_k_major=False, b_k_major=False))
    assert a_m == (64 * 128, 1, 64) and b_n == (128 * 256, 256, 1)
    weight = torch.empty(256, 128)  # nn.Linear layout [n, k]; b is its transpose
    assert plugin._normalised(weight.t(), b_k) == b_k
    assert plugin._normalised(torch.empty(128, 256), b_n) == b_n
    # a [1, k] row has no layout: whatever strides torch gives it, it is read k-major
    row = torch.empty(128, 1).t()
    one = gemm(m=1, a_k_major=False)
    assert plugin._normalised(row, plugin._gemm_strides(one)[0]) == (128, 128, 1)
    batched = torch.empty(3, 64, 128)
    assert plugin._normalised(batched[:, :, :], a_k) == (64 * 128, 128, 1)
    assert plugin._normalised(torch.empty(3, 2, 64, 128)[:, 0], a_k) == (2 * 64 * 128, 128, 1)


def test_gemm_check_reasons() -> None:
    odd = plugin._gemm_reasons(gemm(m=5, n=33, k=17))
    assert any("a: k must be a multiple of 8 (got 17)" in r for r in odd)
    assert any("out: n must be a multiple of 8 (got 33)" in r for r in odd)
    fp8 = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", scale_mode="per_tensor")
    assert any("both operands k-major" in r for r in plugin._gemm_reasons(gemm(b_k_major=False, **fp8)))
    assert any("multiple of 16 (got 136)" in r for r in plugin._gemm_reasons(gemm(k=136, **fp8)))
    assert not any("k-major" in r for r in plugin._gemm_reasons(gemm(m=1, a_k_major=False, **fp8)))
    sdpa = tactix.Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8})
    assert "not this op's" in plugin._params_reasons(sdpa, "matmul")[0]


def test_shape_override_gate() -> None:
    from tactix_cudnn.library import shape_override

    class Frontend:  # a frontend build whose pygraph takes the flag
        @staticmethod
        def pygraph(io_data_type: object = None, is_override_shape_enabled: bool = False) -> None: ...

    class OldFrontend:
        @staticmethod
        def pygraph(io_data_type: object = None) -> None: ...

    class BrokenFrontend:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError("Unable to find symbol cudnnGetVersion")

    ok, why = shape_override(library=91900, module=Frontend)  # the H200's cuDNN 9.19: buckets
    assert not ok and why == "shape override needs cuDNN >= 9.21.0 (this library is 9.19.0)"
    assert shape_override(library=92100, module=Frontend) == (True, "cuDNN shape override is available")
    ok, why = shape_override(library=92100, module=OldFrontend)
    assert not ok and "no is_override_shape_enabled flag" in why
    ok, why = shape_override(library=92200, module=BrokenFrontend())
    assert not ok and "cannot ask the cuDNN frontend" in why and "cudnnGetVersion" in why


def test_direct_references_offer_no_call_over_a_cache_of_another_dtype() -> None:
    """`tactix bench`'s "cudnn (direct)" rows: a cuDNN graph takes q's dtype for its I/O, so over an
    fp8 cache it would read 16-bit values past the pages (an illegal access on the H200): no call."""
    from tactix_cudnn import direct

    k = torch.zeros(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
    i32 = torch.int32
    inputs = {"q": torch.zeros(2, 8, 64, dtype=torch.bfloat16), "k_cache": k, "v_cache": k.clone(),
              "out": torch.zeros(2, 8, 64, dtype=torch.bfloat16), "qo_indptr": torch.tensor([0, 1, 2], dtype=i32),
              "kv_indptr": torch.tensor([0, 2, 4], dtype=i32), "kv_indices": torch.arange(4, dtype=i32),
              "kv_last_page_len": torch.tensor([16, 5], dtype=i32)}  # fmt: skip
    assert direct.attention_references("decode", inputs) == []


@pytest.mark.parametrize("extra", [{"sinks": torch.zeros(8)}, {"window_left": 32}], ids=["sinks", "window"])
def test_direct_references_offer_no_call_for_sinks_or_a_window(extra: dict[str, Any]) -> None:
    """The "cudnn (direct)" graphs take neither sinks nor a window: for such a case no call (it
    would compute without them and fail the oracle, as the gpt-oss rows did on the H200)."""
    from tactix_cudnn import direct

    k = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    i32 = torch.int32
    inputs = {"q": torch.zeros(2, 8, 64, dtype=torch.bfloat16), "k_cache": k, "v_cache": k.clone(),
              "out": torch.zeros(2, 8, 64, dtype=torch.bfloat16), "qo_indptr": torch.tensor([0, 1, 2], dtype=i32),
              "kv_indptr": torch.tensor([0, 2, 4], dtype=i32), "kv_indices": torch.arange(4, dtype=i32),
              "kv_last_page_len": torch.tensor([16, 5], dtype=i32), **extra}  # fmt: skip
    assert direct.attention_references("decode", inputs) == []


def test_ragged_prefill_metadata_addresses_each_requests_packed_rows() -> None:
    """cudnn's ragged-KV prefill: the block a plan sends holds the lengths and, per tensor, the
    element offset of each request's first row in the packed q, out, LSE, k and v (the graph has
    no page table); requests past the real batch (the bucket's padding) are empty, at the end."""
    from tactix_cudnn import ragged
    from tactix_cudnn.graphs import UID_K_OFF, UID_O_OFF, UID_Q_OFF, UID_SEQ_KV, UID_SEQ_Q, UID_STATS_OFF, UID_V_OFF

    qo, kv = [0, 37, 37, 337], [0, 100, 100, 400]
    problem, batch = tactix.ragged.ragged_problem(
        device=torch.device("cpu"), qo_indptr=torch.tensor(qo), kv_indptr=torch.tensor(kv), num_qo_heads=16,
        num_kv_heads=4, head_dim_qk=192, head_dim_vo=128, causal=True, sm_scale=None, window_left=-1,
        logits_soft_cap=None, q_data_type=torch.bfloat16, kv_data_type=None, o_data_type=None, return_lse=True,
    )  # fmt: skip
    key = plugin._key(problem, batch.batch_size, batch.max_qo_len, batch.max_kv_len, 0, plugin.NO_STRIDES,
                      plugin.NO_STRIDES, tactix.Tactic.default("cudnn"))  # fmt: skip
    assert key.ragged_kv and key.table_width == 0 and key.page_size == 0
    assert (key.batch, key.max_q, key.max_kv, key.head_dim_qk, key.head_dim_vo) == (4, 512, 512, 192, 128)
    flat, at = ragged.ragged_metadata(problem, batch, key)
    assert all(entry % 32 == 0 for entry in at.values())  # 128-byte aligned sections

    def section(uid: int, n: int) -> list[int]:
        return flat[at[uid] : at[uid] + n]

    assert section(UID_SEQ_Q, 4) == [37, 0, 300, 0] and section(UID_SEQ_KV, 4) == [100, 0, 300, 0]
    assert section(UID_Q_OFF, 5) == [r * 16 * 192 for r in [*qo, 337]]
    assert section(UID_O_OFF, 5) == [r * 16 * 128 for r in [*qo, 337]]
    assert section(UID_STATS_OFF, 5) == [r * 16 for r in [*qo, 337]]
    assert section(UID_K_OFF, 5) == [r * 4 * 192 for r in [*kv, 400]]
    assert section(UID_V_OFF, 5) == [r * 4 * 128 for r in [*kv, 400]]
    # the static reasons of a ragged problem read no page size; a bad head dim is still refused
    bad = problem.model_copy(update={"head_dim_vo": 260})
    assert any("head_dim_vo 260" in r for r in plugin._attention_reasons_now(bad))
    spec = tactix.get_registry().get("cudnn").spec
    on_gpu = problem.model_copy(update={"device_type": "cuda"})
    assert spec.ragged_prefill is not None and spec.ragged_prefill.reasons(on_gpu) == []
