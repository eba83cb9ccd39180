"""Device-to-host copies that do not stall the step.

A blocking ``.cpu()`` makes the CPU wait until the GPU has run everything queued
before it. Under vLLM's async scheduling the CPU prepares step N+1 while the GPU
runs step N, so one such wait per step leaves the GPU idle for the whole of the
next step's preparation. Copies here go to pinned host memory with
``non_blocking=True`` and a CUDA event; :func:`wait` runs once, just before
anything reads the host tensors (when a step's results are encoded to leave the
worker, which for per-step captures is the request's last step).
"""

from __future__ import annotations

import torch

_pending: list[torch.cuda.Event] = []  # events of copies still in flight


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of ``t``; from a CUDA tensor it may still be in flight
    (read it only after :func:`wait`)."""
    if t.device.type != "cuda":
        return t.detach().to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append(event)
    return host


def wait() -> None:
    """Block until every copy started by :func:`host_copy` has landed."""
    while _pending:
        _pending.pop().synchronize()
