"""The GPU as the heuristics see it: `DeviceInfo` (the few properties they need), `H200` (the default for
compiling ahead of time, and for the tests), the properties of a CUDA device, CTAs per SM, architectures.

Only `device_info` asks torch about a GPU; everything else is a pure function, tested without one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final

import torch

__all__ = [
    "H200",
    "SMEM_RESERVED_PER_CTA",
    "WGMMA_ARCHS",
    "DeviceInfo",
    "arch_at_least",
    "ctas_per_sm",
    "cuda_device",
    "device_index",
    "device_info",
    "info_for",
    "wgmma_arch",
]

SMEM_RESERVED_PER_CTA: Final = 1024  # the driver keeps 1 KB of each CTA's shared memory
WGMMA_ARCHS: Final = ("sm_90", "sm_90a")
"""Where the Hopper kernels (wgmma: kernels/prefill_sm90.cu, kernels/gemm_sm90.cu) run."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the heuristics need to know about a GPU."""

    sms: int
    smem_per_block: int  # largest dynamic shared memory a CTA may opt into
    smem_per_sm: int
    arch: str  # "sm_90"
    l2_bytes: int = 50 * 2**20  # the L2 cache (the H100's and H200's 50 MiB where not asked)


H200: Final = DeviceInfo(sms=132, smem_per_block=232448, smem_per_sm=233472, arch="sm_90")


@functools.cache
def device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceInfo(
        sms=int(props.multi_processor_count),
        smem_per_block=int(getattr(props, "shared_memory_per_block_optin", 48 * 1024)),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 100 * 1024)),
        arch=f"sm_{major}{minor}",
        l2_bytes=int(getattr(props, "L2_cache_size", 0)) or 50 * 2**20,
    )


def info_for(device: torch.device | None) -> DeviceInfo:
    """This GPU's properties, or the H200's where there is none (tactic spaces, ahead-of-time compiles)."""
    if not torch.cuda.is_available():
        return H200
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return device_info(index)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
def cuda_device(index: int) -> torch.device:
    return torch.device("cuda", index)


def ctas_per_sm(info: DeviceInfo, smem: int, threads: int, max_threads: int = 2048, resident: int | None = None) -> int:
    """How many CTAs of this shared-memory size and width fit on one SM (at least 1): ``resident``
    where the driver's occupancy calculator answered (it knows the registers), else an estimate
    from shared memory and threads, at most 4."""
    if resident is not None:
        return max(1, resident)
    by_smem = info.smem_per_sm // (smem + SMEM_RESERVED_PER_CTA)
    return max(1, min(4, by_smem, max_threads // threads))


def arch_at_least(arch: str, cc: int) -> bool:
    """Whether ``arch`` ("sm_90", "sm_90a", "sm_100") is compute capability ``cc`` or later."""
    digits = arch.removeprefix("sm_").rstrip("abf")
    return digits.isdigit() and int(digits) >= cc


def wgmma_arch(arch: str) -> str:
    """The NVRTC target of the wgmma kernels for a GPU of ``arch``: wgmma needs the arch-specific
    ``sm_90a`` (its cubins run only on sm_90 GPUs)."""
    return "sm_90a" if arch in WGMMA_ARCHS else arch
