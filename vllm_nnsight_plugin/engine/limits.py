"""Per-request result limits (what one traced request may save)."""

from __future__ import annotations

from typing import Any

import torch

from .cache import ModuleCache
from .rowlog import RowLog
from .tree import leaves

DEFAULT_LIMITS = {"max_saved_bytes": 1 << 30, "max_saves": 100_000}


def limits(settings: dict[str, Any]) -> dict[str, int]:
    """Per-request result limits: ``--additional-config '{"nnsight": {"max_saved_bytes": N,
    "max_saves": N}}'`` or ``VLLM_NNSIGHT_MAX_SAVED_BYTES`` / ``VLLM_NNSIGHT_MAX_SAVES``."""
    import os

    out = {}
    for key, default in DEFAULT_LIMITS.items():
        env = os.environ.get(f"VLLM_NNSIGHT_{key.upper()}")
        out[key] = int(settings.get(key, env if env is not None else default))
    return out


def measure(value: Any) -> tuple[int, int]:
    """(number of leaf values, tensor bytes) of a saved structure."""
    count = size = 0
    for item in leaves(value):
        if isinstance(item, torch.Tensor):
            count, size = count + 1, size + item.numel() * item.element_size()
        elif isinstance(item, RowLog):  # a batched read's per-step rows
            count, size = count + item.count(), size + item.nbytes()
        elif isinstance(item, ModuleCache):
            found = measure(item.values())
            count, size = count + found[0], size + found[1]
        else:
            count += 1
    return count, size
