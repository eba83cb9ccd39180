"""What a declarative edit may write: floating-point activations, never indices.

vLLM indexes with some of the values a module receives (token ids into the
embedding table, positions into the rotary cache). An edit of those drives a
kernel out of bounds: a segfault on CPU, a device-side assert on a GPU, either way
the engine for everyone. So spec and JSON-edit writes to integer-valued tensors are
refused, in two places that use one rule:

- up front, from the model's module table (:func:`table`, built in the worker from
  each module's ``forward`` signature and sent to the front end over RPC): HTTP 400,
  or a per-request error before the request touches the engine;
- at the write itself (:func:`check_writable`), for whatever the table does not
  know: the tensor's dtype is checked before anything is changed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from ..payload.codec import PayloadError
from ..payload.spec import WRITES, runs_batched
from .tree import leaves, map_tensors

# first-argument names vLLM's models give integer inputs (ids, positions, indices)
INTEGER_NAMES = ("input_ids", "ids", "positions", "position_ids", "token_type_ids", "input_positions",
                 "indices", "index", "slot_mapping")


def first_input_is_integer(module: torch.nn.Module) -> bool:
    """Whether the module's first positional argument (what ``.input`` is) is an index
    tensor: an embedding's ids, or an argument named like one (``positions``)."""
    if isinstance(module, torch.nn.Embedding) or hasattr(module, "num_embeddings"):
        return True
    return _first_parameter_is_an_index(type(module))


