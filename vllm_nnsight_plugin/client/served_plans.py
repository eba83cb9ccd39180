"""A served trace's blocks recorded here, into the plans the server's workers would
make of them (:mod:`..engine.lower`), and sent as JSON specs.

Code payloads are remote code execution, so a server runs them only where its
operator opted in (``VLLM_NNSIGHT_ALLOW_CODE=1``); a JSON spec runs on every server.
Recording needs no weights: the server lists its modules and, for each, what its
forward returns, the activations' dtype, the modules reachable by two paths and those
whose input is an index tensor (``GET /v1/nnsight/tree``'s ``record``). The block
runs here against stand-ins, as the worker would run it (no time bound: it is the
caller's own code, and the caller's timers stay untouched). A block that cannot be a
plan, or whose plan the server would refuse (an untapped location, an index tensor's
edit), goes as code, as it would run as code in the worker; a refusal of it says which
line kept it code and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import guards, lower
from ..engine.cache import Gather
from ..payload import codec, request_args, spec
from ..payload import values as tagged
from ..payload.tapset import TapSet


@dataclass(frozen=True)
class ServedPlan:
    """A block sent as a spec: its recording, the spec's text, and each saved list's
    name with the names its items come back under (:func:`finish` gathers them)."""

    lowered: lower.Lowered
    payload: str
    lists: tuple[tuple[str, Gather], ...]
    filename: str
    source_lines: tuple[str, ...]
    first_line: int


Plan = ServedPlan | lower.Fallback | None  # None: nothing recorded (no block, or code asked for)


def payload_for(code_payload: str | None, extra_args: dict[str, Any] | None, tree: Any) -> tuple[str | None, Plan]:
    """What an invoke sends: its block as a spec where it records as one, else its code
    payload (and why). ``tree``: the server's :class:`.served.ServedTree`."""
    if code_payload is None:
        return None, None
    args = request_args.parse(extra_args)
    if not args.lower or args.stream:  # (asked to run as code, or saves streamed per step: code)
        return code_payload, None
    found = plan(code_payload, tree)
    return (found.payload, found) if isinstance(found, ServedPlan) else (code_payload, found)


def plan(code_payload: str, tree: Any) -> ServedPlan | lower.Fallback:
    """The block of ``code_payload`` (an invoke's code envelope) as a spec over the
    served model, or why it goes as code."""
    env = codec.parse_envelope(code_payload)
    if tree.record is None:
        return lower.Fallback("the server sends no record table (an older plugin)", env["lineno"])
    try:
        rec, resolve = lower.table_recorder(list(tree.modules), tree.record)
        values = codec.load_code(env, resolve).values
        found = lower.plan_block(rec, env["source"], env["filename"], env["lineno"], values, seconds=0)
        if isinstance(found, lower.Fallback):
            return found
        return _served(found, env, tree)
    except Exception as exc:  # noqa: BLE001 - the recorder's own failure, or a table it cannot read: code
        return lower.Fallback(f"recording it here failed ({type(exc).__name__}: {str(exc)[:200]})", env["lineno"])


def _served(found: lower.Lowered, env: dict[str, Any], tree: Any) -> ServedPlan | lower.Fallback:
    """The recorded spec as sent: checked as the server checks it, list items under names
    the server ships, values as base64 tensors (as compact as the code payload's)."""
    taps = None if tree.taps is None else TapSet(tree.taps)
    integer_inputs = frozenset(tree.record.get("integer_inputs") or ())
    renamed = {item: f"_l{k}.{i}" for k, (_, gather) in enumerate(found.lists)
               for i, item in enumerate(gather.reads())}
    ops = []
    for op in found.spec["ops"]:
        op = {**op, "name": renamed.get(op["name"], op["name"])} if "name" in op else dict(op)
        if isinstance(op.get("value"), list):
            op["value"] = _tensor(op["value"])
        ops.append(op)

    def check(op: dict[str, Any]) -> None:
        spec.validate(codec.spec_envelope([op]))
        guards.refuse_integer_writes(codec.spec_envelope([op]), integer_inputs)
        for path, io in _locations(op):
            if path not in tree.modules:
                raise codec.PayloadError(f"{path or 'the model'} is not a module of the served model")
            if taps is not None and not taps.matches(path, io):
                raise codec.PayloadError(f"{path}.{io} is not tapped on the server")

    refused = lower.first_refused(ops, found.lines, check)
    if refused is not None:
        return refused
    lists = tuple((name, gather.renamed(renamed)) for name, gather in found.lists)
    return ServedPlan(found, json.dumps(codec.spec_envelope(ops)), lists, env["filename"],
                      tuple(env["source"].splitlines()), env["lineno"])


def _locations(op: dict[str, Any]) -> list[tuple[str, str]]:
    if op["op"] == "cache":
        from ..engine.cache import ios

        return [(path, io) for path in op.get("modules") or () for io in ios(op)]
    return [(op["module"], op.get("io", "output"))] if "module" in op else []


def _tensor(value: list[Any]) -> dict[str, Any]:
    """A recorded value (float64 numbers) as a base64 tensor: float32 where that holds it exactly."""
    t = torch.tensor(value, dtype=torch.float64)
    if torch.equal(t.float().double(), t):
        t = t.float()
    return {"$tensor": tagged.encode_tensor(t)}


def explain(found: Plan) -> str | None:
    """What a server's refusal of a block sent as code should add: why it went as code."""
    if not isinstance(found, lower.Fallback):
        return None
    return f"the block was sent as code, which this server may not run, not as a plan: line {found.line}: {found.why}"


def finish(output: Any, found: Plan) -> None:
    """A spec's results as the block's: saved lists gathered under their names (each
    sequence's, then merged as :func:`.codec.merge_sequences` merges), and an op's
    error named by the block's line."""
    if not isinstance(found, ServedPlan):
        return
    sequences = getattr(output, "nnsight_sequence_saves", None)
    holders = [*(sequences or ()), *(c.saves for c in getattr(output, "outputs", ()) if getattr(c, "saves", None))]
    if sequences is None and getattr(output, "saves", None):
        holders.append(output.saves)
    failed = any(isinstance(e := getattr(h, "nnsight_error", None), dict) and e.get("message")
                 for h in (output, *getattr(output, "outputs", ())))
    for saves in {id(s): s for s in holders}.values():
        for name, gather in found.lists:
            reads = gather.reads()
            if (reads or not failed) and all(item in saves for item in reads):  # (a failed request: nothing)
                saves[name] = gather.build(saves.pop, copy=True)
    if sequences is not None:  # (n > 1: every name a list of the sequences' values)
        names = dict.fromkeys(name for saves in sequences for name in saves)
        output.saves = {name: [saves.get(name) for saves in sequences] for name in names}
    for holder in (output, *getattr(output, "outputs", ())):
        error = getattr(holder, "nnsight_error", None)
        if isinstance(error, dict) and error.get("message"):
            holder.nnsight_error = _relabel(error, found)


def _relabel(error: dict[str, Any], found: ServedPlan) -> dict[str, Any]:
    message, line = found.lowered.relabel(error["message"])
    if line is None:
        return error
    index = line - found.first_line
    text = found.source_lines[index].strip() if 0 <= index < len(found.source_lines) else ""
    return {**error, "message": message, "lineno": line, "line": text, "filename": found.filename}
