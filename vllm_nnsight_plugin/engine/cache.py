"""``tracer.cache()`` in the worker: a ``cache`` op as batched reads of every module.

A cache op (from a JSON spec, a block's plan, or ``tracer.cache()`` in a block
that runs as code) becomes one batched read per cached module location, run by
:mod:`.batched` like any read: one host copy of a location's rows per step for
all requests, chunked prompts gathered in order. The reads are *late*: at a
location they run after every edit of it (batched or by a block), so the cache
holds what the forward went on with, as nnsight's cache does. They are
*optional*: a module the forward never calls (``lm_head``, applied inside
``compute_logits``) or whose value has no row per token is left out instead of
failing the request.

The reads' values stay in the session's namespace under derived names; the
:class:`ModuleCache` bound to the user's name gathers them when results ship
(:mod:`..payload.cache` is the client's side).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch

from ..payload import values as tagged
from .rowlog import RowLog

_PREFIX = "__cache__"  # derived names (a snapshot ships no name starting with "__")


@dataclass(frozen=True)
class Part:
    """One cached location: ``path``'s ``io``, read whole (``names`` one name) or one
    read per element of the tuple its forward returns."""

    path: str
    io: str
    names: tuple[str, ...]
    is_tuple: bool


@dataclass(frozen=True)
class Expansion:
    """A cache op as read ops, and how their values make the cache."""

    name: str
    reads: tuple[dict[str, Any], ...]
    parts: tuple[Part, ...]
    dtype: str | None


def ios(op: dict[str, Any]) -> list[str]:
    """What a cache op keeps of each module: ``"output"``, ``"input"`` or both."""
    return [io for io, flag in (("output", op.get("outputs", True)), ("input", op.get("inputs", False))) if flag]


def expand(op: dict[str, Any], paths: list[str], structure_of: Callable[[str], int | None]) -> Expansion:
    """The reads of a cache op over ``paths`` (module paths in forward order);
    ``structure_of(path)``: N for a module whose forward returns a tuple of N
    tensors, else None (read as it comes)."""
    steps = op.get("steps", "all")
    reads: list[dict[str, Any]] = []
    parts: list[Part] = []
    for path in paths:
        for io in ios(op):
            n = structure_of(path) if io == "output" else None
            names = []
            for element in range(n) if n else (None,):
                name = f"{_PREFIX}{op['name']}.{len(reads)}"
                read = {"op": "read", "name": name, "module": path, "io": io, "steps": steps,
                        "late": True, "optional": True}
                if element is not None:
                    read.update(index=element, structure=n)
                reads.append(read)
                names.append(name)
            parts.append(Part(path, io, tuple(names), bool(n)))
    return Expansion(op["name"], tuple(reads), tuple(parts), op.get("dtype"))


class Gathered:
    """A saved value made of batched reads under derived names in the session's
    namespace, put together when results ship (:class:`ModuleCache`, :class:`ReadList`)."""

    __slots__ = ("_namespace",)

    def __init__(self, namespace: dict[str, Any]):
        self._namespace = namespace

    def _read_names(self) -> Iterable[str]:
        raise NotImplementedError

    def values(self) -> list[Any]:
        """The reads' values (what the saved-value limits measure)."""
        raise NotImplementedError

    def keep_values(self) -> None:
        """Hold the reads' values itself (the session's namespace is being cleared)."""
        self._namespace = {n: self._namespace[n] for n in self._read_names() if n in self._namespace}


