"""Walking the nested values a block sees and saves (tuples, lists, dicts of tensors).

One definition of "a nested value" for every walk: narrowing to a request's rows,
copying on save, moving to the engine's device, shipping to the CPU. Named tuples
and other objects are leaves.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch


def _container(value: Any) -> bool:
    return isinstance(value, (list, dict)) or (isinstance(value, tuple) and not hasattr(value, "_fields"))


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The same structure with ``fn`` applied to every tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is tuple:  # a decoder layer's (hidden, residual): no call per tensor
        return tuple(fn(v) if type(v) is torch.Tensor else map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        mapped = {k: map_tensors(v, fn) for k, v in value.items()}
        return defaultdict(value.default_factory, mapped) if isinstance(value, defaultdict) else mapped
    if isinstance(value, list):  # (a saved list of per-step rows: no call per row)
        return [fn(v) if type(v) is torch.Tensor else map_tensors(v, fn) for v in value]
    if _container(value):
        return tuple(map_tensors(v, fn) for v in value)
    return value


def leaves(value: Any) -> Iterator[Any]:
    """Every leaf (tensor or other object) of a nested value."""
    if isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    elif _container(value):
        for v in value:
            if type(v) is torch.Tensor:  # no generator per tensor (per-step rows)
                yield v
            else:
                yield from leaves(v)
    else:
        yield value
