"""A tensor-parallel serving step with tactix: one Llama-like layer split over the ranks of a
`torch.distributed` group, tuned rank-consistently into one shared store, then replayed.

    torchrun --nproc-per-node 2 examples/tensor_parallel_step.py [--store DIR] [--decode-steps N] [--json PATH]

On GPUs each rank takes the GPU of its ``LOCAL_RANK`` and the group is NCCL; with ``--device
cpu`` (or no GPU) the group is gloo on the CPU and the torch backend serves (what CI runs). Rank
``r`` of ``W`` holds query heads ``[r H/W, (r+1) H/W)`` with their KV heads and a paged KV cache
of those heads, and MLP columns ``[r I/W, (r+1) I/W)``: the QKV and gate/up projections are
column-parallel, the output and down projections row-parallel, each followed by an all-reduce
(Megatron-style). Every GEMM and attention is planned through tactix's ``auto``.

The same step (a prefill of a mixed batch of prompts, then decode steps that append one token
per request) runs three times from the same inputs:

1. untuned: ``auto`` from an empty store (the untuned order), timed;
2. tune: ``tactix.autotune(mode="tune", cache_dir=STORE, process_group=group)``: rank 0 measures
   each problem's candidates and every rank plans rank 0's choice (ranks that chose differently
   would run different kernels around the same collective);
3. replay: ``mode="replay"`` on the same store: nothing is measured; timed.

Checks, on every rank: each step's output (the hidden states after the last all-reduce) against
a single-process float64 reference of the whole layer; every rank's ``(backend, tactic)`` per op
and the bytes of its store entries equal rank 0's. Rank 0 prints one JSON line: the choices, the
errors, the time per decode step untuned and tuned, and whether the ranks agreed. The exit status
is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import tactix
from tactix.testing import relative_error, tolerance_for


@dataclass(frozen=True)
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    page_size: int
    prompts: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def for_device(cls, device: torch.device) -> Shapes:
        if device.type == "cuda":  # a Llama-3-8B layer
            return cls(4096, 32, 8, 128, 14336, 16, (512, 1000, 37, 2048), torch.bfloat16)
        return cls(256, 8, 4, 32, 512, 16, (37, 1, 64, 20), torch.float32)


@dataclass(frozen=True)
class Weights:
    """The whole layer's weights (nn.Linear layout ``[out, in]``), the same on every rank (one seed)."""

    qkv: torch.Tensor  # [(H + 2 Hkv) d, hidden]: q heads, then k heads, then v heads
    o: torch.Tensor  # [hidden, H d]
    gate_up: torch.Tensor  # [2 I, hidden]: gate rows, then up rows
    down: torch.Tensor  # [hidden, I]

    @classmethod
    def make(cls, s: Shapes, seed: int) -> Weights:
        gen = torch.Generator().manual_seed(seed)

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)

        d = s.head_dim
        return cls(w((s.heads + 2 * s.kv_heads) * d, s.hidden), w(s.hidden, s.heads * d),
                   w(2 * s.intermediate, s.hidden), w(s.hidden, s.intermediate))  # fmt: skip

    def shard(self, s: Shapes, rank: int, world: int, device: torch.device) -> Weights:
        """Rank ``rank``'s part: its heads' rows of qkv and columns of o, its MLP columns."""
        d, hq, hkv, inter = s.head_dim, s.heads // world, s.kv_heads // world, s.intermediate // world
        q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
        k_rows = slice(s.heads * d + rank * hkv * d, s.heads * d + (rank + 1) * hkv * d)
        v_rows = slice((s.heads + s.kv_heads) * d + rank * hkv * d, (s.heads + s.kv_heads) * d + (rank + 1) * hkv * d)
        cols = slice(rank * inter, (rank + 1) * inter)
        qkv = torch.cat([self.qkv[q_rows], self.qkv[k_rows], self.qkv[v_rows]])
        gate_up = torch.cat([self.gate_up[cols], self.gate_up[s.intermediate :][cols]])

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, s.dtype).contiguous()

        return Weights(put(qkv), put(self.o[:, q_rows]), put(gate_up), put(self.down[:, cols]))


def inputs(s: Shapes, decode_steps: int, seed: int) -> list[torch.Tensor]:
    """The hidden states entering the layer at each step: the prompts' tokens, then one token per request."""
    gen = torch.Generator().manual_seed(seed + 1)
    steps = [torch.randn(sum(s.prompts), s.hidden, generator=gen, dtype=torch.float64)]
    steps += [torch.randn(len(s.prompts), s.hidden, generator=gen, dtype=torch.float64) for _ in range(decode_steps)]
    return steps


