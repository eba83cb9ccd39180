"""What a block saves is a copy: vLLM reuses its buffers (and on CUDA writes a
layer's output in place later in the step), so a saved tensor, and every tensor
put into a saved list or dict afterwards, is copied unless the block made it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .tree import map_tensors


def copy_value(value: Any, owned: Callable[[torch.Tensor], bool] | None = None) -> Any:
    """A private copy of what is saved: vLLM's kernels overwrite buffers later. A
    tensor the block made itself (``owned``, e.g. ``out[0] + out[1]``) is kept as is:
    one device copy less per saved tensor per step."""
    if owned is None:
        return map_tensors(value, lambda t: t.detach().clone())
    return map_tensors(value, lambda t: t.detach() if owned(t) else t.detach().clone())


class SavedList(list):
    """A list a block saved: a tensor put into it later is kept as a copy, as ``.save()``
    copies (vLLM's kernels write into their buffers in place later in the step, e.g. the
    next layer's fused residual add and norm into this layer's output)."""

    def __init__(self, items: Any = (), copy: Callable[[Any], Any] = lambda v: v):
        super().__init__(items)
        self._copy = copy

    def append(self, value: Any) -> None:
        super().append(self._copy(value))

    def extend(self, values: Any) -> None:
        super().extend(self._copy(v) for v in values)

    def insert(self, index: Any, value: Any) -> None:
        super().insert(index, self._copy(value))

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, [self._copy(v) for v in value] if isinstance(index, slice) else self._copy(value))

    def __iadd__(self, values: Any) -> SavedList:
        self.extend(values)
        return self


class SavedDict(dict):
    """A dict a block saved: values put into it later are kept as copies (see SavedList).
    A saved ``defaultdict`` keeps its ``default_factory``: a missing key gets a fresh
    value, itself a saved container (``d[k].append(h)`` copies ``h``)."""

    def __init__(self, items: Any = (), copy: Callable[[Any], Any] = lambda v: v,
                 default_factory: Callable[[], Any] | None = None):
        super().__init__(items)
        self._copy = copy
        self.default_factory = default_factory

    def __missing__(self, key: Any) -> Any:
        if self.default_factory is None:
            raise KeyError(key)
        value = saved_containers(self.default_factory(), self._copy)
        super().__setitem__(key, value)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, self._copy(value))

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


def saved_containers(value: Any, copy: Callable[[Any], Any]) -> Any:
    """``value`` with its lists and dicts (nested too) as Saved ones that copy what is
    put into them; the rest as it is."""
    if isinstance(value, list) and not isinstance(value, SavedList):
        return SavedList((saved_containers(v, copy) for v in value), copy)
    if isinstance(value, dict) and not isinstance(value, SavedDict):
        return SavedDict(((k, saved_containers(v, copy)) for k, v in value.items()), copy,
                         getattr(value, "default_factory", None))
    return value
