"""Host cost of the core's part of a re-plan, on the CPU (no GPU needed).

    python benchmarks/plan_core_cpu.py [--plans 2000] [--batches 16] [--profile]

A serving engine re-plans every step with a new batch of the same shapes. This re-plans
``tactix.PagedDecode("HND", backend="torch", device="cpu")`` (and a `PagedPrefill`) over
batches made beforehand and cycled, and reports per plan the median of

* ``plan``: the whole ``plan()`` call,
* ``hook``: the torch backend's plan hook, timed inside the call,
* ``core``: ``plan - hook``, what tactix itself costs: validating the CSR arrays, the problem,
  the selection and check, the plan bookkeeping.

The torch backend's real plan builds its gather indices and mask with a few dozen torch ops
(hundreds of µs to ms, and freeing the previous plan's large mask lands in the core's time), so
by default its plan hooks are replaced by a stub that returns a tensor-free plan at once: the
core is then measured alone. ``--real-hook`` keeps the real hooks.

Cases: decode of 8 requests with ~1k keys, decode of 64 requests with 4-8k keys, prefill of
16 causal requests of 64 new tokens over ~4k cached keys; page 16, HND, 32 query / 8 KV heads,
d128, bf16; int32 CPU index tensors; one torch thread. ``--store miss|hit`` plans inside a
``replay`` block whose store has no entry (each plan asks the disk) or one per bucket.
``--profile`` prints a cProfile of each case's re-plans, sorted by own time. Compare runs on
one host only.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from plan_time import batch

import tactix
from tactix.autotune import StoreEntry, autotune
from tactix.registry import get_registry
from tactix.tactics import Tactic

_HEADS: dict[str, Any] = {
    "num_qo_heads": 32,
    "num_kv_heads": 8,
    "head_dim_qk": 128,
    "page_size": 16,
    "q_data_type": torch.bfloat16,
}
_PAGE = 16


def make_batch(seed: int, count: int, low: int, high: int) -> tuple[torch.Tensor, ...]:
    """CSR metadata (kv_indptr, kv_indices, last_page_len) of ``count`` requests of low..high keys."""
    return batch(seed, count, low, high, _PAGE)[:3]


class _StubPlan:
    """What the stub hook returns: a plan without tensors (``run`` does nothing)."""

    built = False

    def __init__(self, tactic: Tactic) -> None:
        self.tactic = tactic

    def run(self, *args: object) -> None:
        pass


class _FastStubPlan(_StubPlan):
    """A stub plan that also offers the fast re-plan (``--replan``): it keeps itself, as the
    cudnn plugin's does."""

    def replan(self, problem: object, batch: object, options: object) -> _FastStubPlan:
        return self


_EXPLICIT = Tactic(backend="torch", kernel="explicit")


def _stub_hook(problem: object, batch: object, tactic: Tactic, options: object) -> _StubPlan | None:
    return _StubPlan(_EXPLICIT)


def _fast_stub_hook(problem: object, batch: object, tactic: Tactic, options: object) -> _StubPlan | None:
    return _FastStubPlan(_EXPLICIT)


_STUB = [_stub_hook]  # --replan: _fast_stub_hook


