"""Run a code block that is exactly a whole-row read or steering as the batched spec.

A block runs as a greenlet per request: every access a switch and its own
kernels (piecewise under CUDA graphs). The most common interpretability blocks
are fixed functions of each request's rows, which the engine also runs as a
batched spec (one kernel for all requests; in CUDA graphs' lanes with ``taps``).
This module recognises exactly those forms in the block's syntax tree::

    x = model.model.layers[6].output[0].save()        # read: the prompt's rows
    rows = []                                          # (or rows = list().save())
    for _ in tracer.all():                             # (or tracer.iter[:]): every step
        model.model.layers[7].output[0][:] += vec      # add (a 1-D tensor of the model's dtype)
        model.model.layers[8].self_attn.output[:] *= 0.5   # scale (a number); [:] = 0 zeroes
        out = model.model.layers[8].output             # an alias, used at once: out[0], out[1]
        rows.append(out[0] + out[1])                   # read each step (a new tensor, or .clone())
    stream = rows.save()

A module's output structure comes from its ``forward``'s return annotation
(vLLM annotates its layers): ``output[i]`` lowers only where that is a tuple, a
bare ``output`` only where it is a tensor, so indexing means what it means in the
block. Annotations can be wrong (a few vLLM models return one tensor where they
say a pair): each op carries the ``structure`` it assumed, and the batched runner
fails the request, naming the fix, where the value is not that. Accesses must
certainly follow the forward's order (one module list's layers in index order, a
submodule before its parent), as a block's must; an alias (``out``) is used only
before any other access in its own scope, where it means a fresh access. Modules
reachable by two paths (shared weights, called twice a step) are not lowered.
Anything else (another statement, a second loop, a read beside an edit of one
module, an unknown structure) leaves the block as code. Saved names and
values are the block's; an error names the block's line.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import typing
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_OP = re.compile(r"^ops\[(\d+)\] \(([^)]*)\)(: )?")
STATS = {"lowered": 0}  # blocks run as batched specs since start (the lane-stats RPC)


class _NoMatch(Exception):
    """The block is not one of the lowerable forms."""


@dataclass(frozen=True)
class Lowered:
    """A block as a spec: its ops and each op's source line."""

    spec: dict[str, Any]
    lines: tuple[int, ...]

    def relabel(self, message: str) -> tuple[str, int | None]:
        """A batched op's error (``ops[N] (add ...): why``) as the block's: the message
        without the op's name, and the line that op came from."""
        found = _OP.match(message)
        if found is None or int(found.group(1)) >= len(self.lines):
            return message, None
        rest = message[found.end():]
        return rest if found.group(3) else found.group(2) + rest, self.lines[int(found.group(1))]


@functools.lru_cache(maxsize=256)
def output_structure(cls: type) -> int | None:
    """What ``cls.forward`` returns, by its annotation: 0 for a tensor, N for a tuple
    of N tensors, None when unannotated or anything else (a union, an optional)."""
    try:
        ret = typing.get_type_hints(cls.forward).get("return")
    except Exception:  # noqa: BLE001 - an unresolvable annotation is an unknown structure
        return None
    if ret is torch.Tensor:
        return 0
    args = typing.get_args(ret)
    if typing.get_origin(ret) is tuple and args and Ellipsis not in args \
            and all(a is torch.Tensor for a in args):
        return len(args)
    return None