@functools.cache
def _first_parameter_is_an_index(cls: type) -> bool:
    # a custom op's forward(*args) dispatches to per-platform methods named forward_*
    methods = [getattr(cls, "forward", None)] + [getattr(cls, n) for n in dir(cls) if n.startswith("forward_")]
    for method in methods:
        try:
            params = list(inspect.signature(method).parameters.values())[1:]
        except (TypeError, ValueError):
            continue
        first = next((p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
        if first is not None and (first.name in INTEGER_NAMES or first.name.endswith(("_ids", "_indices"))):
            return True
    return False


def table(model: torch.nn.Module) -> dict[str, Any]:
    """The module table the front end checks specs with: the paths whose input is an
    index tensor (msgpack-native, for vLLM's RPC)."""
    # every path, also a shared module's second one (vLLM's rotary embedding is one module
    # under every layer's attention)
    paths = model.named_modules(remove_duplicate=False)
    return {"integer_inputs": sorted({path for path, m in paths if first_input_is_integer(m)})}


def absent_message(path: str, absent: Any) -> str:
    """Why a block run as code cannot touch a module another pipeline stage holds
    (``absent``: the paths this, the last, stage does not hold)."""
    return (f"{path} is computed in an earlier pipeline stage (this engine runs pipeline parallel): a block "
            f"that runs as code reaches the last stage's modules, model.logits and model.samples; reads and "
            f"edits of an earlier stage's modules run as a plan (a spec, or a block that runs batched). "
            f"The earlier stages hold {_summary(absent)}")


def _summary(absent: Any) -> str:
    layers = sorted((p for p in absent if p.rsplit(".", 1)[-1].isdigit()), key=lambda p: int(p.rsplit(".", 1)[1]))
    others = sorted(p for p in absent if not p.rsplit(".", 1)[-1].isdigit())
    parts = others + ([f"{layers[0]} to {layers[-1]}" if len(layers) > 1 else layers[0]] if layers else [])
    return ", ".join(parts)


def held_elsewhere(path: str, absent: Any) -> bool:
    """Whether ``path`` is one of ``absent`` or under one."""
    if not absent:
        return False
    if path in absent:
        return True
    parts = path.split(".")
    return any(".".join(parts[:i]) in absent for i in range(1, len(parts)))


def refuse_absent(env: dict[str, Any], absent: Any, carried: bool = True) -> None:
    """Raise :class:`PayloadError` for a spec that touches a module an earlier pipeline
    stage holds in a way only the last stage could run (``absent``: those modules).
    Batched reads and edits reach every stage (:mod:`.stages`); a cache or a spec that
    runs per request does not, and a read before an edit of the same location would
    get the edited value (the value that travels is the one the earlier stage left).
    Not ``carried`` (tensor parallel too): no op may touch an earlier stage's module."""
    if env.get("kind") != "spec" or not absent:
        return
    batchable = runs_batched(env)
    edited_later: dict[tuple[str, str], int] = {}
    for i, op in enumerate(env["ops"]):
        if op["op"] in WRITES:
            edited_later[(op["module"], op.get("io", "output"))] = i
    for i, op in enumerate(env["ops"]):
        for path in [op["module"]] if "module" in op else op.get("modules") or []:
            if not held_elsewhere(path, absent):
                continue
            if not carried:
                raise PayloadError(f"invalid spec at ops[{i}]: {path} is computed in an earlier pipeline stage, "
                                   "which plans reach only with two stages, no tensor parallel and not "
                                   "under the external launcher: here they reach the last stage's modules, "
                                   f"model.logits and model.samples. The earlier stages hold {_summary(absent)}")
            if "modules" in op or not batchable:
                what = "a cache" if "modules" in op else "a spec that runs per request (not batched)"
                raise PayloadError(f"invalid spec at ops[{i}]: {path} is computed in an earlier pipeline stage, "
                                   f"which {what} cannot reach; batched reads and edits can. The earlier "
                                   f"stages hold {_summary(absent)}")
            if op["op"] == "read" and edited_later.get((path, op.get("io", "output")), -1) > i:
                raise PayloadError(f"invalid spec at ops[{i}]: reads {path} before editing it, but it is computed "
                                   "in an earlier pipeline stage, whose value reaches the last stage after all of "
                                   "that stage's edits: read it after the edit")


def refuse_integer_writes(env: dict[str, Any], integer_inputs: Any) -> None:
    """Raise :class:`PayloadError` for a spec op that writes a module input the table
    names as an index tensor."""
    if env.get("kind") != "spec":
        return
    for i, op in enumerate(env["ops"]):
        if op["op"] in WRITES and op.get("io") == "input" and op["module"] in integer_inputs:
            raise PayloadError(
                f"invalid spec at ops[{i}]: {op['module']}.input is an integer tensor (token ids or "
                f"positions) that vLLM indexes with; edits of it are refused (edit a floating-point "
                f"activation instead, e.g. an output)")


def check_writable(value: torch.Tensor, where: str) -> None:
    """Refuse a write to an integer-valued tensor, before anything is changed."""
    if not value.is_floating_point():
        raise TypeError(f"{where} is an integer tensor ({value.dtype}: token ids, positions or indices "
                        "that vLLM indexes with); edits of it are refused")


class Protected(NamedTuple):
    """A copy a block got in place of a tensor it may not edit, and the copy's version
    counter when given: an in-place edit moves the counter (no device sync to check)."""

    copy: torch.Tensor
    version: int


def _protected(t: torch.Tensor, parameters: frozenset[int]) -> bool:
    """A tensor a block gets a copy of: token ids, positions or indices (vLLM indexes
    with them), or one of the model's parameters (a linear's bias that vLLM returns
    beside its output: every later request would read an edit of it), known by type or
    by its storage (``parameters``: the model's; a compiled graph may pass a plain view)."""
    return not t.is_floating_point() or is_parameter(t, parameters)


def is_parameter(t: torch.Tensor, parameters: frozenset[int]) -> bool:
    return isinstance(t, torch.nn.Parameter) or (t.dim() <= 1 and t.untyped_storage().data_ptr() in parameters)


def holds_protected(value: Any, parameters: frozenset[int]) -> bool:
    """Whether any tensor of ``value`` is :func:`_protected` (then each request's view
    of it goes through :func:`copy_protected`)."""
    return any(isinstance(t, torch.Tensor) and _protected(t, parameters) for t in leaves(value))


def copy_protected(value: Any, parameters: frozenset[int]) -> tuple[Any, list[Protected]]:
    """``value`` with its :func:`_protected` tensors replaced by copies, and those copies."""
    copies: list[Protected] = []

    def swap(t: torch.Tensor) -> torch.Tensor:
        if not _protected(t, parameters):
            return t
        with torch.inference_mode(False):  # (a normal tensor keeps a version counter; an inference one does not)
            copy = t.detach().clone()
        copies.append(Protected(copy, copy._version))
        return copy

    return map_tensors(value, swap), copies


def edited(copies: list[Protected]) -> str | None:
    """What a block changed of the copies :func:`copy_protected` gave it (None: nothing).
    Any in-place op counts, also one that leaves the values as they were (``x[:] = x``);
    a write around torch's counter (``.data``, numpy) changes only the copy."""
    for found in copies:
        if found.copy._version != found.version:
            if found.copy.is_floating_point():  # (a protected float tensor is a parameter)
                return ("is one of the model's parameters (a linear's bias, returned beside its output), "
                        "which every request reads: edits of it are refused (the block changed its copy; "
                        "edit the output, element 0, instead)")
            return ("holds token ids or positions that vLLM indexes with; edits of it are refused (the block "
                    "changed its copy)")
    return None
