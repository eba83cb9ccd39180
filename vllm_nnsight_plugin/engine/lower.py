"""A code block's plan: its recording (:mod:`.record`) as the batched spec's ops.

Every code block is recorded once (per distinct payload text) when a request
brings it. The recording's notes become ops of the batched spec: edits merged
across the steps of an unrolled loop (one op per distinct edit, with its steps),
a saved value a read at the prompt, a saved list a read per step (or a read per
item at the prompt), and a trace-level list or dict the block wrote into a read per
module value put in, other items kept (:class:`.cache.Gather`). The spec runs
for all requests at once (:mod:`.batched`). A block that cannot be recorded runs
as code for its request; :class:`Fallback` says which line and why.

A module's output structure comes from its ``forward``'s return annotation (vLLM
annotates its layers): ``output[i]`` means a tuple's element where that is a
tuple. Annotations can be wrong (a few vLLM models return one tensor where they
say a pair): each op carries the ``structure`` it assumed, and the batched
runner fails the request, naming the fix, where the value is not that.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..payload import codec, spec
from . import record
from .cache import Gather, Kept
from .envoy import ResultRef
from .forward_types import output_structure
from .limits import measure
from .memo import PLANS_KEPT
from .proxies import RecEnvoy, RecTensor, RecTuple, _Expr
from .rec_tracer import RecTracer
from .record import Recorder, Unrecordable
from .tree import leaves

logger = logging.getLogger("vllm.nnsight_plugin")
_OP = re.compile(r"^ops\[(\d+)\] \(([^)]*)\)(: )?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
STATS = {"lowered": 0}  # blocks run as batched specs since start (the lane-stats RPC)


LIST_PREFIX = "__list__"  # derived names of a saved list's items (a snapshot ships no name starting with "__")
MAX_LIST_ITEMS = 256  # (a JSON spec carries at most as many ops: payload.spec.MAX_OPS)
MAX_KEPT_BYTES = 64 * 1024  # tensor bytes a plan keeps of what a block put into a trace-level container
MAX_INTERNED_OP = 4096  # JSON characters of an op that plans share (reads; small edits)


@dataclass(frozen=True)
class Lowered:
    """A block as a spec: its ops and each op's source line, and the saved lists (and
    trace-level dicts) put together from reads at the prompt and values the block put
    there (``lists``: each name with its :class:`.cache.Gather`; :class:`.cache.ReadList`
    gathers it)."""

    spec: dict[str, Any]
    lines: tuple[int, ...]
    lists: tuple[tuple[str, Gather], ...] = ()

    def relabel(self, message: str) -> tuple[str, int | None]:
        """A batched op's error (``ops[N] (add ...): why``) as the block's: the message
        without the op's name, and the line that op came from."""
        found = _OP.match(message)
        if found is None or int(found.group(1)) >= len(self.lines):
            return message, None
        rest = message[found.end():]
        return rest if found.group(3) else found.group(2) + rest, self.lines[int(found.group(1))]


@dataclass(frozen=True)
class Fallback:
    """Why a block runs as code, and the line that made it."""

    why: str
    line: int


def recorder(model: torch.nn.Module, dtype: torch.dtype, shared: frozenset[int],
             stand_ins: dict[int, type] | None = None,
             structure_of: Callable[[torch.nn.Module], int | None] | None = None) -> tuple[Recorder, Callable]:
    """A fresh recording and the resolver that loads a block's values into it (the
    model, the tracer and envoys become proxies). ``stand_ins``: the class to read a
    module's forward from where this pipeline stage holds a placeholder for it;
    ``structure_of``: what a module returns where its forward's annotation does not say
    (the boundary's: vLLM's linears return ``(output, bias)``)."""
    rec = Recorder(dtype, shared, _structure_fn(stand_ins, structure_of))
    root = RecEnvoy(rec, model, "")
    tracer = RecTracer(rec)

    def resolve(ref: tuple) -> Any:
        if ref[0] == "model":
            return root
        if ref[0] == "tracer":
            return tracer
        if ref[0] == "envoy":
            envoy = root
            for part in ref[1].split(".") if ref[1] else ():
                envoy = envoy._child(part)
            return envoy
        raise ValueError(f"unknown reference {ref!r}")

    return rec, resolve


