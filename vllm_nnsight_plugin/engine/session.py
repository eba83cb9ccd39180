"""One traced request's block, running in a greenlet beside the forward.

The block is ordinary Python. When it reads ``module.output`` it parks (switches
back to the forward) with a :class:`Wait`; the interleaver resumes it with that
request's rows when the forward reaches the module. Everything runs on the
forward's thread, one block at a time, so no locks and no nondeterminism.
"""

from __future__ import annotations

import builtins
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import greenlet
import torch

from . import host
from .block_source import compile_block
from .budget import BlockTimeout
from .cache import Gathered
from .rowlog import RowLog, TupleLog
from .saved import copy_value, saved_containers
from .tree import leaves, map_tensors

if TYPE_CHECKING:
    from .interleave import Interleaver

_NOTHING = object()
GROWS = (list, dict, RowLog, TupleLog, Gathered)  # saved values that change in place (shipped again at the end)
END = object()  # given to a block parked between steps when its request has finished


class StopBlock(Exception):
    """``tracer.stop()``: end the block and the request, without an error."""


class InterventionFailure(Exception):
    """An error the engine raises into a block (bad access, unreached module...)."""


@dataclass
class Wait:
    """What a parked block is waiting for."""

    kind: str  # "output" | "input" | "logits" | "samples" | "step"
    step: int
    path: str = ""
    module: Any = None
    value: Any = _NOTHING  # an assignment waiting to be applied
    key: tuple = field(init=False)  # where it waits: the interleaver's waiter key (read per serve)

    def __post_init__(self) -> None:
        self.key = (id(self.module), self.kind) if self.module is not None else (self.kind,)

    def describe(self) -> str:
        if self.kind == "step":
            return f"the start of step {self.step}"
        where = f"{self.path}.{self.kind}" if self.path else f"model.{self.kind}"
        return f"{where} at step {self.step}"


class StepClock:
    """Steps that a steady batch's sessions have advanced together."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0


@dataclass
class Serving:
    """The location a block is being served right now (reads repeat, sets apply)."""

    key: tuple
    step: int
    value: Any
    assign: Callable[[Any], None]


def engine_error(message: str, lineno: int | None = None, line: str = "",
                 filename: str = "<engine>") -> dict[str, Any]:
    """A request's error as the results carry it, for a failure the engine reports."""
    return {"type": "RuntimeError", "message": message, "lineno": lineno, "line": line,
            "filename": filename, "traceback": ""}


