"""`tactix bench` on the quick CPU suite: every row checked against float64, rates and ratios reported."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tactix.cli import main


def test_cpu_suite_reports_checked_rows_for_every_backend_and_tuned_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    assert main(["bench", "--suite", "cpu", "--device", "cpu", "--repeat", "3", "--json", str(out),
                 "--markdown", str(md)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    rows = report["rows"]
    cases = {r["case"] for r in rows}
    assert cases == {"d1", "d2", "p1", "p4", "d1-fp8", "v1", "r1", "o1", "g1", "g2"}
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        assert {"torch", "auto (untuned)", "auto (tuned)"} <= {r["implementation"] for r in mine}
        assert len({(r["op"], r["shape_class"]) for r in mine}) == 1 and mine[0]["shape_class"]
        ok = [r for r in mine if r["status"] == "ok"]
        assert ok and max(r["ratio_to_best"] for r in ok) == 1.0
        for r in ok:
            assert r["error"] is not None and r["error"] < 1e-5  # float32 on the CPU, checked against float64
            assert r["time_us"] > 0 and r["rate"] > 0 and r["unit"] in ("TB/s", "TFLOP/s")
            # host cost of every implementation: a re-plan for new lengths and an eager run()
            assert r["plan_host_us"] > 0 and r["run_host_us"] > 0
            assert r["eager_us"] == max(r["time_us"], r["run_host_us"])  # what an eager caller pays a call
            # two interleaved rounds after the first on the CPU: their samples are what time_us is the median of
            assert r["rounds"] == 2 and len(r["samples_us"]) == 6 and "retime" not in r
            assert r["time_us"] == pytest.approx(statistics.median(r["samples_us"]))
    # the fp8-KV case reads one byte per cache element: its bytes (rate x time) are about a quarter
    # of the float32 case's over the same batch
    moved = {r["case"]: r["rate"] * r["time_us"] for r in rows if r["implementation"] == "torch"}
    assert 0.2 < moved["d1-fp8"] / moved["d1"] < 0.3
    # a backend that cannot take the sinks (or the window) says so in its row, not as a failure
    sinks = {r["implementation"]: r for r in rows if r["case"] == "o1"}
    assert sinks["torch"]["status"] == "ok" and sinks["naive"]["status"] == "unsupported"
    decode = [r for r in rows if r["case"] == "d1"]
    assert {r["implementation"] for r in decode} >= {"naive"}  # a third-party backend is benchmarked too
    # FlashInfer's wrappers are anchors only where they can run (a GPU with flashinfer installed)
    assert report["environment"]["flashinfer"] is None and report["environment"]["arch"] == "cpu"
    assert {r["shape_class"] for r in rows if r["case"] == "g2"} == {"fp32, m <= 16"}
    assert not [r for r in rows if r["implementation"].startswith("flashinfer")]
    text = md.read_text()
    assert "| d1 | decode b8, kv 64-512 |" in text and "auto (tuned)" in text
    assert "| plan host (us) | run host (us) |" in text
    assert "auto (tuned)" in capsys.readouterr().out


def test_direct_library_calls_get_checked_rows_of_their_own(tmp_path: Path) -> None:
    from tactix.bench import run_bench
    from tests.plugin_fixtures import plugins_on_path, referencing_plugin, write_distribution

    root = tmp_path / "site"
    write_distribution(root, "tactix-refs", "1.0", {"refs": "refs_plugin"}, {"refs_plugin": referencing_plugin("refs")})
    with plugins_on_path(root):
        import torch

        report = run_bench("cpu", torch.device("cpu"), cases=["d2"], backends=["refs", "torch"], tune=False,
                           untuned=False)  # fmt: skip
    rows = {r["implementation"]: r for r in report["rows"]}
    assert set(rows) == {"refs", "torch", "refs (direct)"}
    direct = rows["refs (direct)"]
    assert direct["status"] == "ok" and direct["tactic"] == "right" and direct["error"] < 1e-6
    assert "fastest of 1 variants" in direct["detail"]
    assert "wrong: wrong result" in direct["detail"] and "boom: RuntimeError: no such plan" in direct["detail"]
    assert direct["rate"] > 0 and direct["ratio_to_best"] is not None


def test_eager_execution_ranks_rows_by_their_eager_cost() -> None:
    """``--execution eager``: the rows of a case best first by the longer of device and host time,
    each with the cheapest's cost over its own; the untuned `auto` row is there to compare."""
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.bench import run_bench

    policy = MeasurementPolicy(execution="eager", warmup=0, warmup_ms=0, repeat=3, settle_blocks=1)
    report = run_bench("cpu", torch.device("cpu"), cases=["g2"], backends=["torch"], tune=False, policy=policy)
    ok = [r for r in report["rows"] if r["status"] == "ok"]
    assert {r["implementation"] for r in ok} == {"torch", "auto (untuned)"}
    costs = [r["eager_us"] for r in ok]
    assert costs == sorted(costs) and ok[0]["ratio_to_best"] == 1.0
    assert ok[1]["ratio_to_best"] == pytest.approx(costs[0] / costs[1])


