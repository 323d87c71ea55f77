"""The FlashInfer parity harness (benchmarks/flashinfer_parity), without a GPU or flashinfer.

The report is checked on a JUnit file written here, the scope and the sample on small sources,
the runner's argument errors in-process, and one whole run end to end on stand-ins: a stub
``flashinfer``, a stub ``tactix.compat.flashinfer`` and a small test tree laid out like
FlashInfer's, so the substitution, the scope, the sample and the report meet as on the GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pytest

HERE = Path(__file__).resolve().parents[1] / "benchmarks" / "flashinfer_parity"
_spec = importlib.util.spec_from_file_location("flashinfer_parity_run", HERE / "run.py")
assert _spec is not None and _spec.loader is not None
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)  # puts its folder on sys.path, for its two pure modules

import parity_report as report  # noqa: E402
import parity_scope as scope  # noqa: E402

# --- the report ---------------------------------------------------------------------------------

DECODE = "tests.attention.test_batch_decode_kernels"
PREFILL = "tests.attention.test_batch_prefill_kernels"
FAST_PLAN_TRACE = """\
tests/attention/test_batch_decode_kernels.py:326: in test_batch_decode_with_paged_kv_cache_with_fast_plan
    wrapper.plan(
/tmp/site/flashinfer/decode.py:4850: in fast_decode_plan
    if self._requested_backend == "cudnn":
E   AttributeError: 'BatchDecodeWithPagedKVCacheWrapper' object has no attribute '_requested_backend'"""
CASES = [  # (classname, name, element, attributes, text)
    (DECODE, "test_batch_decode_with_paged_kv_cache[True-float16-float16]", None, {}, ""),
    (DECODE, "test_batch_decode_with_paged_kv_cache[True-float8_e4m3fn-float16]", "failure",
     {"message": "tactix.errors.UnsupportedProblemError: backend 'auto' cannot serve "
                 "DecodeProblem(kv_dtype='float8_e4m3fn'): no backend"}, "trace"),
    (DECODE, "test_batch_decode_with_paged_kv_cache_nvfp4[float16-128]", "failure",
     {"message": "tactix.errors.InvalidArgumentError: 'kv_data_type' must be a dtype among "
                 "['bfloat16', 'float16', 'float8_e4m3fn'] (got torch.uint8)"}, "trace"),
    (DECODE, "test_batch_decode_with_paged_kv_cache_with_fast_plan[True-float16]", "failure",
     {"message": "AttributeError: 'BatchDecodeWithPagedKVCacheWrapper' object has no attribute '_requested_backend'"},
     FAST_PLAN_TRACE),
    (DECODE, "test_batch_decode_rejects_unequal_kv_strides_nvfp4_contract", "failure",
     {"message": "AttributeError: 'BatchDecodeWithPagedKVCacheWrapper' object has no attribute 'use_tensor_cores'"},
     "trace"),
    (DECODE, "test_tensor_core_decode_rejects_mismatched_q_len", "error",
     {"message": 'failed on setup with "RuntimeError: CUDA error: an illegal memory access"'}, "trace"),
    (PREFILL, "test_batch_prefill_with_paged_kv_cache[True-NONE-False]", "skipped",
     {"type": "pytest.xfail", "message": "NOTE(Zihao): temporarily disable cuda graph"}, ""),
    (PREFILL, "test_batch_prefill_with_paged_kv_cache[True-NONE-True]", "skipped",
     {"type": "pytest.skip", "message": "qo_len > kv_len and causal is not supported"}, ""),
    (PREFILL, "test_batch_prefill_with_paged_kv_cache_custom_mask[577-97]", "failure",
     {"message": "tactix.errors.InvalidArgumentError: 'custom_mask' must be None (tactix does not implement it) "
                 "(got tensor([True, ...]))"}, "trace"),
]  # fmt: skip


def _junit(cases: list[tuple[str, str, str | None, dict[str, str], str]]) -> str:
    """The JUnit XML pytest writes for ``cases``."""
    lines = ['<?xml version="1.0" encoding="utf-8"?>', f'<testsuites><testsuite name="parity" tests="{len(cases)}">']
    for classname, name, element, attributes, text in cases:
        lines.append(f"<testcase classname={quoteattr(classname)} name={quoteattr(name)}>")
        if element is not None:
            attrs = " ".join(f"{key}={quoteattr(value)}" for key, value in attributes.items())
            lines.append(f"<{element} {attrs}>{escape(text)}</{element}>")
        lines.append("</testcase>")
    return "\n".join([*lines, "</testsuite></testsuites>"])


JUNIT = _junit(CASES)


def _case(message: str, text: str = "") -> report.Case:
    return report.Case("m::f", "f[x]", "failed", message=message, text=text)


@pytest.mark.parametrize(
    ("message", "text", "cause"),
    [
        (
            "InvalidArgumentError: 'kv_data_type' must be a dtype among ['float8_e4m3fn'] (got torch.uint8)",
            "",
            "NVFP4 KV cache",
        ),
        ("TypeError: run() got an unexpected keyword argument 'kv_cache_sf'", "", "NVFP4 KV cache"),
        (
            "UnsupportedProblemError: backend 'auto' cannot serve DecodeProblem(kv_dtype='float8_e5m2')",
            "",
            "fp8 KV cache",
        ),
        (
            "InvalidArgumentError: 'q_len_per_req' must be None (tactix does not implement it) (got 2)",
            "",
            "multi-token decode (q_len_per_req)",
        ),
        (
            "AttributeError: 'X' object has no attribute '_block_tables'",
            "decode.py:12: in fast_decode_plan\n",
            "fast_decode_plan internals",
        ),
        ("AttributeError: 'X' object has no attribute '_block_tables'", "", "missing attribute `_block_tables`"),
        (
            "BackendNotFoundError: 'backend' must be 'auto' or one of 'cudnn', 'torch' (got 'fa3')",
            "",
            "backend names fa2/fa3",
        ),
        (
            "InvalidArgumentError: 'backend' must be one of FlashInfer's 'auto', 'fa2', 'fa3' (tactix's auto) or a "
            "tactix backend name (torch) (got 'cutlass')",
            "",
            "backend name `cutlass`",
        ),
        (
            "InvalidArgumentError: 'packed_custom_mask' must be None (got tensor([1]))",
            "",
            "custom masks (custom_mask / packed_custom_mask)",
        ),
        (
            "AssertionError: Tensor-likes are not close!\n\nMismatched elements: 3 / 4096",
            "",
            "wrong result (differs from FlashInfer's reference)",
        ),
        (
            "\nRuntimeError: CUDA error: an illegal memory access\nmore",
            "",
            "other: RuntimeError: CUDA error: an illegal memory access",
        ),
        (
            "Failed: DID NOT RAISE <class 'Exception'>",
            '    with pytest.raises(Exception, match="must have identical strides"):\n',
            "tactix serves K and V pools of different strides (FlashInfer's CUDA-core decode refuses them)",
        ),
        (
            "Failed: DID NOT RAISE NotImplementedError",
            '    with pytest.raises(NotImplementedError, match="fa2"):\n',
            "tactix serves multi-token decode with backend='fa3' (its auto), which FlashInfer's fa3 refuses",
        ),
        (
            "tactix.errors.InvalidArgumentError: 'paged_kv_last_page_len' must be large enough that each request "
            "has at least as many kv tokens as query tokens (causal attention ...)",
            "",
            "causal prefill with more query rows than keys: refused at plan (rows with no key)",
        ),
        ("Failed: DID NOT RAISE <class 'ValueError'>", "", "expected error not raised"),
        (  # torch.testing wraps an out-of-memory error raised while it compared
            "RuntimeError: Comparing\n\nTensorLikePair(",
            "E   torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 38.00 MiB.\n",
            "CUDA out of memory",
        ),
        (
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling",
            "CUDA out of memory",
        ),
        ("RuntimeError: Comparing\n", "E   AssertionError: no memory word here\n", "other: RuntimeError: Comparing"),
        ("", "", "other: (no message)"),
    ],
)
def test_causes_come_from_the_first_matching_rule(message: str, text: str, cause: str) -> None:
    assert report.cause_of(_case(message, text)) == cause


def test_a_rule_added_in_front_names_a_new_cause() -> None:
    rules = (report.Rule("sinks ({0})", message=r"'(sinks)' must be"), *report.CAUSES)
    case = _case("InvalidArgumentError: 'sinks' must be None (got tensor)")
    assert report.cause_of(case, rules) == "sinks (sinks)"
    assert report.cause_of(case).startswith("other: ")


def test_junit_outcomes_per_test_function() -> None:
    results = report.parse_junit(JUNIT)
    outcomes = {(c.function, c.outcome, c.detail) for c in results.cases}
    assert ("test_batch_decode_kernels::test_batch_decode_with_paged_kv_cache", "passed", "") in outcomes
    assert (
        "test_batch_decode_kernels::test_tensor_core_decode_rejects_mismatched_q_len",
        "failed",
        "error",
    ) in outcomes
    assert ("test_batch_prefill_kernels::test_batch_prefill_with_paged_kv_cache", "skipped", "xfailed") in outcomes
    assert len(results.cases) == 9 and results.selection == {}


def test_summary_tables(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    selection = {
        "mode": "tactix",
        "sample": 9,
        "seed": 3,
        "collected": 40,
        "in_scope": 20,
        "selected": 9,
        "deselected": {scope.OUT_OF_SCOPE_ROPE: 20, scope.NOT_SAMPLED: 11},
        "functions": {
            "test_batch_decode_kernels::test_batch_decode_with_paged_kv_cache": {
                "collected": 30,
                "in_scope": 12,
                "selected": 2,
                "out_of_scope": {scope.OUT_OF_SCOPE_ROPE: 18},
            },
            "test_batch_decode_kernels::test_cuda_graph_batch_decode_with_paged_kv_cache": {
                "collected": 2,
                "in_scope": 0,
                "selected": 0,
                "out_of_scope": {scope.OUT_OF_SCOPE_NO_WRAPPER: 2},
            },
        },
        "substituted": ["flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper"],
        "environment": {"flashinfer": "0.7.2", "gpu": "NVIDIA H200"},
    }
    report.embed_selection(path, selection)
    results = report.parse_junit(path)
    assert results.selection == selection
    md = report.summarize(results)
    assert "with tactix.compat.flashinfer's wrappers" in md
    assert "`flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper`" in md
    assert "**1 passed, 6 failed, 2 skipped** of 9 cases run." in md
    assert "| `test_batch_decode_with_paged_kv_cache` | 12 | 1 | 1 | 0 |" in md
    assert "| `test_batch_prefill_with_paged_kv_cache` | — | 0 | 0 | 2 |" in md
    assert "| fp8 KV cache | 1 | `test_batch_decode_with_paged_kv_cache` (1) |" in md
    assert "| NVFP4 KV cache | 1 |" in md and "| fast_decode_plan internals | 1 |" in md
    assert "| missing attribute `use_tensor_cores` | 1 |" in md
    assert '| other: failed on setup with "RuntimeError: CUDA error: an illegal memory access" | 1 |' in md
    assert "| xfail: NOTE(Zihao): temporarily disable cuda graph | 1 |" in md
    assert "| qo_len > kv_len and causal is not supported | 1 |" in md
    assert (
        f"| `test_batch_decode_kernels::test_cuda_graph_batch_decode_with_paged_kv_cache` | "
        f"{scope.OUT_OF_SCOPE_NO_WRAPPER} | 2 |" in md
    )
    assert (
        "| `test_batch_decode_kernels::test_batch_decode_with_paged_kv_cache` | not in the seeded sample | 10 |" in md
    )
    assert "--sample 9 --seed 3" in md and "gpu NVIDIA H200" in md
    report.embed_selection(path, {**selection, "mode": "reference"})  # replaces, does not add
    again = report.parse_junit(path)
    assert again.selection["mode"] == "reference" and "FlashInfer's own wrappers (reference run)" in report.summarize(
        again
    )


def test_report_script_rereads_a_junit_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert report.main([str(path), "--summary", str(tmp_path / "s.md")]) == 0
    assert "## Failures by cause" in (tmp_path / "s.md").read_text()
    assert report.main([str(tmp_path / "missing.xml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- the scope and the sample -------------------------------------------------------------------

SOURCE = """
def helper(q, head_dim=128, pos_encoding_mode="NONE"):
    return flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(q)

def test_param(head_dim, pos_encoding_mode):
    helper(1)

def test_body():
    num_qo_heads, head_dim = 4, 512
    flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None)

