"""Non-finite logits end their request, and no one else's.

A traced request whose logits hold NaN or +inf ends with a per-request error naming
the step. Its rows are made finite before sampling (a sampler fed NaN can fail for
the whole batch). On a GPU the check is read once the device has got there, a step
or two later (the CPU never waits for it), or at once in a request's last step.
(KV blocks a traced request held are zeroed before reuse: ``boundary/kv_blocks.py``.)
"""

from __future__ import annotations

from typing import Any

import torch


class FiniteLogits:
    """Per step: traced rows of the logits made finite, and which were not, read once
    the device has got there (a device-to-host copy that neither stalls the step nor
    makes the CPU wait for the GPU: under async scheduling the CPU prepares the next
    step while the GPU runs this one, and one wait per step would undo that).

    A row is bad when its maximum is NaN or +inf (the maximum propagates NaN): one
    reduction and one in-place pass per step, whatever the batch. Pinned buffers and
    events are reused, so a steady batch allocates nothing per step."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[str], torch.Tensor, Any]] = []  # oldest first
        self._spare: list[tuple[torch.Tensor, Any]] = []  # (pinned buffer, event) pairs to reuse

    def check(self, logits: torch.Tensor, index: torch.Tensor | None, req_ids: list[str]) -> list[str]:
        """Make the logits rows at ``index`` (those of ``req_ids``; None: every row, in
        order) finite; return the requests whose rows were not, in the steps checked so
        far whose copies have landed (on the CPU: this one too)."""
        found = self.collect(wait=False)
        if not req_ids:
            return found
        part = logits if index is None else logits.index_select(0, index)
        # (-inf is a mask some models' logits carry: kept, and not an error)
        finite = part.amax(dim=-1) < float("inf")
        if index is None:
            torch.nan_to_num(logits, neginf=float("-inf"), out=logits)
        else:
            logits.index_copy_(0, index, torch.nan_to_num(part, neginf=float("-inf")))
        if finite.device.type != "cuda":
            return found + [r for r, ok in zip(req_ids, finite.tolist()) if not ok]
        host, event = self._buffer(finite.shape[0])
        host.copy_(finite, non_blocking=True)
        event.record()
        self._pending.append((req_ids, host, event))
        return found

    def _buffer(self, rows: int) -> tuple[torch.Tensor, Any]:
        for i, (host, event) in enumerate(self._spare):
            if host.shape[0] >= rows:
                del self._spare[i]
                return host[:rows], event
        return torch.empty(max(rows, 256), dtype=torch.bool, pin_memory=True)[:rows], torch.cuda.Event()

    @property
    def waiting(self) -> bool:
        return bool(self._pending)

    def collect(self, wait: bool = True) -> list[str]:
        """The requests whose rows were non-finite in the checked steps (``wait``: all of
        them, waiting for the device; else those whose copies have landed)."""
        found: list[str] = []
        while self._pending:
            req_ids, finite, event = self._pending[0]
            if not wait and not event.query():
                break
            event.synchronize()
            self._pending.pop(0)
            if not bool(finite.all()):
                found += [r for r, ok in zip(req_ids, finite.tolist()) if not ok]
            if len(self._spare) < 8:
                self._spare.append((finite._base if finite._base is not None else finite, event))
        return found
