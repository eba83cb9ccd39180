"""A code block as a per-request plan: run it once against recording proxies.

The block runs as Python, once, at admission, with ``model``, ``tracer`` and the
envoys it brought replaced by proxies that note what it does: which module's
value it reads or saves, which rows it edits and how, at which steps. Names,
constants, helper functions, ``for`` loops over Python values and every spelling
of the step loops (``tracer.iter[a:b]``, ``tracer.iter[:]``, ``tracer.all()``, as
``for`` or ``with``) resolve as Python resolves them; a bounded step loop is
unrolled, step by step. The notes become the batched spec's ops
(:mod:`.batched`), which the engine runs for all requests at once.

What a plan cannot hold makes the block run as code for its request, and the
report (``ran_as``) names the line and why: control flow on a tensor's value,
``.item()``/``.tolist()``, passing a module's value to torch functions or calling
a module, arithmetic beyond ``+ v``/``- v``/``* f`` in an edit, edits of
``model.logits`` and anything of ``model.samples``, I/O (``print``, ``open``; an import of a module not loaded),
a read beside an edit of one module, a step loop inside a step loop.

A read is the module's value when it ran (a copy), whether the block cloned it
or not; an edit applies where and when the block applied it.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

RECORD_TIME_S = 2.0  # a block still running after this long runs as code (its own time limit)
MAX_STEPS = 4096  # steps of a bounded loop a plan unrolls (and the spec's limit)
_WIDE = (torch.float32, torch.bfloat16, torch.float16)  # exact in float32, as the plan adds them


class Unrecordable(BaseException):
    """The block cannot be a plan (a BaseException: ``except Exception`` in the block
    does not swallow it)."""

    def __init__(self, why: str, line: int | None):
        super().__init__(why)
        self.why, self.line = why, line


class _TooLong(BaseException):
    pass


@dataclass
class Plan:
    """A block as a spec: its ops and each op's line in the block."""

    ops: list[dict[str, Any]]
    lines: list[int]


@dataclass
class _Edit:
    kind: str
    where: dict[str, Any]
    value: Any
    factor: float
    step: int | str
    line: int
    seq: int


