"""The `tactix` command: the demo (the main job), doctor, the --json convention, and error reporting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tactix
import tactix.cli
from tactix.cli import main

# a CUDA device this machine does not have, whatever the machine, and what the error says about it
MISSING_CUDA = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
DEVICES_HERE = (
    f"'cpu' or 'cuda[:N]' with N < {torch.cuda.device_count()}"
    if torch.cuda.is_available()
    else "'cpu' (no CUDA GPU is visible)"
)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``tactix ARGV`` run in this process (argparse exits too)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_demo_checks_every_op_against_float64_and_names_its_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "demo.json"
    assert main(["demo", "--device", "cpu", "--decode-steps", "2", "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(report.read_text())["rows"]
    ops = {r["op"] for r in rows}
    assert ops == {"prefill attention", "decode attention", "gemm qkv", "gemm o", "gemm gate_up", "gemm down"}
    assert len(rows) == 5 * 3  # prefill + 2 decode steps, 5 ops each
    for row in rows:
        assert row["ok"] and 0 < row["error"] <= row["tolerance"], row
        assert row["backend"] == "torch" and row["tactic"].startswith("torch:")
        assert row["tactic"] in printed
        assert row["graph_us"] is None and row["eager_over_graph"] is None  # no CUDA graph on the CPU
    assert f"{len(rows)}/{len(rows)} ops within tolerance" in printed
    header = printed.splitlines()[0].split()
    assert header[-1] == "check", header  # the ok/FAIL column has a name like every other


def test_demo_json_on_stdout_is_only_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["demo", "--device", "cpu", "--decode-steps", "0", "--json"], capsys)
    assert code == 0
    report = json.loads(out)  # no table mixed in
    assert report["device"] == "cpu" and len(report["rows"]) == 5


def test_doctor_reports_torch_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] and "cuda_available" in info
    assert any(b["name"] == "torch" and b["status"] == "active" for b in info["backends"])


def test_doctor_on_a_cpu_only_torch_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(["doctor"], capsys)
    assert code == 0
    assert "CUDA None" not in out and "a CPU-only build" in out


def test_json_option_means_a_file_or_stdout_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--json PATH` writes a file and prints the text; `--json` / `--json -` print only the JSON."""
    for argv in (["backends", "--json"], ["backends", "--json", "-"]):
        code, out, _ = run(argv, capsys)
        assert code == 0 and any(r["name"] == "torch" for r in json.loads(out))
    path = tmp_path / "backends.json"
    code, out, _ = run(["backends", "--json", str(path)], capsys)
    assert code == 0 and out.startswith("backend ") and "torch" in out
    assert any(r["name"] == "torch" for r in json.loads(path.read_text()))
    code, out, _ = run(["warmup", "torch", "--json"], capsys)
    assert code == 0 and json.loads(out) == {"backend": "torch", "arch": None, "compiled": None, "seconds": 0.0}


def test_help_is_plain_text_and_documents_every_demo_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "`" not in out and "--json" in out
    code, out, _ = run(["demo", "--help"], capsys)
    assert code == 0
    assert "decode steps after the prefill" in out and "(default: 3)" in out
    assert "seed of the weights" in out and "(default: 0)" in out


def test_bad_arguments_exit_2_with_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["demo", "--decode-steps", "x"], capsys)
    assert code == 2
    assert err.startswith("tactix: error: argument --decode-steps: must be an integer >= 0 (got 'x')")
    assert main(["demo", "--device", "tpu"]) == 2
    assert "'--device' must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["bench", "--device", MISSING_CUDA], f"'--device' must be {DEVICES_HERE} (got '{MISSING_CUDA}')"),
        (["bench", "--device", "foo"], "'--device' must be "),
        (["bench", "--warmup", "-1"], "argument --warmup: must be an integer >= 0 (got '-1')"),
        (["bench", "--warmup-ms", "nan"], "argument --warmup-ms: must be a number >= 0 (got 'nan')"),
        (["bench", "--settle-blocks", "0"], "argument --settle-blocks: must be an integer >= 1 (got '0')"),
        (["bench", "--backends", "torch,nosuch"], "'--backends' must be one of "),
        (["bench", "--suite", "cpu", "--json", "/nonexistent-dir/bench.json"],
         "'--json' must be a file path that can be written"),
        (["demo", "--decode-steps", "-1"], "argument --decode-steps: must be an integer >= 0 (got '-1')"),
        (["demo", "--device", MISSING_CUDA], "'--device' must be "),
        (["support-matrix", "/nonexistent.json"], "'reports' must be reports written by 'tactix conformance --json' "
         "(got '/nonexistent.json': No such file or directory)"),
        (["support-matrix", "pyproject.toml"], "'reports' must be reports written by 'tactix conformance --json' "
         "(got 'pyproject.toml': not JSON"),
        (["warmup", "auto"], "'backend' must be one of "),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # pyproject.toml: a file that is not a report
    code, out, err = run(argv, capsys)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("tactix: error: "), err
    assert named in err, err


def test_warmup_lists_the_backends_it_accepts_not_auto(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["warmup", "auto"], capsys)
    assert code == 2
    assert "'torch'" in err and "(got 'auto')" in err
    assert "'auto' or" not in err  # warmup compiles one named backend: 'auto' is no choice


def test_output_cut_short_by_its_reader_ends_quietly() -> None:
    """`tactix backends | head -1`: the reader leaving early is no error and prints no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "tactix", "backends"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before the first write, as `head` is after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err  # 128 + SIGPIPE, what a shell reports for such a writer
    assert err == ""


def test_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(tactix.cli, "cmd_backends", interrupted)
    code, _, err = run(["backends"], capsys)
    assert code == 130 and err == "tactix: interrupted\n"


def test_ctrl_c_reaches_a_run_that_inherited_sigint_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    """A script's background job (``tactix conformance ... &``, as h200_checks.sh runs its jobs)
    starts with SIGINT ignored: the CLI takes it as an interrupt again, so ``timeout -s INT`` stops
    the run with what it finished written, not a KILL half a minute later."""
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, _, _ = run(["backends"], capsys)
        assert code == 0 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_cache_ls_json_lists_environments_and_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["cache", "--root", str(tmp_path), "ls", "--json"], capsys)
    assert code == 0 and json.loads(out) == []
    with tactix.autotune(mode="tune", cache_dir=tmp_path):
        tactix.Gemm(device="cpu").plan(8, 16, 32, a_dtype=torch.float32)
    code, out, _ = run(["cache", "--root", str(tmp_path), "ls", "--entries", "--json", "-"], capsys)
    assert code == 0
    (env,) = json.loads(out)
    assert env["entry_count"] == 1 and env["manifest_defect"] is None and env["env"]["torch"] == torch.__version__
    (entry,) = env["entries"]
    assert entry["op"] == "gemm" and entry["env_hash"] == env["env_hash"] and env["bad"] == []
