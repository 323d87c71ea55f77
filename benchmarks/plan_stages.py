"""Where ``plan()`` time goes for the cudnn backend: each stage timed alone (host µs, medians).

    python benchmarks/plan_stages.py [--profile]

Decode batches of 8 requests (~1k tokens) and 64 requests (4-8k tokens), HND, page 16, bf16.
The stages are the core's (batch validation, problem, store lookup, check) and the plugin's
(metadata layout, the pinned transfer, graph key and cache lookup). ``--profile`` adds a
cProfile of whole plans, sorted by cumulative time.
"""

# ruff: noqa: B023  (each timed lambda runs inside its own loop iteration)
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
from collections.abc import Callable

import torch
from plan_floor import timed as median_us
from plan_time import batch
from tactix_cudnn import plugin
from tactix_cudnn.graphs import graph_cache

import tactix
from tactix import selection
from tactix.attention import attention_problem
from tactix.batch import PagedBatch


def timed(name: str, fn: Callable[[], object], n: int = 200) -> None:
    print(f"{name:34} {median_us(fn, n):8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    for count, lo, hi in ((8, 900, 1000), (64, 4100, 8000)):
        print(f"== decode, batch {count}")
        batches = [batch(i, count, lo, hi) for i in range(50)]
        wrapper = tactix.PagedDecode("HND", backend="cudnn", device=dev)
        step = iter(range(10**9))

        def full(w: tactix.PagedDecode = wrapper, bs: list[tuple[torch.Tensor, ...]] = batches) -> None:
            b = bs[next(step) % len(bs)]
            w.plan(b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)

        timed("whole plan()", full)
        gc.disable()
        timed("whole plan(), gc off", full)
        gc.enable()
        same = batches[0]
        timed("whole plan(), same batch", lambda w=wrapper, b=same: w.plan(b[0], b[1], b[2], 32, 8, 128, 16,
                                                                    q_data_type=torch.bfloat16))  # fmt: skip
        b0 = batches[0]
        timed("PagedBatch.build", lambda b=b0: PagedBatch.build(  # type: ignore[misc]
            qo_indptr=None, kv_indptr=b[0], kv_indices=b[1], kv_last_page_len=b[2], page_size=16, device=dev,
            causal=False))  # fmt: skip
        kw = dict(device=dev, kv_layout="HND", qo_indptr=None, paged_kv_indptr=b0[0], paged_kv_indices=b0[1],
                  paged_kv_last_page_len=b0[2], num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=None,
                  page_size=16, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
                  q_data_type=torch.bfloat16, kv_data_type=None, o_data_type=None, return_lse=False)  # fmt: skip
        timed("attention_problem (with build)", lambda: attention_problem("decode", **kw))  # type: ignore[arg-type]
        problem, pb = attention_problem("decode", **kw)  # type: ignore[arg-type]
        backend = tactix.get_registry().get("cudnn")
        default = tactix.Tactic.default("cudnn")
        timed("stored tactic lookup", lambda: selection._stored(problem, pb, "cudnn"))
        timed("backend.check", lambda: backend.check(problem, default, pb))
        options: tactix.PlanOptions = {"device": dev, "use_cuda_graph": False, "previous": None}
        timed("plugin plan (CudnnAttentionPlan)", lambda: plugin.CudnnAttentionPlan(problem, pb, default, options))
        made = plugin.CudnnAttentionPlan(problem, pb, default, options)
        key = made._base_key
        timed("  host_metadata", lambda: plugin.host_metadata(problem, pb, key))
        table = torch.empty(key.batch * key.table_width, dtype=torch.int32)
        src = pb.kv_indices.data_ptr()
        timed("  write_table", lambda: plugin.write_table(table.data_ptr(), src, pb.kv_indptr_list, key.batch,
                                                          key.table_width))  # fmt: skip
        timed("  pinned empty", lambda: torch.empty(4096, dtype=torch.int32, pin_memory=True))
        staging = torch.empty(4096, dtype=torch.int32, pin_memory=True)
        timed("  pinned -> device", lambda: staging.to(dev, non_blocking=True))
        timed("  graph key", lambda: made._key(key.k_strides, key.v_strides))
        timed("  graph_cache.get", lambda: graph_cache.get(key, made.handle))
    if args.profile:
        batches = [batch(i, 8, 900, 1000) for i in range(50)]
        wrapper = tactix.PagedDecode("HND", backend="cudnn")
        for b in batches:
            wrapper.plan(b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(4):
            for b in batches:
                wrapper.plan(b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
        pstats.Stats(profile).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