class ModuleCache(Gathered):
    """The value bound to a cache's name in a block: the session's reads of each
    cached location, encoded as one ``$cache`` value when results ship."""

    __slots__ = ("_expansion",)

    def __init__(self, namespace: dict[str, Any], expansion: Expansion):
        super().__init__(namespace)
        self._expansion = expansion

    def _read_names(self) -> Iterable[str]:
        return (n for part in self._expansion.parts for n in part.names)

    def _parts(self) -> Iterable[tuple[Part, list[Any]]]:
        for part in self._expansion.parts:
            found = [self._namespace.get(name) for name in part.names]
            if all(v is not None and not (isinstance(v, RowLog) and len(v) == 0) for v in found):
                yield part, found  # (a module never reached, or not per token, has no values)

    def values(self) -> list[Any]:
        """The reads' values (what the saved-value limits measure)."""
        return [v for _, found in self._parts() for v in found]

    def __nnsight_encode__(self, binary: bool) -> Any:
        entries = [[part.path, part.io, "tuple" if part.is_tuple else "tensor",
                    [tagged.encode(v, binary) for v in found]] for part, found in self._parts()]
        return {"$cache": {"entries": entries, "dtype": self._expansion.dtype}}

    def __repr__(self) -> str:
        return f"ModuleCache({self._expansion.name!r}, {len(self._expansion.parts)} locations)"


@dataclass(frozen=True, eq=False)
class Kept:
    """An item a block put into a saved list or dict that is no module's value (a
    number, None, a tensor it was given): it goes back as it is."""

    value: Any


@dataclass(frozen=True, eq=False)
class Gather:
    """A saved list or dict as the block left it: each item the derived name of a read
    at the prompt (a ``str``), a :class:`Kept` value, or an inner list or dict (a
    ``Gather``); a dict's keys beside them."""

    kind: str  # "list" or "dict"
    items: tuple[str | Kept | Gather, ...]
    keys: tuple[Any, ...] = ()

    def reads(self) -> tuple[str, ...]:
        return tuple(name for item in self.items for name in
                     ((item,) if isinstance(item, str) else item.reads() if isinstance(item, Gather) else ()))

    def kept(self) -> list[Any]:
        return [value for item in self.items for value in
                ((item.value,) if isinstance(item, Kept) else item.kept() if isinstance(item, Gather) else ())]

    def build(self, value_of: Callable[[str], Any], copy: bool = False) -> list[Any] | dict[Any, Any]:
        """The list or dict, each read's value taken by ``value_of(name)``; ``copy``: the
        kept values copied (each result its own, as decoded results are)."""
        got = [value_of(item) if isinstance(item, str) else item.build(value_of, copy) if isinstance(item, Gather)
               else deepcopy(item.value) if copy else item.value for item in self.items]
        return got if self.kind == "list" else dict(zip(self.keys, got, strict=True))

    def renamed(self, names: dict[str, str]) -> Gather:
        return Gather(self.kind, tuple(names[i] if isinstance(i, str) else i.renamed(names) if isinstance(i, Gather)
                                       else i for i in self.items), self.keys)


class ReadList(Gathered):
    """A saved list (or dict) of values read at the prompt from several locations (a
    block's ``[layer.output[0] for layer in layers]``, or a trace-level list or dict an
    invoke wrote into): one batched prefill read per read item under a derived name,
    put together with the items the block put there otherwise when results ship. An
    item not read (its request failed first) is None."""

    __slots__ = ("_gather",)

    def __init__(self, namespace: dict[str, Any], gather: Gather):
        super().__init__(namespace)
        self._gather = gather

    def _read_names(self) -> Iterable[str]:
        return self._gather.reads()

    def values(self) -> list[Any]:
        """The items read so far and the kept ones (what the saved-value limits measure)."""
        return [self._namespace[n] for n in self._gather.reads() if n in self._namespace] + self._gather.kept()

    def __nnsight_encode__(self, binary: bool) -> Any:
        return tagged.encode(self._gather.build(self._namespace.get), binary)

    def __repr__(self) -> str:
        return f"ReadList({len(self._gather.items)} items)"


def default_paths(model: torch.nn.Module, shared: frozenset[int], outside_forward: frozenset[str],
                  served: Callable[[str, str], bool], ios: Iterable[str]) -> list[str]:
    """Every module a cache of all modules reads: named submodules in registration
    (forward) order, less those under two paths (shared weights run once per path),
    those vLLM calls outside the model's forward (``outside_forward``: top-level
    names) and those the engine does not serve (untapped, on a compiled engine)."""
    ios = tuple(ios)
    return [name for name, module in model.named_modules() if name and name.split(".")[0] not in outside_forward
            and id(module) not in shared and all(served(name, io) for io in ios)]


