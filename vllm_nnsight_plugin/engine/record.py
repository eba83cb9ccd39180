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
``model.logits`` and anything of ``model.samples``, I/O (``print``, ``open``; an
import of a module not loaded), a read beside an edit of one module, a step loop
inside a step loop. The proxies are in :mod:`.proxies`.

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

from ..payload.spec import check_result_path
from .envoy import ResultRef
from .proxies import RecEnvoy, RecTensor, RecTuple, _Expr, _Loc
from .rec_tracer import StepIndex

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
class _Edit:
    kind: str
    where: dict[str, Any]
    value: Any
    factor: float
    step: int | str
    line: int
    seq: int

    @property
    def location(self) -> tuple[str, str]:
        return location(self.where)

    @property
    def signature(self) -> tuple:
        """What the edit does, wherever and whenever it is made (like edits merge)."""
        value = self.value
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # (numpy has no bfloat16)
            value = (str(t.dtype), tuple(t.shape), raw.numpy().tobytes())
        return self.kind, repr(sorted(self.where.items())), value, self.factor


@dataclass
class RecCache:
    """``tracer.cache()``'s value while recorded: its op (named when assembled)."""

    op: dict[str, Any]
    line: int


def location(where: dict[str, Any]) -> tuple[str, str]:
    """The module location (path, io) an op or a note reads or edits."""
    return where.get("module"), where.get("io", "output")


@dataclass
class Recorder:
    """One recording: the block's notes so far."""

    dtype: torch.dtype
    shared: frozenset[int]
    structure_of: Any  # module -> 0 (a tensor), N (a tuple of N), None (unannotated)
    code: Any = None  # the block's code object (its frame gives the line)
    step: int = 0  # the step the block's accesses refer to now
    word: str | None = None  # inside an open-ended loop: "all" or "generated"
    in_loop: bool = False
    looped: bool = False  # a step loop ran (its body recorded once per step, or twice when open-ended)
    after_open: bool = False  # an open-ended loop is over: nothing may be read after it
    seq: int = 0
    edits: list[_Edit] = field(default_factory=list)
    saved: dict[int, Any] = field(default_factory=dict)
    trail: list[tuple[str, str]] = field(default_factory=list)  # each access, in order
    namespace: dict[str, Any] = field(default_factory=dict)  # the block's names, as it runs
    failed: Unrecordable | None = None
    result_lines: dict[int, int] = field(default_factory=dict)  # id of a saved tracer.result -> its line

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
        self.trail.append((envoy._path, io))
        structure = self.structure_of(envoy._module) if io == "output" else 0
        loc = _Loc(envoy._path, io, structure, self.at(), self.seq, self.line() or 0)
        if structure and structure > 0:
            return RecTuple(self, loc)
        return RecTensor(self, loc, None)

    def logits(self) -> RecTensor:
        """``model.logits``: the request's logits row at this step (read only)."""
        if self.after_open:
            self.fail("reads model.logits after an open-ended step loop")
        self.seq += 1
        self.trail.append(("logits", "logits"))
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
        self.seq += 1  # (edits of one location apply in the order the block made them)
        self.edits.append(_Edit(kind, target._where(), value, float(factor), self.at(), self.line() or 0,
                                self.seq))

    def edited_since(self, where: dict[str, Any], count: int) -> bool:
        """Whether an edit of ``where``'s module location was noted after the first ``count``."""
        loc = location(where)
        return any(e.location == loc for e in self.edits[count:])

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
        return value.detach().clone()  # (its value now: the block may change the tensor later)

    def save(self, value: Any) -> Any:
        if isinstance(value, RecCache):
            return value  # (saved already)
        if type(value) is ResultRef:  # (a result op: the client takes that part of the finished output)
            path = value.__nnsight_result_path__
            if not check_result_path(path):
                self.fail("saves a part of tracer.result a plan cannot name")
            copy = ResultRef(path)
            self.saved[id(copy)] = copy
            self.result_lines[id(copy)] = self.line() or 0
            return copy
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

    def cache(self, modules: Any, dtype: Any, include_output: bool, include_inputs: bool) -> RecCache:
        """``tracer.cache()``: a cache op from the prompt on (saved by the name it is bound to)."""
        from .cache import cache_op

        if self.in_loop or self.step != 0 or self.after_open:
            self.fail("calls tracer.cache() inside or after a step loop (a plan caches from the prompt on)")
        if modules is not None and not isinstance(modules, (list, tuple, str, RecEnvoy)):
            self.fail(f"caches modules given as a {type(modules).__name__}")
        try:
            op = cache_op("cache", modules, dtype, include_output, include_inputs)
        except Exception as exc:  # noqa: BLE001 - the block's own error: code reports it at its line
            self.fail(f"tracer.cache() raised {type(exc).__name__}")
        value = RecCache(op, self.line() or 0)
        self.saved[id(value)] = value
        return value

    # ------------------------------------------------------------ steps
    def steps(self, start: int | None, stop: int | None, stride: int) -> Iterator[Any]:
        if self.in_loop:
            self.fail("a step loop inside a step loop")
        if self.after_open:
            self.fail("a step loop after an open-ended step loop")
        self.in_loop = self.looped = True
        try:
            if stop is None:
                first = self.step if start is None else start
                if first < self.step or stride != 1 or first > 1:
                    self.fail("an open-ended step loop from a later step than the prompt's next")
                self.word = "all" if first == 0 else "generated"
                self.step = first
                # the body runs twice: a plan holds it only if both times do the same (no
                # Python state that changes what it does from one step to the next)
                marks = [(len(self.edits), len(self.trail))]
                names = []
                index = StepIndex(self)
                for _ in range(2):
                    try:
                        yield index
                    except GeneratorExit:  # (a break, or the block raised: either way no plan)
                        if self.failed is None:
                            self.failed = Unrecordable("leaves an open-ended step loop early", self.line())
                        raise
                    marks.append((len(self.edits), len(self.trail)))
                    names.append(dict(self.namespace))
                (e0, t0), (e1, t1), (e2, t2) = marks
                if [e.signature for e in self.edits[e0:e1]] != [e.signature for e in self.edits[e1:e2]] \
                        or self.trail[t0:t1] != self.trail[t1:t2] or not _same_state(*names):
                    self.fail("its open-ended step loop does something else from one step to the next "
                              "(Python state that changes between steps)")
                del self.edits[e1:e2]  # (the second pass only checked the first)
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


