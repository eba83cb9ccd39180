"""Edits that differ only in their value, applied as one.

Invokes that add (or set) a value of their own - a steering vector per prompt, a
strength sweep ``coefs[i] * v`` - record plans of their own, since the value is in
the plan, so their ops are distinct objects and group apart (:meth:`.batched.
BatchedEdits._groups`): one application per request at every step. At a location,
the step's consecutive groups whose ops are the same but for a tensor value, with no
request in two of them, are applied as one: each row's value picked from the stacked
values, one gather and one kernel, element for element what each group's own
application computes (every request's rows are its own, and a value is a constant).
Only picks of a few rows join (a decode step's); a prompt's many rows keep their own
application, which broadcasts the value instead of repeating it per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import arith
from .memo import IdentityMemo
from .plan_ops import _flat, row_index

KINDS = ("add", "set")  # edits whose value differs per invoke (scale's factor and zero have none)
MAX_ROWS = 4  # a pick of more rows this step (a prompt's) is applied on its own
STATS = {"joined": 0}  # picks applied as part of a run (engine-wide: nnsight_lane_stats)


def edit_key(op: dict[str, Any]) -> tuple | None:
    """What makes two ops one edit with two values: the op but its value (None: an op
    that takes no part, e.g. a read or a scale)."""
    if op["op"] not in KINDS or "value" not in op:
        return None
    return tuple(sorted((k, _frozen(v)) for k, v in op.items() if k != "value"))


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


class LikeEdits:
    """The runs of a location's picks, and a run's rows and picked values, kept per
    location for a steady batch (whose picks are the same objects every step): a decode
    step of a steered batch is one kernel per location."""

    def __init__(self) -> None:
        self._keys: IdentityMemo[tuple | None] = IdentityMemo(4096)  # op -> its edit_key
        self._runs: dict[Any, tuple[list[tuple], list[list[tuple]]]] = {}  # location -> (picks, runs)
        self._built: dict[Any, dict[int, tuple]] = {}  # location -> id(run) -> (run, what apply built)

    def forget(self) -> None:
        """Requests ended: nothing kept for their picks (picked values on the device too)."""
        self._runs.clear()
        self._built.clear()

    def runs(self, where: Any, picked: list[tuple]) -> list[list[tuple]]:
        """``picked`` (``(gkey, entry, spans, sessions)`` in the order they apply) in runs:
        consecutive like edits with no request in two of them (a request may have a
        block and an installed edit: two sessions), else one pick each."""
        last = self._runs.get(where)
        if last is not None and last[0] is picked:
            return last[1]
        out: list[list[tuple]] = []
        run: list[tuple] = []
        run_key: tuple | None = None
        seen: set[str] = set()
        for pick in picked:
            op = pick[1].op
            key = self._keys.get(op, lambda op=op: edit_key(op))
            requests = {s.req_id for s in pick[3]}
            if run and key is not None and key == run_key and seen.isdisjoint(requests):
                run.append(pick)
                seen |= requests
                continue
            run, run_key, seen = [pick], key, requests
            out.append(run)
        self._runs[where] = (picked, out)
        self._built[where] = {}  # (the last picks' runs only)
        return out

    def apply(self, where: Any, run: list[tuple], target: torch.Tensor,
              value_of: Callable[[dict[str, Any]], Any], fail: Callable[[tuple, Exception], None]) -> list[tuple]:
        """Apply ``run``'s edits to ``target`` (a location's per-token tensor) as one;
        ``value_of(op)``: an op's value (:meth:`.batched.BatchedEdits._value`). A pick
        whose value cannot join (a number, a shape not one row of the target's, a pick
        of many rows) is returned, to apply on its own; one whose value is bad, or
        whose joined application failed, is ended (``fail``)."""
        built = self._built.setdefault(where, {})  # (the runs of this location's last picks: runs())
        known = built.get(id(run))
        if known is None or known[0] is not run:
            known = built[id(run)] = (run, *self._build(run, target, value_of, fail))
        _, rows, operand, joined, alone = known
        if operand is None:
            return alone
        try:
            part = target[rows] if isinstance(rows, slice) else target.index_select(0, rows)
            arith.apply(run[0][1].op["op"], part, operand)
            if not isinstance(rows, slice):
                target.index_copy_(0, rows, part)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the run's requests end, not the step
            for pick in joined:
                fail(pick, exc)
            built.pop(id(run), None)
            return alone
        STATS["joined"] += len(joined)
        return alone

    @staticmethod
    def _build(run: list[tuple], target: torch.Tensor, value_of: Callable[[dict[str, Any]], Any],
               fail: Callable[[tuple, Exception], None]) -> tuple[Any, torch.Tensor | None, list[tuple], list[tuple]]:
        rest = tuple(target.shape[1:])
        joined: list[tuple[tuple, torch.Tensor]] = []
        alone: list[tuple] = []
        for pick in run:
            if sum(end - start for start, end in _flat(pick[2])) > MAX_ROWS:
                alone.append(pick)
                continue
            try:
                value = value_of(pick[1].op)
            except Exception as exc:  # noqa: BLE001 - a bad value ends the requests that sent it
                fail(pick, exc)
                continue
            row = _one_row(value, rest)
            if row is None:
                alone.append(pick)
            else:
                joined.append((pick, row))
        if len(joined) < 2:
            return None, None, [], alone + [pick for pick, _ in joined]
        spans = sorted((start, end, k) for k, (pick, _) in enumerate(joined) for start, end in _flat(pick[2]))
        owner = torch.from_numpy(np.concatenate([np.full(end - start, k) for start, end, k in spans]))
        rows = row_index([(start, end) for start, end, _ in spans], target.device)
        stacked = torch.stack([row for _, row in joined])
        operand = stacked.index_select(0, owner.to(stacked.device, non_blocking=True))
        return rows, operand, [pick for pick, _ in joined], alone


def _one_row(value: Any, rest: tuple[int, ...]) -> torch.Tensor | None:
    """A tensor value as one row of the target's shape (``rest``), else None: a number,
    a 0-dim tensor (an operand PyTorch treats as a number: it rounds to the target's
    dtype first, a row would not), or a shape that is not one row of the target's."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    while value.dim() > len(rest) and value.shape[0] == 1:
        value = value[0]
    try:
        return value.expand(rest)
    except RuntimeError:
        return None
