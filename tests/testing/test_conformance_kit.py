"""The conformance kit, run the way a backend author runs it: on real backends and on wrong ones.

The torch backend and the example third-party plugin must pass; deliberately wrong backends must
fail, with messages that name the case and the error, and a backend that claims a feature it
does not implement must fail those cases rather than skip them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.plugin_fixtures import write_distribution, wrong_backend


def run_kit(
    backend: str, report: Path, *extra: str, plugin_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if plugin_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "tactix", "conformance", backend, "--json", str(report), "--device", "cpu", *extra],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip


def outcomes(report: Path) -> dict[str, list[dict[str, Any]]]:
    data = json.loads(report.read_text())
    grouped: dict[str, list[dict[str, Any]]] = {"passed": [], "skipped": [], "xfailed": [], "failed": []}
    for result in data["results"]:
        grouped[result["outcome"]].append(result)
    return grouped


@pytest.mark.slow
def test_torch_backend_passes_the_kit(tmp_path: Path) -> None:
    # (the 32k-key "long", the "large" and the 2 x 3000 stale-slot cases, every tactic on the chunked batches and
    # the chunked batch's feature variants (sinks, fp8, window, stale slots: 2 s each, the plain
    # chunked batch and each feature on the other batches stay) take a minute of the CPU suite's
    # budget and run the same code as the rest here; the GPU runs of the kit include them; so do the
    # "devidx" cases, whose arrays on the CPU are the host arrays of the cases beside them)
    done = run_kit("torch", tmp_path / "torch.json", "-k", "not long and not large and not 2x3000 and not devidx and "
                   "not (tactics and chunked) and not (chunked and (sinks or e4m3 or win100 or stale))")  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    header = done.stdout.split("\n", 12)
    assert any(line.startswith("backend torch ") and "distribution tactix" in line for line in header), header
    got = outcomes(tmp_path / "torch.json")
    assert not got["failed"] and len(got["passed"]) > 150
    ops = {r["op"] for r in got["passed"]}
    assert ops == {"prefill", "decode", "ragged_prefill", "gemm", "merge_states"}


def test_example_plugin_passes_the_kit_and_skips_what_it_does_not_claim(tmp_path: Path) -> None:
    try:
        importlib.metadata.distribution("tactix-example-naive")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("examples/naive-decode is not installed (scripts/setup.sh installs it)")
    done = run_kit("naive", tmp_path / "naive.json")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    got = outcomes(tmp_path / "naive.json")
    assert not got["failed"] and got["passed"]
    assert {r["op"] for r in got["passed"]} == {"decode"}
    skipped = {r["case"]: r["detail"] for r in got["skipped"]}
    assert (
        skipped["decode[bf16-h32/8-d128-p16-HND-win64]"]
        == "not claimed: sliding window (window_left >= 0) not supported"
    )
    assert "logits soft-cap not supported" in skipped["decode[bf16-h32/8-d128-p16-HND-cap30]"]


@pytest.mark.parametrize(
    ("backend", "ops"), [("torch", {"prefill", "decode", "ragged_prefill"}), ("naive", {"decode"})]
)
def test_the_kit_checks_that_an_empty_batch_is_refused(tmp_path: Path, backend: str, ops: set[str]) -> None:
    """Every backend under test is held to the refusal of an empty batch at plan, op by op."""
    if backend == "naive":
        try:
            importlib.metadata.distribution("tactix-example-naive")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("examples/naive-decode is not installed (scripts/setup.sh installs it)")
    done = run_kit(backend, tmp_path / "report.json", "-k", "empty_batch")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    got = outcomes(tmp_path / "report.json")
    checked = [r for r in got["passed"] if r["test"] == "test_attention_refuses_an_empty_batch"]
    assert {r["op"] for r in checked} == ops and not got["failed"], got
    from tactix.ops import OPS

    assert json.loads((tmp_path / "report.json").read_text())["ops"] == list(OPS)  # the kit's ops, for the matrix


@pytest.mark.parametrize(
    ("flaw", "selection", "must_fail", "must_pass"),
    [
        ("drop_last_page", "decode and not tactics and not long and not large", "decode[bf16-h32/8-d128-p16-HND]",
         None),  # every case has a request of several pages
        # (test_attention's own cases: the replan, graph and bad-input tests, the fp8, sinks and stale-slot
        # variants add half a second of torch CPU attention each and nothing to what this checks)
        ("ignore_causal", "test_attention and not replan and not graph and not refuses and not rejects and prefill "
         "and not ragged and not tactics and not long and not large and not 2x3000 and not chunked and not stale "
         "and not e4m3 and not e5m2 and not sinks", "prefill[bf16-h32/8-d128-p16-HND-causal]",
         "prefill[bf16-h32/8-d128-p16-HND]"),
        ("fake_window", "test_attention and not tactics and not long and not large",
         "decode[bf16-h32/8-d128-p16-HND-win64]", "decode[bf16-h32/8-d128-p16-HND]"),
    ],
)  # fmt: skip
def test_wrong_backends_fail_the_kit_naming_the_case(
    tmp_path: Path, flaw: str, selection: str, must_fail: str, must_pass: str | None
) -> None:
    name = flaw.replace("_", "")
    write_distribution(tmp_path / "site", f"tactix-{name}", "0.0.1", {name: f"tx_{name}"},
                       {f"tx_{name}": wrong_backend(name, flaw)})  # fmt: skip
    done = run_kit(name, tmp_path / "report.json", "-k", selection, plugin_dir=tmp_path / "site")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    got = outcomes(tmp_path / "report.json")
    failed = {r["case"]: r["detail"] for r in got["failed"] if r["test"] == "test_attention"}
    # the flaw is caught as a failure of the claimed case, with the case and the error named
    assert must_fail in failed, sorted(failed)
    assert "relative error" in failed[must_fail] and must_fail in failed[must_fail]
    assert "FAILED " in done.stdout and f"::test_attention[{must_fail}]" in done.stdout
    assert f"AssertionError: {must_fail} with tactic {name}:wrong: relative error" in done.stdout
    # and cases the flaw does not touch still pass: the kit blames the right thing
    passed = {r["case"] for r in got["passed"] if r["test"] == "test_attention"}
    assert must_pass is None or must_pass in passed, sorted(passed)
    assert not any(must_fail == r["case"] and r["test"] == "test_attention" for r in got["skipped"])


def test_declared_known_failures_run_as_strict_xfails(tmp_path: Path) -> None:
    """A declared failure that fails is an xfail; one that passes fails the run (strict)."""
    known = {
        "decode[bf16-h32/8-d128-p16-HND-win64]": "window not implemented yet",  # really fails
        "decode[bf16-h32/8-d128-p16-HND]": "thought broken",  # actually passes
    }
    write_distribution(tmp_path / "site", "tactix-knownfail", "0.0.1", {"knownfail": "tx_knownfail"},
                       {"tx_knownfail": wrong_backend("knownfail", "fake_window", known)})  # fmt: skip
    done = run_kit("knownfail", tmp_path / "report.json", "-k", "test_attention and HND and not long and not large "
                   "and not tactics and not 5d and not edge", plugin_dir=tmp_path / "site")  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]
    results = {(r["test"], r["case"]): r for r in json.loads((tmp_path / "report.json").read_text())["results"]}
    window = results[("test_attention", "decode[bf16-h32/8-d128-p16-HND-win64]")]
    assert window["outcome"] == "xfailed" and "window not implemented yet" in window["detail"]
    passing = results[("test_attention", "decode[bf16-h32/8-d128-p16-HND]")]
    assert passing["outcome"] == "failed"  # XPASS(strict): the declaration is stale
    assert "XPASS(strict)" in done.stdout


CANNOT_RUN_HERE = """
import tactix
from tactix.backends import torch as _torch

