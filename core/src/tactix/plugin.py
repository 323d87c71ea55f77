"""The plugin surface: everything a backend author may import from tactix besides ``tactix`` itself.

A backend plugin imports ``tactix`` (the public API: problems, tactics, capabilities, errors,
``hookimpl``) and this module, nothing else of tactix: the rest of the package is private and may
change between releases. What is here:

* ``hookimpl``, ``PlanOptions``, ``ReferenceCall`` and the op registry (``OPS``), to implement hooks;
* `bucket_size`, to bucket sizes the way the store does;
* device helpers: `cuda_available` (never initialises CUDA), `compute_capability` (cached per
  GPU; core already refuses what a declaration's ``compute_capabilities`` excludes),
  `resolve_device`, `raw_stream`
  (the ``cudaStream_t`` of torch's current stream on a device);
* metadata staging for fast plans (`Staging`, `Piece`, `Sections`, `sections`,
  `write_int32`, `write_table`, `gather_table`): pinned host buffers and device slots that
  a plan refills every step without allocating (see docs/plugin-authoring.md);
* files: `write_atomically` (readers see the old file or the new one, never a part) and
  `cache_root` (where tactix keeps its caches; a plugin's compile cache belongs below it).
"""

from __future__ import annotations

from tactix.autotune.store import default_root as cache_root
from tactix.autotune.store import write_atomically
from tactix.cudart import raw_stream
from tactix.devices import compute_capability, cuda_available, resolve_device
from tactix.hookspecs import PlanOptions, ReferenceCall, hookimpl
from tactix.ops import OPS, OpDefinition
from tactix.problems import bucket_size
from tactix.staging import Piece, Sections, Staging, gather_table, sections, write_int32, write_table

__all__ = [
    "OPS",
    "OpDefinition",
    "Piece",
    "PlanOptions",
    "ReferenceCall",
    "Sections",
    "Staging",
    "bucket_size",
    "cache_root",
    "compute_capability",
    "cuda_available",
    "gather_table",
    "hookimpl",
    "raw_stream",
    "resolve_device",
    "sections",
    "write_atomically",
    "write_int32",
    "write_table",
]