def _same_state(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether the block's names hold the same after two passes of a step loop's body
    (module values aside: each pass reads them afresh). A counter, an ``enumerate``
    index or a flag set in the body differs."""
    if first.keys() != second.keys():
        return False
    for name, a in first.items():
        b = second[name]
        if a is b or isinstance(a, (RecTensor, RecTuple, _Expr, RecEnvoy)) and type(a) is type(b):
            continue
        if type(a) is ResultRef and type(b) is ResultRef \
                and a.__nnsight_result_path__ == b.__nnsight_result_path__:
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)):
                continue
            return False
        if isinstance(a, (int, float, str, bytes, bool, type(None))) and type(a) is type(b) and a == b:
            continue
        return False
    return True


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
    ends a sleep), else an exception set asynchronously on this thread. 0: no bound
    (a client recording its own block: its timers and signals stay its own)."""
    if seconds <= 0:
        yield
        return
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
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)  # (again every 50 ms: a bare except cannot keep it)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_block(rec: Recorder, code: Any, values: dict[str, Any], lineno: int,
              seconds: float = RECORD_TIME_S) -> dict[str, Any]:
    """Run the block's code against the proxies in ``values``: its namespace after.
    ``seconds``: how long the recording may run (0: unbounded)."""
    rec.code = code
    namespace = rec.namespace = dict(values)
    namespace["__nnsight_save__"] = rec.save
    namespace["__builtins__"] = _builtins(rec)
    rng = _rng_states()
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
    if _rng_moved(rng):  # random values would be drawn once, for every request of the plan
        raise Unrecordable("it draws random numbers (each request draws its own as code)", lineno)
    return namespace


def _rng_states() -> tuple:
    import random

    # (CUDA's only once started: a client recording its block must not start it; a block
    # that starts it to draw changes the count, which counts as drawn)
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return torch.random.get_rng_state(), cuda, random.getstate()


def _rng_moved(before: tuple) -> bool:
    """Whether a random generator (torch's, CUDA's, Python's) drew since ``before``."""
    now = _rng_states()
    return not torch.equal(now[0], before[0]) or len(now[1]) != len(before[1]) \
        or any(not torch.equal(a, b) for a, b in zip(now[1], before[1])) or now[2] != before[2]