def test_unknown_case_ids_are_an_error_listing_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--suite", "cpu", "--device", "cpu", "--cases", "d1,zz"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before anything ran: no empty table
    valid = "d1, d2, p1, p4, d1-fp8, v1, r1, o1, g1, g2"
    assert captured.err == f"tactix: error: '--cases' must be ids of the cpu suite: {valid} (got 'zz')\n"


def test_help_lists_the_case_ids_of_both_suites(capsys: pytest.CaptureFixture[str]) -> None:
    from tactix.bench import SUITES, suite

    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in SUITES:
        ids = ", ".join(c.id for c in suite(name))
        assert f"{name} suite: {ids}" in shown, shown


REFUSING = """
import tactix
from tactix.backends import torch as _torch

REASON = {reason!r}

@tactix.hookimpl
def tactix_backends():
    return [tactix.BackendSpec(name="refusing", version="1.0", decode=_torch.tactix_backends()[0].decode)]

@tactix.hookimpl
def tactix_check(problem, tactic, batch):
    return [REASON]
"""


def test_unsupported_reasons_stay_whole_in_json_and_end_at_a_word_in_markdown(tmp_path: Path) -> None:
    from tests.plugin_fixtures import plugins_on_path, write_distribution

    reason = "the frobnicator needs " + " ".join(f"setting{i} enabled" for i in range(40)) + " to serve this"
    assert len(reason) > 300
    root = tmp_path / "site"
    write_distribution(root, "tactix-refusing", "1.0", {"refusing": "refusing_plugin"},
                       {"refusing_plugin": REFUSING.format(reason=reason)})  # fmt: skip
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    with plugins_on_path(root):
        argv = ["bench", "--suite", "cpu", "--device", "cpu", "--cases", "d2", "--backends", "refusing", "--no-tune",
                "--no-untuned", "--json", str(out), "--markdown", str(md)]  # fmt: skip
        assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "unsupported"
    whole = "; ".join(row["reasons"])
    assert whole.endswith(reason) and reason in row["detail"]
    line = next(line for line in md.read_text().splitlines() if line.startswith("| d2 |"))
    shown = line.split("unsupported: ", 1)[1].removesuffix(" |")
    assert shown.endswith(" …") and len(shown) < len(whole)
    kept = shown.removesuffix(" …")
    assert whole.startswith(kept) and whole[len(kept)] == " ", kept  # cut between words, not inside one


