"""The cuDNN library as this process sees it: imported lazily, versions read once, features gated.

Importing the frontend (``cudnn``) or asking for the library version can fail on a machine
without the cuDNN library (``RuntimeError: Unable to find symbol cudnnGetVersion``); nothing
here raises because of that: `status()` records why, and the plugin reports it as a reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["FEATURES", "LibraryStatus", "feature_reasons", "frontend", "shape_override", "status"]

FEATURES: Final[dict[str, int]] = {
    # feature -> first cuDNN library version (as cudnnGetVersion reports it: 90500 = 9.5.0) with it
    "sdpa": 90000,
    "paged_kv": 90500,  # paged K/V caches through page tables
    "ragged_paged": 90700,  # ragged (packed) Q together with paged K/V
    "ragged_kv": 90000,  # ragged (packed) Q, K, V and O with per-request offsets (the THD layout)
    "bottom_right_causal": 90300,
    "sliding_window": 90600,
    "matmul": 90000,
    "fp8_matmul": 90000,
    "attention_sinks": 91300,  # SDPA's sink_token (frontend 1.14.1 and newer; cuDNN 9.13.0)
    "shape_override": 92100,  # graphs built with is_override_shape_enabled, executed with per-call shapes
}
"""Library versions that introduced what the plugin relies on (from cuDNN's release notes)."""


@dataclass(frozen=True)
class LibraryStatus:
    frontend_version: str | None
    library_version: int | None  # e.g. 91900 for 9.19.0
    error: str | None

    @property
    def usable(self) -> bool:
        return self.error is None

    @property
    def library_version_text(self) -> str:
        v = self.library_version
        if v is None:
            return "none"
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"


@functools.cache
def status() -> LibraryStatus:
    """Import the frontend and read the library version, once per process."""
    try:
        import cudnn
    except Exception as exc:  # any failure to load is a reason to report, not a crash
        return LibraryStatus(None, None, f"cuDNN frontend cannot be imported ({type(exc).__name__}: {exc})")
    version = getattr(cudnn, "__version__", None)
    try:
        library = int(cudnn.backend_version())
    except Exception as exc:
        return LibraryStatus(version, None, f"the cuDNN library is not available ({type(exc).__name__}: {exc})")
    return LibraryStatus(version, library, None)


def frontend() -> Any:
    """The imported ``cudnn`` module (only after `status()` said it is usable)."""
    import cudnn

    return cudnn


def feature_reasons(*features: str, library: int | None = None) -> list[str]:
    """Why the features cannot be used with this library (empty list: they can)."""
    st = status()
    version = library if library is not None else st.library_version
    if version is None:
        return [st.error or "the cuDNN library is not available"]
    out = []
    for feature in features:
        needed = FEATURES[feature]
        if version < needed:
            have = LibraryStatus(None, version, None).library_version_text
            want = LibraryStatus(None, needed, None).library_version_text
            out.append(f"{feature.replace('_', ' ')} needs cuDNN >= {want} (this library is {have})")
    return out


def shape_override(library: int | None = None, module: Any = None) -> tuple[bool, str]:
    """Whether graphs can be built once and executed with each batch's own shapes, and why (not).

    Two paths serve a new batch without a new graph:

    * **shape override** (cuDNN library >= 9.21 and a frontend whose ``pygraph`` takes
      ``is_override_shape_enabled``): one graph, the real sizes given at execute time;
    * **buckets** (every other library): dynamic sizes rounded up to the next power of two in the
      graph key, requests past the real batch given length 0; a new batch of a seen bucket reuses
      its graph.

    The library version decides first; the frontend is then asked whether it knows the flag,
    and any failure of that query means "no" with the reason, never an exception. The plugin
    builds bucketed graphs on every library today: the override path is detected (this function)
    but not yet used, because no library that has it was at hand to test it (the H200 here has
    cuDNN 9.19).
    """
    version = library if library is not None else status().library_version
    if version is None:
        return False, status().error or "the cuDNN library is not available"
    reasons = feature_reasons("shape_override", library=version)
    if reasons:
        return False, reasons[0]
    try:
        mod = module if module is not None else frontend()
        import inspect

        accepts = "is_override_shape_enabled" in inspect.signature(mod.pygraph).parameters
    except Exception as exc:  # the query itself may fail on an odd frontend build
        return False, f"cannot ask the cuDNN frontend about shape override ({type(exc).__name__}: {exc})"
    if not accepts:
        return False, "this cuDNN frontend's pygraph has no is_override_shape_enabled flag"
    return True, "cuDNN shape override is available"