def _structure_fn(stand_ins: dict[int, type] | None,
                  structure_of: Callable[[torch.nn.Module], int | None] | None) -> Callable[[Any], int | None]:
    stand_ins = stand_ins or {}

    def structure(module: torch.nn.Module) -> int | None:
        found = structure_of(module) if structure_of is not None else None
        return found if found is not None else output_structure(stand_ins.get(id(module), type(module)))

    return structure


def record_table(model: torch.nn.Module, dtype: torch.dtype, stand_ins: dict[int, type] | None = None,
                 structure_of: Callable[[torch.nn.Module], int | None] | None = None) -> dict[str, Any]:
    """What a client needs to record blocks as this engine would (a served trace
    records its blocks itself: :func:`table_recorder`): the activations' dtype, each
    module's output structure where known, and the paths of modules reachable by more
    than one path (never planned). JSON-native."""
    from .guards import table

    structure = _structure_fn(stand_ins, structure_of)
    paths: dict[int, list[str]] = defaultdict(list)
    structures: dict[str, int] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths[id(module)].append(path)
        found = structure(module)
        if found is not None:
            structures[path] = found
    shared = sorted(p for ps in paths.values() if len(ps) > 1 for p in ps)
    return {"dtype": str(dtype).removeprefix("torch."), "structures": structures, "shared": shared,
            "integer_inputs": table(model)["integer_inputs"]}


_TABLE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}


class _Stub:
    """A module of a served model as the recorder sees it: its children and what it returns."""

    __slots__ = ("_modules", "structure")

    def __init__(self) -> None:
        self._modules: dict[str, _Stub] = {}
        self.structure: int | None = None


def table_recorder(paths: list[str], table: dict[str, Any]) -> tuple[Recorder, Callable]:
    """A recording over a served model known only by its module paths and its
    :func:`record_table` (no weights, no vLLM): the same plans the server's workers make.
    Raises ValueError for a table it cannot read."""
    dtype = _TABLE_DTYPES.get(table.get("dtype"))  # (the server's word: only names, no lookups)
    structures, aliases = table.get("structures"), table.get("shared")
    if dtype is None or not isinstance(structures, dict) or not isinstance(aliases, list) \
            or not all(isinstance(p, str) for p in [*paths, *aliases]):
        raise ValueError("the server's record table is not one this client reads")
    root, shared, aliases = _Stub(), set(), set(aliases)
    for path in [*paths, *sorted(aliases)]:
        node = root
        for part in path.split(".") if path else ():
            node = node._modules.setdefault(part, _Stub())
        found = structures.get(path)
        node.structure = found if type(found) is int and 0 <= found <= 16 else None
        if path in aliases:
            shared.add(id(node))
    return recorder(root, dtype, frozenset(shared), structure_of=lambda m: m.structure)


def plan_block(rec: Recorder, source: str, filename: str, lineno: int, values: dict[str, Any],
               seconds: float = record.RECORD_TIME_S) -> Lowered | Fallback:
    """Record the block (its values loaded through :func:`recorder`'s resolver), for
    at most ``seconds``."""
    from .block_source import compile_block

    try:
        code = compile_block(source, filename, lineno)
    except Exception:  # noqa: BLE001 - a syntax error: code reports it
        return Fallback("it does not compile", lineno)
    from ..payload.codec import SharedDict, SharedList

    before: dict[int, list[Any] | dict[Any, Any]] = {}  # trace-level containers as they came
    for value in values.values():  # (saved, as the trace saved them)
        if isinstance(value, (SharedList, SharedDict)):
            rec.saved[id(value)] = value
            before[id(value)] = _structure(value)
    try:
        namespace = record.run_block(rec, code, values, lineno, seconds)
        return _assemble(rec, namespace, before)
    except Unrecordable as exc:
        return Fallback(exc.why, exc.line or lineno)


