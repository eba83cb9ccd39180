"""Declarative interventions (``kind: "spec"``): JSON any HTTP client can write.

A spec runs no user code, so a server accepts it without the code opt-in. It is
checked against ``spec.schema.json`` (published; validated with ``jsonschema``,
one op at a time so an error names the bad field) and then run in the worker
by :mod:`vllm_nnsight_plugin.engine.spec_runner` through the same interleaver
as code blocks::

    {"v": 1, "kind": "spec", "ops": [
      {"op": "read", "name": "h1", "module": "model.layers.1", "index": 0, "positions": [-1]},
      {"op": "read", "name": "stream", "module": "model.layers.1", "sum": true, "steps": "all"},
      {"op": "add", "module": "model.layers.0", "index": 0, "value": [0.1, ...], "steps": "all"},
      {"op": "logits_topk", "name": "top", "k": 5, "steps": "all"}]}
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from .codec import PayloadError

STEP_WORDS = ("prefill", "generated", "all")


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The published JSON Schema of a spec."""
    return json.loads(resources.files(__package__).joinpath("spec.schema.json").read_text())


@functools.lru_cache(maxsize=16)
def _validator(ref: str) -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator({"$ref": ref, "$defs": schema()["$defs"]})


def _check(instance: Any, ref: str, where: str) -> None:
    from jsonschema.exceptions import best_match

    error = best_match(_validator(ref).iter_errors(instance))
    if error is not None:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise PayloadError(f"invalid spec at {where}{path}: {error.message}")


def validate(env: dict[str, Any]) -> dict[str, Any]:
    """Check a spec envelope; raise :class:`PayloadError` naming the bad field."""
    for key in env:
        if key not in ("v", "kind", "ops"):
            raise PayloadError(f"invalid spec: unknown field {key!r}")
    ops = env.get("ops")
    if not isinstance(ops, list) or not ops:
        raise PayloadError("invalid spec at ops: must be a non-empty list of operations")
    if len(ops) > 256:
        raise PayloadError("invalid spec at ops: at most 256 operations")
    names: set[str] = set()
    for i, op in enumerate(ops):
        kind = op.get("op") if isinstance(op, dict) else None
        if f"op_{kind}" not in schema()["$defs"]:
            known = ", ".join(k[3:] for k in schema()["$defs"] if k.startswith("op_"))
            raise PayloadError(f"invalid spec at ops[{i}].op: {kind!r} is not one of {known}")
        _check(op, f"#/$defs/op_{kind}", f"ops[{i}]")
        if op.get("sum") and op.get("index") is not None:
            raise PayloadError(f"invalid spec at ops[{i}].sum: a sum of the value's tensors takes no index")
        if "name" in op:
            if op["name"] in names:
                raise PayloadError(f"invalid spec at ops[{i}].name: {op['name']!r} is used twice")
            names.add(op["name"])
    return env


def step_filter(steps: Any) -> tuple[set[int] | None, bool, int | None]:
    """``(explicit steps or None, includes generated steps, last step or None)``."""
    steps = "prefill" if steps is None else steps
    if steps == "prefill":
        return {0}, False, 0
    if steps == "generated":
        return None, True, None
    if steps == "all":
        return None, True, None
    explicit = {int(s) for s in steps}
    return explicit, False, max(explicit)


def is_single(op: dict[str, Any]) -> bool:
    """A read at prefill only returns one value; anything else a list per step."""
    return op.get("steps", "prefill") == "prefill"