def test_tuning_progress_in_a_log_is_plain_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tactix bench 2> log`: the tuner's progress has no cursor controls where stderr is not a terminal."""
    from tactix.autotune import tuner

    monkeypatch.setattr(tuner._Progress, "QUIET_S", 0.0, raising=False)  # show it however quick the tuning
    argv = ["bench", "--suite", "cpu", "--device", "cpu", "--cases", "g1", "--backends", "torch",
            "--warmup", "0", "--repeat", "1"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("tactix: tuning gemm[")]
    assert progress, err
    assert "\r" not in err and "\033[" not in err, repr(err)


def test_benchmark_docs_describe_the_suite_inside_the_repository() -> None:
    """The suite is documented in benchmarks/README.md, and nothing links outside the repository."""
    from tactix.bench import suite

    root = Path(__file__).resolve().parents[1]
    readme = (root / "benchmarks" / "README.md").read_text()
    for case in suite("gpu"):
        assert case.id.split("-")[0] in readme, case.id
    linking = [root / "README.md", *(root / "docs").glob("*.md"), root / "core" / "src" / "tactix" / "bench.py"]
    for path in linking:
        assert "../shared/" not in path.read_text(), path


def test_a_windowed_decode_rate_counts_the_keys_the_window_reads() -> None:
    """The TB/s of a decode case with a window counts the last window_left + 1 keys of each
    request (what any kernel must read), not the whole cache: gpt-oss's window-128 layers."""
    import dataclasses

    import torch

    from tactix import bench

    case = next(c for c in bench.suite("cpu") if c.op == "decode" and c.window_left >= 0)
    hq = case.heads[0]
    whole, _ = bench._attention_work(dataclasses.replace(case, window_left=-1), torch.float32)
    windowed, unit = bench._attention_work(case, torch.float32)
    q_and_out = 2 * len(case.kv_lens) * hq * case.head_dim * 4
    read = sum(min(n, case.window_left + 1) for n in case.kv_lens)
    assert unit == "TB/s" and min(case.kv_lens) > case.window_left + 1
    assert (windowed - q_and_out) * sum(case.kv_lens) == (whole - q_and_out) * read


def test_interleaved_rounds_pool_every_rows_blocks_visiting_the_rows_back_and_forth() -> None:
    """After the first round, each row is timed in short blocks that alternate between the rows
    (reverse order first, then forwards, ...), and its time is the median of all its blocks: a
    row first timed while the device was slow loses that time (its rate scaled with it), a row
    whose call now fails keeps its first-round time."""
    import torch

    from tactix.autotune.policy import MeasurementPolicy
    from tactix.bench import BenchRow, _interleaved_rounds

    order: list[str] = []

    def call(name: str) -> Callable[[], None]:
        return lambda: order.append(name)

    def broken() -> None:
        raise RuntimeError("gone")

    slow_first = BenchRow("x", "", "a", "-", "ok", time_us=1e9, rate=1.0, retime=call("a"))
    other = BenchRow("x", "", "b", "-", "ok", time_us=1e9, rate=1.0, retime=call("b"))
    failing = BenchRow("x", "", "c", "-", "ok", time_us=5.0, rate=2.0, retime=broken)
    unsupported = BenchRow("x", "", "d", "-", "unsupported")
    rows = [slow_first, other, failing, unsupported]
    _interleaved_rounds(rows, torch.device("cpu"), MeasurementPolicy(warmup=0, repeat=2), rounds=3)
    assert order == [*"bbaa", *"aabb", *"bbaa"]
    for row in (slow_first, other):
        assert row.rounds == 3 and len(row.samples_us) == 6 and row.time_us is not None and row.time_us < 1e6
        assert row.time_us == pytest.approx(statistics.median(row.samples_us))
        assert row.rate == pytest.approx(1e9 / row.time_us)
    assert failing.time_us == 5.0 and failing.rate == 2.0 and failing.rounds == 0
    assert unsupported.time_us is None and unsupported.rounds == 0
    assert all(r.retime is None for r in rows)


def test_an_interrupted_run_still_writes_the_cases_it_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bench stopped by SIGINT (Ctrl-C, or `timeout -s INT` on a device with a time limit) keeps
    the cases finished before it in its JSON and Markdown, marks where it stopped, and exits 130."""
    import tactix.bench as bench

    real = bench._bench_case

    def stop_at_d2(case, *args, **kwargs):  # type: ignore[no-untyped-def]
        if case.id == "d2":
            raise KeyboardInterrupt  # what SIGINT raises in the main thread, mid-case
        return real(case, *args, **kwargs)

    monkeypatch.setattr(bench, "_bench_case", stop_at_d2)
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    rc = main(["bench", "--suite", "cpu", "--device", "cpu", "--cases", "d1,d2,g2", "--backends", "torch", "--no-tune",
               "--repeat", "2", "--json", str(out), "--markdown", str(md)])  # fmt: skip
    assert rc == 130
    report = json.loads(out.read_text())
    assert report["environment"]["interrupted"] == "d2"
    assert {r["case"] for r in report["rows"]} == {"d1"} and all(r["status"] == "ok" for r in report["rows"])
    assert "Interrupted during d2" in md.read_text()
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "tactix: interrupted during case d2; the report holds the cases finished before it"


def test_host_cost_keeps_the_least_disturbed_block() -> None:
    """Another tenant's burst in one block of a GPU host-cost measurement does not move it; a
    steady slowdown over every block does; with one block it is the plain median."""
    from tactix.autotune.timing import least_disturbed

    steady = [10.0, 11.0, 10.5, 9.5] * 15
    burst = steady[:24] + [60.0] * 12 + steady[36:]  # one block of 12 (of 5) all disturbed
    assert least_disturbed(burst, 5) == least_disturbed(steady, 5) == 10.25
    assert least_disturbed([x * 1.5 for x in steady], 5) == 10.25 * 1.5
    assert least_disturbed(burst, 1) == statistics.median(burst) > 10.25
    assert least_disturbed([3.0, 1.0], 5) == 1.0  # more blocks than samples: one sample a block