def _assemble(rec: Recorder, namespace: dict[str, Any], before: dict[int, Any]) -> Lowered:
    """The spec of a recording. ``before``: the trace-level lists and dicts the block
    was given, by id, as they came (what it wrote into them goes back)."""
    ops: list[tuple[int, dict[str, Any], int]] = []  # (access order, op, line)
    caches: list[tuple[int, dict[str, Any], int]] = []
    lists: list[tuple[str, Gather]] = []
    seen: set[int] = set()
    for name, value in namespace.items():
        if name.startswith("__") or id(value) not in rec.saved or rec.saved[id(value)] is not value:
            continue
        if id(value) in seen:
            raise Unrecordable(f"binds one saved value to two names ({name})", None)
        seen.add(id(value))
        if _NAME.fullmatch(name) is None:
            raise Unrecordable(f"saves under the name {name[:80]!r}, longer than a plan carries", None)
        if isinstance(value, record.RecCache):  # (after every other op: it reads what they made)
            caches.append((1 << 62, {**value.op, "name": name}, value.line))
            continue
        if type(value) is ResultRef:  # (no engine work: the client takes that part of the output)
            ops.append((1 << 61, {"op": spec.RESULT, "name": name,
                                  "path": [list(part) for part in value.__nnsight_result_path__]},
                        rec.result_lines.get(id(value), 0)))
            continue
        if isinstance(value, list) and any(isinstance(v, RecTensor) and v._pending for v in value):
            raise Unrecordable(f"saves a list ({name}) holding a copy of a module's value that the block edited",
                               None)
        came = before.get(id(value))
        written = id(value) in before and not _per_step_list(value, came)  # (a trace-level container)
        if written:
            if _as_came(value, came):
                continue  # (nothing to merge: the caller's container stays as it is)
            if rec.looped and not _as_came(value, came, reads=True):
                # (a step loop's body is recorded for steps a request may not reach, or twice)
                raise Unrecordable(f"changes {name}, a trace-level container, beside a step loop other than by "
                                   "putting module values into it (how often the loop runs is known only "
                                   "when it runs)", None)
        if written or _read_list(value):
            reads, gather = _written(name, value)
            ops.extend(reads)
            lists.append((name, gather))
            continue
        ops.append(_read(name, value))
    edited = {e.location for e in rec.edits}
    for _, op, line in ops:
        if record.location(op) in edited:
            raise Unrecordable(f"reads {op['module']}.{op.get('io', 'output')} beside an edit of it", line)
    ops.extend(_merged_edits(rec))
    ops.extend(caches)
    if not ops:
        if lists:  # (numbers or None only: what they are is known without the engine)
            raise Unrecordable("it reads and edits nothing (it only puts values that are no module's into "
                               f"{lists[0][0]})", None)
        if rec.saved:  # (saved, then put where no name of the block holds it)
            line = next((v._loc.line for v in rec.saved.values() if hasattr(v, "_loc")), None)
            raise Unrecordable("it saves no value under a name (only names bound in the block come back: "
                               "a value put into a dict, a list or an attribute does not)", line)
        raise Unrecordable("it reads and edits nothing", None)
    ops.sort(key=lambda item: item[0])
    return Lowered(codec.spec_envelope([op for _, op, _ in ops]), tuple(line for _, _, line in ops), tuple(lists))


def _per_step_list(value: Any, came: Any) -> bool:
    """A trace-level list that came empty and holds the values of one location at
    successive steps (``for step in tracer.iter[:]: outs.append(...)``): one per-step
    read, as a list the block made (:func:`_read`)."""
    return isinstance(value, list) and not came and bool(value) \
        and all(isinstance(v, (RecTensor, RecTuple)) for v in value) \
        and not (all(v._loc.step == 0 for v in value) and any(v._where() != value[0]._where() for v in value))


