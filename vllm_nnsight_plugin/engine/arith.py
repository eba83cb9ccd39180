"""The edit operations' arithmetic, defined once.

An edit (``add``, ``scale``, ``zero``, ``set``) means what the same in-place
PyTorch statement in a block means (``x += v``, ``x *= f``, ``x[:] = 0``,
``x[:] = v``), on any value, NaN and inf included: ``zero`` and ``set`` do not
look at the old value. The per-request spec runner and the batched Python path
call :func:`apply`; the CUDA-graph lanes (:mod:`.lanes`) run the same arithmetic
from the coefficients :func:`lane_coefficients` gives.

Operands keep full precision until the one rounding into the edited tensor (as
PyTorch's in-place ops do): a vector is decoded to float32 (float64 for a float64
model), a number stays a Python float.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..payload import values as tagged

EDITS = ("add", "scale", "zero", "set")
Operand = torch.Tensor | float


def operand(raw: Any, like: torch.Tensor) -> Operand:
    """An op's ``value`` (a number, a nested list, or a tagged tensor) for editing
    ``like``: a Python float, or a tensor on ``like``'s device."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError("the value is NaN or inf")
        return value
    t = tagged.decode_tensor(raw["$tensor"]) if isinstance(raw, dict) else torch.as_tensor(raw, dtype=torch.float64)
    if not torch.isfinite(t).all():  # base64 bytes can hold what JSON numbers cannot
        raise ValueError("the value holds NaN or inf")
    wide = torch.float64 if like.dtype == torch.float64 else torch.float32
    return t.to(dtype=wide, device=like.device)


def apply(kind: str, target: torch.Tensor, value: Operand | None = None, factor: float = 1.0) -> torch.Tensor:
    """Edit ``target`` in place (a view of the rows to change, or a copy of them)."""
    if kind == "add":
        return target.add_(value)
    if kind == "scale":
        return target.mul_(factor)
    if kind == "zero":
        return target.zero_()
    if kind == "set":
        if isinstance(value, float):
            return target.fill_(value)
        return target.copy_(value.expand_as(target))
    raise ValueError(f"unknown edit {kind!r}")


def lane_coefficients(kind: str, value: Operand | None, factor: float) -> tuple[bool, float, Operand]:
    """``(keep, scale, offset)``: the lanes compute ``x * scale + offset`` where
    ``keep``, else ``offset``, in float32, and round once: :func:`apply` (with
    ``keep`` False the old value, NaN or not, is not read)."""
    if kind == "add":
        return True, 1.0, value
    if kind == "scale":
        return True, factor, -0.0  # (x * f + -0.0 is x * f, signed zeros included)
    if kind == "zero":
        return False, 0.0, 0.0
    if kind == "set":
        return False, 0.0, value
    raise ValueError(f"unknown edit {kind!r}")
