"""Installable-looking test plugins: a folder on sys.path with ``*.dist-info`` metadata.

``importlib.metadata`` finds these exactly as it finds pip-installed distributions, so the
registry is exercised through real entry-point discovery, not a mocked list.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tactix.registry import set_registry


def write_distribution(
    root: Path, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[tactix.backends]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@contextmanager
def plugins_on_path(root: Path) -> Iterator[None]:
    """Make the distributions under ``root`` discoverable; restore everything afterwards."""
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    set_registry(None)
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            mod = sys.modules.get(name)
            if mod is not None and str(getattr(mod, "__file__", "") or "").startswith(str(root)):
                del sys.modules[name]
        set_registry(None)


BROKEN_IMPORT = """
raise ImportError("libmissing.so.1: cannot open shared object file")
"""

RAISING_REGISTRATION = """
import tactix

@tactix.hookimpl
def tactix_backends():
    raise RuntimeError("registration exploded")
"""

WRONG_NAME = """
import tactix
from tactix.backends.torch import tactix_backends as _torch_backends

@tactix.hookimpl
def tactix_backends():
    spec = _torch_backends()[0]
    return [spec.model_copy(update={"name": "someone_else"})]
"""

MISSPELT_HOOK = """
import tactix

@tactix.hookimpl
def tactix_backends():
    return [tactix.BackendSpec(name="misspelt", version="1.0")]

@tactix.hookimpl
def tactix_plan_prefil(problem, batch, tactic, options):
    return None
"""


def delegating_plugin(
    name: str, preference: int, plan_raises: str | None = None, check_reason: str | None = None
) -> str:
    """A plugin that serves decode by delegating to the torch backend's decode plan.

    ``plan_raises``: its plan raises RuntimeError with this message instead.
    ``check_reason``: its check refuses every non-default tactic with this reason.
    """
    return f"""
import tactix
from tactix.backends import torch as _torch

NAME = {name!r}
PLAN_RAISES = {plan_raises!r}
CHECK_REASON = {check_reason!r}

@tactix.hookimpl
def tactix_backends():
    spec = _torch.tactix_backends()[0]
    return [tactix.BackendSpec(name=NAME, version="9.9", decode=spec.decode, preference={preference})]

@tactix.hookimpl
def tactix_tactics(problem):
    return [tactix.Tactic(backend=NAME, kernel="special")]

@tactix.hookimpl
def tactix_check(problem, tactic):
    if tactic.kernel == "special" and CHECK_REASON is not None:
        return [CHECK_REASON]
    return []

@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    if PLAN_RAISES is not None:
        raise RuntimeError(PLAN_RAISES)
    inner = _torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options)
    inner.tactic = tactic if not tactic.is_default else tactix.Tactic(backend=NAME, kernel="plain")
    return inner
