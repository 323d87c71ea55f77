"""``tactix demo``: one Llama-like serving step through ``auto``, checked against float64.

A ragged prefill batch writes its keys and values into a paged cache and attends causally;
then several decode steps append one token per request (taking a new page when the last one
fills) and attend over the grown cache; every step runs the layer's GEMMs (QKV projection,
output projection, gate/up and down MLP projections). Each op's result is compared with the
float64 oracle on the same inputs, and the table names the backend and tactic that served it.
(Normalisation and rotary embeddings are left out: they are not tactix's kernels.)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from tactix.attention import PagedDecode, PagedPrefill
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import measure, measure_with_policy
from tactix.errors import InvalidArgumentError
from tactix.gemm import Gemm
from tactix.testing.oracle import attention_reference, gemm_reference, relative_error, tolerance_for

__all__ = ["DemoConfig", "DemoRow", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    hidden: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    page_size: int
    prefill_lens: tuple[int, ...]
    decode_steps: int
    dtype: torch.dtype
    kv_layout: str = "HND"

    @classmethod
    def for_device(cls, device: torch.device, decode_steps: int) -> DemoConfig:
        if device.type == "cuda":  # one Llama-3-8B layer, a mixed batch of prompts
            return cls(4096, 32, 8, 128, 14336, 16, (512, 1000, 37, 2048), decode_steps, torch.bfloat16)
        return cls(512, 8, 2, 64, 1024, 16, (37, 1, 64, 100), decode_steps, torch.bfloat16)


@dataclass
class DemoRow:
    step: str
    op: str
    shape: str
    backend: str
    tactic: str
    time_us: float
    error: float
    tolerance: float
    graph_us: float | None = None
    """The same call replayed from a CUDA graph (kernel time, no host cost); None on the CPU or
    where the call does not capture."""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    @property
    def eager_over_graph(self) -> float | None:
        """``time_us / graph_us``: what calling eagerly costs over a graph replay (host cost that a
        graph hides, where it is larger than the kernel)."""
        return self.time_us / self.graph_us if self.graph_us else None


class _PagedCache:
    """A paged KV cache that hands out pages in a shuffled order, as a long-running server would."""

    def __init__(self, cfg: DemoConfig, num_pages: int, device: torch.device, gen: torch.Generator) -> None:
        self.cfg = cfg
        shape = (
            (num_pages, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
            if cfg.kv_layout == "HND"
            else (num_pages, cfg.page_size, cfg.num_kv_heads, cfg.head_dim)
        )
        self.k = torch.randn(shape, generator=gen, device="cpu").to(device, cfg.dtype)  # stale data everywhere
        self.v = torch.randn(shape, generator=gen, device="cpu").to(device, cfg.dtype)
        self.free = torch.randperm(num_pages, generator=gen).tolist()
        self.pages: list[list[int]] = []
        self.lengths: list[int] = []

    def append(self, request: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[tokens, kv_heads, dim]`` after the request's current tokens."""
        if request == len(self.pages):
            self.pages.append([])
            self.lengths.append(0)
        s = self.cfg.page_size
        for t in range(k.shape[0]):
            pos = self.lengths[request]
            if pos % s == 0:
                self.pages[request].append(self.free.pop())
            page, slot = self.pages[request][pos // s], pos % s
            if self.cfg.kv_layout == "HND":
                self.k[page, :, slot] = k[t]
                self.v[page, :, slot] = v[t]
            else:
                self.k[page, slot] = k[t]
                self.v[page, slot] = v[t]
            self.lengths[request] = pos + 1

    def metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CSR metadata on the host (so planning needs no device sync)."""
        indptr = [0]
        for p in self.pages:
            indptr.append(indptr[-1] + len(p))
        indices = [i for p in self.pages for i in p]
        s = self.cfg.page_size
        last = [(n - 1) % s + 1 for n in self.lengths]
        return (
            torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32),
        )


EAGER_OVER_GRAPH_TARGET = 1.25
"""Issue 25's bound for a decode step's ops: eager time at most this much over the graph replay's."""
_GRAPH_POLICY = MeasurementPolicy(warmup=3, warmup_ms=2, repeat=20, cold_l2=False, execution="cuda_graph",
                                  settle_blocks=1)  # fmt: skip
"""Graph replays as the eager blocks are timed: warm L2, the GPU kept busy for 2 ms first (an H100's
5-replay medians of one op spread 18-37 us between decode steps), the median of 20."""


EAGER_CALLS: Final = 20
"""Calls per timed block of an eager op on a GPU (`_time_us`)."""
EAGER_BLOCKS: Final = 5


def _time_us(fn: Any, device: torch.device) -> tuple[float, float | None]:
    """Eager time per call of ``fn`` and, on a GPU, of its replay from a CUDA graph (None where it
    does not capture), in microseconds.

    Eager, on a GPU: blocks of `EAGER_CALLS` calls back to back, as a step enqueues its ops, with one
    pair of CUDA events around each block; the time per call is the median block's over the calls.
    That is what an eager step pays per op once its stream is busy: the kernel when the host
    enqueues faster than the GPU runs, the host cost when it does not. (An event pair around each
    call, as before, reads host latency plus kernel whenever the GPU drains between calls: 27 us on
    an H100 for a GEMM whose run() host cost is 12 us and kernel 16 us.) On the CPU: the median of
    5 calls, wall clock.
    """
    if device.type != "cuda":
        return measure(fn, device, warmup=1, repeat=5).median * 1e6, None
    for _ in range(EAGER_CALLS):  # one untimed block: kernels loaded, caches and clocks warm
        fn()
    new_event = torch.cuda.Event
    blocks = [(new_event(enable_timing=True), new_event(enable_timing=True)) for _ in range(EAGER_BLOCKS)]  # type: ignore[no-untyped-call]
    for start, end in blocks:
        start.record()
        for _ in range(EAGER_CALLS):
            fn()
        end.record()
    torch.cuda.synchronize(device)
    eager = statistics.median(start.elapsed_time(end) for start, end in blocks) * 1e3 / EAGER_CALLS
    replay = measure_with_policy(fn, device, _GRAPH_POLICY)
    return eager, replay.median * 1e6 if replay.timed_as == "cuda_graph" else None


def run_demo(device: torch.device, decode_steps: int = 3, seed: int = 0) -> list[DemoRow]:
    if decode_steps < 0:
        raise InvalidArgumentError("decode_steps", "an integer >= 0", decode_steps)
    cfg = DemoConfig.for_device(device, decode_steps)
    gen = torch.Generator().manual_seed(seed)
    rows: list[DemoRow] = []
    d, hq, hkv = cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads
    qkv_out = (hq + 2 * hkv) * d

    def weight(n: int, k: int) -> torch.Tensor:  # nn.Linear layout [n, k], used as b = w.t()
        return (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device, cfg.dtype)

    w_qkv, w_o = weight(qkv_out, cfg.hidden), weight(cfg.hidden, hq * d)
    w_gate_up, w_down = weight(2 * cfg.intermediate, cfg.hidden), weight(cfg.hidden, cfg.intermediate)
    max_len = max(cfg.prefill_lens) + decode_steps
    pages_needed = sum(-(-(n + decode_steps) // cfg.page_size) for n in cfg.prefill_lens)
    cache = _PagedCache(cfg, pages_needed + 16, device, gen)
    gemms: dict[tuple[int, int, int], Gemm] = {}

    def linear(step: str, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        g = gemms.get((m, n, k))
        if g is None:
            g = gemms[(m, n, k)] = Gemm(device=device)
            g.plan(m, n, k, a_dtype=cfg.dtype)
        y = g.run(x, w.t())
        err = relative_error(y, gemm_reference(x, w.t()))
        t, graph_t = _time_us(lambda: g.run(x, w.t(), out=y), device)
        rows.append(
            DemoRow(
                step,
                f"gemm {name}",
                f"m{m} n{n} k{k}",
                g.backend,
                str(g.tactic),
                t,
                err,
                tolerance_for(cfg.dtype),
                graph_t,
            )
        )
        return y

    def layer(step: str, x: torch.Tensor, attend: Any) -> None:
        qkv = linear(step, "qkv", x, w_qkv)
        q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
        attn = attend(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d))
        h = linear(step, "o", attn.reshape(-1, hq * d), w_o)
        gate, up = linear(step, "gate_up", h, w_gate_up).chunk(2, dim=-1)
        linear(step, "down", (torch.nn.functional.silu(gate.float()) * up.float()).to(cfg.dtype), w_down)

    def check_attention(
        step: str, op: str, wrapper: Any, q: torch.Tensor, qo_indptr: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        out = wrapper.run(q, (cache.k, cache.v))
        kv_indptr, kv_indices, last = cache.metadata()
        ref, _ = attention_reference(
            q,
            cache.k,
            cache.v,
            qo_indptr,
            kv_indptr,
            kv_indices,
            last,
            kv_layout=cfg.kv_layout,
            causal=causal,
            sm_scale=1 / math.sqrt(d),
        )
        err = relative_error(out, ref)
        t, graph_t = _time_us(lambda: wrapper.run(q, (cache.k, cache.v), out=out), device)
        shape = f"b{len(cache.lengths)} q{q.shape[0]} kv<={max(cache.lengths)} h{hq}/{hkv} d{d}"
        rows.append(DemoRow(step, op, shape, wrapper.backend, str(wrapper.tactic), t, err, tolerance_for(cfg.dtype),
                            graph_t))  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out

    # prefill: a ragged batch of fresh prompts
    lens = cfg.prefill_lens
    qo_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lens), cfg.hidden, generator=gen).to(device, cfg.dtype)
    prefill = PagedPrefill(cfg.kv_layout, device=device)  # type: ignore[arg-type]

    def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for r, (lo, hi) in enumerate(zip(qo_indptr[:-1].tolist(), qo_indptr[1:].tolist(), strict=True)):
            cache.append(r, k[lo:hi], v[lo:hi])
        kv_indptr, kv_indices, last = cache.metadata()
        prefill.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last,
            hq,
            hkv,
            d,
            cfg.page_size,
            causal=True,
            q_data_type=cfg.dtype,
        )
        return check_attention("prefill", "prefill attention", prefill, q, qo_indptr, causal=True)

    layer("prefill", x, prefill_attention)

    decode = PagedDecode(cfg.kv_layout, device=device)  # type: ignore[arg-type]
    batch = len(lens)
    for step in range(decode_steps):
        x = torch.randn(batch, cfg.hidden, generator=gen).to(device, cfg.dtype)

        def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: int = step) -> torch.Tensor:
            for r in range(batch):
                cache.append(r, k[r : r + 1], v[r : r + 1])
            kv_indptr, kv_indices, last = cache.metadata()
            decode.plan(kv_indptr, kv_indices, last, hq, hkv, d, cfg.page_size, q_data_type=cfg.dtype)
            return check_attention(
                f"decode {step + 1}",
                "decode attention",
                decode,
                q,
                torch.arange(batch + 1, dtype=torch.int32),
                causal=False,
            )

        layer(f"decode {step + 1}", x, decode_attention)
    assert max(cache.lengths) == max_len
    return rows


