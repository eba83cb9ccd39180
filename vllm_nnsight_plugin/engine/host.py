"""Device-to-host copies that do not stall the step.

A blocking ``.cpu()`` makes the CPU wait until the GPU has run everything queued
before it. Under vLLM's async scheduling the CPU prepares step N+1 while the GPU
runs step N, so one such wait per step leaves the GPU idle for the whole of the
next step's preparation. Copies here go to pinned host memory with
``non_blocking=True`` and a CUDA event; :func:`wait` runs once, just before
anything reads the host tensors (when a step's results are encoded to leave the
worker, which for per-step captures is the request's last step).

Per-step reads of a batch (:mod:`.rowlog`) go into shared host blocks
(:func:`put_rows`), so a request's rows from every step can later be gathered
with one ``index_select`` instead of one slice per step.
"""

from __future__ import annotations

import math

import torch

_pending: list[torch.cuda.Event] = []  # events of copies still in flight

BLOCK_BYTES = 32 << 20  # one host block of per-step rows (a step's rows never straddle two)
_blocks: dict[tuple, list] = {}  # (dtype, row shape, pinned) -> [block, rows used]


def _landing(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        _pending.append(event)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of ``t``; from a CUDA tensor it may still be in flight
    (read it only after :func:`wait`)."""
    if t.device.type != "cuda":
        return t.detach().to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    _landing(t)
    return host


def put_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Copy ``rows`` (``[n, ...]``, any device) into the current host block for its
    dtype and row shape: ``(block, first)``, the rows being ``block[first:first + n]``
    (in flight until :func:`wait`, like :func:`host_copy`). A block lives while
    anything holds it (the requests whose rows it has); a full one is left to them."""
    n, inner = rows.shape[0], tuple(rows.shape[1:])
    pinned = rows.device.type == "cuda"
    key = (rows.dtype, inner, pinned)
    current = _blocks.get(key)
    if current is None or current[1] + n > current[0].shape[0]:
        row_bytes = max(1, math.prod(inner) * rows.element_size())
        size = max(n, BLOCK_BYTES // row_bytes)
        current = _blocks[key] = [torch.empty((size, *inner), dtype=rows.dtype, pin_memory=pinned), 0]
    block, first = current
    block[first : first + n].copy_(rows.detach(), non_blocking=pinned)
    _landing(rows)
    current[1] = first + n
    return block, first


def release() -> None:
    """Forget the current blocks (nothing traced is live: new rows start new blocks,
    and blocks no request holds are freed)."""
    _blocks.clear()


def wait() -> None:
    """Block until every copy started here has landed."""
    while _pending:
        _pending.pop().synchronize()
