"""The serving-step example runs as documented, and its replay pass measures nothing."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_serving_step_example_tunes_then_replays_the_same_choices(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serving_step.py"), "--device", "cpu", "--layers", "2",
         "--tune-into", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in done.stdout.strip().splitlines())
    tuned = ast.literal_eval(lines["tuned"].strip())
    replay_text = lines["replayed"].strip()
    replayed = ast.literal_eval(replay_text[: replay_text.index("}") + 1])
    stats = ast.literal_eval(replay_text[replay_text.index("}") + 1 :].strip())
    assert replayed == tuned and set(tuned) == {"prefill", "decode"}
    assert stats["timer_calls"] == 0 and stats["store_hits"] >= 2


def test_tensor_parallel_step_on_two_gloo_ranks_matches_the_float64_layer(tmp_path: Path) -> None:
    """examples/tensor_parallel_step.py under torchrun, two ranks on the CPU (gloo): the sharded
    layer's outputs match one float64 process, and the ranks tuned into one store agree on every
    choice and on the store's bytes; the replay measures nothing."""
    summary = tmp_path / "tp.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "tensor_parallel_step.py"), "--device", "cpu", "--decode-steps", "3",
         "--store", str(tmp_path / "store"), "--json", str(summary)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["ok"] and result["ranks"] == 2 and result["backend"] == "gloo"
    assert result["same_choices_on_every_rank"] and result["same_store_bytes_on_every_rank"]
    assert result["nothing_measured_in_replay"]
    assert all(max(e.values()) <= result["tolerance"] for e in result["errors_by_rank"])
    ops = set(result["tuned"])
    assert {"prefill attention", "decode attention", "gemm qkv m4", "gemm down m4"} <= ops
    assert (tmp_path / "store").is_dir() and any((tmp_path / "store").rglob("*.json"))