_IMMUTABLE = (type(None), bool, int, float, str)
_DEPTH = 8  # how deep lists and dicts inside a trace-level container are followed (deeper: code)
_NOTHING = object()


def _structure(value: Any, depth: int = 0) -> Any:
    """Lists and dicts copied all the way down (the items themselves kept): what a
    container held before the block ran, inner lists too."""
    if depth < _DEPTH and isinstance(value, list):
        return [_structure(v, depth + 1) for v in value]
    if depth < _DEPTH and isinstance(value, dict):
        return {k: _structure(v, depth + 1) for k, v in value.items()}
    return value


def _as_came(value: Any, came: Any, reads: bool = False, depth: int = 0) -> bool:
    """Whether the block surely left a container as it came (:func:`_structure`), inner
    ones too; ``reads``: or only put module values into it (into slots, under new keys,
    appended, inner lists too). An item that can change in place (a tensor, a tuple
    holding a list) counts as changed: the container goes back and the client's merge
    compares it."""
    if reads and isinstance(value, (RecTensor, RecTuple)):
        return True
    if depth < _DEPTH and isinstance(value, list) and type(came) is list:
        return (len(value) >= len(came) if reads else len(value) == len(came)) \
            and all(_as_came(a, b, reads, depth + 1) for a, b in zip(value, came)) \
            and all(_as_came(v, _new(v), reads, depth + 1) for v in value[len(came):])
    if depth < _DEPTH and isinstance(value, dict) and type(came) is dict:
        return (set(came) <= set(value) if reads else list(value) == list(came)) and all(
            _as_came(v, came[k] if k in came else _new(v), reads, depth + 1) for k, v in value.items())
    return value is came and type(value) in _IMMUTABLE


def _new(value: Any) -> Any:
    """What an item the block added is compared with: an empty list or dict (holding
    only module values it may be), else nothing it can be."""
    return [] if type(value) is list else {} if type(value) is dict else _NOTHING


def _written(name: str, value: Any) -> tuple[list[tuple[int, dict[str, Any], int]], Gather]:
    """A saved list, or a trace-level list or dict the block wrote into, as it left it:
    a read at the prompt per module value in it, inner lists and dicts too (each read
    under a derived name), every other item kept as it is (a number, None, a tensor it
    was given)."""
    reads: list[tuple[int, dict[str, Any], int]] = []
    gather = _gathered(name, value, reads, 0)
    if len(reads) > MAX_LIST_ITEMS:
        raise Unrecordable(f"reads {len(reads)} values into {name} (a plan reads at most {MAX_LIST_ITEMS})", None)
    kept = gather.kept()
    count, size = measure(kept)
    size += sum(len(leaf) for leaf in leaves(kept) if isinstance(leaf, str))
    if size > MAX_KEPT_BYTES or count > MAX_LIST_ITEMS:  # (a cached plan holds them)
        raise Unrecordable(f"puts more than {MAX_KEPT_BYTES // 1024} KiB or {MAX_LIST_ITEMS} values that are no "
                           f"module's into {name} (the code path's limits measure them)", None)
    return reads, gather