@tactix.hookimpl
def tactix_backends():
    return [tactix.BackendSpec(name="elsewhere", version="1.0", decode=_torch.tactix_backends()[0].decode)]

@tactix.hookimpl
def tactix_environment(backend):
    return ["no frobnicator is attached", "libfrob is not installed"]
"""

QUICK = "test_attention and decode and HND and not long and not large and not 5d and not edge"
"""A handful of cases: these tests are about how a run ends, not about what the cases check."""


def test_a_run_in_which_no_case_ran_fails_with_the_environment_reasons(tmp_path: Path) -> None:
    write_distribution(tmp_path / "site", "tactix-elsewhere", "1.0", {"elsewhere": "tx_elsewhere"},
                       {"tx_elsewhere": CANNOT_RUN_HERE})  # fmt: skip
    done = run_kit("elsewhere", tmp_path / "report.json", "-k", QUICK, plugin_dir=tmp_path / "site")
    assert done.returncode == 5, done.stdout[-3000:] + done.stderr[-2000:]  # pytest's "no tests ran"
    errors = [line for line in done.stderr.splitlines() if line.startswith("tactix: error:")]
    assert errors == [
        "tactix: error: no conformance case ran on cpu: elsewhere: no frobnicator is attached; libfrob is not installed"
    ], done.stderr
    got = outcomes(tmp_path / "report.json")  # the report is still written: it documents the skips
    assert got["skipped"] and not got["passed"] and not got["failed"]


def test_a_device_the_machine_lacks_is_one_error_before_any_case(tmp_path: Path) -> None:
    import torch

    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    done = run_kit("torch", tmp_path / "report.json", "--device", missing, "-k", QUICK)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stderr.startswith("tactix: error: '--device' must be 'cpu'") and done.stderr.count("\n") == 1
    assert done.stdout == "" and not (tmp_path / "report.json").exists()  # nothing ran
    direct = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "tactix.testing.suite",
         "--tactix-backend=torch", f"--tactix-device={missing}", "-k", QUICK],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert direct.returncode == 4, direct.stdout[-3000:]  # pytest's usage error, once
    assert "ERROR: '--tactix-device' must be 'cpu'" in direct.stderr + direct.stdout
    assert "FAILED" not in direct.stdout and "AssertionError" not in direct.stdout


@pytest.mark.parametrize("name", ["auto", "nosuch"])
def test_an_unknown_backend_name_lists_what_the_kit_accepts(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tactix.cli import main

    assert main(["conformance", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tactix: error: 'backend' must be one of 'all', ") and f"(got '{name}')" in err, err
    assert "'torch'" in err and "'auto' or" not in err  # the kit tests named backends: 'auto' is no choice


def test_json_without_a_path_prints_only_the_report(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tactix", "conformance", "torch", "--device", "cpu", "--json", "-k",
         "test_gemm and not tactics and m64n256k128"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)  # pytest's own output went to stderr
    assert report["totals"]["passed"] > 0 and report["backends"][0]["name"] == "torch"
    assert " passed" in done.stderr
    assert not (tmp_path / "-").exists()


def test_ragged_cases_ask_about_what_a_backend_does_not_declare() -> None:
    """The kit's ragged-KV cases come from the declaration plus a standard set, so an undeclared
    feature is a skip with its reason rather than a case never asked."""
    import torch

    from tactix.ops import RaggedPrefillCapabilities
    from tactix.ragged import ragged_problem
    from tactix.testing.cases import build_ragged_inputs, ragged_cases

    caps = RaggedPrefillCapabilities(devices=frozenset({"cpu"}), q_dtypes=frozenset({"float16"}),
                                     kv_dtypes=frozenset({"float16"}), out_dtypes=frozenset({"float16"}),
                                     head_dims=frozenset({128}), causal=True, non_causal=False)  # fmt: skip
    cases = {case.id: case for case in ragged_cases("ragged_prefill", caps)}
    reasons = {}
    for case_id, case in cases.items():
        inputs = build_ragged_inputs(case, torch.device("cpu"))
        problem, _ = ragged_problem(device=torch.device("cpu"), qo_indptr=inputs.qo_indptr,
                                    kv_indptr=inputs.kv_indptr, sm_scale=None, **case.plan_kwargs())  # fmt: skip
        reasons[case_id] = "; ".join(caps.reasons(problem))
    assert reasons["ragged_prefill[f16-h8/2-d128-causal]"] == ""  # the base follows the declared dtype
    assert reasons["ragged_prefill[f16-h8/2-d128-causal-lse]"] == "LSE output not supported"
    assert reasons["ragged_prefill[f16-h8/2-d128-causal-win64]"] == "sliding window (window_left >= 0) not supported"
    assert reasons["ragged_prefill[f16-h8/2-d128]"] == "non-causal prefill not supported"
    assert "head_dim_qk 192 not in {128}" in reasons["ragged_prefill[f16-h8/2-d192x128-causal]"]
    assert "q dtype bfloat16 not in {float16}" in reasons["ragged_prefill[bf16-h8/2-d128-causal]"]
    assert {case.op for case in cases.values()} == {"ragged_prefill"} and len({c.seed for c in cases.values()}) == len(
        cases
    )


def test_the_kit_fails_ragged_results_that_ignore_causal_or_leave_rows_unwritten() -> None:
    import torch

    from tactix import RaggedPrefill
    from tactix.registry import get_registry
    from tactix.testing import suite
    from tactix.testing.cases import build_ragged_inputs, ragged_cases

    caps = get_registry().get("torch").spec.capabilities("ragged_prefill")
    assert caps is not None
    case = next(c for c in ragged_cases("ragged_prefill", caps) if c.batch == "chunked" and c.window_left < 0)
    inputs = build_ragged_inputs(case, torch.device("cpu"))
    wrapper = RaggedPrefill(device="cpu")
    wrapper.plan(*inputs.plan_args(case.op), **case.plan_kwargs())
    wrapper.run(*inputs.run_args(), out=inputs.out, lse=inputs.lse)
    suite._check_attention(case, inputs, case.id)  # right: passes
    inputs.out[-1] = float("nan")
    row = case.num_qo_heads * case.head_dim_vo
    with pytest.raises(AssertionError, match=rf"{row} of \d+ output elements were never written"):
        suite._check_attention(case, inputs, case.id)
    wrapper.plan(*inputs.plan_args(case.op), **{**case.plan_kwargs(), "causal": False})
    wrapper.run(*inputs.run_args(), out=inputs.out, lse=inputs.lse)
    with pytest.raises(AssertionError, match=r"relative error .* above"):
        suite._check_attention(case, inputs, case.id)
