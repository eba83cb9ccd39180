"""A bounded memo keyed by an object's identity, for values derived from objects that
do not hash (spec dicts, vLLM configs) and are sent again as the very same object (a
payload text the codec keeps parses to one spec for every request that sends it)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")
# plans the engine keeps (lower.Lowerings), and the entries of the memos derived from them:
# a trace's invokes with a value each (a sweep) have a plan each
PLANS_KEPT = 1024


class IdentityMemo(Generic[V]):
    """``get(obj, compute)``: ``compute()``'s value, once per object (and ``extra``). An entry holds its
    object, so an ``id`` reused by a new object never finds the old value. Bounded:
    emptied when full (callers hold a few objects at a time; a flood of new ones only
    computes again)."""

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._held: dict[tuple[int, Hashable], tuple[Any, V]] = {}

    def get(self, obj: Any, compute: Callable[[], V], extra: Hashable = None, keep: bool = True) -> V:
        """``extra``: a second part of the key (values that differ per request for one
        object). Not ``keep``: computed and not stored (an object no other caller will
        send: keeping it would only keep it alive)."""
        key = (id(obj), extra)
        hit = self._held.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        value = compute()
        if keep:
            if len(self._held) >= self.limit:
                self._held.clear()
            self._held[key] = (obj, value)
        return value

    def __len__(self) -> int:
        return len(self._held)