def reference(s: Shapes, w: Weights, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole layer in float64 on one process, keys and values kept per request."""
    d, hq, hkv = s.head_dim, s.heads, s.kv_heads
    keys: list[list[torch.Tensor]] = [[] for _ in s.prompts]
    values: list[list[torch.Tensor]] = [[] for _ in s.prompts]
    outs = []
    for step, x in enumerate(xs):
        rows = list(s.prompts) if step == 0 else [1] * len(s.prompts)
        q, k, v = torch.split(x @ w.qkv.T, [hq * d, hkv * d, hkv * d], dim=-1)
        attn = torch.empty(x.shape[0], hq, d, dtype=torch.float64)
        at = 0
        for r, n in enumerate(rows):
            keys[r].append(k[at : at + n].reshape(n, hkv, d))
            values[r].append(v[at : at + n].reshape(n, hkv, d))
            kr, vr = torch.cat(keys[r]), torch.cat(values[r])  # [kv, hkv, d]
            qr = q[at : at + n].reshape(n, hq, d)
            group = hq // hkv
            logits = torch.einsum("qhd,khd->hqk", qr, kr.repeat_interleave(group, dim=1)) / math.sqrt(d)
            kv = kr.shape[0]
            causal = torch.arange(kv)[None, :] <= (kv - n + torch.arange(n))[:, None]  # rows end at the last key
            logits = logits.masked_fill(~causal, -math.inf)
            attn[at : at + n] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vr.repeat_interleave(group, dim=1))
            at += n
        h = x + attn.reshape(x.shape[0], hq * d) @ w.o.T
        gate, up = (h @ w.gate_up.T).chunk(2, dim=-1)
        outs.append(h + (torch.nn.functional.silu(gate) * up) @ w.down.T)
    return outs


class PagedCache:
    """One rank's paged KV cache (HND), pages handed out in a fixed shuffled order (the same on every rank)."""

    def __init__(self, s: Shapes, heads: int, steps: int, device: torch.device) -> None:
        self.s = s
        pages = sum(-(-(n + steps) // s.page_size) for n in s.prompts) + 8
        self.k = torch.zeros(pages, heads, s.page_size, s.head_dim, device=device, dtype=s.dtype)
        self.v = torch.zeros_like(self.k)
        self.free = torch.randperm(pages, generator=torch.Generator().manual_seed(7)).tolist()
        self.pages: list[list[int]] = [[] for _ in s.prompts]
        self.lengths = [0] * len(s.prompts)

    def append(self, request: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for t in range(k.shape[0]):
            pos = self.lengths[request]
            if pos % self.s.page_size == 0:
                self.pages[request].append(self.free.pop())
            page, slot = self.pages[request][pos // self.s.page_size], pos % self.s.page_size
            self.k[page, :, slot] = k[t]
            self.v[page, :, slot] = v[t]
            self.lengths[request] = pos + 1

    def metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        indptr = [0]
        for p in self.pages:
            indptr.append(indptr[-1] + len(p))
        last = [(n - 1) % self.s.page_size + 1 for n in self.lengths]
        i32 = torch.int32
        flat = [i for p in self.pages for i in p]
        return torch.tensor(indptr, dtype=i32), torch.tensor(flat, dtype=i32), torch.tensor(last, dtype=i32)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(s: Shapes, w: Weights, xs: list[torch.Tensor], rank: int, world: int, device: torch.device,
             group: Any) -> tuple[list[torch.Tensor], dict[str, str], list[float]]:  # fmt: skip
    """The layer over every step, on this rank's shard: the outputs, each op's ``backend tactic``
    and each decode step's wall time (plan and layer, synchronised)."""
    d, hq, hkv = s.head_dim, s.heads // world, s.kv_heads // world
    cache = PagedCache(s, hkv, len(xs) - 1, device)
    gemms: dict[tuple[str, int], tactix.Gemm] = {}
    chosen: dict[str, str] = {}

    def linear(name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        g = gemms.get((name, x.shape[0]))
        if g is None:
            g = gemms[(name, x.shape[0])] = tactix.Gemm(device=device)
            g.plan(x.shape[0], weight.shape[0], x.shape[1], a_dtype=s.dtype)
            chosen[f"gemm {name} m{x.shape[0]}"] = f"{g.backend} {g.tactic}"
        return g.run(x, weight.t())

    Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    def layer(x: torch.Tensor, attend: Attend) -> torch.Tensor:
        q, k, v = torch.split(linear("qkv", x, w.qkv), [hq * d, hkv * d, hkv * d], dim=-1)
        attn = attend(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d))
        h = linear("o", attn.reshape(-1, hq * d), w.o)
        dist.all_reduce(h, group=group)
        h = h + x
        gate, up = linear("gate_up", h, w.gate_up).chunk(2, dim=-1)
        y = linear("down", (torch.nn.functional.silu(gate.float()) * up.float()).to(s.dtype), w.down)
        dist.all_reduce(y, group=group)
        return y + h

    outs: list[torch.Tensor] = []
    times: list[float] = []
    prefill = tactix.PagedPrefill("HND", device=device)
    lens = s.prompts
    qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for r, (lo, hi) in enumerate(zip(qo[:-1].tolist(), qo[1:].tolist(), strict=True)):
            cache.append(r, k[lo:hi], v[lo:hi])
        prefill.plan(qo, *cache.metadata(), hq, hkv, d, s.page_size, causal=True, q_data_type=s.dtype)
        chosen["prefill attention"] = f"{prefill.backend} {prefill.tactic}"
        out = prefill.run(q, (cache.k, cache.v))
        assert isinstance(out, torch.Tensor)  # (no return_lse: the output alone)
        return out

    outs.append(layer(xs[0].to(device, s.dtype), prefill_attention))
    decode = tactix.PagedDecode("HND", device=device)
    batch = len(lens)

    def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for r in range(batch):
            cache.append(r, k[r : r + 1], v[r : r + 1])
        decode.plan(*cache.metadata(), hq, hkv, d, s.page_size, q_data_type=s.dtype)
        chosen["decode attention"] = f"{decode.backend} {decode.tactic}"
        out = decode.run(q, (cache.k, cache.v))
        assert isinstance(out, torch.Tensor)
        return out

    for x in xs[1:]:
        x_dev = x.to(device, s.dtype)
        sync(device)
        start = time.perf_counter()
        outs.append(layer(x_dev, decode_attention))
        sync(device)
        times.append(time.perf_counter() - start)
    return outs, chosen, times


def store_digest(state: Any) -> str:
    """A digest of the bytes of every entry in a rank's view of the store."""
    texts = sorted(e.to_json() for e in state.store.entries())
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when GPUs are visible")
    p.add_argument("--store", help="the shared tactic store (default: a new temporary folder on rank 0's host)")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a rank waits for another at each exchange")
    p.add_argument("--json", help="also write rank 0's summary here")
    args = p.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=dt.timedelta(seconds=args.timeout))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        summary = serve(args, device, group, rank, world)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        text = json.dumps(summary)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if summary["ok"] else 1


def serve(args: argparse.Namespace, device: torch.device, group: Any, rank: int, world: int) -> dict[str, Any]:
    s = Shapes.for_device(device)
    if s.kv_heads % world or s.intermediate % world:
        raise SystemExit(f"{world} ranks do not divide {s.kv_heads} KV heads and {s.intermediate} MLP columns")
    full = Weights.make(s, args.seed)
    w = full.shard(s, rank, world, device)
    xs = inputs(s, args.decode_steps, args.seed)
    ref = reference(s, full, xs)
    store = [args.store or (tempfile.mkdtemp(prefix="tactix-tp-store-") if rank == 0 else None)]
    dist.broadcast_object_list(store, src=0, group=group)  # one shared store: rank 0's folder
    policy = tactix.MeasurementPolicy(warmup=2, repeat=10) if device.type == "cpu" else None

    with tactix.autotune(mode="off", cache_dir=tempfile.mkdtemp(prefix="tactix-tp-empty-")):
        untuned_out, untuned, untuned_times = run_step(s, w, xs, rank, world, device, group)
    with tactix.autotune(mode="tune", cache_dir=store[0], policy=policy, process_group=group,
                         timeout=args.timeout) as state:  # fmt: skip
        run_step(s, w, xs, rank, world, device, group)
        digest = store_digest(state)
    tactix.reset_stats()
    with tactix.autotune(mode="replay", cache_dir=store[0], policy=policy, process_group=group, timeout=args.timeout):
        tuned_out, tuned, tuned_times = run_step(s, w, xs, rank, world, device, group)
    measured = tactix.stats()["timer_calls"]

    tolerance = tolerance_for(s.dtype)
    errors = {
        "untuned": max(relative_error(o, r) for o, r in zip(untuned_out, ref, strict=True)),
        "tuned": max(relative_error(o, r) for o, r in zip(tuned_out, ref, strict=True)),
    }
    mine = {"choices": tuned, "digest": digest, "errors": errors, "measured_in_replay": measured}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    same_choices = all(e["choices"] == every[0]["choices"] for e in every)
    same_store = all(e["digest"] == every[0]["digest"] for e in every)
    within = all(max(e["errors"].values()) <= tolerance for e in every)
    replay_quiet = all(e["measured_in_replay"] == 0 for e in every)
    return {
        "ranks": world,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "backend": dist.get_backend(group),
        "store": store[0],
        "untuned": untuned,
        "tuned": tuned,
        "same_choices_on_every_rank": same_choices,
        "same_store_bytes_on_every_rank": same_store,
        "errors_by_rank": [e["errors"] for e in every],
        "tolerance": tolerance,
        "nothing_measured_in_replay": replay_quiet,
        "decode_step_ms": {
            "untuned": 1e3 * statistics.median(untuned_times),
            "tuned": 1e3 * statistics.median(tuned_times),
        },
        "ok": same_choices and same_store and within and replay_quiet,
    }


if __name__ == "__main__":
    sys.exit(main())