# ------------------------------------------------------------ admission (the interleaver's side)


def cache_op(name: str, modules: Any, dtype: Any, include_output: bool, include_inputs: bool) -> dict[str, Any]:
    """``tracer.cache(...)``'s arguments as a spec's cache op (``modules``: envoys or
    path strings; ``dtype``: a torch dtype or its name)."""
    op: dict[str, Any] = {"op": "cache", "name": name, "outputs": bool(include_output),
                          "inputs": bool(include_inputs)}
    if modules is not None:
        if isinstance(modules, str) or not isinstance(modules, (list, tuple, set, frozenset)):
            modules = [modules]
        paths = []
        for m in modules:
            path = m if isinstance(m, str) else getattr(m, "_path", None)
            if not isinstance(path, str):
                raise TypeError(f"tracer.cache(modules=...) takes modules or their paths, not {type(m).__name__}")
            paths.append(path)
        op["modules"] = paths
    if dtype is not None:
        op["dtype"] = dtype if isinstance(dtype, str) else tagged.dtype_name(dtype)
    return op


def resolve_path(model: torch.nn.Module, raw: str) -> str:
    """A module path as this engine names it: nnsight's full paths start with the
    root's name (``model.model.layers.0``), this engine's do not (``model.layers.0``)."""
    if raw.startswith("model."):
        try:
            model.get_submodule(raw[len("model."):])
            return raw[len("model."):]
        except AttributeError:
            pass
    return raw


def expander(inter: Any) -> Callable[[dict[str, Any]], Expansion]:
    """Expands a cache op against the interleaver's model: every module it serves, or
    the op's ``modules`` (each checked: known, on one path, served). Memoized per op
    text, so requests caching alike share their reads (the interleaver keeps one)."""
    from .forward_types import output_structure

    memo: dict[str, Expansion] = {}

    def served(path: str, io: str) -> bool:
        try:
            inter.check_module_access(path, io)
            return True
        except Exception:  # noqa: BLE001 - an untapped module: not cached
            return False

    def structure(path: str) -> int | None:
        return output_structure(type(inter.envoy_at(path)._module))

    def expand_op(op: dict[str, Any]) -> Expansion:
        key = repr(sorted(op.items()))
        found = memo.get(key)
        if found is not None:
            return found
        kept = ios(op)
        shared = inter.lowerings.shared()
        if op.get("modules") is None:
            paths = default_paths(inter.model, shared, inter.setup.outside_forward, served, kept)
        else:
            paths = []
            for raw in op["modules"]:
                path = resolve_path(inter.model, raw)
                if id(inter.envoy_at(path)._module) in shared:
                    raise ValueError(f"{path} is reachable by two paths (shared weights): it runs once per path "
                                     "in a step, so a cache cannot tell its visits apart")
                for io in kept:
                    inter.check_module_access(path, io)
                paths.append(path)
        if len(memo) > 64:
            memo.clear()
        found = memo[key] = expand(op, paths, structure)
        return found

    return expand_op


def bind(session: Any, env: dict[str, Any]) -> None:
    """A batched session's caches, bound to their names (after its reads are added)."""
    for expansion in env.get("caches", ()):
        session.namespace[expansion.name] = session.keep(ModuleCache(session.namespace, expansion))
        session.caches += 1


def attach(inter: Any, session: Any, expansion: Expansion, block: int) -> ModuleCache:
    """A cache for a block that runs as code (``tracer.cache()``, or a spec run per
    request): its reads join the batched ones, due from this step to the request's
    end, and the block stays parked until then (:meth:`.session.RequestSession._main`)."""
    inter.batched.add(session, {"ops": list(expansion.reads)}, block)
    if inter.eager:
        for read in expansion.reads:
            inter.ensure_hook(inter.envoy_at(read["module"])._module, read["io"])
    value = ModuleCache(session.namespace, expansion)
    session.caches += 1
    return session.keep(value)
