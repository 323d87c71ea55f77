"""Run-to-run determinism of cuDNN's decode plans, per batch shape.

    python benchmarks/cudnn_determinism.py

Each shape (32 q heads, 8 kv heads, d128, page 16, bf16, HND) is planned with an explicit
engine-8 tactic, ``KERNEL_CFG`` 35 (split-KV) and 3, run once, then 20 more times on the same
inputs; prints how many of the 20 differ from the first in any element and the most elements
that differed. (The H200 output is in benchmarks/results/h200-cudnn-determinism.txt.)
"""

from __future__ import annotations

import torch

import tactix


def batch(lens: list[int], page: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages), generator=gen).tolist()
    indptr, indices = [0], []
    for n in pages:
        indices += [order.pop() for _ in range(n)]
        indptr.append(len(indices))
    last = [(n - 1) % page + 1 for n in lens]
    i32 = torch.int32
    return (torch.tensor(indptr, dtype=i32), torch.tensor(indices, dtype=i32), torch.tensor(last, dtype=i32),
            sum(pages))  # fmt: skip


def main() -> None:
    d1 = torch.randint(1024, 8192, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    shapes = {
        "large(16..583)x64": [16 + 9 * i for i in range(64)],
        "D2 1x8192": [8192],
        "D3 256x2048": [2048] * 256,
        "64x64": [64] * 64,
        "64x256": [256] * 64,
        "64x512": [512] * 64,
        "64x1024": [1024] * 64,
        "8x600": [600] * 8,
        "1x600": [600],
        "1x2048": [2048],
        "4x300": [300] * 4,
        "64x(1k-8k)": d1,
    }
    for cfg in (35, 3):
        tactic = tactix.Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"KERNEL_CFG": cfg}})
        for name, lens in shapes.items():
            indptr, indices, last, pages = batch(lens)
            k = torch.randn(pages, 8, 16, 128, device="cuda").bfloat16()
            v = torch.randn_like(k)
            q = torch.randn(len(lens), 32, 128, device="cuda").bfloat16()
            wrapper = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
            wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, tactic=tactic,
                         deterministic=False)  # fmt: skip
            first = wrapper.run(q, (k, v)).clone()
            differ = [int((wrapper.run(q, (k, v)) != first).sum()) for _ in range(20)]
            print(f"cfg{cfg} {name:20} nondet runs {sum(x > 0 for x in differ):2}/20 max {max(differ)}")


if __name__ == "__main__":
    main()
