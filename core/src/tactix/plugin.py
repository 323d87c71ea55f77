"""The plugin surface: everything a backend author may import from tactix besides ``tactix`` itself.

A backend plugin imports ``tactix`` (the public API: problems, tactics, capabilities, errors,
``hookimpl``) and this module, nothing else of tactix: the rest of the package is private and may
change between releases. What is here:

* ``hookimpl``, ``PlanOptions``, ``ReferenceCall`` and the op registry (``OPS``), to implement hooks;
* `bucket_size`, to bucket sizes the way the store does;
* cache layouts: `cache_axes` (a cache's sizes or strides by axis, whatever its layout),
  `page_shape`, `dense_strides`, `CacheAxes`, `KVLayout`;
* device helpers: `cuda_available` (never initialises CUDA), `compute_capability` (cached per
  GPU; core already refuses what a declaration's ``compute_capabilities`` excludes),
  `resolve_device`, `raw_stream`
  (the ``cudaStream_t`` of torch's current stream on a device);
* kernel launches through the driver: `function_launcher` (a `Launcher` for a kernel the plugin
  loaded itself: a few microseconds less host time a launch than ``cuda.core.launch``) with the
  argument types `LAUNCH_INT`, `LAUNCH_INT64` and `LAUNCH_POINTER`;
* metadata staging for fast plans (`Staging`, `Piece`, `Sections`, `sections`,
  `write_int32`, `write_table`, `gather_table`): pinned host buffers and device slots that
  a plan refills every step without allocating (see docs/plugin-authoring.md);
* `stale_slot_failures`: the known-failure declaration of the kit's stale-slot cases;
* files: `write_atomically` (readers see the old file or the new one, never a part) and
  `cache_root` (where tactix keeps its caches; a plugin's compile cache belongs below it).
"""

from __future__ import annotations

from typing import Final, TypeVar

from tactix.autotune.store import default_root as cache_root
from tactix.autotune.store import write_atomically
from tactix.cudadrv import INT as LAUNCH_INT
from tactix.cudadrv import INT64 as LAUNCH_INT64
from tactix.cudadrv import POINTER as LAUNCH_POINTER
from tactix.cudadrv import Launcher, function_launcher
from tactix.cudart import raw_stream
from tactix.devices import compute_capability, cuda_available, resolve_device
from tactix.hookspecs import PlanOptions, ReferenceCall, hookimpl
from tactix.layouts import CacheAxes, KVLayout, cache_axes, dense_strides, page_shape
from tactix.ops import OPS, OpDefinition
from tactix.problems import bucket_size
from tactix.staging import Piece, Sections, Staging, gather_table, sections, write_int32, write_table

__all__ = [
    "LAUNCH_INT",
    "LAUNCH_INT64",
    "LAUNCH_POINTER",
    "OPS",
    "STALE_SLOTS",
    "CacheAxes",
    "KVLayout",
    "Launcher",
    "OpDefinition",
    "Piece",
    "PlanOptions",
    "ReferenceCall",
    "Sections",
    "Staging",
    "bucket_size",
    "cache_axes",
    "cache_root",
    "compute_capability",
    "cuda_available",
    "dense_strides",
    "from_static",
    "function_launcher",
    "gather_table",
    "hookimpl",
    "keep_static",
    "page_shape",
    "raw_stream",
    "resolve_device",
    "sections",
    "stale_slot_failures",
    "write_atomically",
    "write_int32",
    "write_table",
]

_T = TypeVar("_T")

STALE_SLOTS: Final = (
    "reads whole pages: a NaN or Inf in a cache slot past a request's length reaches the output (0 x NaN in "
    "P @ V); the caller must keep slots no request owns finite (e.g. allocate the cache with torch.zeros)"
)
"""The reason a backend gives for failing the kit's stale-slot cases (see `stale_slot_failures`)."""


def keep_static(plan: object) -> None:
    """Remember the attributes ``plan`` holds so far as its static part: what depends on the
    static problem, the tactic and the device only (kernels, scalars, module handles), made once.
    `from_static` starts each re-plan's object from it."""
    plan.__dict__["_static"] = dict(plan.__dict__)


def from_static(plan: _T) -> _T:
    """A new object of ``plan``'s class holding ``plan``'s static part (`keep_static`) and nothing
    of its batch: what a plugin's fast re-plan (``replan``) fills in with the new batch's part,
    without running ``__init__`` again. The static part is shared, not copied: never mutate it."""
    static = plan.__dict__["_static"]
    new = type(plan).__new__(type(plan))
    new.__dict__.update(static)
    new.__dict__["_static"] = static
    return new


def stale_slot_failures(*ops: str, reason: str = STALE_SLOTS) -> dict[str, str]:
    """Known failures (``tactix_known_failures``) for the conformance kit's cases with NaN and Inf
    in the cache slots no request owns (``<op>[*-stale-nan]``, ``<op>[*-stale-inf]``), for a
    backend whose kernels let such values into the output of ``ops``."""
    return {f"{op}[*-stale-{value}]": reason for op in ops for value in ("nan", "inf")}
