"""``model.trace(...)`` and ``tracer.invoke(...)``: capture blocks, run requests.

Each invoke is one vLLM request carrying its own block. ``trace(prompt)`` is a
single invoke whose block is the trace body. ``trace()`` without a prompt runs
its body normally in the caller; each ``tracer.invoke(prompt)`` inside it
captures its own body. On exit the requests run together (vLLM batches them) and
saved values land in the caller's variables.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..payload.codec import SharedDict, SharedList
from .capture import (
    BlockSource,
    BodySkipper,
    SkipBlock,
    compile_trace_body,
    find_block,
    gather_values,
    push_locals,
    saves_outside_invokes,
    skipper_for,
)
from .requests import check_one_prompt
from .shared import merge, shareable, snapshot

if TYPE_CHECKING:
    from .model import VLLM

_NO_PROMPT = object()


@dataclass
class Invoke:
    """One request: its prompt, its sampling overrides, and its block."""

    prompt: Any
    sampling: dict[str, Any]
    block: BlockSource
    values: dict[str, Any] = field(default_factory=dict)
    # names of trace-level saved lists the block reads -> (the caller's list, its lengths when sent)
    shared: dict[str, tuple[list, Any]] = field(default_factory=dict)


class _TracerRef:
    """What a block's tracer (or invoker) sends: a reference the engine resolves to the
    request's own tracer. An invoke keeps this, not the tracer: the tracer holds its
    invokes and outputs, and a cycle back would keep a finished trace's outputs alive
    until Python's collector finds it (a batch of 256 requests: thousands of objects)."""

    __slots__ = ()

    def __nnsight_ref__(self) -> tuple:
        return ("tracer",)


TRACER_REF = _TracerRef()


class _Capturing:
    """Shared enter/exit of blocks whose body is sent to the engine."""

    _skipper: BodySkipper | None = None

    def _capture(self, frame: FrameType) -> tuple[BlockSource, dict[str, Any]]:
        block = find_block(frame)
        values = gather_values(frame, block.names)
        if block.as_name and block.as_name in block.names:
            values[block.as_name] = self
        for name, value in values.items():  # (the tracer holds its invokes: no cycle back to it)
            if isinstance(value, _Capturing):
                values[name] = TRACER_REF
        if not block.empty:  # (an empty body runs here as the no-op it is)
            self._skipper = skipper_for(frame, block)
        return block, values

    def _arm(self) -> None:
        """The last step of ``__enter__``: an error before it leaves nothing armed
        (``__exit__`` would not run to disarm it)."""
        if self._skipper is not None:
            self._skipper.arm()

    def _release(self) -> None:
        if self._skipper is not None:
            self._skipper.disarm()
            self._skipper = None


