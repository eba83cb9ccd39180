"""Trace-level containers the invokes write into (nnsight's shared state across invokes).

A list or dict saved in the trace body, above the invokes, goes to each invoke's
request as a copy (:class:`..payload.codec.SharedList`, :class:`..payload.codec.SharedDict`)
and comes back as that request's save. The copies are merged into the caller's
container in invoke order, so each invoke's writes land as if all had written the
one object: appended items are appended (lists of lists too, item by item), a list
slot or a dict key whose value an invoke changed takes the new value (the last
invoke to change it wins), and a new dict key is added. ``None`` is an unwritten slot.
"""

from __future__ import annotations

from typing import Any

import torch

_ABSENT = object()


def snapshot(value: Any) -> Any:
    """What a shared container holds before the invokes run: its items, and those of
    the lists and dicts in it, recursively (the items themselves, not copies: nothing
    changes the caller's container until :func:`merge`)."""
    if isinstance(value, list):
        return ("list", [snapshot(v) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: snapshot(v) for k, v in value.items()})
    return ("value", value)


def merge(shared: Any, before: Any, returned: Any) -> None:
    """Fold one invoke's copy (``returned``) into the caller's container ``shared``,
    whose :func:`snapshot` was ``before``."""
    kind, held = before
    if kind == "list":
        for i, old in enumerate(held[: len(returned)]):
            _merge_item(shared, i, old, returned[i])
        shared.extend(returned[len(held):])
    elif kind == "dict":
        for key, new in returned.items():
            old = held.get(key, _ABSENT)
            if old is _ABSENT:
                shared[key] = new
            else:
                _merge_item(shared, key, old, new)


def _merge_item(shared: Any, key: Any, old: Any, new: Any) -> None:
    kind, value = old
    if kind == "value":
        if changed(value, new):
            shared[key] = new
        return
    container = list if kind == "list" else dict
    if not isinstance(new, container):
        shared[key] = new  # (the invoke put something else there)
    elif isinstance(shared[key], container):  # (else an earlier invoke put something else there)
        merge(shared[key], old, new)  # (the caller's inner container keeps its identity)


def changed(old: Any, new: Any) -> bool:
    """Whether an invoke's copy of a value differs from the value it was sent (tensors
    by their values; a copy comes back on the CPU)."""
    if old is None or new is None:
        return old is not new
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return True
        return old.shape != new.shape or old.dtype != new.dtype or not torch.equal(old.cpu(), new.cpu())
    try:
        return not bool(old == new)
    except Exception:  # noqa: BLE001 - a value without a plain equality: taken as written
        return True