@dataclass
class Recorder:
    """One recording: the block's notes so far."""

    dtype: torch.dtype
    shared: frozenset[int]
    structure_of: Any  # module class -> 0 (a tensor), N (a tuple of N), None (unannotated)
    code: Any = None  # the block's code object (its frame gives the line)
    step: int = 0  # the step the block's accesses refer to now
    word: str | None = None  # inside an open-ended loop: "all" or "generated"
    in_loop: bool = False
    after_open: bool = False  # an open-ended loop is over: nothing may be read after it
    seq: int = 0
    edits: list[_Edit] = field(default_factory=list)
    saved: dict[int, Any] = field(default_factory=dict)
    failed: Unrecordable | None = None

    def line(self) -> int | None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        return frame.f_lineno if frame is not None else None

    def fail(self, why: str) -> NoReturn:
        exc = Unrecordable(why, self.line())
        if self.failed is None:
            self.failed = exc  # (kept: a bare except in the block cannot hide it)
        raise exc

    def at(self) -> int | str:
        return self.word or self.step

    # ------------------------------------------------------------ notes
    def access(self, envoy: RecEnvoy, io: str) -> Any:
        if self.after_open:
            self.fail(f"reads {envoy._name()}.{io} after an open-ended step loop")
        if id(envoy._module) in self.shared:
            self.fail(f"{envoy._name()} is reachable by two paths (shared weights): it runs twice a step")
        self.seq += 1
        structure = self.structure_of(type(envoy._module)) if io == "output" else 0
        loc = _Loc(envoy._path, io, structure, self.at(), self.seq, self.line() or 0)
        if structure and structure > 0:
            return RecTuple(self, loc)
        return RecTensor(self, loc, None)

    def logits(self) -> RecTensor:
        """``model.logits``: the request's logits row at this step (read only)."""
        if self.after_open:
            self.fail("reads model.logits after an open-ended step loop")
        self.seq += 1
        return RecTensor(self, _Loc("logits", "logits", 0, self.at(), self.seq, self.line() or 0), None)

    def edit(self, kind: str, target: RecTensor, value: Any = None, factor: float = 1.0) -> None:
        if target._loc.io == "logits":
            self.fail("edits model.logits")
        if target._sum:
            self.fail("edits the sum of a module's outputs")
        if target._loc.step != self.at():
            self.fail("edits a module's value taken at another step")
        if kind in ("add", "set"):
            value = self.operand(value)
        self.edits.append(_Edit(kind, target._where(), value, float(factor), self.at(), self.line() or 0,
                                target._loc.seq))

    def operand(self, value: Any) -> Any:
        if isinstance(value, bool) or isinstance(value, (RecTensor, RecTuple, _Expr)):
            self.fail("edits with a value the plan cannot hold")
        if isinstance(value, (int, float)):
            if not (-(1 << 63) <= value < (1 << 63)) or value != value or value in (float("inf"), float("-inf")):
                self.fail("edits with a number that is not finite")
            return float(value)
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.dim() > 2:
            self.fail(f"edits with a {type(value).__name__}")
        if value.dtype not in _WIDE and not (value.dtype == self.dtype == torch.float64):
            self.fail(f"edits with a {value.dtype} tensor (a plan adds float32, bfloat16 or float16 values)")
        if value.dim() == 2 and value.shape[0] != 1:
            self.fail("edits with a matrix (a plan adds one row to every row)")
        if not bool(torch.isfinite(value).all()):
            self.fail("edits with a tensor holding NaN or inf")
        return value

    def save(self, value: Any) -> Any:
        if isinstance(value, (RecTensor, RecTuple)):
            copy = value._copy()  # (as a block's save: a copy; the saved name is the one bound to it)
            self.saved[id(copy)] = copy
            return copy
        if isinstance(value, list):
            copy = list(value)  # (as a block's save: a copy, which later appends go into)
            self.saved[id(copy)] = copy
            return copy
        if isinstance(value, _Expr):
            self.fail("saves arithmetic on a module's value")
        self.fail(f"saves a {type(value).__name__}, not a module's value")

    # ------------------------------------------------------------ steps
    def steps(self, start: int | None, stop: int | None, stride: int) -> Iterator[Any]:
        if self.in_loop:
            self.fail("a step loop inside a step loop")
        if self.after_open:
            self.fail("a step loop after an open-ended step loop")
        self.in_loop = True
        try:
            if stop is None:
                first = self.step if start is None else start
                if first < self.step or stride != 1 or first > 1:
                    self.fail("an open-ended step loop from a later step than the prompt's next")
                self.word = "all" if first == 0 else "generated"
                self.step = first
                try:
                    yield _StepIndex(self)
                except GeneratorExit:  # (a break, or the block raised: either way no plan)
                    if self.failed is None:
                        self.failed = Unrecordable("leaves an open-ended step loop early", self.line())
                    raise
                self.after_open = True
                return
            span = range(start or 0, stop, stride)
            if len(span) > MAX_STEPS:
                self.fail(f"a step loop over more than {MAX_STEPS} steps")
            for i in span:
                if i < self.step:
                    self.fail(f"returns to step {i} after step {self.step}")
                self.step = i
                yield i
        finally:
            self.in_loop, self.word = False, None


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


def _refuse(what: str) -> Any:
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
    setattr(_Value, _name, _refuse(_what))


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

    __slots__ = ("_loc", "_index", "_positions", "_sum")

    def __init__(self, rec: Recorder, loc: _Loc, index: int | None, positions: Any = None, total: bool = False):
        self._rec, self._loc, self._index, self._positions, self._sum = rec, loc, index, positions, total

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
        if self._loc.io == "output":
            where["structure"] = self._loc.structure if self._loc.structure is not None else 0
        if self._positions is not None:
            where["positions"] = self._positions
        return where

    def _copy(self) -> RecTensor:
        return RecTensor(self._rec, self._loc, self._index, self._positions, self._sum)

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
        if type(key) is int:
            return RecTensor(self._rec, self._loc, self._index, key, self._sum)
        if isinstance(key, list) and key and all(type(k) is int for k in key):
            return RecTensor(self._rec, self._loc, self._index, list(key), self._sum)
        self._rec.fail(f"indexes a module's value with {key!r} (a plan picks whole rows)")

    def clone(self, *args: Any, **kwargs: Any) -> RecTensor:
        return self

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
        self._rec.edit("add", self, other)
        return self

    def __isub__(self, other: Any) -> RecTensor:
        if isinstance(other, _Value):
            self._rec.fail("subtracts module values")
        self._rec.edit("add", self, -other if isinstance(other, (torch.Tensor, int, float)) else other)
        return self

    def __imul__(self, other: Any) -> RecTensor:
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            self._rec.fail("multiplies a module's value by something other than a number")
        self._rec.edit("scale", self, factor=self._rec.operand(other))
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        target = self[key]
        if value is target or (isinstance(value, RecTensor) and target._same_rows(value)):
            return  # x[:] += v (the edit is noted), or x[:] = x[:]
        if isinstance(value, _Expr):
            if not target._same_rows(value.base):
                self._rec.fail("assigns arithmetic on one module's value to another's rows")
            self._rec.edit(value.kind, target, value.operand if value.kind == "add" else None,
                           factor=self._rec.operand(value.operand) if value.kind == "scale" else 1.0)
            return
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            self._rec.edit("zero", target)
            return
        self._rec.edit("set", target, value)


