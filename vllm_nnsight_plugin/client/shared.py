"""Trace-level containers the invokes write into (nnsight's shared state across invokes).

A list or dict saved in the trace body, above the invokes, goes to each invoke's
request as a copy (:class:`..payload.codec.SharedList`, :class:`..payload.codec.SharedDict`)
and comes back as that request's save. The copies are merged into the caller's
container in invoke order, so each invoke's writes land as if all had written the
one object: appended items are appended (lists of lists too, item by item), a list
slot or a dict key whose value an invoke changed takes the new value (the last
invoke to change it wins), a new dict key is added (a key new in several invokes
takes the last one's value), a removed key is removed, and a list an invoke
shortened is replaced by that invoke's copy. ``None`` is an unwritten slot. Only
plain lists and dicts are shared (a subclass, e.g. a ``defaultdict``, stays the
caller's own, as any other value).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_ABSENT = object()


def shareable(value: Any) -> bool:
    return type(value) in (list, dict)


def snapshot(value: Any) -> Any:
    """What a shared container holds before the invokes run: its items, and those of
    the lists and dicts in it, recursively (the items themselves, not copies: nothing
    changes the caller's container until :func:`merge`)."""
    if type(value) is list:
        return ("list", [snapshot(v) for v in value])
    if type(value) is dict:
        return ("dict", {k: snapshot(v) for k, v in value.items()})
    return ("value", value)


def merge(shared: Any, before: Any, returned: Any, _merged: set[int] | None = None) -> None:
    """Fold one invoke's copy (``returned``) into the caller's container ``shared``,
    whose :func:`snapshot` was ``before``. (An inner container held in several places
    is merged once.)"""
    merged = set() if _merged is None else _merged
    if id(shared) in merged:
        return
    merged.add(id(shared))
    kind, held = before
    if kind == "list":
        if len(returned) < len(held):  # (items removed: the invoke's list as it left it)
            shared[:] = returned
            return
        for i, old in enumerate(held):
            _merge_item(shared, i, old, returned[i], merged)
        shared.extend(returned[len(held):])
    elif kind == "dict":
        for key in held:
            if key not in returned:
                shared.pop(key, None)
        for key, new in returned.items():
            old = held.get(key, _ABSENT)
            if old is _ABSENT:
                shared[key] = new
            else:
                _merge_item(shared, key, old, new, merged)


def _merge_item(shared: Any, key: Any, old: Any, new: Any, merged: set[int]) -> None:
    kind, value = old
    if kind == "value":
        if not same(value, new):
            shared[key] = new
        return
    container = list if kind == "list" else dict
    if type(new) is not container:
        shared[key] = new  # (the invoke put something else there)
    elif type(shared[key]) is container:  # (else an earlier invoke put something else there)
        merge(shared[key], old, new, merged)  # (the caller's inner container keeps its identity)


def same(old: Any, new: Any) -> bool:
    """Whether an invoke's copy of a value is the value it was sent: of one type, and
    equal (tensors by their values, a copy comes back on the CPU; NaN equals NaN;
    tuples item by item)."""
    if old is None or new is None:
        return old is new
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return False
        if old.shape != new.shape or old.dtype != new.dtype:
            return False
        old, new = old.detach().cpu(), new.detach().cpu()
        return torch.equal(old, new) or bool(((old == new) | (old.isnan() & new.isnan())).all()) \
            if old.is_floating_point() else torch.equal(old, new)
    if type(old) is not type(new):
        return False
    if isinstance(old, (tuple, list)):
        return len(old) == len(new) and all(same(a, b) for a, b in zip(old, new))
    if isinstance(old, dict):
        return old.keys() == new.keys() and all(same(old[k], new[k]) for k in old)
    if isinstance(old, float) and math.isnan(old):
        return math.isnan(new)
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 - a value without a plain equality: taken as written
        return False