class _Matcher:
    def __init__(self, values: dict[str, Any], dtype: torch.dtype, shared: frozenset[int]):
        from .envoy import WorkerEnvoy, WorkerTracer

        self.values, self.dtype, self.shared = dict(values), dtype, shared
        self.envoys = {n: v for n, v in values.items() if isinstance(v, WorkerEnvoy)}
        self.tracers = {n for n, v in values.items() if isinstance(v, WorkerTracer)}
        # out = <module>.output -> (that envoy, the scope and access count it was bound at)
        self.aliases: dict[str, tuple[Any, bool, int]] = {}
        self.in_loop = False
        self.lists: dict[str, int | None] = {}  # rows = []: the op its one append made
        self.saved_lists: set[str] = set()  # rows = list().save(): saved before the loop
        self.ops: list[dict[str, Any]] = []
        self.lines: list[int] = []
        self.bound: set[str] = set()
        self.accesses: list[str] = []  # each .output the block evaluates, in order

    def bind(self, name: str) -> None:
        """The block binds ``name``: what the caller's frame had under it is gone (a
        name bound twice is not one of the forms)."""
        if name in self.bound or name == "list":  # (list() must stay the builtin)
            raise _NoMatch
        self.bound.add(name)
        self.values.pop(name, None)
        self.envoys.pop(name, None)
        self.tracers.discard(name)

    # ------------------------------------------------------------ expressions
    def module(self, node: ast.expr) -> Any:
        """The envoy of a module a block may read or edit as a spec: not one reachable
        by two paths (shared weights run twice a step; a spec would apply twice)."""
        envoy = self.envoy(node)
        if id(envoy._module) in self.shared:
            raise _NoMatch
        return envoy

    def envoy(self, node: ast.expr) -> Any:
        """The module envoy an expression names (``model.model.layers[8]``)."""
        if isinstance(node, ast.Name) and node.id in self.envoys:
            return self.envoys[node.id]
        if isinstance(node, ast.Attribute):
            parent = self.envoy(node.value)
            if node.attr not in parent._module._modules or hasattr(type(parent), node.attr):
                raise _NoMatch
            return parent._child(node.attr)
        if isinstance(node, ast.Subscript):
            index = _int(node.slice)
            parent = self.envoy(node.value)
            try:
                return parent[index]
            except IndexError:
                raise _NoMatch from None
        raise _NoMatch

    def output(self, node: ast.expr) -> tuple[str, int | None]:
        """``<module>.output`` (or an alias of it): the module's path and structure."""
        if isinstance(node, ast.Name) and node.id in self.aliases:
            # an alias holds the values served when it was bound: it means the same as a
            # fresh access only in that scope (not a later step) and before any other
            # access (after one, vLLM may have overwritten them in place)
            envoy, in_loop, mark = self.aliases[node.id]
            if in_loop != self.in_loop or mark != len(self.accesses):
                raise _NoMatch
        elif isinstance(node, ast.Attribute) and node.attr == "output":
            envoy = self.module(node.value)
            self.accesses.append(envoy._path)
        else:
            raise _NoMatch
        return envoy._path, output_structure(type(envoy._module))

    def part(self, node: ast.expr, new: bool = False) -> dict[str, Any]:
        """``X[i]`` of a tuple output, a tensor output ``X``, or (``new``: only an
        expression that makes a new tensor) ``X[0] + X[1]`` of a 2-tuple, ``<part>.clone()``."""
        if new:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "clone" and not node.args and not node.keywords:
                return self.part(node.func.value)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) \
                    and all(isinstance(s, ast.Subscript) for s in (node.left, node.right)):
                left, right = self.output(node.left.value), self.output(node.right.value)
                if left != right or left[1] != 2 or (_int(node.left.slice), _int(node.right.slice)) != (0, 1):
                    raise _NoMatch
                return {"module": left[0], "sum": True, "structure": 2}
            raise _NoMatch
        if isinstance(node, ast.Subscript):
            path, size = self.output(node.value)
            index = _int(node.slice)
            if not size or not 0 <= index < size:
                raise _NoMatch
            return {"module": path, "index": index, "structure": size}
        path, size = self.output(node)
        if size != 0:
            raise _NoMatch
        return {"module": path, "structure": 0}

    def vector(self, node: ast.expr) -> list[float]:
        """A steering vector: a name bound to a 1-D tensor of the model's dtype (then
        the spec adds exactly what the block would)."""
        if not isinstance(node, ast.Name) or node.id in self.bound:
            raise _NoMatch
        value = self.values.get(node.id)
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 2 \
                or value.dtype != self.dtype or value.layout != torch.strided:
            raise _NoMatch  # (one element broadcasts in a block; the lanes take whole rows)
        return value.detach().cpu().tolist()

    # ------------------------------------------------------------ statements
    def add(self, op: dict[str, Any], line: int) -> int:
        self.ops.append(op)
        self.lines.append(line)
        return len(self.ops) - 1

    def alias(self, stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and isinstance(stmt.value, ast.Attribute) and stmt.value.attr == "output":
            envoy = self.module(stmt.value.value)
            self.accesses.append(envoy._path)
            self.bind(stmt.targets[0].id)
            self.aliases[stmt.targets[0].id] = (envoy, self.in_loop, len(self.accesses))
            return True
        return False

    def top(self, stmt: ast.stmt, looped: bool) -> bool:
        """A statement outside the loop; True when it is the loop."""
        if not looped and self.alias(stmt):
            return False
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, value = stmt.targets[0].id, stmt.value
            saved = _saved(value)
            if not looped and _empty_list(value if saved is None else saved):
                self.bind(name)
                self.lists[name] = None
                if saved is not None:
                    self.saved_lists.add(name)
                return False
            if saved is None:
                raise _NoMatch
            if isinstance(saved, ast.Name) and saved.id in self.lists:  # stream = rows.save()
                rows = saved.id
                op = self.lists.pop(rows)
                if op is None or not looped or rows in self.saved_lists:
                    raise _NoMatch
                if name != rows:  # (stream = stream.save() rebinds the list's own name)
                    self.bind(name)  # (a copy of the list: rows itself is not saved)
                self.ops[op]["name"] = name
                return False
            if looped:
                raise _NoMatch
            self.add({"op": "read", "name": name, **self.part(saved, new=_makes_new(saved)),
                      "steps": "prefill"}, stmt.lineno)
            self.bind(name)
            return False
        if isinstance(stmt, ast.For) and not looped and not stmt.orelse and isinstance(stmt.target, ast.Name) \
                and self.every_step(stmt.iter):
            self.bind(stmt.target.id)
            self.in_loop = True
            for inner in stmt.body:
                self.step(inner)
            self.in_loop = False
            for rows in list(self.saved_lists):  # rows = list().save(): the op's name is rows
                op = self.lists.pop(rows, None)
                if op is None:
                    raise _NoMatch
                self.ops[op]["name"] = rows
                self.saved_lists.discard(rows)
            return True
        raise _NoMatch

    def every_step(self, node: ast.expr) -> bool:
        """``tracer.all()`` or ``tracer.iter[:]``."""
        if isinstance(node, ast.Call) and not node.args and not node.keywords \
                and isinstance(node.func, ast.Attribute) and node.func.attr == "all":
            return isinstance(node.func.value, ast.Name) and node.func.value.id in self.tracers
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) \
                and node.slice.lower is node.slice.upper is node.slice.step is None \
                and isinstance(node.value, ast.Attribute) and node.value.attr == "iter":
            return isinstance(node.value.value, ast.Name) and node.value.value.id in self.tracers
        return False

    def step(self, stmt: ast.stmt) -> None:
        """A statement inside the every-step loop."""
        if self.alias(stmt):
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "append" \
                and isinstance(stmt.value.func.value, ast.Name) and len(stmt.value.args) == 1 \
                and not stmt.value.keywords:
            rows = stmt.value.func.value.id
            if rows not in self.lists or self.lists[rows] is not None:  # unknown, or appended twice
                raise _NoMatch
            self.lists[rows] = self.add({"op": "read", "name": "", **self.part(stmt.value.args[0], new=True),
                                         "steps": "all"}, stmt.lineno)
            return
        target = stmt.target if isinstance(stmt, ast.AugAssign) else \
            stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if not (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Slice)
                and target.slice.lower is target.slice.upper is target.slice.step is None):
            raise _NoMatch
        where = self.part(target.value)
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add):
            op = {"op": "add", **where, "value": self.vector(stmt.value)}
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Mult) and _number(stmt.value):
            op = {"op": "scale", **where, "factor": float(stmt.value.value)}
        elif isinstance(stmt, ast.Assign) and _number(stmt.value) and stmt.value.value == 0:
            op = {"op": "zero", **where}
        else:
            raise _NoMatch
        self.add({**op, "steps": "all"}, stmt.lineno)


