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
from typing import Any

import torch

from ..payload.codec import PayloadError
from ..payload.spec import WRITES
from .tree import map_tensors

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


def copy_index_tensors(value: Any) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``value`` with its integer-valued tensors replaced by copies, and the
    ``(copy, original)`` pairs (none for the usual all-float value: no copy made)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value, []
        copy = value.clone()
        return copy, [(copy, value)]
    if type(value) is tuple and all(not isinstance(v, torch.Tensor) or v.is_floating_point() for v in value):
        return value, []  # (a decoder layer's (hidden, residual): the common case, no walk)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def swap(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t
        copy = t.clone()
        pairs.append((copy, t))
        return copy

    return map_tensors(value, swap), pairs


def edited(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether a block changed any of the copies :func:`copy_index_tensors` gave it."""
    return any(not torch.equal(copy, original) for copy, original in pairs)
