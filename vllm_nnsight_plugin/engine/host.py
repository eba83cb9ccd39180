"""Device-to-host copies that do not stall the step.

A blocking ``.cpu()`` makes the CPU wait until the GPU has run everything queued
before it. Under vLLM's async scheduling the CPU prepares step N+1 while the GPU
runs step N, so one such wait per step leaves the GPU idle for the whole of the
next step's preparation. Copies here go to pinned host memory with
``non_blocking=True`` and a CUDA event; :func:`wait` runs once, just before
anything reads the host tensors (when a step's results are encoded to leave the
worker, which for per-step captures is the request's last step).

A step's saves of blocks leave together (:func:`to_host`), one copy per dtype.
Per-step reads of a batch (:mod:`.rowlog`) go into shared host blocks
(:func:`put_rows`), so a request's rows from every step can later be gathered
with one ``index_select`` instead of one slice per step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .session import RequestSession

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


def on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


HOST_CHUNK_BYTES = 256 << 20  # at most this much extra device memory for one step's copy


def to_host(sessions: list[RequestSession]) -> None:
    """Move the snapshots (``session.last``) of a step's sessions to the CPU with one
    device-to-host copy per dtype for the whole step (in chunks of at most
    ``HOST_CHUNK_BYTES``), not one per request. The copies are non-blocking:
    read the host values only after ``host.wait()``. A tensor
    shipped before (a saved list re-sent as it grows) is not copied again."""
    groups: dict[tuple, list[list[tuple[RequestSession, torch.Tensor]]]] = {}
    filled: dict[tuple, int] = {}  # bytes in each group's last chunk
    for session in sessions:
        for t in session.off_host(session.last):
            key, size = (t.dtype, t.device), t.numel() * t.element_size()
            chunks = groups.setdefault(key, [[]])
            if chunks[-1] and filled.get(key, 0) + size > HOST_CHUNK_BYTES:
                chunks.append([])
                filled[key] = 0
            chunks[-1].append((session, t))
            filled[key] = filled.get(key, 0) + size
    for chunk in (c for chunks in groups.values() for c in chunks):
        flat = host_copy(torch.cat([t.reshape(-1) for _, t in chunk])) if len(chunk) > 1 else None
        offset = 0
        for session, t in chunk:
            cpu = flat[offset : offset + t.numel()].view(t.shape) if flat is not None else host_copy(t)
            offset += t.numel()
            session.adopt_host(t, cpu)
    for session in sessions:
        if session._on_device:  # (batched reads are on the host already: no walk)
            session.last = session.on_host(session.last)