class _Expr(_Value):
    """``x + v``, ``x - v`` or ``x * f``: usable only as ``x[:] = x + v``."""

    __slots__ = ("base", "kind", "operand")

    def __init__(self, base: RecTensor, kind: str, operand: Any):
        self._rec, self.base, self.kind, self.operand = base._rec, base, kind, operand


class _StepIndex:
    """The step number of an open-ended loop: unknown while recording."""

    __slots__ = ("_rec",)

    def __init__(self, rec: Recorder):
        self._rec = rec

    def __getattr__(self, name: str) -> Any:
        self._rec.fail("uses the step number of an open-ended step loop")


for _name in ("__bool__", "__int__", "__index__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__add__", "__radd__", "__sub__", "__rsub__", "__mod__", "__mul__", "__format__", "__repr__"):
    setattr(_StepIndex, _name, _refuse("uses the step number of an open-ended step loop"))
_StepIndex.__hash__ = object.__hash__  # type: ignore[method-assign]


class RecTracer:
    """``tracer`` while the block is recorded: its step loops."""

    __slots__ = ("_rec", "iter")

    def __init__(self, rec: Recorder):
        self._rec = rec
        self.iter = _RecIter(rec)

    def all(self) -> Iterator[Any]:
        return self._rec.steps(None, None, 1)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._rec.fail(f"uses tracer.{name}")


class _RecIter:
    __slots__ = ("_rec",)

    def __init__(self, rec: Recorder):
        self._rec = rec

    def __getitem__(self, item: int | slice) -> Iterator[Any]:
        if type(item) is int:
            if item < 0:
                raise ValueError("tracer.iter takes non-negative steps, e.g. tracer.iter[:3]")
            return self._rec.steps(item, item + 1, 1)
        if isinstance(item, slice):
            start, stride = item.start or 0, item.step or 1
            if start < 0 or stride < 1 or (item.stop is not None and item.stop < 0):
                raise ValueError("tracer.iter takes non-negative steps, e.g. tracer.iter[:3]")
            return self._rec.steps(start, item.stop, stride)
        raise TypeError("tracer.iter takes an int or a slice")


# ------------------------------------------------------------ running the block


def _builtins(rec: Recorder) -> dict[str, Any]:
    """The block's builtins while recorded: what does I/O refuses (it runs as code)."""
    names = dict(vars(builtins))
    for name in ("print", "open", "input", "breakpoint", "exec", "eval", "compile", "exit", "quit", "help"):
        names[name] = _refuse_call(rec, f"calls {name}()")

    def importer(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.partition(".")[0] not in sys.modules:
            rec.fail(f"imports {name}")
        return builtins.__import__(name, *args, **kwargs)

    names["__import__"] = importer
    return names


def _refuse_call(rec: Recorder, what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        rec.fail(what)
    return refuse


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt a recording that runs too long: a signal on the main thread (it also
    ends a sleep), else an exception set asynchronously on this thread."""
    if threading.current_thread() is not threading.main_thread():
        ident = threading.get_ident()
        timer = threading.Timer(seconds, lambda: ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(ident), ctypes.py_object(_TooLong)))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _TooLong

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_block(rec: Recorder, code: Any, values: dict[str, Any], lineno: int,
              seconds: float = RECORD_TIME_S) -> dict[str, Any]:
    """Run the block's code against the proxies in ``values``: its namespace after.
    ``seconds``: how long the recording may run."""
    rec.code = code
    namespace = dict(values)
    namespace["__nnsight_save__"] = rec.save
    namespace["__builtins__"] = _builtins(rec)
    try:
        with _deadline(seconds):
            exec(code, namespace)  # noqa: S102 - the block, against proxies (code payloads are opt-in)
    except Unrecordable:
        pass
    except _TooLong:
        raise Unrecordable(f"it ran for more than {seconds:g} s while being recorded", lineno) from None
    except Exception as exc:  # noqa: BLE001 - the block's own error: code reports it at its line
        tb = exc.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code is code:
                line = tb.tb_lineno
            tb = tb.tb_next
        raise Unrecordable(f"it raised {type(exc).__name__}", line) from None
    if rec.failed is not None:
        raise rec.failed
    return namespace