def test_rope_helper():
    helper(2, head_dim=64, pos_encoding_mode="ROPE_LLAMA")

def test_ragged():
    flashinfer.BatchPrefillWithRaggedKVCacheWrapper(None)

def test_plain(dtype):
    head_dim = 128
    helper(3)
"""
WRAPPERS = ("BatchDecodeWithPagedKVCacheWrapper",)


@pytest.mark.parametrize(
    ("function", "params", "reason"),
    [
        ("test_param", {"head_dim": 256, "pos_encoding_mode": "NONE"}, None),
        ("test_param", {"head_dim": 512, "pos_encoding_mode": "NONE"}, scope.OUT_OF_SCOPE_HEAD_DIM),
        ("test_param", {"head_dim": 128, "pos_encoding_mode": "ROPE_LLAMA"}, scope.OUT_OF_SCOPE_ROPE),
        ("test_body", {}, scope.OUT_OF_SCOPE_HEAD_DIM),
        ("test_rope_helper", {}, scope.OUT_OF_SCOPE_ROPE),
        ("test_ragged", {}, scope.OUT_OF_SCOPE_NO_WRAPPER),
        ("test_plain", {"dtype": "float16"}, None),
        ("test_missing", {}, scope.OUT_OF_SCOPE_NO_WRAPPER),
    ],
)
def test_scope_reads_params_first_then_the_source(function: str, params: dict[str, object], reason: str | None) -> None:
    facts = scope.ModuleFacts(SOURCE).facts(function)
    assert scope.out_of_scope(params, facts, WRAPPERS) == reason


def test_sample_is_seeded_spread_and_order_free() -> None:
    groups = {"big": [f"big[{i}]" for i in range(90)], "mid": [f"mid[{i}]" for i in range(9)], "one": ["one"]}
    counts = scope.allocate({k: len(v) for k, v in groups.items()}, 20, seed=1)
    assert sum(counts.values()) == 20 and counts["one"] == 1 and counts["big"] > counts["mid"] >= 1
    drawn = scope.sample(groups, 20, seed=1)
    assert len(drawn) == 20 and "one" in drawn
    shuffled = {k: list(reversed(v)) for k, v in reversed(list(groups.items()))}
    assert scope.sample(shuffled, 20, seed=1) == drawn
    assert scope.sample(groups, 20, seed=2) != drawn
    assert len(scope.sample(groups, 2, seed=1)) == 2
    assert (
        scope.sample(groups, None, seed=0)
        == scope.sample(groups, 1000, seed=0)
        == {c for v in groups.values() for c in v}
    )


def test_file_keys() -> None:
    assert scope.file_key("/x/.gpu/flashinfer-tests/" + scope.DECODE_FILE) == scope.DECODE_FILE
    assert scope.file_key(scope.PREFILL_FILE) == scope.PREFILL_FILE
    assert scope.file_key("/x/tests/attention/test_other.py") is None


# --- the runner's arguments ---------------------------------------------------------------------


def _tree(root: Path) -> Path:
    for rel in scope.SUBSTITUTIONS:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    return root


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["{missing}"], "is not a directory (prepare.sh --flashinfer puts it in .gpu/)"),
        (["{empty}"], "is not FlashInfer's test tree: it has no tests/attention/test_batch_decode_kernels.py"),
        (["{tree}", "--seed", "3"], "--seed applies to a sample: give --sample N too"),
        (["{tree}", "--sample", "0"], "argument --sample: expected a positive number of cases, got 0"),
        (["{tree}", "--sample", "many"], "argument --sample: expected a positive number of cases, got 'many'"),
        (["{tree}", "--junit", "{tree}"], "is a directory; give a file path"),
        (["{tree}", "--bogus"], "unrecognized arguments: --bogus"),
        (["{tree}", "--summary", "{tree}/tests/attention/test_batch_decode_kernels.py/x/s.md"], "Not a directory"),
    ],
)
def test_runner_argument_errors_are_one_line(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "tree": _tree(tmp_path / "tree")}
    with pytest.raises(SystemExit) as exit_info:
        runner.main([arg.format(**paths) for arg in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: ") and err.count("\n") == 1 and expected in err, err


def test_runner_script_missing_tree_prints_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "run.py"), str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"run.py: error: FlashInfer's test tree {tmp_path / 'nowhere'} is not a directory " \
        "(prepare.sh --flashinfer puts it in .gpu/)\n"  # fmt: skip


# --- one whole run on stand-ins -----------------------------------------------------------------

STUBS = {
    "flashinfer/__init__.py": """
        __version__ = "0.0.stub"
        from . import decode, prefill, utils
        from .decode import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan
        from .prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
    """,
    "flashinfer/utils.py": """
        def has_flashinfer_jit_cache():
            return False
    """,
    "flashinfer/decode.py": """
        class BatchDecodeWithPagedKVCacheWrapper:
            origin = "flashinfer"
            use_tensor_cores = False
            _requested_backend = "auto"
            def __init__(self, *args, **kwargs):
                pass
            def plan(self, **kwargs):
                pass
        def fast_decode_plan(self, **kwargs):
            return self._requested_backend
        def single_decode_with_kv_cache():
            return "flashinfer"
    """,
    "flashinfer/prefill.py": """
        class BatchPrefillWithPagedKVCacheWrapper:
            origin = "flashinfer"
            def __init__(self, *args, **kwargs):
                pass
            def plan(self, **kwargs):
                pass
        class BatchPrefillWithRaggedKVCacheWrapper(BatchPrefillWithPagedKVCacheWrapper):
            pass
    """,
    "tactix/__init__.py": '__version__ = "0.0.stub"',
    "tactix/compat/__init__.py": "",
    "tactix/compat/flashinfer.py": """
        class _Wrapper:
            origin = "tactix"
            def __init__(self, *args, **kwargs):
                pass
            def plan(self, **kwargs):
                for name in ("q_len_per_req", "custom_mask"):
                    if name in kwargs:
                        raise ValueError(f"'{name}' must be None (tactix does not implement it) (got {kwargs[name]})")
        class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
            pass
        class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
            pass
    """,
}
TREE = {
    scope.DECODE_FILE: """
        import os
        import pytest
        import flashinfer
        from flashinfer.utils import has_flashinfer_jit_cache

        @pytest.fixture(autouse=not has_flashinfer_jit_cache(), scope="module")
        def warmup_jit():
            raise RuntimeError("the bulk JIT warm-up ran")

        @pytest.mark.parametrize("head_dim", [128, 256, 512])
        @pytest.mark.parametrize("pos_encoding_mode", ["NONE", "ROPE_LLAMA"])
        def test_decode(head_dim, pos_encoding_mode):
            assert flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None).origin == os.environ["PARITY_EXPECT"]
            assert flashinfer.decode.single_decode_with_kv_cache() == "flashinfer"
            assert flashinfer.utils.has_flashinfer_jit_cache() is False  # restored once collected

        @pytest.mark.parametrize("q_len_per_req", [2, 3])
        def test_multi_token(q_len_per_req):
            assert flashinfer.BatchPrefillWithPagedKVCacheWrapper(None).origin == "flashinfer"  # a reference here
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(None).plan(q_len_per_req=q_len_per_req)

        def test_fast_plan():
            flashinfer.fast_decode_plan(flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None))

        def test_tensor_cores():
            assert not flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None).use_tensor_cores

        def test_large_head():
            test_decode(head_dim=512, pos_encoding_mode="NONE")

        def test_single_only():
            assert flashinfer.decode.single_decode_with_kv_cache() == "flashinfer"

        def test_skipped():
            pytest.skip("needs SM100")
            flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None)
    """,
    scope.PREFILL_FILE: """
        import os
        import pytest
        import flashinfer
        from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper as Paged

        @pytest.mark.parametrize("causal", [False, True])
        def test_prefill(causal):
            assert flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper(None).origin == os.environ["PARITY_EXPECT"]

        def test_prefill_from_import():
            assert Paged(None).origin == os.environ["PARITY_EXPECT"]

        def test_custom_mask():
            flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper(None).plan(custom_mask=[True])

        def test_ragged():
            flashinfer.BatchPrefillWithRaggedKVCacheWrapper(None)
    """,
    "tests/__init__.py": "",
    "tests/attention/__init__.py": "",
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip())
    return root


def _run(tmp_path: Path, mode: str, *extra: str) -> tuple[report.Results, str]:
    stubs = _write(tmp_path / "site", STUBS)
    tree = _write(tmp_path / "tree", TREE)
    env = {**os.environ, "PYTHONPATH": str(stubs), "PARITY_EXPECT": "flashinfer" if mode == "reference" else "tactix"}
    env.pop("PYTEST_ADDOPTS", None)
    junit, summary = tmp_path / f"{mode}.xml", tmp_path / f"{mode}.md"
    argv = [str(tree), "--junit", str(junit), "--summary", str(summary), *extra]
    if mode == "reference":
        argv.append("--reference")
    done = subprocess.run(
        [sys.executable, str(HERE / "run.py"), *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert summary.read_text().strip() in done.stdout
    return report.parse_junit(junit), summary.read_text()


def test_whole_run_on_stand_ins(tmp_path: Path) -> None:
    ours, md = _run(tmp_path, "tactix")
    sel = ours.selection
    assert (sel["collected"], sel["in_scope"], sel["selected"]) == (18, 11, 11)
    assert sel["deselected"] == {
        scope.OUT_OF_SCOPE_ROPE: 3,
        scope.OUT_OF_SCOPE_HEAD_DIM: 2,
        scope.OUT_OF_SCOPE_NO_WRAPPER: 2,
    }
    assert "flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper" in sel["substituted"]
    assert "flashinfer.BatchPrefillWithPagedKVCacheWrapper" in sel["substituted"]
    assert "fast_decode_plan" not in " ".join(sel["substituted"])  # the stub tactix has none: FlashInfer's runs
    assert sel["environment"] == {"flashinfer": "0.0.stub", "tactix": "0.0.stub"}
    assert "**5 passed, 5 failed, 1 skipped** of 11 cases run." in md
    for row in (
        "| multi-token decode (q_len_per_req) | 2 |",
        "| fast_decode_plan internals | 1 |",
        "| missing attribute `use_tensor_cores` | 1 |",
        "| custom masks (custom_mask / packed_custom_mask) | 1 |",
        "| `test_decode` | 2 | 2 | 0 | 0 |",
        "| `test_prefill_from_import` | 1 | 1 | 0 | 0 |",
    ):
        assert row in md, md

    # FlashInfer's own wrappers on a sample of the same selection: nothing substituted, nothing fails
    theirs, md = _run(tmp_path, "reference", "--sample", "3", "--seed", "4")
    assert theirs.selection["selected"] == len(theirs.cases) == 3 and theirs.selection["substituted"] == []
    assert {c.name for c in theirs.cases} <= {c.name for c in ours.cases}
    assert all(c.outcome != "failed" for c in theirs.cases), md
    assert "FlashInfer's own wrappers (reference run)" in md and "--sample 3 --seed 4" in md


def test_workers_run_the_cases_in_xdist_processes(tmp_path: Path) -> None:
    args, extra = runner._arguments([str(_tree(tmp_path / "tree")), "--workers", "6", "--", "-x"])
    cmd = runner.command(args, tmp_path / "j.xml", tmp_path / "r.json", tmp_path / "p.ini", extra)
    assert cmd[cmd.index("-n") + 1] == "6" and cmd[-1] == "-x"
    plain, _ = runner._arguments([str(tmp_path / "tree")])
    assert "-n" not in runner.command(plain, tmp_path / "j.xml", tmp_path / "r.json", tmp_path / "p.ini", [])


def test_an_interrupted_run_reports_the_cases_that_ran(tmp_path: Path) -> None:
    """`timeout -s INT` signals the whole process group (the H200 jobs stop that way): pytest
    still writes its JUnit XML, and the runner reports what ran, saying it was interrupted. The
    runner starts with SIGINT ignored, as a script's background job does (h200_checks.sh runs its
    jobs so): it must take the interrupt all the same."""
    import signal
    import time

    stubs = _write(tmp_path / "site", STUBS)
    marker = tmp_path / "started"
    tree = _write(tmp_path / "tree", {
        scope.DECODE_FILE: f"""
            import pathlib, time
            import flashinfer

            def test_quick():
                assert flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None).origin == "tactix"

            def test_slow():
                flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(None)
                pathlib.Path({str(marker)!r}).touch()
                time.sleep(60)
        """,
        scope.PREFILL_FILE: "",
        "tests/__init__.py": "",
        "tests/attention/__init__.py": "",
    })  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(stubs)}
    env.pop("PYTEST_ADDOPTS", None)
    summary = tmp_path / "s.md"
    child = subprocess.Popen([sys.executable, str(HERE / "run.py"), str(tree), "--summary", str(summary)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    deadline = time.monotonic() + 60
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGINT)
    out, err = child.communicate(timeout=90)
    assert marker.exists(), out + err
    md = summary.read_text()
    assert "**The run was interrupted**" in md and "**1 passed, 0 failed, 0 skipped** of 1 cases run." in md, md + err
