"""``tracer`` while a block is recorded (:mod:`.record`): its step loops
(``tracer.iter[...]``, ``tracer.all()``), ``tracer.cache()``, ``tracer.result``, and the step number of
an open-ended loop, which the recording cannot know. Anything else a block asks of
the tracer ends the recording (the block runs as code)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .envoy import ResultRef
from .proxies import refuse_as

if TYPE_CHECKING:
    from .record import Recorder


class StepIndex:
    """The step number of an open-ended loop: unknown while recording."""

    __slots__ = ("_rec",)

    def __init__(self, rec: Recorder):
        self._rec = rec

    def __getattr__(self, name: str) -> Any:
        self._rec.fail("uses the step number of an open-ended step loop")


for _name in ("__bool__", "__int__", "__index__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__add__", "__radd__", "__sub__", "__rsub__", "__mod__", "__mul__", "__format__", "__repr__"):
    setattr(StepIndex, _name, refuse_as("uses the step number of an open-ended step loop"))
StepIndex.__hash__ = object.__hash__  # type: ignore[method-assign]


class RecTracer:
    """``tracer`` while the block is recorded: its step loops."""

    __slots__ = ("_rec", "iter")

    def __init__(self, rec: Recorder):
        self._rec = rec
        self.iter = _RecIter(rec)

    def all(self) -> Iterator[Any]:
        return self._rec.steps(None, None, 1)

    @property
    def result(self) -> ResultRef:
        """The finished output, as in the worker: a path the block may save (a result op)."""
        return ResultRef()

    def cache(self, modules: Any = None, device: Any = None, dtype: Any = None, detach: bool = True,
              include_output: bool = True, include_inputs: bool = False, **_: Any) -> Any:
        return self._rec.cache(modules, dtype, include_output, include_inputs)

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
