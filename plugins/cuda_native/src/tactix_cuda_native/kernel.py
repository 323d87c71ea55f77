"""What the ops' plans share about their kernels: the loaded-kernel memo (`Kernel`, `kernel`), the
``cuda.core`` module they launch with (`launcher`), the tensor maps they keep (`TensorMaps`), and
the compile-time conventions of more than one kernel source (dtypes, the L2 hints, the flag bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import tactix
from tactix import InvalidArgumentError, Tactic
from tactix_cuda_native import NAME
from tactix_cuda_native.device import DeviceInfo, ctas_per_sm
from tactix_cuda_native.runtime import Variant, cuda_core_status, load, resident_ctas
from tactix_cuda_native.tactics import TacticParams

__all__ = ["DTYPES", "FLAG_BYTES", "L2_HINTS", "Kernel", "TensorMaps", "bf16", "launcher", "load_kernel"]

DTYPES: Final = frozenset({"float16", "bfloat16"})
FLAG_BYTES: Final = 16  # the "last CTA" flag at the end of the decode and mma.sync GEMM kernels' dynamic shared memory
L2_HINTS: Final = (0, 1, 2)  # 0: none, 1: evict_first on the KV cache (GEMM: none), 2: 1 + 256-byte L2 prefetch


def bf16(dtype: str) -> int:
    """The ``TX_BF16`` define of every kernel source: 1 for bfloat16, 0 for float16."""
    return 1 if dtype == "bfloat16" else 0


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel and what plans derive from its static parameters alone (device, dtype, head
    dim, tactic parameters): memoised, so a plan for a new batch of a seen problem loads nothing,
    hashes no source and asks the driver nothing."""

    kernel: Any
    smem: int
    threads: int
    ctas_per_sm: int
    tactic: Tactic


_kernels: dict[tuple[Any, ...], Kernel] = {}


def load_kernel(key: tuple[Any, ...], variant: Callable[[], Variant], name: str, smem: int, threads: int,
           params: TacticParams, index: int, info: DeviceInfo) -> tuple[Kernel, bool]:  # fmt: skip
    """The kernel ``name`` of ``variant()`` on device ``index`` for the tactic ``params`` (memoised
    by ``key``), launched with ``threads`` and ``smem`` bytes of dynamic shared memory, and whether
    NVRTC compiled it now."""
    found = _kernels.get(key)
    if found is not None:
        return found, False
    module, built = load(variant(), index)
    loaded = module.kernel(name, smem)
    ctas = ctas_per_sm(info, smem, threads, resident=resident_ctas(loaded, threads, smem))
    found = _kernels[key] = Kernel(loaded, smem, threads, ctas, params.to_tactic())
    return found, built


def launcher() -> Any:
    """The ``cuda.core`` module plans launch with, or a `tactix.BackendUnavailableError` saying why not."""
    module, why = cuda_core_status()
    if module is None:
        raise tactix.BackendUnavailableError(f"{NAME}: {why}")
    return module


class TensorMaps:
    """A plan's tensor maps (TMA descriptors), kept per key (a tensor's address and layout), the
    ``kept`` most recently used: a tensor that does not move (a weight, a KV cache) is encoded once,
    which costs microseconds of host time. A map depends on nothing but its key, so it stays valid
    for whatever tensor later lies at that address with that layout.

    `rebound` keeps maps per layout instead, for tensors that arrive at a new address every call
    (activations: a ragged prefill's K and V): a new address is swapped into the kept map in place
    (`rebind`, cuda.core's ``replace_address``), not encoded anew. A launch copies its arguments,
    so rewriting a map that an earlier launch (or a captured graph) took changes nothing there."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._maps: dict[tuple[Any, ...], Any] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def _keep(self, key: tuple[Any, ...], found: Any) -> None:
        while len(self._maps) >= self.kept:
            self._maps.pop(next(iter(self._maps)))
        self._maps[key] = found  # the most recently used last

    def get(self, key: tuple[Any, ...], make: Callable[[], Any], argument: str) -> Any:
        found = self._maps.pop(key, None)
        if found is None:
            found = _encoded(make, argument)
        self._keep(key, found)
        return found

    def rebound(self, layout: tuple[Any, ...], address: int, make: Callable[[], Any],
                rebind: Callable[[Any], None], argument: str) -> Any:  # fmt: skip
        """The map of a tensor of ``layout`` (dtype, shape, strides, box) at ``address``: the kept
        one of that layout, moved to ``address`` by ``rebind(map)`` where it was last bound
        elsewhere; ``make()`` encodes one where none is kept, or where ``rebind`` is missing from
        this cuda.core (AttributeError)."""
        entry = self._maps.pop(layout, None)
        if entry is not None and entry[1] != address:
            try:
                _encoded(lambda: rebind(entry[0]), argument)
                entry = (entry[0], address)
            except AttributeError:  # a cuda.core without replace_address: encode
                entry = None
        if entry is None:
            entry = (_encoded(make, argument), address)
        self._keep(layout, entry)
        return entry[0]


def _encoded(make: Callable[[], Any], argument: str) -> Any:
    """``make()``, with cuda.core's refusal of what the TMA unit cannot describe (ValueError,
    RuntimeError) as an `InvalidArgumentError` naming ``argument``."""
    try:
        return make()
    except (ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(argument, "a tensor the tensor memory accelerator can describe "
                                   "(16-byte aligned, 16-byte strides)", str(exc)) from exc  # fmt: skip
