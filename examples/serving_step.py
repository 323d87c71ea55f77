"""A serving engine's attention step with tactix: plan once per batch, run once per layer.

    python examples/serving_step.py [--device cuda] [--layers 4] [--tune-into /tmp/tactix-store]

One KV cache tensor per layer ([pages, 2, kv_heads, page_size, head_dim], HND, as vLLM-style
engines keep it), page tables built by a tiny allocator, a mixed batch of new prompts planned
once with `PagedPrefill`, then decode steps planned once each with `PagedDecode` and run for
every layer. With --tune-into, the first pass tunes the shapes it meets and a second pass
replays the stored choices without measuring anything.
"""

from __future__ import annotations

import argparse

import torch

import tactix


class PageAllocator:
    """Hands out pages of a fixed pool and keeps each request's page list and length."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))
        self.page_size = page_size
        self.pages: list[list[int]] = []
        self.lengths: list[int] = []

    def add_request(self) -> int:
        self.pages.append([])
        self.lengths.append(0)
        return len(self.pages) - 1

    def grow(self, request: int, tokens: int) -> None:
        for _ in range(tokens):
            if self.lengths[request] % self.page_size == 0:
                self.pages[request].append(self.free.pop())
            self.lengths[request] += 1

    def metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, on the host (no device sync)."""
        indptr = [0]
        for p in self.pages:
            indptr.append(indptr[-1] + len(p))
        last = [(n - 1) % self.page_size + 1 for n in self.lengths]
        as_i32 = torch.int32
        flat = [i for p in self.pages for i in p]
        return torch.tensor(indptr, dtype=as_i32), torch.tensor(flat, dtype=as_i32), torch.tensor(last, dtype=as_i32)


def serve(device: torch.device, layers: int, decode_steps: int) -> dict[str, str]:
    heads, kv_heads, head_dim, page_size = 8, 2, 64, 16
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    alloc = PageAllocator(num_pages=256, page_size=page_size)
    caches = [torch.randn(256, 2, kv_heads, page_size, head_dim, device=device, dtype=dtype) for _ in range(layers)]
    prompts = [37, 120, 5]
    for n in prompts:
        alloc.grow(alloc.add_request(), n)

    prefill = tactix.PagedPrefill("HND", device=device)
    qo_indptr = torch.tensor([0, *torch.tensor(prompts).cumsum(0).tolist()], dtype=torch.int32)
    prefill.plan(qo_indptr, *alloc.metadata(), heads, kv_heads, head_dim, page_size, causal=True, q_data_type=dtype)
    tokens = int(qo_indptr[-1])
    out = torch.empty(tokens, heads, head_dim, device=device, dtype=dtype)
    for layer in range(layers):  # the model would write this layer's new K/V into caches[layer] first
        q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
        prefill.run(q, caches[layer], out=out)
    chosen = {"prefill": f"{prefill.backend} {prefill.tactic}"}

    decode = tactix.PagedDecode("HND", device=device)
    batch = len(prompts)
    out = torch.empty(batch, heads, head_dim, device=device, dtype=dtype)
    for _ in range(decode_steps):
        for request in range(batch):
            alloc.grow(request, 1)
        decode.plan(*alloc.metadata(), heads, kv_heads, head_dim, page_size, q_data_type=dtype)
        for layer in range(layers):
            decode.run(torch.randn(batch, heads, head_dim, device=device, dtype=dtype), caches[layer], out=out)
    chosen["decode"] = f"{decode.backend} {decode.tactic}"
    assert bool(torch.isfinite(out).all())
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--tune-into", metavar="DIR", help="tune into this store, then replay from it")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tune_into:
        policy = tactix.MeasurementPolicy(warmup=1, repeat=5)
        with tactix.autotune(mode="tune", cache_dir=args.tune_into, policy=policy):
            tuned = serve(device, args.layers, args.decode_steps)
        tactix.reset_stats()
        with tactix.autotune(mode="replay", cache_dir=args.tune_into, policy=policy):
            replayed = serve(device, args.layers, args.decode_steps)
        print("tuned:   ", tuned)
        print("replayed:", replayed, tactix.stats())
    else:
        print(serve(device, args.layers, args.decode_steps))


if __name__ == "__main__":
    main()
