"""A batched read's rows of one request across steps, kept where the step put them.

A per-step read (``"steps": "all"``) of 256 requests would otherwise keep a tensor
view per request per step: 32 768 views for 128 steps, each a few microseconds to
make and again to walk, measure and concatenate when the request ends, which is the
step that ships everything. Instead a step's rows for the whole batch go into a
shared host block (:func:`.host.put_rows`) and each request only notes which rows
are its own; when it ends, one ``index_select`` per block gathers them straight into
the buffer that leaves the worker. To the client it is a list of per-step tensors
(``{"$tensors"}``, see :mod:`..payload.values`).

A value that is not one tensor per step (a tuple such as ``(hidden, residual)``
read without ``index``) is kept as a list of per-step views; in a step where a
prompt comes in chunks, as a :class:`TupleLog` (a log per element).

A prompt split by chunked prefill gives its rows over several engine steps: each
chunk continues the prompt's step (``add(..., cont=True)``), and a read of the
prompt alone (``single``) is one tensor of all of them, in order.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import torch

from ..payload import values as tagged
from .tree import leaves


class RowLog:
    """Per-step rows of one request: runs of ``(host block, row numbers)`` and the
    number of rows each step gave; or, for values that are not one tensor, a list."""

    __slots__ = ("counts", "_runs", "_items", "squeeze", "single")

    def __init__(self, squeeze: bool = False, single: bool = False) -> None:
        self.squeeze = squeeze  # one row per step, given as a vector (a read of x[-1])
        self.single = single  # the prompt's rows only: one tensor, not a list
        self.counts: list[int] = []  # rows per step, in step order
        self._runs: list[tuple[torch.Tensor, array]] = []  # (block, its rows, in order)
        self._items: list[Any] | None = None  # per-step values that are not one tensor

    def add(self, block: torch.Tensor, start: int, end: int, cont: bool = False) -> None:
        """This step's rows are ``block[start:end]`` (``cont``: more rows of the step
        added last, a later chunk of its prompt)."""
        if self._items is not None:
            raise TypeError("the read's value changed from a tuple to one tensor between steps")
        runs = self._runs
        if not runs or runs[-1][0] is not block:
            runs.append((block, array("q")))
        rows = runs[-1][1]
        if end - start == 1:
            rows.append(start)
        else:
            rows.extend(range(start, end))
        if cont and self.counts:
            self.counts[-1] += end - start
        else:
            self.counts.append(end - start)

    def append(self, value: Any) -> None:
        """This step's value, kept as it is (not one tensor)."""
        if self._runs:
            raise TypeError("the read's value changed from one tensor to a tuple between steps")
        if self._items is None:
            self._items = []
        self._items.append(value)

    def latest(self) -> Any:
        """The last value kept with :meth:`append` (None: none)."""
        return self._items[-1] if self._items else None

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else len(self.counts)

    def _like(self) -> torch.Tensor | None:
        return self._runs[0][0] if self._runs else None

    def nbytes(self) -> int:
        like = self._like()
        if like is None:
            return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes()
                       for t in leaves(self._items or ()) if isinstance(t, (torch.Tensor, TupleLog)))
        return sum(self.counts) * like[:1].numel() * like.element_size()

    def count(self) -> int:
        """Leaf values, as a list of the per-step values would count them."""
        if self.single:
            return 1
        if self._items is not None:
            return sum(t.count() if isinstance(t, TupleLog) else 1 for t in leaves(self._items))
        return len(self.counts)

    def tensors(self) -> list[Any]:
        """The per-step values (views of the host blocks; after :func:`.host.wait`)."""
        if self._items is not None:
            return list(self._items)
        if not self._runs:
            return []  # no step gave rows (the request failed first)
        flat = self._gather(None)
        out, offset = [], 0
        for n in self.counts:
            out.append(flat[offset] if self.squeeze else flat[offset : offset + n])
            offset += n
        return out

    def _gather(self, out: torch.Tensor | None) -> torch.Tensor:
        like = self._like()
        assert like is not None
        total = sum(self.counts)
        if out is None:
            out = torch.empty((total, *like.shape[1:]), dtype=like.dtype)
        offset = 0
        for block, rows in self._runs:
            index = torch.frombuffer(rows, dtype=torch.int64) if rows else torch.empty(0, dtype=torch.int64)
            torch.index_select(block, 0, index, out=out[offset : offset + len(rows)])
            offset += len(rows)
        return out

    def __nnsight_encode__(self, binary: bool) -> Any:
        """The result form of the per-step list: one ``$tensors`` buffer, gathered
        straight into it (read after :func:`.host.wait`)."""
        if self.single:
            flat = self._gather(None)
            return tagged.encode(flat[0] if self.squeeze else flat, binary)
        like = self._like()
        if like is None or len(self.counts) < 2 or not binary:
            return tagged.encode(self.tensors(), binary)
        inner = list(like.shape[1:])
        data = tagged.buffer(sum(self.counts) * math.prod(inner) * like.element_size())  # (all gathered into)
        if data.size:
            self._gather(torch.from_numpy(data).view(like.dtype).view(-1, *inner))
        # one shape list per distinct row count, repeated (128 steps of one row each are
        # one list, not 128: the cyclic GC then has a few hundred objects per batch to
        # track, not 32 768)
        shape_of: dict[int, list[int]] = {}
        shapes = [shape_of.setdefault(n, inner if self.squeeze else [n, *inner]) for n in self.counts]
        return tagged.tensors_tag(like.dtype, shapes, data)


class TupleLog:
    """One step's read of a whole tuple (``(hidden, residual)``, a linear's ``(output,
    bias)``) whose prompt may come in chunks: a :class:`RowLog` of the prompt's rows
    per element that has a row per token, in order, and the other elements (a bias,
    the same for every request) as they are. Encodes as the tuple."""

    __slots__ = ("kind", "parts")

    def __init__(self, kind: type, parts: list[Any]) -> None:
        self.kind = kind
        self.parts = parts  # a RowLog per per-token element; the others as they are

    def add(self, placed: list[tuple[torch.Tensor, int] | None], start: int, end: int, cont: bool) -> None:
        """This chunk's rows ``start:end`` of each per-token element's ``(block, first)``."""
        for part, where in zip(self.parts, placed):
            if where is not None:
                part.add(where[0], where[1] + start, where[1] + end, cont)

    def nbytes(self) -> int:
        return sum(p.nbytes() if isinstance(p, RowLog) else p.numel() * p.element_size()
                   for p in self.parts if isinstance(p, (RowLog, torch.Tensor)))

    def count(self) -> int:
        return len(self.parts)

    def __nnsight_encode__(self, binary: bool) -> Any:
        return tagged.encode(self.kind(self.parts), binary)  # (kind: tuple or list)