@dataclass(eq=False)  # (one session is one block: compared by identity, as lists remove it)
class RequestSession:
    """Worker-side state of one traced request."""

    req_id: str
    interleaver: Interleaver
    source: str = ""
    filename: str = "<intervention>"
    lineno: int = 1
    namespace: dict[str, Any] = field(default_factory=dict)
    _base_step: int = 0  # engine steps completed, less the ticks of _clock (see step)
    _clock: StepClock | None = None  # a steady batch's shared count (requests.QuietBatch)
    target_step: int = 0  # the step the block's accesses refer to (tracer.iter)
    iter_bounds: list[int | None] = field(default_factory=list)  # stop of each open iter
    wait: Wait | None = None
    serving: Serving | None = None
    error: dict[str, Any] | None = None
    stopped: bool = False
    done: bool = False
    ended: bool = False  # the request generated its last token
    warnings: list[str] = field(default_factory=list)
    _saved: dict[int, Any] = field(default_factory=dict)
    _shipped: dict[str, int] = field(default_factory=dict)
    _dirty: bool = False
    _fresh: set[int] = field(default_factory=set)  # ids saved since the last snapshot
    changed: list[str] = field(default_factory=list)  # names the last snapshot brought new values for
    last: dict[str, Any] = field(default_factory=dict)  # the last shipped saves (CPU)
    final: bool = False  # its last state has been recorded
    batched: bool = False  # a batched spec: no greenlet, applied by the interleaver
    batched_reads: bool = False  # ...that reads: its saves ship when the request ends
    prefill_reads: bool = False  # ...at the prompt only: those ship after the first step
    prompt_only: bool = False  # ...and nothing else: the session is over after that step
    last_step: int | None = None  # ...whose ops end at this step: over after it
    replayable: bool = False  # ...of edits only, at every step, of whole rows (see payload.spec.replayable)
    edits: bool = True  # it may change activations (a batched spec of reads only does not)
    lowered: Any = None  # a code block run as its batched spec (lower.Lowered): maps errors to lines
    _cpu: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # device tensor -> its CPU copy
    _on_device: bool = True  # the last off_host walk found a device tensor (to_host maps it)
    _glet: greenlet.greenlet | None = None
    code_time: float = 0.0  # seconds its block has run (budget.Watchdog)
    ran_as: str = ""  # how the block runs: "batched", or "code: <file>:<line> (<why>)"
    caches: int = 0  # tracer.cache()s the block made: it stays (parked) until its request ends

    # ------------------------------------------------------------ lifecycle
    @property
    def step(self) -> int:
        """Engine steps this request has completed. A steady batch advances all its
        requests with one add to their shared clock, not one per request."""
        clock = self._clock
        return self._base_step if clock is None else self._base_step + clock.ticks

    @step.setter
    def step(self, value: int) -> None:
        clock = self._clock
        self._base_step = value if clock is None else value - clock.ticks

    def join_clock(self, clock: StepClock | None) -> None:
        """Count later steps on ``clock`` (None: on this session alone)."""
        self._base_step, self._clock = self.step - (clock.ticks if clock is not None else 0), clock

    @property
    def active(self) -> bool:
        return not self.done and self.error is None

    @property
    def read_and_shipped(self) -> bool:
        """A prompt-only spec that is over without error: it edited nothing and its rows
        have shipped, so a recompute of the request's forward changes nothing it did."""
        return self.prompt_only and self.done and self.error is None

    def fail(self, exc: BaseException | str, lineno: int | None = None) -> None:
        if self.error is not None:
            return
        if isinstance(exc, BlockTimeout):  # reported as what it is to the user
            exc = TimeoutError(str(exc)).with_traceback(exc.__traceback__)
        if isinstance(exc, str):
            if self.lowered is not None and lineno is None:  # a lowered block: its op's line
                exc, lineno = self.lowered.relabel(exc)
            lineno = lineno if lineno is not None else self._parked_line()
            self.error = engine_error(exc, lineno, self._line(lineno), self.filename)
        else:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == self.filename]
            last = frames[-1].lineno if frames else (lineno or self._parked_line())
            text = "".join(
                f'  File "{f.filename}", line {f.lineno}\n    {self._line(f.lineno)}\n' for f in frames
            )
            self.error = {
                "type": type(exc).__name__,
                "message": str(exc),
                "lineno": last,
                "line": self._line(last),
                "filename": self.filename,
                "traceback": text,
            }
        self.close()

    def _note_over(self) -> None:
        """A session with entries in the batched registry (a batched spec's, or a code
        block's cache reads) is over: its entries go at the next prune, and no step
        reuses picks that hold it (:meth:`.batched.BatchedEdits._step_picks`)."""
        if (self.batched or self.caches) and self.interleaver is not None:
            self.interleaver.batched.stale = True

    def _parked_line(self) -> int | None:
        frame = self._glet.gr_frame if self._glet is not None else None
        while frame is not None:
            if frame.f_code.co_filename == self.filename:
                return frame.f_lineno
            frame = frame.f_back
        return None

    def _line(self, lineno: int | None) -> str:
        if lineno is None:
            return ""
        lines = self.source.splitlines()
        idx = lineno - self.lineno
        return lines[idx].strip() if 0 <= idx < len(lines) else ""

    def release(self) -> None:
        """The block is over and its results are recorded (``last``, until shipped):
        drop what it made or saved. Its namespace refers back to this session, so
        without this only a garbage collection would free the tensors in it."""
        self.close()
        for value in self._saved.values():
            if isinstance(value, Gathered):
                value.keep_values()  # (it ships later, from the values of its reads)
        self.namespace.clear()
        self._saved.clear()
        self._cpu.clear()

    def close(self) -> None:
        """Drop the greenlet (and the frames and tensors it holds)."""
        self._note_over()
        self.wait = None
        self.serving = None
        glet, self._glet = self._glet, None
        if glet is greenlet.getcurrent():
            return  # failing from inside the block: it ends by returning
        if glet is not None and not glet.dead and glet.gr_frame is not None:
            try:
                glet.throw(greenlet.GreenletExit)
            except BaseException:  # noqa: BLE001 - the block is being discarded
                pass

    def _main(self, _: Any = None) -> None:
        self.namespace["__builtins__"] = builtins
        self.namespace["__nnsight_save__"] = self.save
        try:
            code = compile_block(self.source, self.filename, self.lineno)
            exec(code, self.namespace)  # noqa: S102 - the block is the request's code
        except greenlet.GreenletExit:
            return
        except StopBlock:
            self.stopped = True
        except BaseException as exc:  # noqa: BLE001 - any error ends only this request
            self.fail(exc)
            return
        if self.caches and not self.stopped:  # its caches' reads go on to the request's end (as nnsight's do)
            try:
                while not self.ended and self.request(Wait("step", self.step + 1)) is not END:
                    pass
            except greenlet.GreenletExit:
                return
        self.done = True
        self.wait = None
        self._note_over()

    # ------------------------------------------------------------ switching
    def start(self) -> None:
        """Run the block until its first access."""
        self._glet = greenlet.greenlet(self._main)
        self._switch(None)

    def resume(self, value: Any, serving: Serving | None = None) -> None:
        self.wait = None
        self.serving = serving
        try:
            self._switch(value)
        finally:
            self.serving = None

    def _switch(self, value: Any) -> None:
        inter = self.interleaver
        previous, inter.current = inter.current, self
        inter.watchdog.enter(self)
        try:
            self._glet.switch(value)
        finally:
            inter.watchdog.leave(self)
            inter.current = previous

    # ------------------------------------------------------------ block side
    def request(self, wait: Wait) -> Any:
        """Called inside the block: park until ``wait`` is served."""
        if self.ended:
            if wait.kind == "step":
                return END
            raise InterventionFailure(f"the request has finished: {wait.describe()} will never come")
        if wait.step < self.step:
            raise InterventionFailure(
                f"{wait.describe()} already happened: this request is at step {self.step}"
            )
        serving = self.serving
        if serving is not None and serving.key == wait.key and serving.step == wait.step:
            if wait.value is _NOTHING:
                return serving.value
            serving.assign(wait.value)
            return None
        late = self.interleaver.late_value(self, wait)
        if late is not _NOTHING:
            return late
        self.wait = wait
        self.interleaver.add_waiter(self, wait)
        return self._glet.parent.switch()

    def save(self, value: Any) -> Any:
        owned = self.interleaver.owns if self.interleaver is not None else None
        copied = copy_value(value, owned)
        if isinstance(copied, (list, dict)):  # (what is put into it later is copied too)
            copied = saved_containers(copied, lambda v: copy_value(v, owned))
        return self.keep(copied)

    def keep(self, value: Any) -> Any:
        """Save ``value`` itself: the caller made it private (a batched read's own copy)."""
        self._saved[id(value)] = value
        self._fresh.add(id(value))
        self._dirty = True
        return value

    def end(self) -> None:
        """The request produced its last token: let a block waiting for another
        step leave its loop (``tracer.all()``) and run to its end."""
        self.ended = True
        if self.batched:
            self.over()
            return
        if self.active and self.wait is not None and self.wait.kind == "step":
            self.wait = None
            self.resume(END)

    def over(self) -> None:
        """A batched spec with nothing left to do (its prompt reads are taken): done
        before the request ends, so its later steps cost nothing."""
        self.done, self.wait = True, None
        self._note_over()

    def touch(self, container: Any = None) -> None:
        """A saved container changed in place: ship it again at the end of the step."""
        self._dirty = True
        if container is not None:
            self._fresh.add(id(container))

    # ------------------------------------------------------------ results
    def snapshot(self) -> dict[str, Any] | None:
        """The saved values bound to names, or None when nothing changed.

        Saved lists and dicts can grow without a new ``.save()``; they are shipped
        when something was saved this step and once more when the block is over.
        """
        finished = self.done or self.ended or self.error is not None
        if not self._dirty and not finished:
            return None  # nothing saved since the last snapshot (names are re-read at the end)
        saved = self._saved
        current = {
            name: value
            for name, value in self.namespace.items()
            if saved.get(id(value)) is value and not name.startswith("__")
        }
        ids = {name: id(v) for name, v in current.items()}
        containers = finished and any(isinstance(v, GROWS) for v in current.values())
        if ids == self._shipped and not self._dirty and not containers:
            return None
        self.changed = [n for n, i in ids.items() if i in self._fresh or self._shipped.get(n) != i
                        or (finished and isinstance(current[n], GROWS))]
        self._shipped = ids
        self._dirty = False
        self._fresh = set()
        return current  # still on the device: the interleaver moves a whole step's at once

    def off_host(self, value: Any) -> list[torch.Tensor]:
        """The device tensors of ``value`` that have no CPU copy yet (each once).
        Notes whether ``value`` holds any device tensor at all (see :func:`.host.to_host`)."""
        out: dict[int, torch.Tensor] = {}
        self._on_device = False
        for t in leaves(value):
            if isinstance(t, torch.Tensor) and host.on_device(t):
                self._on_device = True
                if id(t) not in out:
                    hit = self._cpu.get(id(t))
                    if hit is None or hit[0] is not t:
                        out[id(t)] = t
        return list(out.values())

    def adopt_host(self, t: torch.Tensor, cpu: torch.Tensor) -> None:
        self._cpu[id(t)] = (t, cpu)

    def on_host(self, value: Any) -> Any:
        """``value`` with every device tensor replaced by its CPU copy (see :func:`.host.to_host`)."""
        return map_tensors(value, lambda t: self._cpu[id(t)][1] if host.on_device(t) else t)

    def pending(self) -> dict[str, Any] | None:
        if self.wait is None or self.done or self.error is not None or self.batched:
            return None
        return {
            "desc": self.wait.describe(),
            "in_iter": bool(self.iter_bounds),
            "open_ended": any(b is None for b in self.iter_bounds),
        }
