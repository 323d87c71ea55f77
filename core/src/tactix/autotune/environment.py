"""The environment a tuned tactic is valid in, and its hash (the store's directory name).

A measured time depends on the software (tactix, every backend plugin, torch, CUDA, cuDNN), the
hardware (GPU name and compute capability) and how it was measured (the policy). Change any of
them and the store starts a new, empty environment instead of replaying choices made under
another.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

import torch

import tactix
from tactix.autotune.policy import MeasurementPolicy
from tactix.registry import Registry, get_registry
from tactix.tactics import SCHEMA_VERSION

__all__ = ["environment", "environment_hash"]


def _device_identity(device: torch.device | None) -> dict[str, Any]:
    if (device is not None and device.type == "cuda") or (device is None and torch.cuda.is_available()):
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"type": "cuda", "name": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}
    return {"type": "cpu", "name": platform.machine() or "unknown", "compute_capability": None}


def environment(
    policy: MeasurementPolicy, device: torch.device | None = None, registry: Registry | None = None
) -> dict[str, Any]:
    """Everything a stored tactic's validity and measured time depend on, as a JSON object."""
    registry = registry or get_registry()
    cudnn: int | None = None
    if torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    return {
        "schema_version": SCHEMA_VERSION,
        "tactix": tactix.__version__,
        "backends": {
            b.name: {
                "version": b.spec.version,
                "distribution": b.record.distribution,
                "distribution_version": b.record.distribution_version,
            }
            for b in registry.active()
        },
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "device": _device_identity(device),
        "policy": policy.identity(),
    }


def environment_hash(env: dict[str, Any]) -> str:
    text = json.dumps(env, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
