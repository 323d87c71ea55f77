"""Host cost of the cudnn plugin's fast re-plan (`CudnnAttentionPlan.replan`) on a machine with no GPU.

    python benchmarks/plan_cudnn_cpu.py [--plans 5000]

What a re-plan costs in the plugin itself, between the core's fast path and the CUDA runtime:
the checks of the buckets, the int32 metadata, the padded page table written into the staging
buffer. The three runtime calls of a transfer (``cudaMemcpyAsync``, an event record and query:
about 7-8 us on an H200 host, ``plan_floor.py``) are left out: the staging's host buffers here
are plain memory and their transfer does nothing, and no cuDNN graph is built or run (the plan
is made by hand around a graph key). Decode batches of 8 and 64 requests as in ``plan_time.py``;
median us per re-plan. Compare runs on one host only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from plan_time import batch
from tactix_cudnn import plugin

from tactix import PagedBatch, Tactic, staging
from tactix.attention import attention_problem

DEVICE = torch.device("cuda", 0)  # only compared, never used: nothing here touches a GPU


class _PlainBuffer:
    """A staging host buffer of plain memory whose transfer does nothing."""

    def __init__(self, capacity: int, device_index: int) -> None:
        self.tensor = torch.empty(capacity, dtype=torch.int32)
        self.ptr = self.tensor.data_ptr()
        self.pending = False

    def free(self) -> bool:
        return True

    def transfer(self, dst: torch.Tensor, dst_ptr: int, size: int, device_index: int) -> None:
        pass

    def release(self) -> None:
        pass


def _staging(capacity: int) -> staging.Staging:
    made = staging.Staging.__new__(staging.Staging)
    made.device, made.index, made.capacity, made.table_capacity = DEVICE, 0, capacity, capacity
    made._dev = [torch.zeros(capacity, dtype=torch.int32) for _ in range(2)]
    made._dev_ptr = [t.data_ptr() for t in made._dev]
    made._tables = [torch.empty(capacity, dtype=torch.int32) for _ in range(2)]
    made._host, made._retired, made._host_next, made._next, made._views = [], [], 0, 0, {}
    made._new_host = lambda: _PlainBuffer(capacity, 0)  # type: ignore[method-assign]
    return made


def _first_plan(problem: Any, b: PagedBatch) -> plugin.CudnnAttentionPlan:
    """A plan as `CudnnAttentionPlan.__init__` leaves it, without a handle or a graph."""
    made = plugin.CudnnAttentionPlan.__new__(plugin.CudnnAttentionPlan)
    strides = plugin._contiguous_strides(problem, problem.head_dim_qk)
    pages = (b.max_page_index or 0) + 1
    key = plugin._key(problem, b.batch_size, b.max_qo_len, b.max_kv_len, pages, strides, strides,
                      Tactic.default("cudnn"))  # fmt: skip
    made.__dict__.update(problem=problem, device=DEVICE, handle=None, _shape=(b.batch_size, b.max_qo_len,
                         b.max_kv_len, pages), _requested=Tactic.default("cudnn"), _base_key=key, _graph_mode=False,
                         _staging=_staging(1 << 18), _small=None, _table=None, _graphs={}, tactic=None, built=False,
                         _workspace=None, _q_packed=None)  # fmt: skip
    made._fill_metadata(b, key, None)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=5000)
    args = parser.parse_args()
    for count, lo, hi in ((8, 900, 1000), (64, 4100, 8000)):
        made = [batch(seed, count, lo, hi) for seed in range(16)]
        batches = [PagedBatch.build(qo_indptr=None, kv_indptr=m[0], kv_indices=m[1], kv_last_page_len=m[2],
                                    page_size=16, device=DEVICE, causal=False) for m in made]  # fmt: skip
        problem, _ = attention_problem("decode", device=DEVICE, kv_layout="HND", qo_indptr=None,
                                       paged_kv_indptr=made[0][0], paged_kv_indices=made[0][1],
                                       paged_kv_last_page_len=made[0][2], num_qo_heads=32, num_kv_heads=8,
                                       head_dim_qk=128, head_dim_vo=None, page_size=16, causal=False, sm_scale=None,
                                       window_left=-1, logits_soft_cap=None, q_data_type=torch.bfloat16,
                                       kv_data_type=None, o_data_type=None, return_lse=False,
                                       deterministic=True)  # fmt: skip
        plan = _first_plan(problem, batches[0])
        options = {"device": DEVICE, "use_cuda_graph": False, "previous": plan}
        samples = []
        for i in range(args.plans + 200):
            b = batches[i % len(batches)]
            t0 = time.perf_counter()
            new = plan.replan(problem, b, options)  # type: ignore[arg-type]
            dt = time.perf_counter() - t0
            assert new is not None, "a batch of the same buckets must re-plan"
            plan = new
            if i >= 200:
                samples.append(dt)
        print(f"cudnn replan, decode b{count}: {statistics.median(samples) * 1e6:6.1f} us (GPU runtime calls stubbed)")


if __name__ == "__main__":
    main()
