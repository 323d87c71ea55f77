"""Shared test setup.

* The ``gpu`` marker skips with a reason where there is no CUDA GPU.
* The ``exhaustive`` marker (``@pytest.mark.exhaustive(sample=N)``) is for sweeps over a whole
  space (every enumerated tactic, say), parametrised one point per test. By default a sample of
  ``N`` points of each such test runs, drawn afresh each day from a seed printed in the header,
  so CI stays bounded and still covers the whole space over time; ``--exhaustive`` (or
  ``TACTIX_EXHAUSTIVE=1``) runs every point, and ``TACTIX_EXHAUSTIVE_SEED=S`` repeats a day's
  sample.
"""

from __future__ import annotations

import datetime as dt
import os
import random
from collections import defaultdict

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exhaustive", action="store_true", help="run every point of the exhaustive sweeps")


def _seed() -> int:
    return int(os.environ.get("TACTIX_EXHAUSTIVE_SEED") or dt.date.today().strftime("%Y%m%d"))


def _exhaustive(config: pytest.Config) -> bool:
    return bool(config.getoption("--exhaustive")) or os.environ.get("TACTIX_EXHAUSTIVE") == "1"


def pytest_report_header(config: pytest.Config) -> str:
    if _exhaustive(config):
        return "exhaustive sweeps: every point"
    return f"exhaustive sweeps: a sample per test (seed {_seed()}; --exhaustive runs every point)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if _exhaustive(config):
        return
    sweeps: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if item.get_closest_marker("exhaustive") is not None:
            sweeps[item.nodeid.split("[")[0]].append(item)
    seed = _seed()
    dropped: list[pytest.Item] = []
    for name, points in sweeps.items():
        marker = points[0].get_closest_marker("exhaustive")
        assert marker is not None
        size = int(marker.kwargs.get("sample", 4))
        if len(points) > size:
            # every xdist worker draws the same sample: the seed and the collection order agree
            keep = set(random.Random(f"{seed}:{name}").sample(range(len(points)), size))
            dropped += [p for i, p in enumerate(points) if i not in keep]
    if dropped:
        gone = set(map(id, dropped))
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) not in gone]


@pytest.fixture
def devices() -> list[torch.device]:
    """Devices to run on: the CPU, plus the GPU where there is one."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out.append(torch.device("cuda"))
    return out