class Tracer(_Capturing):
    """The object bound by ``with model.trace(...) as tracer``."""

    def __init__(self, model: VLLM, prompt: Any = _NO_PROMPT, serve: str | None = None,
                 api_key: str | None = None, stream_saves: bool = False, **sampling: Any):
        check_one_prompt(prompt)
        self.model = model
        self._prompt = prompt
        self._blocking = bool(sampling.pop("blocking", True))
        if not self._blocking and not serve:
            raise ValueError("blocking=False is for served traces (serve=URL): a local trace runs when its block ends")
        self._sampling = sampling
        self._serve = (serve, api_key) if serve else None
        self._background: _Background | None = None  # blocking=False: the requests in flight
        self._shared: dict[int, list] = {}  # lists the trace body saved (see _run_body)
        self._stream_saves = stream_saves
        self.backend: Any = None  # mode="async": the stream of this trace's outputs
        self._invokes: list[Invoke] = []
        self._frame: FrameType | None = None
        self._open_invoke = False
        self.outputs: list[Any] = []

    def __nnsight_ref__(self) -> tuple:
        return ("tracer",)

    def __enter__(self) -> Tracer:
        frame = sys._getframe(1)
        self._frame = frame
        if self._prompt is not _NO_PROMPT:
            block, values = self._capture(frame)
            self._invokes.append(Invoke(self._prompt, {}, block, values))
            self._arm()
            return self
        block = find_block(frame)
        if saves_outside_invokes(block.statements):
            self._run_body(frame, block)
        return self

    def _run_body(self, frame: FrameType, block: BlockSource) -> None:
        """A trace body that saves values of its own (``outs = list().save()``, appended to
        in its invokes) runs here, with ``.save()`` marking those values as the trace's;
        the body itself is then skipped. Its invokes capture their blocks as always."""
        try:
            code = compile_trace_body(block)
        except SyntaxError:  # (return/break/continue in the body: it runs where it is, as always)
            return
        skipper = skipper_for(frame, block)  # (before the body runs: it may refuse the block)
        before = frame.f_locals
        # one namespace (the caller's globals and locals): comprehensions, lambdas and
        # functions in the body see the caller's local names, as in the caller
        names = {**frame.f_globals, **before, "__nnsight_trace_save__": self._share}
        if block.as_name:
            names[block.as_name] = self
        initial = dict(names)
        exec(code, names)  # noqa: S102 - the caller's own code, in the caller
        changed = {k: v for k, v in names.items() if not k.startswith("__") and k != block.as_name
                   and (k not in initial or initial[k] is not v)}
        push_locals(frame, changed)  # (a function's own locals, or the module's globals)
        self._skipper = skipper
        self._skipper.arm()

    def _share(self, value: Any) -> Any:
        """``.save()`` in the trace body: a list or dict the invokes may write into
        (other values are the caller's own, returned as they are)."""
        if shareable(value):
            self._shared[id(value)] = value
        return value

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._release()
        if exc_type is not None and not issubclass(exc_type, SkipBlock):
            return False
        try:
            self._run()
        finally:
            self._frame = None
        return True

    def invoke(self, prompt: Any = _NO_PROMPT, **sampling: Any) -> Invoker:
        """One more request in this trace (a prompt per invoke)."""
        if self._prompt is not _NO_PROMPT:
            raise RuntimeError(
                "trace(prompt) is already a single invoke; use trace() without a prompt "
                "and one tracer.invoke(prompt) per request"
            )
        if prompt is _NO_PROMPT:
            raise ValueError("tracer.invoke() needs a prompt: each invoke is one vLLM request")
        check_one_prompt(prompt)
        return Invoker(self, prompt, sampling)

    # Inside the caller these only explain themselves; blocks run in the engine.
    @property
    def iter(self) -> Any:
        raise RuntimeError("tracer.iter is only available inside a traced block")

    @property
    def result(self) -> Any:
        raise RuntimeError("tracer.result is only available inside a traced block; "
                           "after the block, see tracer.outputs")

    def all(self) -> Any:
        raise RuntimeError("tracer.all() is only available inside a traced block")

    def cache(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Cannot create a cache outside an invoker: call tracer.cache() inside "
                         "`with tracer.invoke(...)` (or in the body of model.trace(prompt))")

    def barrier(self, *args: Any) -> Any:
        raise NotImplementedError("tracer.barrier: each invoke is an independent vLLM request")

    def _run(self) -> None:
        if not self._invokes:
            return
        if getattr(self.model, "mode", "sync") == "async" and self._serve is None:
            self.backend = self.model._submit_async(self._invokes, self._sampling, self._stream_saves)
            return
        if not self._blocking:  # the requests go out now; collect() gathers them and binds the saves
            self._background = _Background(lambda: self.model._run_invokes(self._invokes, self._sampling,
                                                                            self._serve), self._frame)
            return
        self._bind(self.model._run_invokes(self._invokes, self._sampling, self._serve), self._frame)

    def collect(self, timeout: float | None = None) -> list[Any]:
        """A ``blocking=False`` trace: wait (at most ``timeout`` seconds, else
        ``TimeoutError``) for its requests, bind their saves in the frame that ran the
        trace, raise the first block error, and return the outputs."""
        background = self._background
        if background is None:
            return self.outputs
        outputs = background.result(timeout)
        self._background = None
        self._bind(outputs, background.frame)
        return self.outputs

    def _bind(self, outputs: list[Any], frame: FrameType | None) -> None:
        self.outputs = outputs
        bound: dict[str, Any] = {}
        first_error = None
        for inv, output in zip(self._invokes, outputs):
            saves = dict(getattr(output, "saves", {}) or {})
            # (n > 1: each sequence's block wrote its own copy of a shared container)
            copies = getattr(output, "nnsight_sequence_saves", None) or [saves]
            for name, (shared, before) in inv.shared.items():  # what this invoke wrote, in order
                for copy in copies:
                    if type(copy.get(name)) is type(shared):
                        merge(shared, before, copy[name])
                        saves.pop(name, None)
            bound.update(saves)
            info = getattr(output, "nnsight_error", None)
            if info is not None and first_error is None:
                first_error = info
            for text in getattr(output, "nnsight_warnings", ()) or ():
                warnings.warn(text, RuntimeWarning, stacklevel=3)
        if frame is not None:
            push_locals(frame, bound)
        if first_error is not None:
            from .errors import make_error

            raise make_error(first_error) from None


class _Background:
    """A served trace's requests, sent from a thread (``blocking=False``)."""

    def __init__(self, run: Any, frame: FrameType | None):
        import threading

        self.frame = frame
        self._outputs: list[Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(run,), name="nnsight-served-trace", daemon=True)
        self._thread.start()

    def _main(self, run: Any) -> None:
        try:
            self._outputs = run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller by result()
            self._error = exc

    def result(self, timeout: float | None) -> list[Any]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the served trace did not finish within {timeout} s (collect again to keep waiting)")
        if self._error is not None:
            raise self._error
        return self._outputs or []


class Invoker(_Capturing):
    """``with tracer.invoke(prompt, **sampling):`` -- one request's block."""

    def __init__(self, tracer: Tracer, prompt: Any, sampling: dict[str, Any]):
        self.tracer = tracer
        self.prompt = prompt
        self.sampling = sampling

    def __nnsight_ref__(self) -> tuple:
        return ("tracer",)

    def __enter__(self) -> Invoker:
        frame = sys._getframe(1)
        block, values = self._capture(frame)
        shared = {}
        for name, value in list(values.items()):
            if id(value) in self.tracer._shared and self.tracer._shared[id(value)] is value:
                shared[name] = (value, snapshot(value))
                values[name] = SharedList(value) if isinstance(value, list) else SharedDict(value)
        self.tracer._invokes.append(Invoke(self.prompt, self.sampling, block, values, shared))
        self._arm()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._release()
        return exc_type is not None and issubclass(exc_type, SkipBlock)