def _gathered(name: str, value: Any, reads: list[tuple[int, dict[str, Any], int]], depth: int) -> Gather:
    keys = tuple(value) if isinstance(value, dict) else ()
    items: list[str | Kept | Gather] = []
    for key in keys:
        if not _plain(key):
            raise Unrecordable(f"writes into {name} under a key a plan cannot carry ({type(key).__name__})", None)
    for item in (value.values() if isinstance(value, dict) else value):
        if isinstance(item, (RecTensor, RecTuple)):
            if item._loc.step != 0:
                raise Unrecordable(f"puts a value of a step after the prompt into {name} (a plan reads a "
                                   "list's items at the prompt, or one location per step)", item._loc.line)
            if isinstance(item, RecTensor) and item._pending:
                raise Unrecordable(f"puts a copy of a module's value that the block edited into {name}", None)
            hidden = f"{LIST_PREFIX}{name}.{len(reads)}"
            reads.append((item._loc.seq, {**_read_op(hidden, item._where()), "steps": "prefill"}, item._loc.line))
            items.append(hidden)
        elif _plain(item):
            items.append(Kept(item))
        elif depth < _DEPTH and type(item) in (list, dict):  # (an inner list an invoke appended to: outs[i])
            items.append(_gathered(name, item, reads, depth + 1))
        else:
            what = "value computed from a module's value" if isinstance(item, _Expr) \
                else type(item).__name__
            raise Unrecordable(f"puts a {what} into {name}, which a plan cannot carry", None)
    return Gather("dict" if isinstance(value, dict) else "list", tuple(items), keys)


def _plain(value: Any, depth: int = 0) -> bool:
    """A value that goes back as it is: numbers, strings, None, tensors, and lists,
    tuples and dicts of them (no recorded value inside)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return not isinstance(value, RecTensor)
    if depth < _DEPTH and type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if depth < _DEPTH and type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _read_list(value: Any) -> bool:
    """A saved list of values read at the prompt from more than one location (or rows):
    one read per item, gathered into the list (a list of one location's values at
    successive steps is one per-step read: :func:`_read`). A trace-level list that
    invokes write into (``codec.SharedList``) is not one: its slots merge per invoke."""
    return type(value) is list and 1 < len(value) <= MAX_LIST_ITEMS \
        and all(isinstance(v, (RecTensor, RecTuple)) and v._loc.step == 0 for v in value) \
        and any(v._where() != value[0]._where() for v in value)


def _read(name: str, value: Any) -> tuple[int, dict[str, Any], int]:
    if not isinstance(value, list):
        loc = value._loc
        if loc.step != 0:
            raise Unrecordable(f"saves {name} at a step after the prompt (a plan saves one value at the prompt, "
                               "or a list with one value per step)", loc.line)
        return loc.seq, {**_read_op(name, value._where()), "steps": "prefill"}, loc.line
    if not value or not all(isinstance(v, (RecTensor, RecTuple)) for v in value):
        raise Unrecordable(f"saves a list ({name}) that is not one module value per step", None)
    first = value[0]._loc
    if any(v._where() != value[0]._where() for v in value):
        raise Unrecordable(f"saves a list ({name}) of values of different modules or rows", first.line)
    steps = [v._loc.step for v in value]
    if all(isinstance(s, str) for s in steps):  # (an open-ended loop's body is recorded twice)
        if len(steps) != 2 or steps[0] != steps[1]:
            raise Unrecordable(f"saves a list ({name}) that is not one value per step", first.line)
    elif all(isinstance(s, int) for s in steps) and all(a < b for a, b in zip(steps, steps[1:])):
        steps = list(steps)
    else:
        raise Unrecordable(f"saves a list ({name}) that is not one value per step", first.line)
    return first.seq, {**_read_op(name, value[0]._where()),
                       "steps": steps[0] if isinstance(steps[0], str) else steps}, first.line


def _read_op(name: str, where: dict[str, Any]) -> dict[str, Any]:
    """A read of ``where`` saved under ``name`` (the logits have an op of their own)."""
    if where.get("logits"):
        return {"op": "logits", "name": name}
    return {"op": "read", "name": name, **where}


def _merged_edits(rec: Recorder) -> list[tuple[int, dict[str, Any], int]]:
    """One op per distinct edit, with every step it applied at. The k-th like edit of
    a location within a step merges with the k-th of the other steps; merging must
    keep each step's order of edits at each location."""
    merged: dict[tuple, list[Any]] = {}
    per_slot: dict[tuple, list[tuple]] = defaultdict(list)
    for e in rec.edits:
        loc, base = e.location, e.signature
        slot = per_slot[(e.step, loc)]
        # (an open-ended loop's edit never merges with a step's: at its first step both apply)
        key = (base, isinstance(e.step, str), sum(1 for k in slot if k[0] == base))
        slot.append(key)
        merged.setdefault(key, [e, loc, []])[2].append(e.step)
    order = list(merged)
    for (step, loc), keys in per_slot.items():
        if [k for k in order if merged[k][1] == loc and step in merged[k][2]] != keys:
            raise Unrecordable(f"edits {loc[0]} in a different order at different steps", None)
    out = []
    for key in order:
        e, _, steps = merged[key]
        word = next((s for s in steps if isinstance(s, str)), None)
        op: dict[str, Any] = {"op": e.kind, **e.where,
                              "steps": word or ("prefill" if steps == [0] else sorted(steps))}
        if e.kind in ("add", "set"):
            op["value"] = e.value.detach().cpu().double().tolist() if isinstance(e.value, torch.Tensor) else e.value
        if e.kind == "scale":
            op["factor"] = e.factor
        out.append((e.seq, op, e.line))
    return out


