"""Where the time of real ``plan()`` calls goes: inclusive time per function, inside whole plans.

    python benchmarks/plan_breakdown.py [--backend cudnn|cuda_native|trtllm] [--plans 400] [--profile]
                                        [--indices host|device] [--batches 8,64]

`plan_stages.py` times each stage alone, in a tight loop; this wraps the functions a plan calls
with timers and runs whole plans over changing batches (decode, 8 and 64 requests), so the
figures add up to the whole and the remainder of each function is visible. The timers add
about 0.2 us per wrapped call; the last column is per plan. ``--profile`` prints a cProfile of
the plans instead (own time per function, sorted; cProfile's own cost per call inflates
functions that make many small calls). ``--indices device`` passes the page indices as a device
tensor (what vLLM passes), the CSR offsets and last-page lengths on the host. trtllm has
timers for its decode plan too.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from plan_time import batch

import tactix
from tactix import attention, registry, selection, staging
from tactix import batch as batch_module

_spent: dict[str, float] = defaultdict(float)


def _wrap(owner: Any, name: str, label: str, *, classmethod_: bool = False) -> None:
    """Replace method ``name`` of class ``owner`` by a timed one."""
    original = owner.__dict__[name]
    timed = _timed_fn(original.__func__ if classmethod_ else original, label)
    setattr(owner, name, classmethod(timed) if classmethod_ else timed)


def instrument(backend: str) -> None:
    _wrap(attention._PagedAttention, "_plan", "_plan (whole)")
    attention.attention_problem = _timed_fn(attention.attention_problem, "  attention_problem")
    _wrap(batch_module.PagedBatch, "build", "    PagedBatch.build", classmethod_=True)
    attention.select_and_plan = _timed_fn(attention.select_and_plan, "  select_and_plan")
    selection._stored = _timed_fn(selection._stored, "    _stored")
    _wrap(registry.Backend, "check", "    Backend.check")
    _wrap(registry.Backend, "plan", "    Backend.plan")
    selection.replan_selection = _timed_fn(selection.replan_selection, "    replan_selection (fast re-plan)")
    if hasattr(attention, "replan_selection"):
        attention.replan_selection = selection.replan_selection
    _wrap(staging.Staging, "send", "          Staging.send")
    _wrap(staging.Staging, "copy_in", "          Staging.copy_in")
    _wrap(staging.Staging, "reuse", "          Staging.reuse", classmethod_=True)
    _wrap(staging.Sections, "write", "            Sections.write")
    if backend == "cuda_native":
        from tactix_cuda_native import decode as native
        from tactix_cuda_native.paged import StagedPlan

        _wrap(native.CudaNativeDecodePlan, "__init__", "      CudaNativeDecodePlan.__init__")
        _wrap(native.CudaNativeDecodePlan, "_plan_batch", "      CudaNativeDecodePlan._plan_batch")
        _wrap(native.CudaNativeDecodePlan, "_kernel_for", "        _kernel_for")
        _wrap(StagedPlan, "_inherit_accepted", "        _inherit_accepted")
        for name in ("decode_work", "decode_items", "decode_chunk", "decode_is_small", "_decode_kernel",
                     "launch_config", "decode_bounds", "decode_plan_on_device", "decode_buffer_sizes",
                     "attended_lengths", "_plan_kernel", "decode_grid"):  # fmt: skip
            setattr(native, name, _timed_fn(getattr(native, name), f"        {name}"))
        _wrap(StagedPlan, "_send", "        StagedPlan._send")
        # the device plan's kernel launch, through cuda.core or (TACTIX_CUDA_NATIVE_DRIVER_LAUNCH=1) the driver
        _wrap(native.CudaNativeDecodePlan, "_launch_plan", "        _launch_plan (the device plan kernel)")
    if backend == "trtllm":
        from tactix_trtllm import metadata
        from tactix_trtllm import plugin as trt

        _wrap(trt.XqaDecodePlan, "_plan_batch", "      XqaDecodePlan._plan_batch")
        _wrap(trt._Plan, "_setup", "        _Plan._setup")
        _wrap(trt._Plan, "_fill_metadata", "          _Plan._fill_metadata")
        trt.write_metadata = _timed_fn(metadata.write_metadata, "            write_metadata")
        trt.metadata_sections = _timed_fn(metadata.metadata_sections, "            metadata_sections")
        trt.geometry = _timed_fn(metadata.geometry, "          geometry")
        _wrap(staging.Staging, "gather", "            Staging.gather")
        _wrap(staging.Staging, "view", "            Staging.view")
    if backend == "cudnn":
        from tactix_cudnn import plugin
        from tactix_cudnn.graphs import graph_cache

        _wrap(plugin.CudnnAttentionPlan, "__init__", "      CudnnAttentionPlan.__init__")
        _wrap(plugin.CudnnAttentionPlan, "_fill_metadata", "        _fill_metadata")
        _wrap(plugin.CudnnAttentionPlan, "_key", "        _key")
        plugin.host_metadata = _timed_fn(plugin.host_metadata, "          host_metadata")
        plugin.write_table = _timed_fn(plugin.write_table, "          write_table")
        _wrap(staging.Staging, "gather", "          Staging.gather")
        plugin.handle_for = _timed_fn(plugin.handle_for, "        handle_for")
        plugin._attention_reasons = _timed_fn(plugin._attention_reasons, "      _attention_reasons (check+plan)")
        graph_cache.get = _timed_fn(graph_cache.get, "        graph_cache.get")


def _timed_fn(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[label] += time.perf_counter() - t0

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cudnn")
    parser.add_argument("--plans", type=int, default=400)
    parser.add_argument("--profile", action="store_true", help="a cProfile of the plans, not the timers")
    parser.add_argument("--indices", choices=("host", "device"), default="host")
    parser.add_argument("--batches", default="8,64", help="decode batch sizes: 8 (~1k keys), 64 (4-8k keys)")
    args = parser.parse_args()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    shapes = {8: (8, 900, 1000), 64: (64, 4100, 8000)}
    for count, lo, hi in (shapes[int(b)] for b in args.batches.split(",")):
        batches = [batch(i, count, lo, hi) for i in range(50)]
        if args.indices == "device":
            batches = [(b[0], b[1].to(dev), *b[2:]) for b in batches]
        wrapper = tactix.PagedDecode("HND", backend=args.backend, device=dev)

        def plan(i: int, w: tactix.PagedDecode = wrapper, bs: list[tuple[torch.Tensor, ...]] = batches) -> None:
            b = bs[i % len(bs)]
            w.plan(b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)

        for i in range(50):
            plan(i)
        samples = []
        for i in range(args.plans):
            t0 = time.perf_counter()
            plan(i)
            samples.append(time.perf_counter() - t0)
        plain = statistics.median(samples) * 1e6
        if args.profile:
            print(f"== {args.backend} decode, batch {count}, {args.indices} indices: plan() median {plain:.1f} us; "
                  f"cProfile of {args.plans}")  # fmt: skip
            prof = cProfile.Profile()
            prof.enable()
            for i in range(args.plans):
                plan(i)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
            continue
        if not _spent:
            instrument(args.backend)
        for i in range(50):
            plan(i)
        _spent.clear()
        gc.collect()
        t0 = time.perf_counter()
        for i in range(args.plans):
            plan(i)
        whole = (time.perf_counter() - t0) / args.plans * 1e6
        print(f"== {args.backend} decode, batch {count}, {args.indices} indices: plan() median {plain:.1f} us "
              "uninstrumented; "
              f"instrumented mean {whole:.1f} us")  # fmt: skip
        for label, spent in _spent.items():
            print(f"{label:44} {spent / args.plans * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