class _HookTimer:
    """Times the torch backend's plan hooks per call (stubbed unless ``real``): inside the block, the
    function of each plan hook's implementation on the torch backend's plugin manager is swapped
    for a timed one (the real hook or the stub), so the hook keeps its one implementation and the
    core calls it as it calls any backend's. What the dispatch costs is the core's."""

    def __init__(self, real: bool) -> None:
        self.spent = 0.0
        self.real = real
        manager = get_registry().get("torch").manager
        self._impls = [impl for name in ("tactix_plan_decode", "tactix_plan_prefill")
                       for impl in getattr(manager.hook, name).get_hookimpls()]  # fmt: skip
        self._functions = [impl.function for impl in self._impls]

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        def call(problem: Any, batch: Any, tactic: Any, options: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return (fn if timer.real else _STUB[0])(problem, batch, tactic, options)
            finally:
                timer.spent += time.perf_counter() - t0

        return call

    def __enter__(self) -> _HookTimer:
        for impl, fn in zip(self._impls, self._functions, strict=True):
            impl.function = self._timed(fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for impl, fn in zip(self._impls, self._functions, strict=True):
            impl.function = fn


Case = tuple[tactix.PagedDecode | tactix.PagedPrefill, tuple[Callable[[], None], ...]]


def _cases(batches: int) -> dict[str, Case]:
    decode8 = tactix.PagedDecode("HND", backend="torch", device="cpu")
    decode64 = tactix.PagedDecode("HND", backend="torch", device="cpu")
    prefill16 = tactix.PagedPrefill("HND", backend="torch", device="cpu")
    qo = torch.arange(0, 17 * 64, 64, dtype=torch.int32)  # 16 requests of 64 new tokens

    def decode_calls(wrapper: tactix.PagedDecode, count: int, low: int, high: int) -> Case:
        made = [make_batch(seed, count, low, high) for seed in range(batches)]
        return wrapper, tuple((lambda b=b: wrapper.plan(*b, **_HEADS)) for b in made)

    made = [make_batch(seed, 16, 4100, 4200) for seed in range(batches)]
    prefill_calls = tuple((lambda b=b: prefill16.plan(qo, *b, causal=True, **_HEADS)) for b in made)
    return {
        "decode b8 (~1k)": decode_calls(decode8, 8, 900, 1000),
        "decode b64 (4-8k)": decode_calls(decode64, 64, 4100, 8000),
        "prefill b16 (64 q, ~4k kv)": (prefill16, prefill_calls),
    }


@contextlib.contextmanager
def _store(kind: str, cases: dict[str, Case], root: str) -> Iterator[None]:
    """Plan inside a ``replay`` block whose store has an entry for every bucket planned (``hit``)
    or none (``miss``: each plan looks on disk for one); ``none``: no store at all."""
    if kind == "none":
        yield
        return
    with autotune(mode="replay", cache_dir=root) as state:
        store = state.store
        assert store is not None
        if kind == "hit":
            with _HookTimer(real=False):
                for wrapper, calls in cases.values():
                    for call in calls:
                        call()
                        problem = wrapper.problem
                        if store.lookup(problem) is None:
                            store.put(StoreEntry(op=problem.op, key=problem.key(), key_hash=problem.key_hash(),
                                                 tactic=_EXPLICIT, baseline=Tactic.default("torch"),
                                                 env_hash=store.env_hash))  # fmt: skip
        yield


def measure(calls: tuple[Callable[[], None], ...], plans: int, real: bool) -> tuple[float, float, float]:
    """Median µs per plan of the whole call, of the backend hook, and of the rest (the core)."""
    whole: list[float] = []
    hooks: list[float] = []
    core: list[float] = []
    with _HookTimer(real) as timer:
        for call in calls * 4:  # warm: problem memo, selection, caches
            call()
        for i in range(plans):
            call = calls[i % len(calls)]
            timer.spent = 0.0
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            whole.append(dt)
            hooks.append(timer.spent)
            core.append(dt - timer.spent)
    return tuple(statistics.median(x) * 1e6 for x in (whole, hooks, core))  # type: ignore[return-value]


def profile(calls: tuple[Callable[[], None], ...], plans: int, real: bool) -> None:
    with _HookTimer(real):
        for call in calls * 4:
            call()
        prof = cProfile.Profile()
        prof.enable()
        for i in range(plans):
            calls[i % len(calls)]()
        prof.disable()
    pstats.Stats(prof).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=2000, help="timed re-plans per case")
    parser.add_argument("--batches", type=int, default=16, help="distinct batches cycled per case")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each case instead")
    parser.add_argument("--real-hook", action="store_true", help="run the torch backend's real plan hooks")
    parser.add_argument("--replan", action="store_true",
                        help="stub plans offer the fast re-plan (tactix.selection.replan_selection)")  # fmt: skip
    parser.add_argument("--store", choices=("none", "miss", "hit"), default="none",
                        help="plan in a replay block whose store misses or hits (default: no store)")  # fmt: skip
    args = parser.parse_args()
    if args.replan:
        _STUB[0] = _fast_stub_hook
    torch.set_num_threads(1)  # the hook's small ops gain nothing from a pool whose spinning disturbs timing
    print(f"tactix from {tactix.__file__}")
    cases = _cases(args.batches)
    if args.profile:
        with tempfile.TemporaryDirectory() as root, _store(args.store, cases, root):
            for label, (_, calls) in cases.items():
                print(f"== {label}")
                profile(calls, args.plans, args.real_hook)
        return
    print(f"{'case':28} {'plan us':>9} {'hook us':>9} {'core us':>9}   (store: {args.store})")
    with tempfile.TemporaryDirectory() as root, _store(args.store, cases, root):
        for label, (_, calls) in cases.items():
            whole, hook, core = measure(calls, args.plans, args.real_hook)
            print(f"{label:28} {whole:9.1f} {hook:9.1f} {core:9.1f}")


if __name__ == "__main__":
    main()
