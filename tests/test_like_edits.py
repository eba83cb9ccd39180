"""Like edits with a value each, applied as one (engine/like_edits.py): the runs a
step's picks are cut into, and one application equal, element for element, to each
pick's own (``BatchedEdits._apply_one``: the rows as a view or an index, one edit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_nnsight_plugin.engine import arith
from vllm_nnsight_plugin.engine.batched import BatchedEdits
from vllm_nnsight_plugin.engine.like_edits import MAX_ROWS, LikeEdits, edit_key


def _op(kind: str, value, module: str = "model.layers.1", **more) -> dict:
    return {"op": kind, "module": module, "index": 0, "steps": "all", "value": value, **more}


def _pick(op: dict, spans: list[tuple[int, int]], *requests: str) -> tuple:
    sessions = [SimpleNamespace(req_id=r) for r in requests or (str(id(op)),)]
    return ((0, 0, 0), SimpleNamespace(op=op), spans, sessions)


def _own(x: torch.Tensor, picks: list[tuple]) -> torch.Tensor:
    """Each pick applied on its own, as the batched runner's one-by-one path does."""
    x = x.clone()
    for _, entry, spans, _ in picks:
        rows = BatchedEdits._rows_of(SimpleNamespace(_row_indexes={}), spans, x.device)
        target = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        arith.apply(entry.op["op"], target, arith.operand(entry.op["value"], x))
        if not isinstance(rows, slice):
            x.index_copy_(0, rows, target)
    return x


def _joined(x: torch.Tensor, picks: list[tuple], like: LikeEdits | None = None) -> tuple[torch.Tensor, list]:
    x = x.clone()
    like = like or LikeEdits()
    runs = like.runs("here", picks)
    assert len(runs) == 1, runs
    left = like.apply("here", runs[0], x, lambda op: arith.operand(op["value"], x), _no_fail)
    return x, left


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def test_ops_that_differ_only_in_their_value_have_one_key():
    assert edit_key(_op("add", [1.0])) == edit_key(_op("add", [2.0]))
    assert edit_key(_op("add", [1.0], steps=[1, 2])) == edit_key(_op("add", [2.0], steps=[1, 2]))
    assert edit_key(_op("add", [1.0])) != edit_key(_op("set", [1.0]))
    assert edit_key(_op("add", [1.0])) != edit_key(_op("add", [1.0], module="model.layers.2"))
    assert edit_key(_op("add", [1.0])) != edit_key(_op("add", [1.0], steps="generated"))
    assert edit_key({"op": "scale", "module": "m", "factor": 0.5}) is None
    assert edit_key({"op": "read", "module": "m", "name": "x"}) is None


def test_a_run_never_holds_a_request_twice_and_breaks_at_another_edit():
    p1, p2 = _pick(_op("add", [1.0]), [(0, 1)], "a"), _pick(_op("add", [2.0]), [(1, 2)], "b")
    p3 = _pick(_op("add", [3.0]), [(0, 1)], "a")  # (a's second edit, e.g. an installed edit's: a run of its own)
    p4 = _pick(_op("set", [4.0]), [(1, 2)], "b")
    assert LikeEdits().runs("here", [p1, p2, p3, p4]) == [[p1, p2], [p3], [p4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["add", "set"])
def test_one_application_equals_each_picks_own_bit_for_bit(kind, dtype):
    torch.manual_seed(0)
    x = torch.randn(9, 16).to(dtype)
    x[4, 3] = float("nan")  # (non-finite rows: as eager torch gives them)
    x[7, 0] = float("inf")
    values = [torch.randn(16, dtype=torch.float64).tolist() for _ in range(4)]
    # picks in another order than their rows; a pick of two spans; rows 2 and 5 nobody's
    spans = [[(8, 9)], [(3, 4), (6, 8)], [(0, 2)], [(4, 5)]]
    picks = [_pick(_op(kind, v), s) for v, s in zip(values, spans)]
    joined, left = _joined(x, picks)
    assert left == []
    assert torch.equal(_bits(joined), _bits(_own(x, picks)))


def test_rows_a_pick_names_twice_are_edited_once_as_on_their_own():
    """A decode step's ``positions: [0, -1]`` names the request's one row twice: those
    rows are not one slice with the rows between them (nor were they before)."""
    x = torch.zeros(4, 8)
    picks = [_pick(_op("add", [100.0] * 8), [(0, 1), (0, 1)]), _pick(_op("add", [200.0] * 8), [(3, 4), (3, 4)])]
    joined, _ = _joined(x, picks)
    own = _own(x, picks)
    assert torch.equal(joined, own)
    assert own[1:3].eq(0).all() and own[0].eq(100).all() and own[3].eq(200).all()
    one_op = _pick(_op("add", [5.0] * 8), [(0, 1), (0, 1), (3, 4), (3, 4)], "a", "d")  # (two requests)
    shared = _own(x, [one_op])
    assert shared[1:3].eq(0).all() and shared[0].eq(5).all() and shared[3].eq(5).all()


def test_a_steady_batch_reuses_its_rows_and_new_picks_build_anew():
    x = torch.zeros(6, 4)
    like = LikeEdits()
    picks = [_pick(_op("add", [1.0] * 4), [(0, 1)]), _pick(_op("add", [2.0] * 4), [(1, 2)])]
    first, _ = _joined(x, picks, like)
    again, _ = _joined(x, picks, like)  # (the same picks: what was built)
    assert torch.equal(first, again)
    moved = [(p[0], p[1], [(s + 4, e + 4) for s, e in p[2]], p[3]) for p in picks]  # (same ops, other rows)
    third, _ = _joined(x, moved, like)
    assert third[:4].eq(0).all() and third[4].eq(1).all() and third[5].eq(2).all()


def test_values_that_cannot_join_are_left_to_their_own_application_or_fail():
    x = torch.zeros(12, 8)
    good = [_pick(_op("add", [1.0] * 8), [(0, 1)]), _pick(_op("add", [2.0] * 8), [(1, 2)])]
    odd = _pick(_op("add", [3.0] * 4), [(2, 3)])  # (a width not the rows': its own error, alone)
    scalar = _pick(_op("add", 0.5), [(3, 4)])  # (a number: PyTorch rounds it first, alone)
    many = _pick(_op("add", [4.0] * 8), [(4, 5 + MAX_ROWS)])  # (a prompt's rows: broadcast alone)
    bad = _pick(_op("add", "not a value"), [(11, 12)])
    failed = []

    def value_of(op):
        return arith.operand(op["value"], x) if isinstance(op["value"], (list, float)) else 1 / 0

    like = LikeEdits()
    run = [*good, odd, scalar, many, bad]
    assert like.runs("here", run) == [run]
    left = like.apply("here", run, x, value_of, lambda pick, exc: failed.append(pick))
    assert left == [odd, scalar, many] and failed == [bad]
    assert x[0].eq(1).all() and x[1].eq(2).all() and x[2:].eq(0).all()


def test_a_zero_dim_value_is_left_alone():
    """A 0-dim tensor is an operand PyTorch treats as a number (rounded to a half
    precision target's dtype first): as a row it would add in float32."""
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    picks = [_pick(_op("add", {"$tensor": None}), [(0, 1)]), _pick(_op("add", {"$tensor": None}), [(1, 2)])]
    like = LikeEdits()
    left = like.apply("here", picks, x, lambda op: torch.tensor(0.1, dtype=torch.float32), _no_fail)
    assert left == picks and x.eq(0).all()


def _no_fail(pick, exc):
    raise AssertionError(exc)
