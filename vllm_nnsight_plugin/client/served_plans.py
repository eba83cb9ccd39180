"""A served trace's blocks recorded here, into the plans the server's workers would
make of them (:mod:`..engine.lower`), and sent as JSON specs.

Code payloads are remote code execution, so a server runs them only where its
operator opted in (``VLLM_NNSIGHT_ALLOW_CODE=1``); a JSON spec runs on every server.
Recording needs no weights: the server lists its modules and, for each, what its
forward returns, the activations' dtype and the modules reachable by two paths
(``GET /v1/nnsight/tree``'s ``record``). A block that cannot be a plan (control
flow on a tensor's value, ``.item()``, a call that needs real tensors) goes as code,
and a server's refusal of it says which line kept it code and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..engine import lower
from ..payload import codec, request_args
from ..payload.tapset import TapSet


@dataclass(frozen=True)
class ServedPlan:
    """A block sent as a spec: its recording, the spec's text, and each saved list's
    name with the names its items come back under (:func:`finish` gathers them)."""

    lowered: lower.Lowered
    payload: str
    lists: tuple[tuple[str, tuple[str, ...]], ...]
    filename: str
    source_lines: tuple[str, ...]
    first_line: int


Plan = ServedPlan | lower.Fallback | None  # None: nothing to record (no block, or code asked for)


def payload_for(code_payload: str | None, sampling: dict[str, Any], tree: Any,
                taps: TapSet | None) -> tuple[str | None, Plan]:
    """What an invoke sends: its block as a spec where it records as one, else its code
    payload (and why). ``tree``: the server's :class:`.served.ServedTree`; ``taps``: the
    locations a compiled server serves (None: every module)."""
    if code_payload is None:
        return None, None
    args = request_args.parse(sampling.get("extra_args"))
    if not args.lower or args.stream:  # (asked to run as code, or saves streamed per step: code)
        return code_payload, None
    found = plan(code_payload, list(tree.modules), tree.record, taps)
    return (found.payload, found) if isinstance(found, ServedPlan) else (code_payload, found)


def plan(code_payload: str, paths: list[str], table: dict[str, Any] | None,
         taps: TapSet | None) -> ServedPlan | lower.Fallback:
    """The block of ``code_payload`` (an invoke's code envelope) as a spec over the
    served model (its module ``paths`` and record ``table``). A Fallback where it
    cannot be one, or where the server sends no record table."""
    env = codec.parse_envelope(code_payload)
    if table is None:
        return lower.Fallback("the server sends no record table (an older plugin)", env["lineno"])
    rec, resolve = lower.table_recorder(paths, table)
    values = codec.load_code(env, resolve).values
    if any(isinstance(v, codec.SharedList) for v in values.values()):
        return lower.Fallback("it writes into a list the trace saved", env["lineno"])
    found = lower.plan_block(rec, env["source"], env["filename"], env["lineno"], values)
    if isinstance(found, lower.Fallback):
        return found
    ops = [dict(op) for op in found.spec["ops"]]
    for op, line in zip(ops, found.lines):
        io = op.get("io", "output")
        if taps is not None and "module" in op and not taps.matches(op["module"], io):
            return lower.Fallback(f"{op['module']}.{io} is not tapped on the server", line)
    renamed: dict[str, str] = {}
    lists = []
    for k, (name, items) in enumerate(found.lists):  # (derived names the server ships: no "__")
        renamed.update({item: f"_l{k}.{i}" for i, item in enumerate(items)})
        lists.append((name, tuple(renamed[item] for item in items)))
    for op in ops:
        if op.get("name") in renamed:
            op["name"] = renamed[op["name"]]
    return ServedPlan(found, json.dumps({**found.spec, "ops": ops}), tuple(lists), env["filename"],
                      tuple(env["source"].splitlines()), env["lineno"])


def explain(found: Plan) -> str | None:
    """What a server's refusal of a block sent as code should add: why it was not a plan."""
    if not isinstance(found, lower.Fallback):
        return None
    return f"the block was sent as code, which this server may not run, because it cannot be a plan: " \
           f"line {found.line}: {found.why}"


def finish(output: Any, found: Plan) -> None:
    """A spec's results as the block's: saved lists gathered under their names (on the
    output and each sequence), and an op's error named by the block's line."""
    if not isinstance(found, ServedPlan):
        return
    for holder in (output, *getattr(output, "outputs", ())):
        saves = getattr(holder, "saves", None)
        for name, items in found.lists if saves else ():
            if all(item in saves for item in items):
                saves[name] = [saves.pop(item) for item in items]
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
