"""The parity run's conftest: FlashInfer's wrapper tests, with tactix's wrappers substituted.

A pytest plugin; ``run.py`` loads it into a pytest run inside FlashInfer's test tree
(``-p parity_plugin``, this folder on ``PYTHONPATH``). It

* makes ``flashinfer.utils.has_flashinfer_jit_cache`` answer True while the test modules are
  imported, so their module-wide JIT warm-up fixture (dozens of kernels the sample never uses)
  stays off and each kernel compiles on first use; FlashInfer's own callers are not affected,
  and the function is restored once collection ends;
* deselects the cases out of scope (`parity_scope.out_of_scope`), then all but a seeded sample
  of the rest (``--parity-sample N --parity-seed S``), the same in both modes;
* with ``--parity-mode tactix`` (the default), gives each collected test module its own view of
  ``flashinfer``: ``flashinfer.X``, ``flashinfer.decode.X``, ``flashinfer.prefill.X`` (and a
  global bound by ``from flashinfer... import X``) are ``tactix.compat.flashinfer.X`` for the
  names `parity_scope.SUBSTITUTIONS` lists for that file; everything else, the single-request
  reference kernels included, is FlashInfer's, and FlashInfer's own modules are left untouched;
  ``--parity-mode reference`` substitutes nothing;
* writes what it selected and substituted as JSON to ``--parity-record PATH``;
* gives the GPU memory a case freed back to the driver after it (`pytest_runtest_teardown`).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import parity_scope as scope
import pytest

_JIT_CACHE = "has_flashinfer_jit_cache"  # in flashinfer.utils


class _State:
    def __init__(self, jit_cache: Callable[[], bool] | None) -> None:
        self.jit_cache = jit_cache  # the real has_flashinfer_jit_cache, until restored
        self.modules: dict[str, scope.ModuleFacts] = {}

    def facts(self, path: Path) -> scope.ModuleFacts:
        key = str(path)
        if key not in self.modules:
            self.modules[key] = scope.ModuleFacts(path.read_text())
        return self.modules[key]

    def restore(self) -> None:
        if self.jit_cache is not None:
            setattr(importlib.import_module("flashinfer.utils"), _JIT_CACHE, self.jit_cache)
            self.jit_cache = None


_STATE = pytest.StashKey[_State]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tactix parity", "FlashInfer parity run (benchmarks/flashinfer_parity)")
    group.addoption(
        "--parity-mode",
        choices=("tactix", "reference"),
        default="tactix",
        help="tactix: tactix.compat.flashinfer's wrappers; reference: FlashInfer's own",
    )
    group.addoption("--parity-sample", type=int, default=None, metavar="N", help="a seeded sample of N in-scope cases")
    group.addoption("--parity-seed", type=int, default=0, metavar="S", help="the sample's seed (default 0)")
    group.addoption("--parity-record", default=None, metavar="PATH", help="write the selection as JSON here")


def pytest_configure(config: pytest.Config) -> None:
    try:
        utils = importlib.import_module("flashinfer.utils")
    except Exception as exc:  # ImportError, or a broken install raising anything
        raise pytest.UsageError(
            f"flashinfer is not importable ({exc}): on the GPU machine, source .gpu/env.sh"
        ) from None
    sample = config.getoption("parity_sample")
    if sample is not None and sample < 1:
        raise pytest.UsageError(f"--parity-sample must be a positive number of cases (got {sample})")
    state = _State(getattr(utils, _JIT_CACHE))
    setattr(utils, _JIT_CACHE, lambda: True)
    config.stash[_STATE] = state


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Return what a case freed to the driver before the next case: each xdist worker's torch
    keeps the memory its cases freed cached, so workers that ran large cases held it while the
    others ran out (session 36 on an H100: one worker at 44.8 GiB, 33-66 of a sample of 500 cases
    failing with CUDA out of memory, with 3 and 12 workers)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_STATE].restore()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STATE in config.stash:
        config.stash[_STATE].restore()


def _compat() -> types.ModuleType:
    try:
        compat = importlib.import_module("tactix.compat.flashinfer")
    except Exception as exc:
        raise pytest.UsageError(f"tactix.compat.flashinfer is not importable: {exc}") from None
    missing = sorted(name for name in scope.REQUIRED if not hasattr(compat, name))
    if missing:
        raise pytest.UsageError(f"tactix.compat.flashinfer has no {', '.join(missing)}")
    return compat


def _function_key(item: pytest.Item) -> str:
    return f"{Path(str(item.path)).stem}::{getattr(item, 'originalname', None) or item.name}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_STATE]
    compat = _compat()
    provided = {key: tuple(n for n in names if hasattr(compat, n)) for key, names in scope.SUBSTITUTIONS.items()}
    wrappers = {key: tuple(n for n in names if n.endswith("Wrapper")) for key, names in provided.items()}

    functions: dict[str, dict[str, Any]] = defaultdict(lambda: {"collected": 0, "in_scope": 0, "selected": 0})
    reasons: dict[str, Counter[str]] = defaultdict(Counter)
    groups: dict[str, list[str]] = defaultdict(list)
    for item in items:
        function = _function_key(item)
        functions[function]["collected"] += 1
        key = scope.file_key(str(item.path))
        if key is None:
            reason: str | None = "not one of FlashInfer's two wrapper test files"
        else:
            facts = state.facts(Path(str(item.path))).facts(getattr(item, "originalname", None) or item.name)
            callspec = getattr(item, "callspec", None)
            params: Mapping[str, object] = callspec.params if callspec is not None else {}
            reason = scope.out_of_scope(params, facts, wrappers[key])
        if reason is None:
            functions[function]["in_scope"] += 1
            groups[function].append(item.nodeid)
        else:
            reasons[function][reason] += 1

    sample = config.getoption("parity_sample")
    kept = scope.sample(groups, sample, config.getoption("parity_seed"))
    selected = [item for item in items if item.nodeid in kept]
    dropped = [item for item in items if item.nodeid not in kept]
    for item in selected:
        functions[_function_key(item)]["selected"] += 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = selected

    substituted: set[str] = set()
    if config.getoption("parity_mode") == "tactix":
        done: set[int] = set()
        for item in selected:
            module = getattr(item, "module", None)
            key = scope.file_key(str(item.path))
            if module is None or key is None or id(module) in done:
                continue
            done.add(id(module))
            substituted |= substitute(module, {name: getattr(compat, name) for name in provided[key]})

    deselected: Counter[str] = Counter()
    for function, counts in reasons.items():
        functions[function]["out_of_scope"] = dict(counts)
        deselected.update(counts)
    unsampled = sum(f["in_scope"] - f["selected"] for f in functions.values())
    if unsampled:
        deselected[scope.NOT_SAMPLED] = unsampled
    record = {
        "mode": config.getoption("parity_mode"),
        "tree": str(config.rootpath),
        "sample": sample,
        "seed": config.getoption("parity_seed"),
        "collected": sum(f["collected"] for f in functions.values()),
        "in_scope": sum(f["in_scope"] for f in functions.values()),
        "selected": len(selected),
        "deselected": dict(deselected),
        "functions": dict(functions),
        "substituted": sorted(substituted),
        "environment": _environment(),
    }
    path = config.getoption("parity_record")
    if path:  # written whole, then renamed: xdist's workers each collect and write the same record
        tmp = Path(f"{path}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, path)


class _View(types.ModuleType):
    """One test module's view of a flashinfer module: some names are tactix's, the rest FlashInfer's."""

    def __init__(self, real: types.ModuleType, names: Mapping[str, object]) -> None:
        super().__init__(real.__name__, real.__doc__)
        for dunder in ("__package__", "__loader__", "__spec__"):
            vars(self).pop(dunder, None)  # read through to the real module
        vars(self).update(names)
        vars(self)["_parity_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(vars(self)["_parity_real"], name)

    def __repr__(self) -> str:
        return f"<tactix parity view of {vars(self)['_parity_real']!r}>"


def substitute(module: types.ModuleType, ours: Mapping[str, object]) -> set[str]:
    """Point ``module``'s globals at views of flashinfer in which ``ours`` replace FlashInfer's names.

    Returns the dotted flashinfer names now served by tactix (``flashinfer.decode.X``).
    """
    flashinfer = importlib.import_module("flashinfer")
    if not ours:
        return set()
    done: set[str] = set()
    children: dict[str, _View] = {}
    views: dict[int, _View] = {}
    for attr, sub in list(vars(flashinfer).items()):
        if not isinstance(sub, types.ModuleType) or not sub.__name__.startswith("flashinfer."):
            continue
        names = {name: obj for name, obj in ours.items() if name in vars(sub)}
        if names:
            children[attr] = views[id(sub)] = _View(sub, names)
            done |= {f"{sub.__name__}.{name}" for name in names}
    top = {name: obj for name, obj in ours.items() if name in vars(flashinfer)}
    done |= {f"flashinfer.{name}" for name in top}
    views[id(flashinfer)] = _View(flashinfer, {**top, **children})

    originals: dict[int, str] = {}
    for real in (flashinfer, *(vars(v)["_parity_real"] for v in children.values())):
        for name in ours:
            if name in vars(real):
                originals[id(vars(real)[name])] = name
    for gname, value in list(vars(module).items()):
        if id(value) in views:
            setattr(module, gname, views[id(value)])
        elif id(value) in originals and not isinstance(value, types.ModuleType):
            setattr(module, gname, ours[originals[id(value)]])
            done.add(f"{module.__name__}.{gname}")
    return done


def _environment() -> dict[str, str]:
    """Versions and GPU, from the modules the tests imported (nothing is imported for this)."""
    out: dict[str, str] = {}
    for name in ("flashinfer", "tactix", "torch"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            out[name] = str(module.__version__)
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["cuda"] = str(torch.version.cuda)
    except Exception:  # report what can be read
        pass
    return out
