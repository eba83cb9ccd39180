"""Per-request result limits (what one traced request may save)."""

from __future__ import annotations

from typing import Any

import torch

from .cache import Gathered
from .rowlog import RowLog, TupleLog
from .tree import leaves


def measure(value: Any) -> tuple[int, int]:
    """(number of leaf values, tensor bytes) of a saved structure."""
    count = size = 0
    for item in leaves(value):
        if isinstance(item, torch.Tensor):
            count, size = count + 1, size + item.numel() * item.element_size()
        elif isinstance(item, (RowLog, TupleLog)):  # a batched read's rows
            count, size = count + item.count(), size + item.nbytes()
        elif isinstance(item, Gathered):
            found = measure(item.values())
            count, size = count + found[0], size + found[1]
        else:
            count += 1
    return count, size