"""


def wrong_backend(name: str, flaw: str, known_failures: dict[str, str] | None = None) -> str:
    """A plugin that claims what the torch backend claims but computes something else.

    ``flaw``: ``drop_last_page`` (decode reads every request's pages but the last),
    ``ignore_causal`` (prefill without the causal mask), ``fake_window`` (decode claims a
    sliding window and ignores it). ``known_failures``: what its tactix_known_failures returns.
    """
    return f"""
import tactix
from tactix.backends import torch as _torch

NAME = {name!r}
FLAW = {flaw!r}
KNOWN = {known_failures!r}


@tactix.hookimpl
def tactix_known_failures():
    return KNOWN


@tactix.hookimpl
def tactix_backends():
    spec = _torch.tactix_backends()[0]
    decode = spec.decode.model_copy(update={{"sliding_window": True, "cuda_graph": "none"}})
    prefill = spec.prefill.model_copy(update={{"cuda_graph": "none"}})
    if FLAW == "ignore_causal":
        return [tactix.BackendSpec(name=NAME, version="0.0.1", prefill=prefill)]
    return [tactix.BackendSpec(name=NAME, version="0.0.1", decode=decode)]


def _plan(problem, batch, options):
    if FLAW == "ignore_causal":
        problem = problem.model_copy(update={{"causal": False}})
    if FLAW == "fake_window":
        problem = problem.model_copy(update={{"window_left": -1}})
    if FLAW == "drop_last_page":
        indptr, indices = [0], []
        lens = batch.kv_indptr.tolist()
        pages = batch.kv_indices.tolist()
        last = []
        for r in range(batch.batch_size):
            mine = pages[lens[r]:lens[r + 1]]
            if len(mine) > 1:
                mine = mine[:-1]
                last.append(batch.page_size)
            else:
                last.append(int(batch.kv_last_page_len[r]))
            indices += mine
            indptr.append(len(indices))
        i32 = lambda v: __import__("torch").tensor(v, dtype=__import__("torch").int32)
        batch = tactix.PagedBatch.build(qo_indptr=None, kv_indptr=i32(indptr), kv_indices=i32(indices),
                                        kv_last_page_len=i32(last), page_size=batch.page_size,
                                        device=options["device"], causal=False)
    plan = _torch._plan_attention(problem, batch, tactix.Tactic.default("torch"), options)
    plan.tactic = tactix.Tactic(backend=NAME, kernel="wrong")
    return plan


@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    return _plan(problem, batch, options)


@tactix.hookimpl
def tactix_plan_prefill(problem, batch, tactic, options):
    return _plan(problem, batch, options)
"""


_DECODE_LIKE_TORCH = """
@tactix.hookimpl
def tactix_backends():
    spec = _torch.tactix_backends()[0]
    return [tactix.BackendSpec(name=NAME, version="1.0", decode=spec.decode, preference=50)]
"""
"""The backend hook of a decode plugin that serves what the torch backend serves, ahead of it."""


def tuning_plugin(name: str, default_fails: bool = False) -> str:
    """A decode plugin with tactics that must never win: one raises, one runs another kernel than
    asked, one is fast but wrong; ``good`` delegates to the torch backend.
    """
    return f"""
import torch as _t
import tactix
from tactix.backends import torch as _torch

NAME = {name!r}
DEFAULT_FAILS = {default_fails!r}

{_DECODE_LIKE_TORCH}


@tactix.hookimpl
def tactix_tactics(problem):
    return [tactix.Tactic(backend=NAME, kernel=k) for k in ("boom", "liar", "wrong", "good")]


class _Zeros:
    built = False

    def __init__(self, tactic):
        self.tactic = tactic

    def run(self, q, k, v, out, lse):
        out.zero_()  # fast, and wrong


class _Boom(_Zeros):
    def run(self, q, k, v, out, lse):
        raise RuntimeError("illegal instruction in kernel boom")


@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    if tactic.kernel == "default" and DEFAULT_FAILS:
        raise RuntimeError("default kernel unavailable on this GPU")
    if tactic.kernel == "boom":
        return _Boom(tactic)
    if tactic.kernel == "wrong":
        return _Zeros(tactic)
    plan = _torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options)
    if tactic.kernel == "liar":
        plan.tactic = tactix.Tactic(backend=NAME, kernel="good")  # says it runs something else
    else:
        plan.tactic = tactic if not tactic.is_default else tactix.Tactic(backend=NAME, kernel="good")
    plan.built = True  # as if it had compiled a kernel
    return plan
"""


def referencing_plugin(name: str) -> str:
    """A decode plugin (delegating to torch) whose ``tactix_references`` offers three direct calls:
    ``right`` computes the case with the float64 oracle, ``wrong`` writes zeros, ``boom`` raises."""
    return f"""
import tactix
from tactix.backends import torch as _torch
from tactix.testing.oracle import attention_reference

NAME = {name!r}


@tactix.hookimpl
def tactix_backends():
    spec = _torch.tactix_backends()[0]
    return [tactix.BackendSpec(name=NAME, version="1.0", decode=spec.decode, preference=-300)]


@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    plan = _torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options)
    plan.tactic = tactix.Tactic(backend=NAME, kernel="plain")
    return plan


@tactix.hookimpl
def tactix_references(op, inputs):
    if op != "decode":
        return None
    qo = __import__("torch").arange(inputs["q"].shape[0] + 1, dtype=__import__("torch").int32)

    def right():
        ref, _ = attention_reference(inputs["q"], inputs["k_cache"], inputs["v_cache"], qo, inputs["kv_indptr"],
                                     inputs["kv_indices"], inputs["kv_last_page_len"], kv_layout="HND",
                                     causal=False, sm_scale=inputs["sm_scale"])
        inputs["out"].copy_(ref)

    def boom():
        raise RuntimeError("no such plan")

    return [("wrong", lambda: inputs["out"].zero_()), ("right", right), ("boom", boom)]
"""


def heating_plugin(name: str) -> str:
    """A decode plugin whose kernels (the torch backend's) move a fake clock, ``now()``, that a
    test gives the timer: ``plain`` costs 1.0 a call and ``fast`` 0.95 on a card in the same
    state, and every call slows the ones after it by 2 % (a card that heats as it runs)."""
    return f"""
import tactix
from tactix.backends import torch as _torch

NAME = {name!r}
CLOCK = [0.0]
CALLS = [0]
COST = {{"plain": 1.0, "fast": 0.95}}


def now():
    return CLOCK[0]

{_DECODE_LIKE_TORCH}

@tactix.hookimpl
def tactix_tactics(problem):
    return [tactix.Tactic(backend=NAME, kernel=k) for k in ("plain", "fast")]


@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    plan = _torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options)
    kernel = "fast" if tactic.kernel == "fast" else "plain"
    plan.tactic = tactix.Tactic(backend=NAME, kernel=kernel)
    inner, cost = plan.run, COST[kernel]

    def run(*args, **kwargs):
        inner(*args, **kwargs)
        CLOCK[0] += cost * (1 + 0.02 * CALLS[0])
        CALLS[0] += 1

    plan.run = run
    return plan
"""
