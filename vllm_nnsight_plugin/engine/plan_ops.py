"""A batched plan's operations in a step: when an op is due, which rows of the
step's flat batch it touches (whole spans, positions, a prompt's chunk), and how a
value's structure is checked against it. Shared by the Python path (:mod:`.batched`)
and the lanes (:mod:`.lane_plans`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .rows import per_token
from .spec_runner import absolute_rows, pick_index

if TYPE_CHECKING:
    from .rows import Chunk
    from .session import RequestSession


LOGITS = ("logits",)  # the location key of the logits rows (one per request, before sampling)


@dataclass
class Entry:
    session: RequestSession
    op: dict[str, Any]
    number: int  # position in the spec (order within a location, error messages)
    block: int  # position of the spec among the request's blocks (edits first)
    seq: int  # the op's first admission: identical ops share it; groups apply in this order


def check_structure(op: dict[str, Any], value: Any) -> None:
    """An op of a lowered block (engine/lower.py) assumed its module returns
    ``structure`` (0: one tensor, N: a tuple of N tensors), from the forward's
    annotation: refuse a value that is not that, rather than index it otherwise."""
    want = op.get("structure")
    if want is None:
        return
    if want == 0:
        fits = isinstance(value, torch.Tensor)
    else:
        fits = type(value) is tuple and len(value) == want and isinstance(value[0], torch.Tensor) \
            and all(v is None or isinstance(v, torch.Tensor) for v in value[1:])  # (a linear's bias: None)
    if not fits:
        got = f"a tuple of ({', '.join(type(v).__name__ for v in value)})" if isinstance(value, tuple) \
            else f"a {type(value).__name__}"
        said = "a tensor" if want == 0 else f"a tuple of {want} tensors"
        raise TypeError(f"{op['module']}.output is {got}, not {said} as its forward's annotation says; the "
                        "block ran as a batched spec on that annotation: send it with extra_args "
                        "{'nnsight_lower': False} to run it as code")


def _code_fits(op: dict[str, Any], code: str) -> bool:
    """Whether a tap site's value (its code, see taps.rebuild) is the op's ``structure``."""
    want = op.get("structure")
    if want is None or want == 0:
        return want is None or code == "T"
    # (a tensor first; then tensors, or None where a linear has no bias)
    return len(code) == want + 1 and code[:2] == "(T" and set(code[2:]) <= {"T", "N"}


def _where(entry: Entry) -> str:
    """How an error names the op: ``ops[N] (add model.layers.8)``."""
    return f"ops[{entry.number}] ({entry.op['op']} {entry.op.get('module', 'logits')})"


def is_due(op: dict[str, Any], step: int) -> bool:
    steps = op.get("steps", "prefill")
    if steps == "all":
        return True
    if steps == "prefill":
        return step == 0
    if steps == "generated":
        return step != 0
    return step in _step_set(steps)


_STEP_SETS: dict[int, tuple[list[int], frozenset[int]]] = {}


def _step_set(steps: list[int]) -> frozenset[int]:
    """An explicit step list as a set (once per list: a payload's ops are shared)."""
    known = _STEP_SETS.get(id(steps))
    if known is None or known[0] is not steps:
        if len(_STEP_SETS) > 4096:
            _STEP_SETS.clear()
        known = _STEP_SETS[id(steps)] = (steps, frozenset(steps))
    return known[1]


def _chunk_rows(span: tuple[int, int], positions: list[int] | int, chunk: Chunk) -> Rows:
    """The rows of ``positions`` (counted in the whole prompt) in this chunk of it."""
    start = chunk.start
    rows = absolute_rows(chunk.prompt_len, positions)
    return Rows(span[0] + q - start for q in rows if start <= q < start + span[1] - span[0])


class Rows(tuple):
    """A request's rows an op picks with ``positions`` (row numbers in the batch)."""


def row_index(spans: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    """Sorted row spans as one slice where they follow one another (no gap, and no row
    twice: ``positions: [0, -1]`` at a decode step names its row twice), else one index
    tensor on ``device`` (built with numpy, uploaded without waiting)."""
    if all(b[0] == a[1] for a, b in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in spans])).to(device, non_blocking=True)


def _flat(spans: list[Any]) -> list[tuple[int, int]]:
    """Spans and picked rows as ``(start, end)`` runs."""
    out = []
    for span in spans:
        if isinstance(span, Rows):
            out.extend((r, r + 1) for r in span)
        else:
            out.append(span)
    return out


def _gathered(op: dict[str, Any], value: Any, spans: list[Any], num_tokens: int) -> tuple[Any, list, int]:
    """A read's picked rows of every request, gathered in request order: the value
    to read, each request's span in it, and its row count."""
    index = [r for span in spans for r in span]
    local, at = [], 0
    for span in spans:
        local.append((at, at + len(span)))
        at += len(span)

    def pick(t: Any) -> Any:
        if not per_token(t, num_tokens) and t is not value:  # (a tuple's shared element: a bias)
            return t
        t = _per_token_tensor({}, t, num_tokens)
        return t.index_select(0, torch.tensor(index, device=t.device))

    if isinstance(value, (tuple, list)):  # (every tensor: index picks one afterwards)
        return type(value)(pick(v) if isinstance(v, torch.Tensor) else v for v in value), local, len(index)
    return pick(value), local, len(index)


def _view(rows: torch.Tensor, start: int, end: int, op: dict[str, Any]) -> torch.Tensor:
    """A request's rows of a read; one picked position (an int) drops the row dimension."""
    return rows[start] if _one_row(op) else rows[start:end]


def _one_row(op: dict[str, Any]) -> bool:
    """The op picks one position (an int): its value per step is that row, a vector."""
    return isinstance(op.get("positions"), int)


def _per_token_tensor(op: dict[str, Any], value: Any, num_tokens: int) -> torch.Tensor:
    value = pick_index(value, op.get("index"))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the value is a {type(value).__name__}: set 'index'")
    if isinstance(value, torch.nn.Parameter):
        raise ValueError(f"the value (shape {tuple(value.shape)}) is one of the model's parameters (a "
                         "linear's bias, returned beside its output): it is not per request")
    if not per_token(value, num_tokens):
        raise ValueError(f"the value (shape {tuple(value.shape)}) has no row per token of the batch "
                         f"({num_tokens}): it cannot be split per request")
    return value
