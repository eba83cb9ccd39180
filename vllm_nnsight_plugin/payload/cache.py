"""``tracer.cache()``'s result: every cached module's values, by module path.

As in nnsight, keys are full envoy paths from the root, which is called
``model`` (``"model.model.layers.0"`` for vLLM's Llama), and a node is reached by
key (``cache["model.model.layers.0"]``), by attribute (``cache.model.model.layers[0]``;
a first name other than the root's skips it: ``cache.lm_head``) or by index. A module's
``.output`` is its value at its one visit, or the list of its values at each
visit (one per engine step when the request generates several tokens);
``.inputs`` is ``((first input,), {})`` per visit (the engine keeps a module's
first input only) and ``.input`` that first input.

On the wire a cache is ``{"$cache": {"entries": [[path, io, kind, parts], ...],
"dtype": name | null}}``: ``path`` without the root's name, ``io`` ``"output"`` or
``"input"``, ``kind`` ``"tensor"`` (``parts``: one encoded list of per-visit
values) or ``"tuple"`` (one such list per element of the module's tuple).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ROOT = "model"  # the root envoy's name in nnsight's paths


@dataclass
class Entry:
    """One visit to a module (an engine step of the request)."""

    output: Any = None
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    @property
    def input(self) -> Any:
        if self.inputs is None:
            return None
        args, kwargs = self.inputs
        return (list(args) + list(kwargs.values()))[0]


class Cache:
    """``{full module path: [Entry per visit]}``."""

    def __init__(self, entries: dict[str, list[Entry]]):
        self.entries = entries

    def view(self) -> CacheView:
        return CacheView(self, None)


def _full(path: str) -> str:
    return f"{ROOT}.{path}" if path else ROOT


def decode(body: Any, decode_value: Callable[[Any], Any], dtypes: dict[str, Any]) -> CacheView:
    """The view of a ``$cache`` body; ``decode_value`` decodes one encoded value,
    ``dtypes`` maps a dtype's name to it."""
    if not isinstance(body, dict) or not isinstance(body.get("entries"), list):
        raise ValueError("malformed cache value")
    dtype = body.get("dtype")
    cast = dtypes[dtype] if dtype is not None else None
    entries: dict[str, list[Entry]] = {}
    for path, io, kind, parts in body["entries"]:
        if kind == "tuple":
            columns = [_visits(decode_value(p)) for p in parts]
            visits: list[Any] = [tuple(v) for v in zip(*columns)]
        else:
            visits = _visits(decode_value(parts[0]))
        if cast is not None:
            visits = [_cast(v, cast) for v in visits]
        slot = entries.setdefault(_full(path), [])
        while len(slot) < len(visits):
            slot.append(Entry())
        for entry, value in zip(slot, visits):
            if io == "output":
                entry.output = value
            else:
                entry.inputs = ((value,), {})
    return Cache(entries).view()


def _visits(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


class CacheView:
    """A node of the cache: the root (above ``model``) or a module path."""

    __slots__ = ("_cache", "_path")

    def __init__(self, cache: Cache, path: str | None):
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_path", path)

    def _entries(self) -> list[Entry]:
        if self._path is None:
            raise KeyError("the cache root is not a module: pick one, e.g. cache.model.model.layers[0]")
        found = self._cache.entries.get(self._path)
        if found is None:
            raise KeyError(f"{self._path!r} was not cached")
        return found

    def _values(self, attr: str) -> Any:
        values = [getattr(entry, attr) for entry in self._entries()]
        return values[0] if len(values) == 1 else values

    @property
    def output(self) -> Any:
        return self._values("output")

    @property
    def inputs(self) -> Any:
        return self._values("inputs")

    @property
    def input(self) -> Any:
        return self._values("input")

    def keys(self) -> list[str]:
        """The cached module paths at or below this node (all of them at the root)."""
        if self._path is None:
            return list(self._cache.entries)
        return [k for k in self._cache.entries if k == self._path or k.startswith(self._path + ".")]

    def _known(self, path: str) -> bool:
        return any(k == path or k.startswith(path + ".") for k in self._cache.entries)

    def _child(self, name: str) -> CacheView:
        if self._path is None:
            path = ROOT if name == ROOT else f"{ROOT}.{name}"  # (the short form skips the root's name)
        else:
            path = f"{self._path}.{name}"
        if not self._known(path):
            raise AttributeError(f"{path!r} was not cached (cached: {', '.join(self.keys()[:8])}"
                                 f"{', ...' if len(self.keys()) > 8 else ''})")
        return CacheView(self._cache, path)

    def __getattr__(self, name: str) -> CacheView:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._child(name)

    def __getitem__(self, key: str | int) -> CacheView:
        if isinstance(key, int):
            return self._child(str(self._index(key)))
        if not isinstance(key, str):
            raise TypeError(f"a cache is indexed by a module path or a list index, not {type(key).__name__}")
        if "." in key or self._path is None and key == ROOT:  # a full path, from the root
            if key in self._cache.entries or self._known(key):
                return CacheView(self._cache, key)
            raise KeyError(f"{key!r} was not cached")
        return self._child(key)

    def _index(self, i: int) -> int:
        """A module list's index (negative from its end)."""
        prefix = (self._path or ROOT) + "."
        found = {int(rest.split(".")[0]) for k in self._cache.entries if k.startswith(prefix)
                 and (rest := k[len(prefix):]).split(".")[0].isdigit()}
        if not found:
            raise IndexError(f"{self._path or 'the cache root'} is not a cached module list")
        n = max(found) + 1
        j = i + n if i < 0 else i
        if j not in found:
            raise IndexError(f"index {i} is out of range for {self._path} (0..{n - 1} cached)")
        return j

    def __contains__(self, key: str) -> bool:
        try:
            node = self[key]
        except (AttributeError, IndexError, KeyError):
            return False
        return node._path in self._cache.entries

    def __len__(self) -> int:
        return len(self._entries())

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __repr__(self) -> str:
        at = "root" if self._path is None else repr(self._path)
        keys = self.keys()
        return f"CacheView({at}, {len(keys)} modules cached)"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a cache is read-only")

    def __reduce__(self) -> tuple:
        return CacheView, (self._cache, self._path)
