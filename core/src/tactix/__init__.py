"""tactix: paged prefill attention, paged decode attention, ragged-KV prefill attention and GEMM
from pluggable backends.

One API (`PagedPrefill`, `PagedDecode`, `RaggedPrefill`, `Gemm`) over backends discovered through
the ``tactix.backends`` entry-point group; see ``tactix backends`` for what is installed.
"""

import typing as _typing

if _typing.TYPE_CHECKING:  # type checkers cannot call a module: to them `tactix.autotune` is the function
    from tactix.autotune.context import autotune
else:  # the package itself is callable: `with tactix.autotune(mode="tune"): ...`
    from tactix import autotune
from tactix._version import __version__
from tactix.attention import PagedDecode, PagedPrefill
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.stats import reset_stats, stats
from tactix.batch import PagedBatch, RaggedBatch
from tactix.capabilities import BackendSpec
from tactix.errors import (
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    DistributedError,
    DuplicateBackendError,
    FallbackWarning,
    InvalidArgumentError,
    PluginError,
    StoreError,
    TacticError,
    TactixError,
    TactixWarning,
    UnsupportedProblemError,
)
from tactix.gemm import Gemm, gemm
from tactix.hookspecs import PlanOptions, hookimpl
from tactix.merge import MergeStates, merge_state, merge_state_in_place, merge_states
from tactix.ops import (
    AttentionCapabilities,
    AttentionPlan,
    DecodeProblem,
    GemmCapabilities,
    GemmDTypes,
    GemmPlan,
    GemmProblem,
    MergeCapabilities,
    MergeProblem,
    PrefillProblem,
    Problem,
    RaggedPrefillCapabilities,
    RaggedPrefillPlan,
    RaggedPrefillProblem,
)
from tactix.problems import bucket_size
from tactix.ragged import RaggedPrefill
from tactix.registry import get_registry
from tactix.tactics import SCHEMA_VERSION, Tactic

__all__ = [
    "SCHEMA_VERSION",
    "AttentionCapabilities",
    "AttentionPlan",
    "BackendError",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "DecodeProblem",
    "DistributedError",
    "DuplicateBackendError",
    "FallbackWarning",
    "Gemm",
    "GemmCapabilities",
    "GemmDTypes",
    "GemmPlan",
    "GemmProblem",
    "InvalidArgumentError",
    "MeasurementPolicy",
    "MergeCapabilities",
    "MergeProblem",
    "MergeStates",
    "PagedBatch",
    "PagedDecode",
    "PagedPrefill",
    "PlanOptions",
    "PluginError",
    "PrefillProblem",
    "Problem",
    "RaggedBatch",
    "RaggedPrefill",
    "RaggedPrefillCapabilities",
    "RaggedPrefillPlan",
    "RaggedPrefillProblem",
    "StoreError",
    "Tactic",
    "TacticError",
    "TactixError",
    "TactixWarning",
    "UnsupportedProblemError",
    "__version__",
    "autotune",
    "bucket_size",
    "gemm",
    "get_registry",
    "hookimpl",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "reset_stats",
    "stats",
]
