"""Runs a declarative spec (``kind: "spec"``) as a request's block.

The spec becomes an ordinary block: this trusted function, running in the
request's greenlet, reads and edits through the same envoys as user code.
Operations are applied in forward order within each step (module order, input
before output, logits last); operations on one location keep the spec's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..payload import spec as specmod
from . import arith
from .guards import check_writable

if TYPE_CHECKING:
    from .interleave import Interleaver
    from .session import RequestSession


def _rows(value: torch.Tensor, positions: list[int] | int | None) -> Any:
    """The request's rows that ``positions`` picks (an int: that row alone)."""
    if positions is None:
        return None
    rows = absolute_rows(value.shape[0], positions)
    return rows[0] if isinstance(positions, int) else torch.tensor(rows, device=value.device)


def absolute_rows(n: int, positions: list[int] | int) -> list[int]:
    """``positions`` (negative from the end) as row numbers among a request's ``n``
    rows this step."""
    rows = []
    for p in [positions] if isinstance(positions, int) else positions:
        q = p + n if p < 0 else p
        if not 0 <= q < n:
            raise IndexError(f"position {p} is out of range: this step has {n} rows for the request")
        rows.append(q)
    return rows


def read_value(value: Any, op: dict[str, Any]) -> Any:
    """What a read op saves of a location's value: the ``index`` element, or with
    ``"sum": true`` the sum of its tensors (a decoder layer's residual stream)."""
    if not op.get("sum"):
        return pick_index(value, op.get("index"))
    parts = [value] if isinstance(value, torch.Tensor) else \
        [v for v in value if v is not None] if isinstance(value, (tuple, list)) else []
    if not parts or not all(isinstance(v, torch.Tensor) for v in parts):
        raise TypeError(f"'sum' needs tensors, but the value is a {type(value).__name__}")
    total = parts[0]
    for part in parts[1:]:
        total = total + part  # a new tensor (the live ones stay as they are)
    return total if len(parts) > 1 else total.clone()


def pick_index(value: Any, index: int | None) -> Any:
    """The op's ``index`` element of a tuple-valued location (the value itself if None)."""
    if index is None:
        return value
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"index {index} given, but the value is a {type(value).__name__}, not a tuple")
    return value[index]


def _location(inter: Interleaver, op: dict[str, Any]) -> Any:
    """The op's value at its location (its ``index`` element, or a read's ``sum``)."""
    envoy = inter.envoy_at(op["module"])
    return read_value(envoy.input if op.get("io", "output") == "input" else envoy.output, op)


def _apply(inter: Interleaver, session: RequestSession, op: dict[str, Any], out: dict[str, Any]) -> None:
    kind = op["op"]
    if kind == "logits_topk":
        vals, ids = inter.root.logits[0].float().topk(op["k"])
        out["value"] = {"values": vals.clone(), "ids": ids.clone()}
        return
    if kind == "logits":  # (the request's row, as the batched read gives it)
        out["value"] = session.save(inter.root.logits)
        return
    value = _location(inter, op)
    if kind == "read":
        if isinstance(value, torch.Tensor) and op.get("positions") is not None:
            value = value[_rows(value, op["positions"])]
        out["value"] = session.save(value)
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op['module']}.{op.get('io', 'output')} is a {type(value).__name__}: set 'index'")
    check_writable(value, f"{op['module']}.{op.get('io', 'output')}")
    rows = _rows(value, op.get("positions"))
    operand = arith.operand(op["value"], value) if "value" in op else None
    if rows is None:
        arith.apply(kind, value, operand, op.get("factor", 1.0))
    else:
        value[rows] = arith.apply(kind, value[rows], operand, op.get("factor", 1.0))


def run_spec(model: Any, tracer: Any, *, ops: list[tuple[int, dict[str, Any]]], session: RequestSession,
             inter: Interleaver) -> None:
    """The body of a spec request's block; ``ops``: each with its number in the spec as
    sent (:func:`..payload.spec.numbered`: what an error names)."""
    ns = session.namespace
    if not ops:  # (a spec of result ops only: admission bound them)
        return
    plan = sorted(
        ops,
        key=lambda numbered: (
            inter.module_rank(numbered[1]["module"]) if "module" in numbered[1] else float("inf"),  # (logits last)
            0 if numbered[1].get("io") == "input" else 1,
            numbered[0],
        ),
    )
    filters = [specmod.step_filter(op.get("steps")) for _, op in plan]
    open_ended = any(f.generated for f in filters)
    last = None if open_ended else max(f.last for f in filters)
    for _, op in plan:
        if "name" in op and not specmod.is_single(op):
            ns[op["name"]] = session.save([])
    steps = tracer.all() if open_ended else tracer.iter[: last + 1]
    for step in steps:
        for (number, op), f in zip(plan, filters):
            if not ((f.explicit is not None and step in f.explicit) or (f.generated and step >= 1)
                    or (op.get("steps") == "all")):
                continue
            out: dict[str, Any] = {}
            try:
                _apply(inter, session, op, out)
            except Exception as exc:  # noqa: BLE001 - name the operation that failed
                msg = f"ops[{number}] ({op['op']} {op.get('module', 'logits')}): {exc}"
                try:
                    named = type(exc)(msg)
                except Exception:  # noqa: BLE001 - exception types with other signatures
                    named = RuntimeError(msg)
                raise named from None
            name = op.get("name")
            if name is None:
                continue
            if specmod.is_single(op):
                ns[name] = session.save(out["value"])
            else:
                ns[name].append(out["value"])
                session.touch(ns[name])
