"""Tensor parallel: module values as the whole model computes them.

Under ``tensor_parallel_size=N`` every worker runs every request's block on its
rank's part of the model. Some values are split across ranks: a column-parallel
linear's output (its segments, e.g. q, k and v, each split by heads), a
row-parallel linear's input, attention's heads, the gated activation between
them; a fused MoE whose caller all-reduces holds a partial sum. When a block or a
batched op touches such a location in a step, every rank puts the whole value
together (one collective, in the same order on every rank: their blocks and
specs are the same), serves it, and then writes its own part of the possibly
edited whole back into the module's value. Replicated values (decoder layers,
norms, row-parallel outputs, embeddings) and untouched locations cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

# since start, on this rank (the lane-stats RPC): split values put together, and their
# whole size in bytes (a replicated value read or edited adds nothing)
STATS = {"tp_wholes": 0, "tp_whole_bytes": 0}


@dataclass(frozen=True, slots=True)
class Split:
    """How a module's value is split across tensor-parallel ranks (the boundary says,
    :class:`Collectives`; looked up once per location by :class:`Splits`)."""

    kind: Literal["sharded", "partial", "refused"]
    # sharded: along the last dimension, each rank holding its slice of every segment;
    # the local sizes, or "whole"/"halves" of the local value
    segments: tuple[int, ...] | str = "whole"
    # sharded: the ranks in a row that hold each segment's same slice (KV heads
    # replicated when there are fewer than ranks); None: one rank each
    replicas: tuple[int, ...] | None = None
    reason: str = ""  # refused: why the value cannot be put together

    @classmethod
    def sharded(cls, segments: tuple[int, ...] | str, replicas: tuple[int, ...] | None = None) -> Split:
        return cls("sharded", segments, replicas)

    @classmethod
    def partial(cls) -> Split:
        """A per-rank partial sum (the caller all-reduces)."""
        return cls("partial")

    @classmethod
    def refused(cls, reason: str) -> Split:
        return cls("refused", reason=reason)


class Collectives(Protocol):
    """This worker's tensor-parallel group, as the boundary gives it (``boundary.parallel``)."""

    ranks: int
    rank: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...  # ranks' values side by side (last dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...  # their sum

    def split_of(self, module: torch.nn.Module, io: str) -> Split | None: ...  # NotImplementedError: cannot



def _sizes(segments: tuple[int, ...] | str, local: int) -> tuple[int, ...]:
    if segments == "whole":
        return (local,)
    if segments == "halves":
        return (local // 2, local - local // 2)
    if sum(segments) != local:
        raise ValueError(f"a split value of width {local} does not hold its segments {segments}")
    return segments  # type: ignore[return-value]


def _whole_sharded(x: torch.Tensor, sizes: tuple[int, ...], group: Collectives,
                   replicas: tuple[int, ...] | None = None) -> torch.Tensor:
    """The whole value: each segment's slices in rank order (a segment replicated on
    ``f`` ranks in a row, as KV heads when there are fewer than ranks, once per group)."""
    gathered = group.all_gather(x)  # [..., rank 0's segments, rank 1's, ...]
    per_rank = gathered.split(x.shape[-1], dim=-1)
    parts, offset = [], 0
    for i, size in enumerate(sizes):
        step = replicas[i] if replicas else 1
        parts.extend(p[..., offset : offset + size] for p in per_rank[::step])
        offset += size
    return torch.cat(parts, dim=-1)


def _write_sharded(x: torch.Tensor, whole: torch.Tensor, sizes: tuple[int, ...], ranks: int, rank: int,
                   replicas: tuple[int, ...] | None = None) -> None:
    local = full = 0
    for i, size in enumerate(sizes):
        step = replicas[i] if replicas else 1
        slot = rank // step
        x[..., local : local + size].copy_(whole[..., full + slot * size : full + (slot + 1) * size])
        local += size
        full += (ranks // step) * size


def gather(value: Any, split: Split, group: Collectives, inputs: bool = False) -> tuple[Any, Callable[[], None]]:
    """The whole value (a tensor, or a tuple whose first element is the split one, as
    a linear's ``(output, bias)``, whose bias slice is put together too; ``inputs``: a
    module's ``(args, kwargs)``, whose first argument is) and a function that writes
    this rank's part of it back into ``value`` if a block or op changed it."""
    if inputs:
        args, kwargs = value
        if not args or not isinstance(args[0], torch.Tensor):
            return value, lambda: None
        first, write_back = gather(args[0], split, group)
        return ((first, *args[1:]), kwargs), write_back
    element = 0 if isinstance(value, tuple) else None
    x = value[0] if element is not None else value
    if not isinstance(x, torch.Tensor):
        return value, lambda: None
    partial = split.kind == "partial"
    if partial:
        whole = group.all_reduce(x)
        before = whole.clone()
    else:
        sizes = _sizes(split.segments, x.shape[-1])
        whole = _whole_sharded(x, sizes, group, split.replicas)
    served = (whole, *value[1:]) if element is not None else whole
    if element is not None and not partial and _sharded_bias(value, x):
        # a column-parallel linear built with skip_bias_add returns its bias beside its
        # output, this rank's slice of it: served whole too, still a parameter (edits of
        # it are refused, so nothing is written back)
        bias = torch.nn.Parameter(_whole_sharded(value[1], sizes, group, split.replicas), requires_grad=False)
        served = (whole, bias, *value[2:])
        STATS["tp_wholes"] += 1
        STATS["tp_whole_bytes"] += bias.numel() * bias.element_size()
    STATS["tp_wholes"] += 1
    STATS["tp_whole_bytes"] += whole.numel() * whole.element_size()

    def write_back() -> None:  # (inference tensors keep no version counter: always, a copy)
        if partial:  # the caller sums the ranks' parts: rank 0 carries the change
            if group.rank == 0:
                x.add_(whole - before)
        else:
            _write_sharded(x, whole, sizes, group.ranks, group.rank, split.replicas)

    return served, write_back


def _sharded_bias(value: tuple, x: torch.Tensor) -> bool:
    """Whether a split linear's ``(output, bias)`` holds this rank's slice of its bias."""
    return len(value) > 1 and isinstance(value[1], torch.nn.Parameter) and value[1].dim() == 1 \
        and value[1].shape[0] == x.shape[-1]


class Splits:
    """Each location's split, looked up once per module."""

    def __init__(self, model: torch.nn.Module, group: Collectives | None):
        self.group = group
        self.ranks, self.rank = (group.ranks, group.rank) if group is not None else (1, 0)
        self._modules = {id(m): m for m in model.modules()} if self.ranks > 1 else {}
        self._known: dict[tuple, Split | None] = {}

    def of(self, key: tuple) -> Split | None:
        """The split of a location key ``(id(module), io)``; None when whole."""
        if self.ranks <= 1:
            return None
        found = self._known.get(key, False)
        if found is False:
            module = self._modules.get(key[0]) if len(key) == 2 else None
            io = "input" if key[-1] in ("input", "inputs") else "output"
            try:
                found = self.group.split_of(module, io) if module is not None else None
            except NotImplementedError as exc:
                found = Split.refused(str(exc))
            self._known[key] = found
        return found