def format_rows(rows: list[DemoRow], device: torch.device) -> str:
    header = ("step", "op", "shape", "backend", "tactic", "time", "graph", "eager/graph", "rel. error", "tolerance",
              "check")  # fmt: skip
    table = [header] + [
        (
            r.step,
            r.op,
            r.shape,
            r.backend,
            r.tactic,
            f"{r.time_us:,.1f} us",
            f"{r.graph_us:,.1f} us" if r.graph_us else "-",
            f"{r.eager_over_graph:.2f}" if r.eager_over_graph else "-",
            f"{r.error:.2e}",
            f"{r.tolerance:.0e}",
            "ok" if r.ok else "FAIL",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    bad = sum(not r.ok for r in rows)
    timer = "CUDA events" if device.type == "cuda" else "wall clock"
    lines.append("")
    lines.append(
        f"{len(rows) - bad}/{len(rows)} ops within tolerance of the float64 oracle on {device} "
        + (
            f"(times: {timer}; eager: {EAGER_CALLS} calls back to back per block, median of {EAGER_BLOCKS} "
            "blocks; graph: median of 20 replays)"
            if device.type == "cuda"
            else f"(times: median of 5, {timer})"
        )
    )
    decode = [r for r in rows if r.step.startswith("decode") and r.eager_over_graph]
    if decode:
        within = sum(r.eager_over_graph <= EAGER_OVER_GRAPH_TARGET for r in decode if r.eager_over_graph)
        lines.append(f"{within}/{len(decode)} decode-step ops within {EAGER_OVER_GRAPH_TARGET}x of their CUDA-graph "
                     "replay when called eagerly")  # fmt: skip
    return "\n".join(lines)


def rows_report(rows: list[DemoRow], device: torch.device) -> dict[str, Any]:
    """The rows as the JSON of ``tactix demo --json``."""
    return {"device": str(device),
            "rows": [asdict(r) | {"ok": r.ok, "eager_over_graph": r.eager_over_graph} for r in rows]}  # fmt: skip
