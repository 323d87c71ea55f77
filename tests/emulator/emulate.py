"""Build the cuda_native kernel sources for the CPU emulation (tx_emulate.h) with g++ and run them.

The same ``kernels/*.cu`` text the GPU runs, compiled with ``-DTX_EMULATE`` and the same ``-D``
parameters as a `runtime.Variant`, into a shared library per variant (cached under the
system's temporary directory, keyed by the sources' hash). Inputs are CPU tensors; the host
metadata comes from the plugin's own functions (`prefill.prefill_work`, `prefill.prefill_lists`,
`prefill.prefill_scalars`; for decode `DecodePlan` repeats `decode.CudaNativeDecodePlan` step by
step with the functions of `tactix_cuda_native.decode`), so what runs here is the plan's data as well
as the kernel's code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from tactix import PagedBatch
from tactix.ops import DecodeProblem, PrefillProblem
from tactix.problems import bucket_size

HERE = Path(__file__).resolve().parent


def available() -> str | None:
    """None if g++ is here, else why not."""
    return None if shutil.which("g++") else "g++ is not installed"


@functools.cache
def _library(source: str, defines: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
    from tactix_cuda_native import runtime

    kernels = runtime.KERNEL_DIR
    text = "".join(p.read_text() for p in sorted(kernels.iterdir()) if p.suffix in (".cu", ".cuh"))
    text += (HERE / "tx_emulate.h").read_text() + (HERE / source).read_text()
    key = hashlib.sha256((text + repr(defines)).encode()).hexdigest()[:24]
    out = Path(tempfile.gettempdir()) / "tactix-emulator" / f"{Path(source).stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")  # pytest-xdist workers may build the same library at once
        cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-include", str(HERE / "tx_emulate.h"),
               "-I", str(kernels), *(f"-D{k}={v}" for k, v in defines), str(HERE / source), "-o", str(tmp)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"g++ failed for {source} {defines}:\n{done.stderr[-4000:]}")
        tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    for name in ("emu_prefill", "emu_decode", "emu_gemm"):  # (emu_fp8_convert returns nothing)
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_char_p
    return lib


def _args(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, float):
            out.append(ctypes.c_double(v))
        elif isinstance(v, torch.Tensor):
            out.append(ctypes.c_void_p(v.data_ptr() if v.numel() else 0))
        elif v is None:
            out.append(ctypes.c_void_p(0))
        else:
            out.append(ctypes.c_longlong(int(v)))
    return out


Scale = float | torch.Tensor | None  # a dequantization scale as run() takes it


def run_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *, return_lse: bool, schedule: Schedule | None = None, persistent: int = 0,
                capacity: int = 0, k_scale: Scale = None, v_scale: Scale = None,
                sinks: torch.Tensor | None = None, kv_tma: bool = False,
                head_section: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
    """The prefill kernel on the emulation: (out, lse or None, the work list). ``k_scale``,
    ``v_scale`` and ``sinks``: as the plan's run passes them (`paged.scale_args`; a CPU tensor's
    address is the pointer); an fp8 ``k``/``v`` selects the fp8 variant, as the plan's kv dtype does.

    Launched as `prefill.CudaNativePrefillPlan` launches it: ``params.threads`` threads (for mma
    "wgmma" the consumer warpgroups and the producer warpgroup) and ``params.smem_bytes`` of
    dynamic shared memory (the bound the emulation checks); ``schedule``: how its CTAs run (one
    at a time in grid order by default). With ``persist`` in the tactic the grid is
    `prefill.prefill_grid` for ``persistent`` CTAs at once (the plan asks the driver; 0 here:
    the H200's estimate, `prefill.prefill_persistent_ctas`), so pass a small count to have
    each CTA loop over several items. ``capacity``: the item capacity of a CUDA-graph plan (the
    grid's size; the item list is padded to it with records that must never be read). ``kv_tma``:
    the ragged plan's tensor-map loads (``TX_KV_TMA``; ``k`` and ``v`` one-token pages of packed
    tensors, the batch's table the identity), maps of ``k[:, 0]`` and ``v[:, 0]`` as
    `prefill.CudaNativePrefillPlan._ragged_map` encodes them. ``head_section``: head groups per
    section of the grid (`prefill.prefill_head_section`; 0: one section, heads fastest)."""
    from tactix_cuda_native import device, paged, prefill

    masked = bool(getattr(problem, "custom_mask", False))
    params = (
        prefill.default_params_for(problem, device.H200)
        if tactic.is_default
        else prefill.PrefillParams.from_tactic(tactic)
    )
    d, dims = prefill.kernel_dims(problem, params)
    variant = prefill.prefill_variant(problem.q_dtype, d, params, "sm_90", masked, problem.kv_dtype, dims, kv_tma)
    runner = "emu_prefill_sm90.cpp" if variant.source == "prefill_sm90.cu" else "emu_prefill.cpp"
    lib = _library(runner, variant.defines)
    pack = prefill.prefill_pack(problem.gqa_ratio, params.q_tile, params.pack)
    work = prefill.prefill_work(batch.qo_lens_list, batch.kv_lens_list, q_tile=params.q_tile,
                                kv_tile=params.kv_tile, pack=pack, causal=problem.causal,
                                window_left=problem.window_left, sched=params.sched)  # fmt: skip
    items, reqs = prefill.prefill_lists(batch, work)
    i32 = torch.int32
    cap = max(capacity, len(work.items))
    # padding past the real items: a record read by mistake points far outside every buffer
    items_t = torch.tensor((items + [1 << 30, 1 << 30] * (cap - len(work.items))) or [0, 0], dtype=i32)
    num_items = torch.tensor([len(work.items)], dtype=i32)
    reqs_t = torch.tensor(reqs, dtype=i32)
    # (the tensor-map kernel gets no page table, as the plan sends none: a read of it would fault)
    indices = None if kv_tma else batch.kv_indices.to(i32).contiguous()
    strides = paged.cache_strides(problem.kv_layout, k, v)
    rows = q.shape[0]
    out = torch.full((rows, problem.num_qo_heads, problem.head_dim_vo), float("nan"), dtype=q.dtype)
    lse = torch.full((rows, problem.num_qo_heads), float("nan"), dtype=torch.float32) if return_lse else None
    smem = params.smem_bytes(d, 1 if problem.kv_dtype in paged.FP8_KV_DTYPES else 2, dims[1] if dims else None)
    if params.persist and not persistent:
        persistent = prefill.prefill_persistent_ctas(device.H200, device.ctas_per_sm(device.H200, smem, params.threads))
    grid = prefill.prefill_grid(cap, problem.num_qo_heads, pack, persistent if params.persist else 0)[0]
    args = _args([q, q.stride(0), q.stride(1), k, v, *strides, out, lse, items_t, num_items, reqs_t, indices,
                  *prefill.prefill_scalars(problem, pack, head_section), *paged.scale_args(k_scale, v_scale),
                  0 if sinks is None else sinks.data_ptr()])  # fmt: skip
    if kv_tma:  # the plan's maps (boxes of 64 of dim x 1 head x kv_tile tokens), first
        box = (params.kv_tile, 1, 64)
        maps = (tensor_map(k.select(1, 0), box), tensor_map(v.select(1, 0), box))  # alive until the launch is done
        args = [ctypes.byref(maps[0]), ctypes.byref(maps[1]), *args]
    if masked:  # the bytes and per-request offsets the plan gives the kernel (`prefill.prefill_mask`)
        mask = prefill.prefill_mask(batch, torch.device("cpu"), None, graph=False)
        offsets = torch.tensor(batch.custom_mask.offsets[:-1] or [0], dtype=i32)
        args += _args([mask.view(torch.uint8), offsets])
    turns = torch.zeros(2, dtype=i32)  # sched 3: the turn counters, as the plan sends them
    if params.dynamic:
        args += _args([turns])
    sched = (schedule or Schedule()).args()
    err = lib.emu_prefill(ctypes.c_uint(grid), ctypes.c_int(params.threads), ctypes.c_longlong(smem), *sched, *args)
    if err:
        raise RuntimeError(f"emulated kernel misuse: {err.decode()}")
    if turns.any():
        raise RuntimeError(f"the launch left its turn counters at {turns.tolist()}: the next one would skip work")
    return out, lse, work


@dataclass(frozen=True)
class Schedule:
    """How the emulation runs a grid's CTAs (tx_emulate.h, `txe::Schedule`).

    ``order``: the order CTAs start in (``grid``: x fastest, as the GPU dispatches them);
    ``resident``: CTAs in flight at once (their threads interleave at every synchronisation
    point, fence and atomic); ``seed``: 0 steps the resident CTAs in turn, otherwise picks the
    next one at random (and shuffles the ``shuffled`` order); ``park``: a CTA that has just done
    an atomic (drawn a ticket) waits while any other resident CTA can run.
    """

    order: Literal["grid", "reversed", "shuffled"] = "grid"
    resident: int = 1
    seed: int = 0
    park: bool = False

    def args(self) -> list[Any]:
        code = ("grid", "reversed", "shuffled").index(self.order)
        return [ctypes.c_int(self.resident), ctypes.c_int(code), ctypes.c_uint(self.seed), ctypes.c_int(self.park)]


# one CTA at a time in grid order, then backwards (a request's pieces are merged by the other end
# of the grid), then overlapping CTAs: in turn, at random from a shuffled start (tickets drawn in
# any order, merges early in the launch while other CTAs still run), and with every CTA held back
# right after its ticket (the last ticket drawn, and merged, before the others go on)
SCHEDULES: tuple[Schedule, ...] = (
    Schedule(),
    Schedule("reversed"),
    Schedule("grid", resident=8),
    Schedule("shuffled", resident=5, seed=1),
    Schedule("grid", resident=64, park=True),
    Schedule("shuffled", resident=64, seed=2, park=True),
)

_LOG2E = 1.4426950408889634


class DecodePlan:
    """`decode.CudaNativeDecodePlan` on the CPU, for the H200's geometry: the same steps with the
    same functions (parameters, chunk, work list, the packed metadata and its capacities, the
    workspace and the ticket counters, the grid), the GPU buffers being CPU tensors. What the
    GPU leaves undefined starts as NaN here (``torch.empty``: the partial outputs and LSEs).
    ``graph``: the CUDA-graph sizing (bucketed capacities, idle CTAs past the work list);
    ``previous``: a graph-mode re-plan writes into that plan's buffers, counters included."""

    packed: torch.Tensor  # all int32 metadata in one buffer (decode.decode_sections: the staging slot)
    part_o: torch.Tensor  # workspace: partial outputs of split requests
    part_lse: torch.Tensor
    counters: torch.Tensor  # one per request and (KV head, q tile); zero between launches

    def __init__(self, problem: DecodeProblem, batch: PagedBatch, tactic: Any, *, graph: bool = False,
                 previous: DecodePlan | None = None) -> None:  # fmt: skip
        from tactix_cuda_native import decode, device, paged

        info = device.H200
        self.problem = problem
        b, hq, hkv, d = batch.batch_size, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk
        gqa = problem.gqa_ratio
        units = decode.decode_units(hkv, gqa)
        ranges = decode.effective_lengths(batch.kv_lens_list, problem.window_left)
        longest_cap = bucket_size(batch.max_kv_len) if graph else batch.max_kv_len
        attended_cap = longest_cap if problem.window_left < 0 else min(longest_cap, problem.window_left + 1)
        lengths = [attended_cap] * b if graph else [e - s for s, e in ranges]
        if tactic.is_default:
            params = decode.default_decode_params(d, info, small=decode.decode_is_small(lengths, units, info),
                                                  fp8=problem.kv_dtype in decode.FP8_KV_DTYPES)  # fmt: skip
        else:
            params = decode.DecodeParams.from_tactic(tactic)
        self.params = params
        variant = decode.decode_variant(problem.q_dtype, d, params, info.arch, problem.kv_dtype)
        self.lib = _library("emu_decode.cpp", variant.defines)
        kv_bytes = 1 if problem.kv_dtype in paged.FP8_KV_DTYPES else 2
        self.smem = decode.decode_smem_bytes(d, params.tile, params.warps, params.stages, params.bulk, params.tma,
                                             kv_bytes, params.vreg)  # fmt: skip
        self.threads = 32 * params.warps
        slots = info.sms * device.ctas_per_sm(info, self.smem, self.threads)  # no driver here: the estimate
        chunk = params.kv_chunk or decode.decode_chunk(lengths, units, params.tile, slots)
        attended = [e - s for s, e in ranges] if graph else lengths
        recut = (units, slots, params.tile) if not graph and not params.kv_chunk else None
        self.on_device = decode.decode_plan_on_device(b, decode.host_plan_forced())
        work = None
        if not self.on_device:
            chunk, work = decode.decode_plan_work(ranges, lengths, units, slots, params, graph)
            items, slot_count = len(work.items), work.slots
        elif graph:
            items, slot_count = 0, 0
        else:
            items, slot_count = decode.decode_bounds(attended, chunk, units, slots, recut is not None)
        item_cap, slot_cap, page_cap = decode.decode_buffer_sizes(
            items, slot_count, batch.num_page_entries, graph=graph, batch=b, attended_cap=attended_cap,
            longest_cap=longest_cap, chunk=chunk, page_size=problem.page_size)  # fmt: skip
        if work is None:  # what the device plan makes (the plan's `work` property)
            work = decode.decode_work(ranges, chunk)
            if recut is not None:
                work = decode.decode_balance_tail(work, *recut)
            self.work = work
            work = None
        else:
            self.work = work
        self.recut = recut
        self.chunk = chunk
        self._geometry = (b, hq, hkv, d, problem.page_size, item_cap, slot_cap, page_cap, params)

        # the plan's layout and writer: what its staging buffer holds before the transfer
        host_indices = batch.indices_on_host
        copied = host_indices or graph
        layout = decode.decode_sections(item_cap, page_cap if copied else None, b if self.on_device else None)
        pieces: list[Any] = [decode.decode_items(work, batch.kv_indptr_list), [len(work.items)]] if work is not None \
            else [[], []]  # fmt: skip
        if self.on_device:
            pieces += [batch.kv_indptr_list, batch.kv_lens_list]
        if copied:
            pieces.append(batch.kv_indices if host_indices else [])
        host = torch.full((layout.total,), -1, dtype=torch.int32)  # every entry must be written
        layout.write(host.data_ptr(), pieces)
        where = {name: (o, n) for name, o, n in zip(layout.names, layout.offsets, layout.capacities, strict=True)}
        if self.on_device:  # the records, made by the device plan's kernel (after the transfer, in the slot)
            o = layout.offset("items")
            decode_plan_records(host[where["kv_indptr"][0] :], host[where["kv_lens"][0] :], host[o:],
                                host[where["num_items"][0] :], b, chunk, problem.window_left, recut)  # fmt: skip
        if graph and previous is not None:
            assert previous._geometry == self._geometry, "the plugin refuses this re-plan"
            previous.packed.copy_(host)
            self.packed = previous.packed
            self.part_o, self.part_lse, self.counters = previous.part_o, previous.part_lse, previous.counters
        else:
            self.packed = host
            self.part_o = torch.full((max(slot_cap, 1) * hq * d,), float("nan"), dtype=torch.float32)
            self.part_lse = torch.full((max(slot_cap, 1) * hq,), float("nan"), dtype=torch.float32)
            self.counters = torch.zeros(b * units, dtype=torch.int32)
        view = {name: self.packed[o : o + n] for name, (o, n) in where.items()}
        indices = view.get("indices", batch.kv_indices)
        self._buffers = (view["items"], view["num_items"], indices, self.part_o, self.part_lse, self.counters)
        shift = paged.log2_exact(problem.page_size)
        assert shift is not None
        self._scalars = (hq, gqa, decode.q_tiles(gqa), shift, problem.sm_scale * _LOG2E,
                         float(problem.logits_soft_cap))  # fmt: skip
        self.grid = decode.decode_grid(item_cap, hkv, gqa)
        # every CTA of the grid reads a whole item record, idle ones included (decode.cu)
        assert view["items"].numel() >= decode.DECODE_ITEM_INTS * item_cap

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            schedule: Schedule = SCHEDULES[0], k_scale: float | torch.Tensor | None = None,
            v_scale: float | torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """`decode.CudaNativeDecodePlan.run`: the same argument list, launched on the emulation (the
        scales as `paged.scale_args` passes them and the sinks: a CPU tensor's address is the pointer).

        The workspace is NaN again before each launch (on the GPU it holds the previous launch's
        partials, here identical ones): a partial read before its CTA wrote it in this launch shows.
        """
        from tactix_cuda_native import paged

        self.part_o.fill_(float("nan"))
        self.part_lse.fill_(float("nan"))

        strides = paged.cache_strides(self.problem.kv_layout, k, v)
        if not (q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0) or q.data_ptr() % 16:
            q = q.contiguous().clone()
        assert (k.data_ptr() | v.data_ptr() | out.data_ptr()) % 16 == 0
        kf, vf, kp, vp = paged.scale_args(k_scale, v_scale)
        args = _args([q, q.stride(0), q.stride(1), k, v, *strides, out, lse, *self._buffers, *self._scalars, kf, vf])
        args += [ctypes.c_void_p(kp or None), ctypes.c_void_p(vp or None),
                 ctypes.c_void_p(None if sinks is None else sinks.data_ptr())]  # fmt: skip
        if self.params.tma:  # the plan's maps: the caches as they are ([pages][heads][tokens][D], HND)
            box = (1, 1, self.params.bulk, 64)
            self._maps = (tensor_map(k, box), tensor_map(v, box))  # alive until the launch is done
            args = [ctypes.byref(self._maps[0]), ctypes.byref(self._maps[1]), *args]
        gx, gy, gz = self.grid
        err = self.lib.emu_decode(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz), ctypes.c_int(self.threads),
                                  ctypes.c_longlong(self.smem), *schedule.args(), *args)  # fmt: skip
        if err:
            raise RuntimeError(f"emulated kernel misuse: {err.decode()}")


def decode_plan_records(kv_indptr: torch.Tensor, kv_lens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
                        batch: int, chunk: int, window_left: int,
                        recut: tuple[int, int, int] | None = None) -> None:  # fmt: skip
    """kernels/decode_plan.cu on the emulation: the work records of ``batch`` requests written into
    ``items`` and their count into ``num_items`` (int32 CPU tensors), a short last wave recut with
    ``recut`` = (units, slots, tile) (the launch `decode.CudaNativeDecodePlan` makes)."""
    from tactix_cuda_native import decode

    lib = _library("emu_decode_plan.cpp", decode.decode_plan_variant("sm_90").defines)
    lib.emu_decode_plan.restype = ctypes.c_char_p
    smem = ctypes.c_longlong(decode.decode_plan_smem(batch))
    err = lib.emu_decode_plan(ctypes.c_int(decode.DECODE_PLAN_THREADS), smem,
                              *_args([kv_indptr, kv_lens, items, num_items, batch, chunk, window_left,
                                      *(recut or (0, 0, 0)), decode.DECODE_MIN_CHUNK]))  # fmt: skip
    if err:
        raise RuntimeError(f"emulated kernel misuse: {err.decode()}")


def merge_states(vs: Any, ss: Any, out_v: torch.Tensor, out_s: torch.Tensor, mask: torch.Tensor | None) -> None:
    """kernels/merge.cu on the emulation, launched as `merge.CudaNativeMergePlan.run` launches it
    (`merge.merge_args`: the states by their address differences; CPU tensors)."""
    from tactix_cuda_native import merge

    args = merge.merge_args(vs, ss, out_v, out_s, mask)
    if args is None:  # as the plan does: one stacked copy of states that lie at no common stride
        stacked_v, stacked_s = torch.stack(list(vs), dim=1), torch.stack(list(ss), dim=1)
        n = len(vs)
        args = merge.merge_args([stacked_v[:, i] for i in range(n)], [stacked_s[:, i] for i in range(n)], out_v,
                                out_s, mask)  # fmt: skip
        assert args is not None
    dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[vs[0].dtype]
    lib = _library("emu_merge.cpp", merge.merge_variant(dtype, "sm_90").defines)
    lib.emu_merge.restype = ctypes.c_char_p
    rows, heads = vs[0].shape[0], vs[0].shape[1]
    blocks = -(-rows * heads // merge.MERGE_WARPS)
    err = lib.emu_merge(ctypes.c_uint(blocks), ctypes.c_int(32 * merge.MERGE_WARPS),
                        *(ctypes.c_longlong(a) for a in args))  # fmt: skip
    if err:
        raise RuntimeError(f"emulated kernel misuse: {err.decode()}")


TXE_MAP_MAGIC = 0x5458454D4150  # tx_emulate.h: opaque[1] is this << 8 | the rank


class TensorMap(ctypes.Structure):
    """A kernel's TxTensorMap (128 bytes) in the emulation's layout; the wrappers take its address."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def tensor_map(view: torch.Tensor, box: tuple[int, ...]) -> TensorMap:
    """What `runtime.tensor_map` encodes for the GPU, in the layout tx_emulate.h's tensor-map
    copies read: opaque[0] the base address, [1] magic << 8 | rank, [2..6] the dims and [11..15]
    the box (elements, innermost first), [7..10] the strides of dims 1 to 4 in bytes (16-bit
    elements, the innermost dimension contiguous)."""
    rank = view.dim()
    if not (1 <= rank <= 5 and len(box) == rank and view.stride(-1) == 1 and view.element_size() == 2):
        raise ValueError(f"the emulation encodes 1- to 5-D maps of 16-bit elements, innermost contiguous, one box "
                         f"size per dimension (got shape {tuple(view.shape)}, strides {view.stride()}, "
                         f"element size {view.element_size()}, box {box})")  # fmt: skip
    m = TensorMap()
    m.opaque[0] = view.data_ptr()
    m.opaque[1] = TXE_MAP_MAGIC << 8 | rank
    for i in range(rank):  # innermost first
        m.opaque[2 + i] = view.shape[rank - 1 - i]
        m.opaque[11 + i] = box[rank - 1 - i]
        if i:
            m.opaque[7 + i - 1] = view.stride(rank - 1 - i) * 2
    return m


def fp8_convert(codes: torch.Tensor, fmt: int, bf16: bool, mode: int = 0) -> torch.Tensor:
    """kernels/fp8.cuh's fp8 -> 16-bit conversion (``fmt``: its TX_KV_FP8, 1 e4m3fn, 2 e5m2;
    ``mode``: its TX_FP8_CVT, the hardware conversion's mode 1 being mode 0 on the CPU) of
    ``codes`` (uint8, a multiple of 4 of them): the bfloat16 (else float16) results."""
    defines = (("TX_BF16", str(int(bf16))), ("TX_KV_FP8", str(fmt)), ("TX_FP8_CVT", str(mode)))
    lib = _library("emu_fp8.cpp", defines)
    codes = codes.contiguous()
    out = torch.empty(codes.numel(), dtype=torch.int16)
    lib.emu_fp8_convert(ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(codes.numel()))
    return out.view(torch.bfloat16 if bf16 else torch.float16)


class GemmPlan:
    """`gemm.CudaNativeGemmPlan` on the CPU for the H200's geometry, for the Hopper kernel
    (kernels/gemm_sm90.cu, tactic kernel "gemm_wgmma"): the same variant, shared memory, split
    count (the cluster), k per split and grid, the GPU buffers being CPU tensors."""

    def __init__(self, problem: Any, tactic: Any) -> None:
        from tactix_cuda_native import device, gemm

        info = device.H200
        params = gemm.GemmWgmmaParams.from_tactic(tactic)
        self.problem, self.params = problem, params
        m, n, k, batch = problem.m, problem.n, problem.k, problem.batch
        self.splits = gemm.gemm_wgmma_splits(m, n, k, params, info)
        self.kps = gemm.gemm_wgmma_k_per_split(k, params.bk, self.splits)
        variant = gemm.gemm_wgmma_variant(problem.a_dtype, params, self.splits, info.arch)
        self.lib = _library("emu_gemm_sm90.cpp", variant.defines)
        self.smem = params.smem_bytes
        self.grid = gemm.gemm_grid(n, params.bw, self.splits, batch)

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
            schedule: Schedule = SCHEDULES[0]) -> None:  # fmt: skip
        """`gemm.CudaNativeGemmPlan.run`'s argument list on the emulation (``b`` is the [k, n]
        k-major view of the [n, k] weight)."""
        p = self.problem
        lda = a.stride(-2) if p.m > 1 else p.k
        ldb = b.stride(-1) if p.n > 1 else p.k
        a_sb = a.stride(0) if p.batched else 0
        b_sb = b.stride(0) if p.batched else 0
        args = _args([a, lda, a_sb, b, ldb, b_sb, out, p.m * p.n, bias, None, None, p.m, p.n, p.k, self.kps])
        if self.params.tma:  # the plan's views and boxes (gemm.CudaNativeGemmPlan._tensor_map)
            from tactix_cuda_native import gemm

            wmap = tensor_map(gemm.gemm_tma_view(b, p, p.n, ldb, b_sb), (1, self.params.bw, 64))
            amap = wmap
            if self.params.tma == 2:
                amap = tensor_map(gemm.gemm_tma_view(a, p, p.m, lda, a_sb), (1, 64, 64))
            args = [ctypes.byref(wmap), ctypes.byref(amap), *args]
        gx, gy, gz = self.grid
        err = self.lib.emu_gemm(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz),
                                ctypes.c_int(self.params.THREADS), ctypes.c_longlong(self.smem), *schedule.args(),
                                *args)  # fmt: skip
        if err:
            raise RuntimeError(f"emulated kernel misuse: {err.decode()}")
