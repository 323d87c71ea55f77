"""The serving-step example runs as documented, and its replay pass measures nothing."""

from __future__ import annotations

import ast
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
