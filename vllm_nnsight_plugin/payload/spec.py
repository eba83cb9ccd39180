"""Declarative interventions (``kind: "spec"``): JSON any HTTP client can write.

A spec runs no user code, so a server accepts it without the code opt-in. It is
checked here against exactly what ``spec.schema.json`` (published) says, by hand
rather than with a generic validator: a spec can carry a million numbers, and
checking them one schema node at a time took the server's event loop for tens of
seconds. Here a value's length is compared with the model's widest tensor before
any element is looked at. Errors name the bad field. The worker then runs it
(:mod:`vllm_nnsight_plugin.engine.spec_runner`, or batched)::

    {"v": 1, "kind": "spec", "ops": [
      {"op": "read", "name": "h1", "module": "model.layers.1", "index": 0, "positions": [-1]},
      {"op": "read", "name": "stream", "module": "model.layers.1", "sum": true, "steps": "all"},
      {"op": "add", "module": "model.layers.0", "index": 0, "value": [0.1, ...], "steps": "all"},
      {"op": "logits_topk", "name": "top", "k": 5, "steps": "all"},
      {"op": "cache", "name": "cache", "modules": ["model.layers.0"], "inputs": false},
      {"op": "result", "name": "ids", "path": [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]}]}

A ``cache`` op is nnsight's ``tracer.cache()``: every named module's value (or
those of ``modules``) at each step, returned as one value (:mod:`.cache`). A
``result`` op is nnsight's ``tracer.result`` saved (or a part of it): the engine
ships only its path, and the client takes that part of the finished ``RequestOutput``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from importlib import resources
from typing import Any, NamedTuple

from .errors import PayloadError

STEP_WORDS = ("prefill", "generated", "all")
MAX_OPS = 256
MAX_VALUE_ITEMS = 1 << 18
MAX_POSITIONS = 65536
MAX_STEPS = 4096
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")  # (not "__...": _check_op refuses the engine's own names)
_MODULE = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_LOCATION = ("io", "index", "structure", "positions", "steps")
# op -> (required fields, optional fields), as in the schema's $defs
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "read": (("op", "name", "module"), ("io", "index", "structure", "sum", "positions", "steps")),
    "logits": (("op", "name"), ("steps",)),
    "logits_topk": (("op", "name", "k"), ("steps",)),
    "add": (("op", "module", "value"), _LOCATION),
    "set": (("op", "module", "value"), _LOCATION),
    "scale": (("op", "module", "factor"), _LOCATION),
    "zero": (("op", "module"), _LOCATION),
    "cache": (("op", "name"), ("modules", "inputs", "outputs", "steps", "dtype")),
    "result": (("op", "name", "path"), ()),
}
MAX_CACHED_MODULES = 4096
WRITES = ("add", "set", "scale", "zero")
READ_OPS = ("read", "logits")  # the reads a batched plan runs (with WRITES)
RESULT = "result"  # tracer.result: a path into the finished RequestOutput, resolved by the client
MAX_RESULT_PATH = 16
_ATTR = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The published JSON Schema of a spec."""
    return json.loads(resources.files(__package__).joinpath("spec.schema.json").read_text())


def is_integer(x: Any) -> bool:
    """JSON Schema's integer: a number with no fractional part (``true`` is not one)."""
    return type(x) is int or (type(x) is float and x.is_integer())


def is_number(x: Any) -> bool:
    """A finite JSON number (``true`` is not one; 1e400 parses to inf and is refused)."""
    return type(x) is int or (type(x) is float and math.isfinite(x))


