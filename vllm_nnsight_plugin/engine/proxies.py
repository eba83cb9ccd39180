"""The proxies a block sees while it is recorded (:mod:`.record`).

``model`` and the envoys it brought become :class:`RecEnvoy` (``tracer`` is
:mod:`.rec_tracer`'s); a module's value is a :class:`RecTuple` (a tuple output) or a
:class:`RecTensor` (a tensor, or chosen rows of one). Each notes what the block does
with it on the recording (reads, saves, in-place edits, step loops) and refuses,
by calling the recording's ``fail``, whatever a plan cannot hold: looking at a
value as data (``bool``, ``.item()``, comparisons, formatting), torch functions,
other arithmetic. They import nothing of the recorder: it is passed in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:
    from .record import Recorder


@dataclass(frozen=True)
class _Loc:
    path: str
    io: str
    structure: int | None
    step: int | str
    seq: int
    line: int


class RecEnvoy:
    """A module, addressed by path, as the block sees it while it is recorded."""

    __slots__ = ("_rec", "_module", "_path")

    def __init__(self, rec: Recorder, module: torch.nn.Module, path: str):
        object.__setattr__(self, "_rec", rec)
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_path", path)

    def _name(self) -> str:
        return self._path or "model"

    def _child(self, name: str) -> RecEnvoy:
        return RecEnvoy(self._rec, self._module._modules[name], f"{self._path}.{name}" if self._path else name)

    def __getattr__(self, name: str) -> Any:
        if name in self._module._modules:
            return self._child(name)
        if name == "logits" and not self._path:
            return self._rec.logits()
        if name == "samples" and not self._path:
            self._rec.fail("uses model.samples")
        if name == "inputs":
            self._rec.fail(f"uses {self._name()}.inputs")
        if name.startswith("__"):
            raise AttributeError(name)
        self._rec.fail(f"uses {self._name()}.{name}, which is not a submodule")

    @property
    def output(self) -> Any:
        return self._rec.access(self, "output")

    @property
    def input(self) -> Any:
        return self._rec.access(self, "input")

    def __setattr__(self, name: str, value: Any) -> None:
        self._rec.fail(f"assigns {self._name()}.{name}")

    def __getitem__(self, index: int | slice | str) -> Any:
        keys = list(self._module._modules)
        if isinstance(index, slice):
            return [self._child(k) for k in keys[index]]
        if isinstance(index, int):
            return self._child(keys[index])  # (an IndexError is the block's: code reports it)
        return self.__getattr__(index)

    def __len__(self) -> int:
        return len(self._module._modules)

    def __iter__(self) -> Iterator[RecEnvoy]:
        return (self._child(k) for k in self._module._modules)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._rec.fail(f"calls {self._name()}")


class _Value:
    """What every recorded value refuses: being looked at as data."""

    __slots__ = ("_rec",)
    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        rec = next(a._rec for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Value))
        rec.fail(f"passes a module's value to torch ({getattr(func, '__name__', func)})")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._rec.fail(f"uses .{name} of a module's value")

    def save(self) -> Any:  # (a block's .save() is rewritten; a helper's is not)
        return self._rec.save(self)


def refuse_as(what: str) -> Any:
    """A method that ends the recording: the block does ``what`` with a value."""
    def refuse(self: _Value, *args: Any) -> NoReturn:
        self._rec.fail(what)
    return refuse


for _name, _what in {
    "__bool__": "branches on a module's value", "__len__": "takes len() of a module's value",
    "__float__": "turns a module's value into a number", "__int__": "turns a module's value into a number",
    "__index__": "turns a module's value into a number", "__complex__": "turns a module's value into a number",
    "__format__": "formats a module's value", "__repr__": "prints a module's value",
    "__eq__": "compares a module's value", "__ne__": "compares a module's value",
    "__lt__": "compares a module's value", "__le__": "compares a module's value",
    "__gt__": "compares a module's value", "__ge__": "compares a module's value",
    "__neg__": "negates a module's value", "__abs__": "computes with a module's value",
    "__truediv__": "divides a module's value", "__rtruediv__": "divides by a module's value",
    "__itruediv__": "divides a module's value", "__floordiv__": "divides a module's value",
    "__matmul__": "multiplies matrices with a module's value",
    "__rmatmul__": "multiplies matrices with a module's value",
    "__pow__": "computes with a module's value", "__contains__": "searches a module's value",
    "__iter__": "iterates over a module's rows",
}.items():
    setattr(_Value, _name, refuse_as(_what))


class RecTuple(_Value):
    """A module output that is a tuple of tensors (a decoder layer's (hidden, residual))."""

    __slots__ = ("_loc",)

    def __init__(self, rec: Recorder, loc: _Loc):
        self._rec, self._loc = rec, loc

    def __getitem__(self, index: Any) -> RecTensor:
        n = self._loc.structure
        if type(index) is not int:
            self._rec.fail(f"indexes a tuple output with {index!r}")
        if not -n <= index < n:
            raise IndexError("tuple index out of range")  # (the block's own error: code reports it)
        return RecTensor(self._rec, self._loc, index % n)

    def __iter__(self) -> Iterator[RecTensor]:  # h, r = layer.output
        return (RecTensor(self._rec, self._loc, i) for i in range(self._loc.structure))

    def __len__(self) -> int:
        return self._loc.structure

    def _copy(self) -> RecTuple:
        return RecTuple(self._rec, self._loc)

    def _where(self) -> dict[str, Any]:
        return {"module": self._loc.path, "structure": self._loc.structure}


class RecTensor(_Value):
    """A tensor a module gave (or the chosen rows of it)."""

    __slots__ = ("_loc", "_index", "_positions", "_sum", "_copied", "_pending", "_edits_at")

    def __init__(self, rec: Recorder, loc: _Loc, index: int | None, positions: Any = None, total: bool = False,
                 copied: bool = False):
        self._rec, self._loc, self._index, self._positions, self._sum = rec, loc, index, positions, total
        # a copy (clone(), x[[0, 2]]): its edits stay its own unless written back unchanged
        self._copied, self._pending, self._edits_at = copied, [], len(rec.edits)

    def _as(self, copied: bool) -> RecTensor:
        return RecTensor(self._rec, self._loc, self._index, self._positions, self._sum, copied)

    def _edit(self, kind: str, value: Any = None, factor: float = 1.0) -> None:
        """An edit of these rows: of the module's value, or, on a copy, of the copy."""
        if self._copied:
            self._pending.append((kind, self._rec.operand(value) if kind in ("add", "set") else None, factor))
        else:
            self._rec.edit(kind, self, value, factor)

    def _write_back(self, copy: RecTensor) -> None:
        """``x[rows] = c`` with ``c`` a copy of those rows: its own edits become the module's,
        if nothing edited the module since the copy was taken (else code: the copy is stale)."""
        if not self._same_rows(copy) or self._rec.edited_since(self._where(), copy._edits_at):
            self._rec.fail("writes a copy of a module's value back over rows it was not taken from, "
                           "or that were edited since")
        for kind, value, factor in copy._pending:
            self._rec.edit(kind, self, value, factor)
        copy._pending = []

    def _where(self) -> dict[str, Any]:
        if self._loc.io == "logits":
            return {"logits": True}  # (the plan's "logits" op: see lower._read)
        where: dict[str, Any] = {"module": self._loc.path}
        if self._loc.io == "input":
            where["io"] = "input"
        if self._sum:
            where["sum"] = True
        elif self._index is not None:
            where["index"] = self._index
        if self._loc.io == "output" and self._loc.structure is not None:  # (unannotated: checked by nothing)
            where["structure"] = self._loc.structure
        if self._positions is not None:
            where["positions"] = self._positions
        return where

    def _copy(self) -> RecTensor:
        if self._pending:
            self._rec.fail("saves a copy of a module's value that the block edited")
        return self._as(False)

    def _same_rows(self, other: Any) -> bool:
        return isinstance(other, RecTensor) and other._where() == self._where() and other._loc.step == self._loc.step

    # ------------------------------------------------------------ rows
    def __getitem__(self, key: Any) -> RecTensor:
        if isinstance(key, tuple):  # x[-1, :], x[:, :]
            if not key or any(k != slice(None) and k is not Ellipsis for k in key[1:]):
                self._rec.fail(f"indexes a module's value with {key!r} (a plan picks whole rows)")
            key = key[0]
        if key is Ellipsis or (isinstance(key, slice) and key == slice(None)):
            return self
        if self._positions is not None:
            self._rec.fail("picks rows of rows")
        if self._loc.io == "logits":
            self._rec.fail("picks rows of model.logits (a plan reads its whole row)")
        if self._loc.structure is None and self._index is None:
            self._rec.fail(f"indexes {self._loc.path}.output, whose forward does not say whether it returns "
                           "a tensor or a tuple")
        if type(key) is int:  # (a view)
            return RecTensor(self._rec, self._loc, self._index, key, self._sum, self._copied)
        if isinstance(key, list) and key and all(type(k) is int for k in key):  # (a copy, as in torch)
            return RecTensor(self._rec, self._loc, self._index, list(key), self._sum, True)
        self._rec.fail(f"indexes a module's value with {key!r} (a plan picks whole rows)")

    def clone(self, *args: Any, **kwargs: Any) -> RecTensor:
        if self._pending:
            self._rec.fail("clones a copy of a module's value that the block edited")
        return self._as(True)

    def detach(self) -> RecTensor:
        return self

    def contiguous(self, *args: Any, **kwargs: Any) -> RecTensor:
        return self

    # ------------------------------------------------------------ arithmetic
    def __add__(self, other: Any) -> Any:
        if isinstance(other, RecTensor):
            pair = {self._index, other._index}
            if self._loc.structure == 2 and pair == {0, 1} and self._positions is None \
                    and other._positions is None and not self._sum and not other._sum \
                    and (self._loc.path, self._loc.io, self._loc.step) == (other._loc.path, other._loc.io,
                                                                          other._loc.step):
                return RecTensor(self._rec, min(self._loc, other._loc, key=lambda c: c.seq), None, total=True)
            self._rec.fail("adds two module values (a plan sums only a layer's (hidden, residual))")
        return _Expr(self, "add", other)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        if isinstance(other, _Value):
            self._rec.fail("subtracts module values")
        return _Expr(self, "add", -other if isinstance(other, (torch.Tensor, int, float)) else other)

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            self._rec.fail("multiplies a module's value by something other than a number")
        return _Expr(self, "scale", other)

    __rmul__ = __mul__

    def __iadd__(self, other: Any) -> RecTensor:
        self._edit("add", other)
        return self

    def __isub__(self, other: Any) -> RecTensor:
        if isinstance(other, _Value):
            self._rec.fail("subtracts module values")
        self._edit("add", -other if isinstance(other, (torch.Tensor, int, float)) else other)
        return self

    def __imul__(self, other: Any) -> RecTensor:
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            self._rec.fail("multiplies a module's value by something other than a number")
        self._edit("scale", factor=self._rec.operand(other))
        return self

    # in-place tensor methods, as the statements they are
    def add_(self, other: Any) -> RecTensor:
        return self.__iadd__(other)

    def sub_(self, other: Any) -> RecTensor:
        return self.__isub__(other)

    def mul_(self, other: Any) -> RecTensor:
        return self.__imul__(other)

    def zero_(self) -> RecTensor:
        self[:] = 0
        return self

    def fill_(self, value: Any) -> RecTensor:
        self[:] = value
        return self

    def copy_(self, value: Any) -> RecTensor:
        self[:] = value
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        sub = self[key]
        if sub is not self and self._copied:
            self._rec.fail("writes rows of a copy of a module's value")
        target = sub if sub is self else sub._as(False)  # (x[[0, 2]] = ... writes x's rows, not a copy)
        if value is target:
            return  # x[:] += v (the edit is noted)
        if isinstance(value, RecTensor) and value._copied and not target._copied:
            target._write_back(value)  # x[[0, 2]] += v, or x[:] = a saved copy
            return
        if isinstance(value, RecTensor) and target._same_rows(value) and not value._pending:
            return  # x[:] = x[:]
        if isinstance(value, _Expr):
            base = value.base
            if not target._same_rows(base) or base._pending \
                    or (base._copied and self._rec.edited_since(target._where(), base._edits_at)):
                self._rec.fail("assigns arithmetic on one module's value to another's rows")
            target._edit(value.kind, value.operand if value.kind == "add" else None,
                         factor=self._rec.operand(value.operand) if value.kind == "scale" else 1.0)
            return
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            target._edit("zero")
            return
        target._edit("set", value)


class _Expr(_Value):
    """``x + v``, ``x - v`` or ``x * f``: usable only as ``x[:] = x + v``."""

    __slots__ = ("base", "kind", "operand")

    def __init__(self, base: RecTensor, kind: str, operand: Any):
        self._rec, self.base, self.kind, self.operand = base._rec, base, kind, operand