def first_refused(ops: list[dict[str, Any]], lines: tuple[int, ...],
                  check: Callable[[dict[str, Any]], None]) -> Fallback | None:
    """The first op ``check`` raises for, as the Fallback at its line: a block whose plan
    would be refused runs as code, and says which line and why."""
    for op, line in zip(ops, lines):
        try:
            check(op)
        except Exception as exc:  # noqa: BLE001 - refused: the block reports it itself
            return Fallback(f"{type(exc).__name__}: {str(exc)[:200]}", line)
    return None


def _check_cache(model: torch.nn.Module, op: dict[str, Any], check_access: Callable[[str, str], None]) -> None:
    """A cache's named modules exist and are served (a cache of every module takes
    those the engine serves)."""
    from .cache import ios, resolve_path

    for raw in op.get("modules") or ():
        path = resolve_path(model, raw)
        model.get_submodule(path)
        for io in ios(op):
            check_access(path, io)


CACHEABLE = 64 * 1024  # payload text (values + source) whose lowering is cached
# plans kept, the least recently used going first: a trace's invokes with a value each (a
# sweep) have a plan each, and a sweep over many batches sends the same ones every batch
CACHED_PLANS = PLANS_KEPT
CACHED_NUMBERS = 4 << 20  # numbers the kept plans' edit values hold in all (about 32 bytes each)
INTERNED_OPS = 4096  # distinct small ops shared across plans (see Lowerings._interned)


def kept(env: dict[str, Any]) -> bool:
    """Whether the plan of this code envelope is cached (:meth:`Lowerings.get`): every
    request that sends its text then shares the plan's spec object."""
    return len(env["values"]) + len(env["source"]) <= CACHEABLE


def _numbers(value: Any) -> int:
    """How many numbers an op's value holds (a nested list for a value of shape (1, h))."""
    if not isinstance(value, list):
        return 0
    return sum(_numbers(v) for v in value) if value and isinstance(value[0], list) else len(value)