class _Op:
    """Checks one op's fields, naming the field on failure."""

    def __init__(self, op: dict[str, Any], where: str):
        self.op, self.where = op, where

    def fail(self, field: str, message: str) -> None:
        raise PayloadError(f"invalid spec at {self.where}.{field}: {message}")

    def integer(self, field: str, low: int, high: int) -> int:
        x = self.op[field]
        if not is_integer(x):
            self.fail(field, f"{x!r:.40} is not an integer")
        if not low <= x <= high:
            self.fail(field, f"{x!r} is out of range [{low}, {high}]")
        return int(x)

    def ints(self, field: str, limit: int, low: int | None, high: int | None, allow_empty: bool) -> list[int]:
        xs = self.op[field]
        if not isinstance(xs, list):
            self.fail(field, f"must be a list of integers, got {type(xs).__name__}")
        if len(xs) > limit or (not xs and not allow_empty):
            self.fail(field, f"must hold {0 if allow_empty else 1} to {limit} integers, got {len(xs)}")
        out = []
        for i, x in enumerate(xs):
            if not is_integer(x):
                self.fail(f"{field}[{i}]", f"{x!r} is not an integer")
            if (low is not None and x < low) or (high is not None and x > high):
                self.fail(f"{field}[{i}]", f"{x!r} is out of range [{low}, {high}]")
            out.append(int(x))
        return out

    def string(self, field: str, pattern: re.Pattern, limit: int) -> None:
        x = self.op[field]
        if not isinstance(x, str):
            self.fail(field, f"must be a string, got {type(x).__name__}")
        if len(x) > limit or pattern.fullmatch(x) is None:
            self.fail(field, f"{x[:80]!r} does not match {pattern.pattern!r} (at most {limit} characters)")

    def tensor(self, field: str, max_width: int | None) -> None:
        x = self.op[field]
        if is_number(x):
            return
        if isinstance(x, list):
            self.vector(field, x, max_width)
        elif isinstance(x, dict):
            self.tagged(field, x, max_width)
        else:
            self.fail(field, "must be a finite number, a list of numbers (or of lists of numbers) or "
                             "{\"$tensor\": {dtype, shape, data}}")

    def vector(self, field: str, x: list, max_width: int | None) -> None:
        if len(x) > MAX_VALUE_ITEMS:
            self.fail(field, f"has {len(x)} items, over the limit of {MAX_VALUE_ITEMS}")
        nested = bool(x) and isinstance(x[0], list)
        if max_width is not None and not nested and len(x) > max_width:
            self.fail(field, f"has {len(x)} numbers, but no tensor of this model is wider than {max_width}")
        if all(type(v) is float or type(v) is int for v in x):  # the usual case, without a call per item
            if not all(map(math.isfinite, x)):
                self.fail(field, "holds a number beyond the float range (it parses as inf)")
            return
        for i, row in enumerate(x):
            if is_number(row):
                continue
            if not isinstance(row, list):
                self.fail(f"{field}[{i}]", f"must be a finite number or a list of numbers, got {row!r:.40}")
            if max_width is not None and len(row) > max_width:
                self.fail(f"{field}[{i}]", f"has {len(row)} numbers, but no tensor of this model is wider "
                                           f"than {max_width}")
            if not all(is_number(v) for v in row):
                bad = next(v for v in row if not is_number(v))
                self.fail(f"{field}[{i}]", f"{bad!r:.40} is not a finite number")

    def tagged(self, field: str, x: dict, max_width: int | None) -> None:
        t = x.get("$tensor")
        if len(x) != 1 or not isinstance(t, dict) or set(t) != {"dtype", "shape", "data"}:
            self.fail(field, 'an object value must be exactly {"$tensor": {"dtype", "shape", "data"}}')
        if t["dtype"] not in TENSOR_DTYPES:
            self.fail(f"{field}.$tensor.dtype", f"{t['dtype']!r:.40} is not one of {', '.join(TENSOR_DTYPES)}")
        shape = t["shape"]
        if not isinstance(shape, list) or len(shape) > 2 or not all(is_integer(d) and d >= 0 for d in shape):
            self.fail(f"{field}.$tensor.shape", "must be a list of at most 2 non-negative integers")
        if not isinstance(t["data"], str):
            self.fail(f"{field}.$tensor.data", "must be a base64 string")
        if max_width is not None and shape and shape[-1] > max_width:
            self.fail(f"{field}.$tensor.shape", f"{shape} is wider than any tensor of this model ({max_width})")
        numel = math.prod(int(d) for d in shape)
        if numel > MAX_VALUE_ITEMS:
            self.fail(f"{field}.$tensor.shape", f"{shape} has more than {MAX_VALUE_ITEMS} numbers")


def _check_op(op: Any, i: int, max_width: int | None) -> None:
    where = f"ops[{i}]"
    kind = op.get("op") if isinstance(op, dict) else None
    if not isinstance(kind, str) or kind not in FIELDS:
        raise PayloadError(f"invalid spec at {where}.op: {kind!r:.80} is not one of {', '.join(FIELDS)}")
    required, optional = FIELDS[kind]
    for key in required:
        if key not in op:
            raise PayloadError(f"invalid spec at {where}: {key!r} is a required property of a {kind} op")
    for key in op:
        if key not in required and key not in optional:
            raise PayloadError(f"invalid spec at {where}: unknown field {key!r:.80} for a {kind} op")
    c = _Op(op, where)
    if "name" in op:
        if isinstance(op["name"], str) and op["name"].startswith("__"):
            c.fail("name", f"{op['name'][:80]!r}: names starting with '__' are the engine's own")
        c.string("name", _NAME, 64)
    if "module" in op:
        c.string("module", _MODULE, 256)
    if "io" in op and op["io"] not in ("output", "input"):
        c.fail("io", f"{op['io']!r:.40} is not one of 'output', 'input'")
    if op.get("index") is not None:
        op["index"] = c.integer("index", 0, 16)
    if "structure" in op:  # (what a recorded plan assumed the module returns: plan_ops.check_structure)
        op["structure"] = c.integer("structure", 0, 16)
    if "sum" in op and type(op["sum"]) is not bool:
        c.fail("sum", "must be true or false")
    if is_integer(op.get("positions")):
        op["positions"] = int(op["positions"])
    elif op.get("positions") is not None:
        op["positions"] = c.ints("positions", MAX_POSITIONS, None, None, allow_empty=True)
    if "steps" in op:
        if isinstance(op["steps"], list):
            op["steps"] = c.ints("steps", MAX_STEPS, 0, 100_000, allow_empty=False)
        elif op["steps"] not in STEP_WORDS:
            c.fail("steps", f"{op['steps']!r:.40} is not one of {', '.join(STEP_WORDS)} or a list of step numbers")
    if "k" in op:
        op["k"] = c.integer("k", 1, 1000)
    if "factor" in op and not is_number(op["factor"]):
        c.fail("factor", f"{op['factor']!r:.40} is not a finite number")
    if "value" in op:
        c.tensor("value", max_width)
    if op.get("sum") and op.get("index") is not None:
        c.fail("sum", "a sum of the value's tensors takes no index")
    if kind == "cache":
        _check_cache(c, op)
    if kind == RESULT:
        _check_result_path(c, op["path"])