def _before(a: str, b: str) -> bool:
    """Whether module ``a``'s output certainly comes no later than ``b``'s in a
    forward: the same module, a submodule of ``b``, or an earlier index of one module
    list (decoder layers run in order; siblings otherwise may not run as registered)."""
    if a == b or a.startswith(b + ".") or not b:
        return True
    pa, pb = a.split("."), b.split(".")
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    if common == len(pa):
        return False  # b is inside a: a's output comes after b's
    return pa[common].isdigit() and pb[common].isdigit() and int(pa[common]) < int(pb[common])


def _int(node: ast.expr) -> int:
    """An int literal (``-1`` too)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int(node.operand)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise _NoMatch


def _number(node: ast.expr) -> bool:
    """A finite int or float literal a tensor op takes as it is (a huge int is an
    OverflowError in the block)."""
    if not isinstance(node, ast.Constant) or type(node.value) not in (int, float):
        return False
    value = node.value
    return -(1 << 63) <= value < (1 << 63) if type(value) is int else math.isfinite(value)


def _saved(node: ast.expr) -> ast.expr | None:
    """``X`` of ``X.save()``, else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "save" \
            and not node.args and not node.keywords:
        return node.func.value
    return None


def _empty_list(node: ast.expr) -> bool:
    """``[]`` or ``list()``."""
    return (isinstance(node, ast.List) and not node.elts) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list"
        and not node.args and not node.keywords)


