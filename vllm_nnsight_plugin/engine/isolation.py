"""No traced request leaves state that another request reads.

Two holes, both closed here:

- **KV blocks.** An edit can put NaN or inf into a request's KV cache. When its
  blocks return to the pool and are handed to another request, the new owner
  writes only the slots it uses; an attention kernel that masks the rest by
  multiplying with a zero probability still reads them, and 0 x NaN is NaN. So the
  scheduler remembers the blocks of every traced request (a request whose cache
  salt is the plugin's) when it frees them, and when the block pool hands such a
  block out again, the worker zeroes it before the step that uses it (with vLLM's
  own block zeroer where the runner has one). Blocks still in the prefix cache are
  only ever hit by requests with the same salt, and they are not zeroed while
  cached: zeroing happens only on a fresh allocation.
- **Non-finite logits.** A traced request whose logits hold NaN or +inf ends with a
  per-request error naming the step. Its rows are made finite before sampling (a
  sampler fed NaN can fail for the whole batch). On a GPU the check is read once
  the device has got there, a step or two later (the CPU never waits for it), or at
  once in a request's last step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import compat, whole_prompts
from .whole_prompts import traced

DIRTY = "_nnsight_dirty_blocks"  # on the block pool: ids freed by traced requests
PENDING = "_nnsight_blocks_to_zero"  # on the block pool: dirty ids handed out again, to zero
ZERO_ATTR = "nnsight_zero_blocks"  # on a SchedulerOutput: ids the worker zeroes before the step


# ----------------------------------------------------------- scheduler (EngineCore)


def _remember(manager: Any, request: Any) -> None:
    if not traced(request):
        return
    try:
        groups = manager.get_block_ids(request.request_id)
    except Exception:  # noqa: BLE001 - a request with no blocks (yet)
        return
    pool = manager.block_pool
    dirty = pool.__dict__.setdefault(DIRTY, set())
    for ids in groups:
        dirty.update(ids)


def _freeing(original: Callable) -> Callable:
    def free(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _remember(self, request)
        return original(self, request, *args, **kwargs)

    return free


def _get_new_blocks(original: Callable) -> Callable:
    def get_new_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = original(self, *args, **kwargs)
        dirty = self.__dict__.get(DIRTY)
        if dirty:
            pending = self.__dict__.setdefault(PENDING, [])
            for block in blocks:
                if block.block_id in dirty:
                    dirty.discard(block.block_id)
                    pending.append(block.block_id)
        return blocks

    return get_new_blocks


def _schedule(original: Callable) -> Callable:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        with whole_prompts.scheduling(self):  # (the one wrap of schedule(): both happen here)
            output = original(self, *args, **kwargs)
        pool = compat.scheduler_block_pool(self)
        pending = pool.__dict__.get(PENDING) if pool is not None else None
        if pending:
            setattr(output, ZERO_ATTR, list(pending))
            pending.clear()
        return output

    return schedule


def install_scheduler(scheduler_cls: type) -> None:
    compat.patch_method(scheduler_cls, "schedule", _schedule)


def install_kv_manager(manager_cls: type) -> None:
    for name in compat.KV_MANAGER_FREES:
        if hasattr(manager_cls, name):
            compat.patch_method(manager_cls, name, _freeing)


def install_block_pool(pool_cls: type) -> None:
    compat.patch_method(pool_cls, compat.BLOCK_POOL_ALLOCATE, _get_new_blocks)


# ----------------------------------------------------------------- worker


def zero_reused_blocks(runner: Any, scheduler_output: Any) -> None:
    """Before a step: zero the blocks traced requests held that are now handed out again."""
    ids = getattr(scheduler_output, ZERO_ATTR, None)
    if ids:
        compat.zero_kv_blocks(runner, ids)


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