def _step_fits(kind: Any, arg: Any) -> bool:
    """One step of a ``tracer.result`` path: an attribute name not starting with ``_``,
    or a key: a 32-bit integer or a string of at most 64 characters."""
    if kind == "attr":
        return isinstance(arg, str) and _ATTR.fullmatch(arg) is not None
    return kind == "item" and (type(arg) is int and -(1 << 31) <= arg < (1 << 31)
                               or isinstance(arg, str) and len(arg) <= 64)


def check_result_path(path: tuple) -> bool:
    """Whether a ``tracer.result`` path (``(("attr", name) | ("item", key), ...)``) fits
    a result op."""
    return len(path) <= MAX_RESULT_PATH and all(_step_fits(kind, arg) for kind, arg in path)


def _check_result_path(c: _Op, path: Any) -> None:
    """``[["attr", name] | ["item", int or str], ...]``: ``tracer.result.outputs[0].token_ids``
    is ``[["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]`` (an integral float
    key becomes an integer)."""
    if not isinstance(path, list) or len(path) > MAX_RESULT_PATH:
        c.fail("path", f"must be a list of at most {MAX_RESULT_PATH} steps")
    for i, step in enumerate(path):
        if not isinstance(step, list) or len(step) != 2 or step[0] not in ("attr", "item"):
            c.fail(f"path[{i}]", 'must be ["attr", name] or ["item", key]')
        kind, arg = step
        if kind == "item" and type(arg) is float and arg.is_integer():
            step[1] = arg = int(arg)
        if not _step_fits(kind, arg):
            c.fail(f"path[{i}]", f"{str(arg)[:80]!r} is not an attribute name ({_ATTR.pattern})" if kind == "attr"
                   else f"{str(arg)[:80]!r} is not an integer or a string of at most 64 characters")


def _check_cache(c: _Op, op: dict[str, Any]) -> None:
    modules = op.get("modules")
    if modules is not None:
        if not isinstance(modules, list) or not modules or len(modules) > MAX_CACHED_MODULES:
            c.fail("modules", f"must be a list of 1 to {MAX_CACHED_MODULES} module paths")
        for i, path in enumerate(modules):
            if not isinstance(path, str) or len(path) > 256 or _MODULE.fullmatch(path) is None:
                c.fail(f"modules[{i}]", f"{str(path)[:80]!r} is not a module path")
    for flag in ("inputs", "outputs"):
        if flag in op and type(op[flag]) is not bool:
            c.fail(flag, "must be true or false")
    if not op.get("outputs", True) and not op.get("inputs", False):
        c.fail("outputs", "a cache of neither outputs nor inputs holds nothing")
    if isinstance(op.get("steps"), list):
        c.fail("steps", "a cache runs from the prompt on: 'all', 'prefill' or 'generated'")
    if op.get("dtype") is not None and op["dtype"] not in TENSOR_DTYPES:
        c.fail("dtype", f"{op['dtype']!r:.40} is not one of {', '.join(TENSOR_DTYPES)}")


def validate(env: dict[str, Any], max_width: int | None = None) -> dict[str, Any]:
    """Check a spec envelope (in place: integral floats become ints); raise
    :class:`PayloadError` naming the bad field. ``max_width``: the widest tensor of
    the served model, when known: a longer value is refused before its numbers are
    looked at."""
    for key in env:
        if key not in ("v", "kind", "ops"):
            raise PayloadError(f"invalid spec: unknown field {key!r:.80}")
    ops = env.get("ops")
    if not isinstance(ops, list) or not ops:
        raise PayloadError("invalid spec at ops: must be a non-empty list of operations")
    if len(ops) > MAX_OPS:
        raise PayloadError(f"invalid spec at ops: at most {MAX_OPS} operations")
    names: set[str] = set()
    for i, op in enumerate(ops):
        _check_op(op, i, max_width)
        if "name" in op:
            if op["name"] in names:
                raise PayloadError(f"invalid spec at ops[{i}].name: {op['name']!r} is used twice")
            names.add(op["name"])
    return env


