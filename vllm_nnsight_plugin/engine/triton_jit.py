"""Triton where it is installed (CUDA builds of torch bring it), and the plugin's
kernels jitted once per mode: compiled for the GPU, or run by Triton's CPU
interpreter where ``TRITON_INTERPRET=1`` (the tests; Triton reads the flag when a
kernel is jitted). Without Triton, or with a broken one, ``triton`` and ``tl`` are None
and every kernel getter returns None: callers then run their torch ops."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - missing or broken: the callers' torch ops run
    triton = tl = None

__all__ = ["jitted", "tl", "triton"]


def jitted(fn: Callable, **options: Any) -> Callable[[], Any]:
    """A getter of ``fn`` jitted for this process's mode (None without Triton);
    ``options`` go to ``triton.jit`` (e.g. ``do_not_specialize``)."""
    built: dict[bool, Any] = {}

    def kernel() -> Any:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if interpret not in built:
            built[interpret] = None if triton is None else triton.jit(fn, **options)
        return built[interpret]

    return kernel