def _makes_new(node: ast.expr) -> bool:
    return isinstance(node, ast.BinOp) or isinstance(node, ast.Call)


def lower_block(source: str, lineno: int, values: dict[str, Any], dtype: torch.dtype,
                shared: frozenset[int] = frozenset()) -> Lowered | None:
    """The batched spec doing exactly what the block does, or None (see the module
    docstring). ``values``: the block's loaded values (the model and tracer resolved);
    ``shared``: ids of modules reachable by more than one path (never lowered)."""
    from . import batched

    if "list" in values:  # list() would not be the builtin
        return None
    matcher = _Matcher(values, dtype, shared)
    try:
        tree = ast.parse(source)
        ast.increment_lineno(tree, lineno - 1)
        looped = False
        for stmt in tree.body:
            looped = matcher.top(stmt, looped) or looped
    except _NoMatch:
        return None
    except Exception:  # noqa: BLE001 - (a pathological block, e.g. too deeply nested): it runs as code
        return None
    read = {op["module"] for op in matcher.ops if op["op"] == "read"}
    if not matcher.ops or matcher.lists or any(op["module"] in read for op in matcher.ops if op["op"] != "read"):
        return None  # nothing to run, a list never saved, or a read beside an edit of one module
    if not all(_before(a, b) for a, b in zip(matcher.accesses, matcher.accesses[1:])):
        return None  # maybe out of execution order: the block reports it (a spec would not)
    spec = {"v": 1, "kind": "spec", "ops": matcher.ops}
    if not batched.eligible(spec):
        return None
    return Lowered(spec, tuple(matcher.lines))


CACHEABLE = 64 * 1024  # payload text (values + source) whose lowering is cached


def wanted(flag: Any) -> bool:
    """``nnsight_lower`` in ``extra_args``: off for False, 0 or "false" (an OpenAI
    request's ``vllm_xargs`` turn JSON ``false`` into 0)."""
    return str(flag).strip().lower() not in ("false", "0", "0.0", "no", "off")


class Lowerings:
    """An engine's lowerings, cached by payload text: requests sending one block
    share one spec, so their ops batch by identity, and a hit loads no values."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self._cache: dict[tuple, Lowered | None] = {}
        self._shared: frozenset[int] | None = None

    def get(self, env: dict[str, Any], resolve: Callable[[tuple], Any],
            check_access: Callable[[str, str], None]) -> tuple[Lowered | None, dict[str, Any] | None]:
        """The spec a checked code envelope is (None: run it as code), and the values
        loaded to decide (None on a cache hit). ``check_access`` raises for a module
        the engine does not serve (untapped): that block runs as code and reports it
        at its line. Payloads over :data:`CACHEABLE` (a block shipping a large
        tensor) are decided each time: the cache keeps no megabytes alive."""
        from ..payload import codec

        key = (env["source"], env["filename"], env["lineno"], env["values"])
        cacheable = len(env["values"]) + len(env["source"]) <= CACHEABLE
        if cacheable and key in self._cache:
            return self._cache[key], None
        values = codec.load_code(env, resolve).values
        found = lower_block(env["source"], env["lineno"], values, self.dtype, self.shared())
        try:
            for op in found.spec["ops"] if found is not None else ():
                check_access(op["module"], op.get("io", "output"))
        except Exception:  # noqa: BLE001 - refused: the block reports it itself
            found = None
        if cacheable:
            if len(self._cache) >= 256:
                self._cache.clear()
            self._cache[key] = found
        return found, values

    def shared(self) -> frozenset[int]:
        """Ids of modules under more than one path (shared weights): never lowered."""
        if self._shared is None:
            seen: dict[int, int] = defaultdict(int)
            for _, module in self.model.named_modules(remove_duplicate=False):
                seen[id(module)] += 1
            self._shared = frozenset(m for m, n in seen.items() if n > 1)
        return self._shared