class StepFilter(NamedTuple):
    """The steps an op's ``steps`` runs it at."""

    explicit: set[int] | None  # these steps (prefill is step 0); None: none listed
    generated: bool  # every generated step (1, 2, ...)
    last: int | None  # the last step it runs at; None: open-ended


def step_filter(steps: Any) -> StepFilter:
    """The steps ``steps`` (an op's ``"steps"``, default ``"prefill"``) names."""
    steps = "prefill" if steps is None else steps
    if steps == "prefill":
        return StepFilter({0}, False, 0)
    if steps == "generated":
        return StepFilter(None, True, None)
    if steps == "all":
        return StepFilter(None, True, None)
    explicit = {int(s) for s in steps}
    return StepFilter(explicit, False, max(explicit))


def is_single(op: dict[str, Any]) -> bool:
    """A read at prefill only returns one value; anything else a list per step."""
    return op.get("steps", "prefill") == "prefill"


# What a valid spec's ops say about how the engine runs it (one definition for the
# admission, the front end's replay check and the pipeline-stage refusals).

def runs_batched(env: dict[str, Any]) -> bool:
    """Whether a spec can run batched: every op reads or edits a module, reads the
    logits or saves ``tracer.result`` (a ``logits_topk`` runs per request)."""
    return env.get("kind") == "spec" and all(op["op"] in WRITES or op["op"] in READ_OPS or op["op"] == RESULT
                                             for op in env["ops"])


def engine_ops(env: dict[str, Any]) -> list[dict[str, Any]]:
    """The ops the engine runs: all but ``result`` ops (the client resolves those on
    the finished output; the engine ships each one's path under its name, as
    ``{"$result": path}``)."""
    return [op for op in env["ops"] if op["op"] != RESULT]


def numbered(env: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The spec's ops with each one's number in the spec as sent (``ops[i]`` in an
    error): the engine's copy may have dropped ops or expanded a cache into its reads
    (which carry the cache's number), and keeps the numbers under ``"numbers"``."""
    numbers = env.get("numbers")
    return list(zip(range(len(env["ops"])) if numbers is None else numbers, env["ops"], strict=True))


def keeping(env: dict[str, Any], keep: Any) -> dict[str, Any]:
    """The spec with only the ops ``keep(op)`` holds for, each keeping its number."""
    kept = [(n, op) for n, op in numbered(env) if keep(op)]
    return {**env, "ops": [op for _, op in kept], "numbers": [n for n, _ in kept]}


def replayable(env: dict[str, Any]) -> bool:
    """Edits only, of whole rows at every step: a recomputed forward, a split prompt or
    a prefix-cache hit computed under the same edits gets them again, row by row."""
    return all(op["op"] in WRITES and op.get("steps") == "all" and op.get("positions") is None
               for op in engine_ops(env))


def edits(env: dict[str, Any]) -> bool:
    """Whether the spec changes activations (else its requests' logits need no check)."""
    return any(op["op"] in WRITES for op in env["ops"])


def may_edit(env: dict[str, Any]) -> bool:
    """Whether a payload, a spec or code, may change activations (code may do anything)."""
    return env["kind"] != "spec" or edits(env)


def last_step(env: dict[str, Any]) -> int | None:
    """The spec's last step (None: it runs to the request's end)."""
    last = 0
    for op in engine_ops(env):
        steps = op.get("steps", "prefill")
        if steps in ("all", "generated"):
            return None
        last = max(last, 0 if steps == "prefill" else max(steps))
    return last


def reads(env: dict[str, Any]) -> bool:
    return any(op["op"] in READ_OPS for op in env["ops"])


def prefill_reads(env: dict[str, Any]) -> bool:
    """Something ships after the first step: a read at the prompt, or a saved
    ``tracer.result`` (its path, which the client resolves on the finished output) of
    a plan without reads (whose saves nothing else ships: edits never report)."""
    ops = env["ops"]
    return any(op["op"] in READ_OPS and is_single(op) for op in ops) \
        or (any(op["op"] == RESULT for op in ops) and not reads(env))


def prompt_only(env: dict[str, Any]) -> bool:
    """Only reads at the prompt (``result`` ops aside: the client resolves them):
    nothing is left to do after the first step."""
    return all(op["op"] in READ_OPS and is_single(op) for op in engine_ops(env))
