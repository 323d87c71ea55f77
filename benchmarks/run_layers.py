"""Where an eager attention ``run()`` spends its host time, layer by layer (issue 21's run rows).

    python benchmarks/run_layers.py [--backends cudnn,cuda_native] [--calls 2000] [--json PATH]

For a decode wrapper of 8 requests of 1k keys (the shapes of ``run_time.py``), each layer's
enqueue-only host time per call, the fastest of 7 blocks:

* ``wrapper``: ``PagedDecode.run(q, (k, v), out=out)``, what a caller pays;
* ``plan``: the backend's plan object called directly, ``plan.run(q, k, v, out, None)``;
* cudnn only: ``execute``, the cuDNN frontend's ``graph.execute(pack, workspace, handle=...)``
  with the plan's own variant pack; ``execute_at_index``, its ``execute_plan_at_index`` (what
  ``cudnn (direct)`` calls); ``execute_entry``, the plugin's `BuiltGraph.execute` (the lowered
  graph's own entry); and ``pack``: building that pack (a dict copy and five pointers) and
  binding the stream, without executing.

``wrapper - plan`` is the core's share, ``plan - execute`` the plugin's, ``execute`` cuDNN's. It
reads the plan object through the wrapper's private binding (``_bound`` now, ``_fast`` in the
commits before contract v2), so the same file measures an older install given by ``PYTHONPATH``.
Run it once per install in one device call, alternating; compare layers, not installs, across
processes (the hosts drift: ``host_ab.py`` is the A/B).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from run_time import paged, per_call_us

import tactix


def _plan_object(wrapper: Any) -> Any:
    bound = getattr(wrapper, "_bound", None)
    run = bound.run if bound is not None else wrapper._fast[0]
    return run.__self__


def layers(backend: str, calls: int) -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    _, indptr, indices, last = paged(8, 1024, 1)
    pages = int(indptr[-1])
    k = torch.randn(pages, 8, 16, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(8, 32, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    wrapper = tactix.PagedDecode("HND", backend=backend, device=dev)
    wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    plan = _plan_object(wrapper)
    fns: dict[str, Any] = {
        "wrapper": lambda: wrapper.run(q, (k, v), out=out),
        "plan": lambda: plan.run(q, k, v, out, None),
    }
    info: dict[str, Any] = {"tactic": str(getattr(plan, "tactic", "?"))}
    if backend == "cudnn":
        from tactix_cudnn import plugin as cp
        from tactix_cudnn.graphs import UID_K, UID_O, UID_Q, UID_V

        try:
            graph = plan._graph_for(k, v, False)
            graph_for = lambda: plan._graph_for(k, v, False)  # noqa: E731
        except TypeError:  # before attention sinks
            graph = plan._graph_for(k, v)
            graph_for = lambda: plan._graph_for(k, v)  # noqa: E731
        pack = dict(plan._fixed)
        pack.update({UID_Q: q.data_ptr(), UID_K: k.data_ptr(), UID_V: v.data_ptr(), UID_O: out.data_ptr()})
        info["pack_entries"] = len(pack)
        info["workspace_bytes"] = int(plan._workspace.numel())

        def build() -> None:
            p = dict(plan._fixed)
            p[UID_Q] = q.data_ptr()
            p[UID_K] = k.data_ptr()
            p[UID_V] = v.data_ptr()
            p[UID_O] = out.data_ptr()
            cp._bind_stream(plan.handle, plan.device)

        fns["execute"] = lambda: graph.graph.execute(pack, plan._workspace, handle=plan.handle)
        index = getattr(graph, "index", None)
        if index is not None:  # the public call by plan index (cudnn (direct)'s) and the plugin's own
            fns["execute_at_index"] = lambda: graph.graph.execute_plan_at_index(pack, plan._workspace, index,
                                                                                handle=plan.handle)  # fmt: skip
            fns["execute_entry"] = lambda: graph.execute(pack, plan._workspace, plan.handle)
            info["backend_entry"] = graph._backend_entry is not None
        fns["pack"] = build
        fns["graph_for"] = graph_for
    for fn in fns.values():
        for _ in range(3):
            per_call_us(fn, 100)
    times = {name: min(per_call_us(fn, calls // 7) for _ in range(7)) for name, fn in fns.items()}
    return {"backend": backend, "us": times, **info}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cudnn,cuda_native")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("run_layers.py needs a CUDA device")
    rows = [layers(b, args.calls) for b in args.backends.split(",")]
    for row in rows:
        cells = "  ".join(f"{name} {us:6.2f}" for name, us in row["us"].items())
        print(f"{tactix.__file__}  {row['backend']:12s} {cells}  ({row['tactic']})", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"tactix": tactix.__file__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
