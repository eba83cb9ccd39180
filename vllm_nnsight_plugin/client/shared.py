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


def snapshot(value: Any, _path: frozenset[int] = frozenset()) -> Any:
    """What a shared container holds before the invokes run: its items, and those of
    the lists and dicts in it, recursively (the items themselves, not copies: nothing
    changes the caller's container until :func:`merge`; a container inside itself is
    taken as a value)."""
    if shareable(value) and id(value) not in _path:
        path = _path | {id(value)}
        if type(value) is list:
            return ("list", [snapshot(v, path) for v in value])
        return ("dict", {k: snapshot(v, path) for k, v in value.items()})
    return ("value", value)


def merge(shared: Any, before: Any, returned: Any) -> None:
    """Fold one invoke's copy (``returned``) into the caller's container ``shared``,
    whose :func:`snapshot` was ``before``. (A copy comes back without shared
    references: an inner list held in two slots returns as two lists, and each is
    merged into the one the caller holds.)"""
    kind, held = before
    if kind == "list":
        if len(returned) < len(held):  # (items removed: the invoke's list as it left it)
            shared[:] = returned
            return
        for i, old in enumerate(held):
            if i < len(shared):  # (an earlier invoke may have shortened it)
                _merge_item(shared, i, old, returned[i])
        shared.extend(returned[len(held):])
    elif kind == "dict":
        for key in held:
            if key not in returned:
                shared.pop(key, None)
        for key, new in returned.items():
            old = held.get(key, _ABSENT)
            if old is _ABSENT:
                shared[key] = new
            elif key in shared:
                _merge_item(shared, key, old, new)
            elif not unchanged(old, new):  # (an earlier invoke removed it, this one wrote it)
                shared[key] = new


def _merge_item(shared: Any, key: Any, old: Any, new: Any) -> None:
    kind, value = old
    if kind == "value":
        if not same(value, new):
            shared[key] = new
        return
    container = list if kind == "list" else dict
    if type(new) is not container:
        shared[key] = new  # (the invoke put something else there)
    elif type(shared[key]) is container:  # (else an earlier invoke put something else there)
        merge(shared[key], old, new)  # (the caller's inner container keeps its identity)


def unchanged(before: Any, new: Any) -> bool:
    """Whether an invoke's copy ``new`` is what :func:`snapshot` saw (``before``)."""
    kind, held = before
    if kind == "value":
        return same(held, new)
    if kind == "list":
        return type(new) is list and len(new) == len(held) and all(unchanged(h, n) for h, n in zip(held, new))
    return type(new) is dict and new.keys() == held.keys() and all(unchanged(held[k], new[k]) for k in held)


def same(old: Any, new: Any, _depth: int = 0) -> bool:
    """Whether an invoke's copy of a value is the value it was sent: equal (tensors by
    their values, a copy comes back on the CPU; NaN equals NaN; tuples and lists item
    by item, a named tuple being a tuple; a bool is not an int)."""
    if _depth > 64:  # (a value inside itself)
        return False
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
    if isinstance(old, bool) or isinstance(new, bool):  # (True == 1, but a write of True is a write)
        return type(old) is type(new) and old == new
    if isinstance(old, (tuple, list)):  # (a named tuple comes back a tuple: compared item by item)
        if not isinstance(new, (tuple, list)):
            return False
        return len(old) == len(new) and all(same(a, b, _depth + 1) for a, b in zip(old, new))
    if isinstance(old, dict):
        return isinstance(new, dict) and old.keys() == new.keys() \
            and all(same(old[k], new[k], _depth + 1) for k in old)
    if isinstance(old, float) and math.isnan(old):
        return isinstance(new, float) and math.isnan(new)
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 - a value without a plain equality: taken as written
        return False