class Lowerings:
    """An engine's plans, cached by payload text: requests sending one block share
    one spec, so their ops batch by identity, and a hit records nothing."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, code_time_limit_s: float = 0.0,
                 stand_ins: dict[int, type] | None = None,
                 structure_of: Callable[[torch.nn.Module], int | None] | None = None):
        self.model, self.dtype = model, dtype
        self.stand_ins, self.structure_of = stand_ins, structure_of  # (see recorder)
        # a recording takes at most the server's code time limit (a block would too)
        self.seconds = min(record.RECORD_TIME_S, code_time_limit_s) if code_time_limit_s > 0 \
            else record.RECORD_TIME_S
        self._cache: OrderedDict[tuple, tuple[Lowered | Fallback, int]] = OrderedDict()  # -> (plan, its numbers)
        self._numbers = 0  # numbers the kept plans' edit values hold
        self._shared: frozenset[int] | None = None
        self._ops: dict[str, dict[str, Any]] = {}  # an op's JSON -> the one object of that op (see _interned)

    def get(self, env: dict[str, Any], check_access: Callable[[str, str], None],
            integer_inputs: frozenset[str] = frozenset()) -> Lowered | Fallback:
        """The plan of a checked code envelope, or why it runs as code.
        ``check_access`` raises for a module the engine does not serve (untapped),
        and an edit of an index tensor (``integer_inputs``) is refused: such a block
        runs as code and reports it at its line. Payloads over :data:`CACHEABLE` (a
        block shipping a large tensor) are recorded each time: the cache keeps no
        megabytes alive."""
        from ..payload import codec
        from . import guards

        key = (env["source"], env["filename"], env["lineno"], env["values"])
        cacheable = kept(env)
        if cacheable and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key][0]
        rec, resolve = recorder(self.model, self.dtype, self.shared(), self.stand_ins, self.structure_of)
        values = codec.load_code(env, resolve).values
        try:
            found = plan_block(rec, env["source"], env["filename"], env["lineno"], values, self.seconds)
        except Exception as exc:  # noqa: BLE001 - the recorder's own failure: the block still runs, as code
            logger.exception("recording the block at %s:%s failed", env["filename"], env["lineno"])
            found = Fallback(f"recording it failed ({type(exc).__name__})", env["lineno"])
        if isinstance(found, Lowered):
            def check(op: dict[str, Any]) -> None:
                if op["op"] == "cache":
                    _check_cache(self.model, op, check_access)
                elif "module" in op:  # (the logits: served in every mode)
                    check_access(op["module"], op.get("io", "output"))
                    guards.refuse_integer_writes(codec.spec_envelope([op]), integer_inputs)

            found = first_refused(found.spec["ops"], found.lines, check) or found
        if cacheable:
            if isinstance(found, Lowered):
                found.spec["ops"][:] = [self._interned(op) for op in found.spec["ops"]]
            self._keep(key, found)
        return found

    def _keep(self, key: tuple, found: Lowered | Fallback) -> None:
        numbers = sum(_numbers(op.get("value")) for op in found.spec["ops"]) if isinstance(found, Lowered) else 0
        if numbers > CACHED_NUMBERS:
            return
        while self._cache and (len(self._cache) >= CACHED_PLANS or self._numbers + numbers > CACHED_NUMBERS):
            self._numbers -= self._cache.popitem(last=False)[1][1]
        if len(self._ops) > INTERNED_OPS:  # (plans kept keep their op objects; new plans intern afresh)
            self._ops.clear()
        self._cache[key] = (found, numbers)
        self._numbers += numbers

    def _interned(self, op: dict[str, Any]) -> dict[str, Any]:
        """One object per distinct op across plans: blocks whose values differ per invoke
        (``out[i] = ...`` with each invoke's ``i``) have plans of their own, and the
        batched runner groups requests by op identity, so their like ops run as one."""
        if _numbers(op.get("value")) > MAX_INTERNED_OP // 4:  # (4+ characters a number: too long
            return op  # to share; a 2048-wide steering vector's text took 0.6 ms per plan)
        try:
            key = json.dumps(op, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            return op
        if len(key) > MAX_INTERNED_OP:  # (an edit's long vector: its plan is shared by payload text)
            return op
        return self._ops.setdefault(key, op)

    def shared(self) -> frozenset[int]:
        """Ids of modules under more than one path (shared weights): never lowered."""
        if self._shared is None:
            seen: dict[int, int] = defaultdict(int)
            for _, module in self.model.named_modules(remove_duplicate=False):
                seen[id(module)] += 1
            self._shared = frozenset(m for m, n in seen.items() if n > 1)
        return self._shared
