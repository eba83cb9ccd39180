"""The traced requests a worker holds: one keeper that adds a request's entries when
it is admitted and drops them together (when its blocks are over, and when vLLM
finishes it), so no index outlives its request.

The per-step paths test membership in whole sets (``coded``, ``stepwise``, the
requests that report every step), so those stay sets; they are only ever changed
here. A steady batch of them advances without a walk (:class:`QuietBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .session import StepClock

if TYPE_CHECKING:
    from .session import RequestSession


class TracedRequests:
    """The interleaver's per-request state (see the module docstring)."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[RequestSession]] = {}  # live blocks: edit copies first, own block last
        self.traced: set[str] = set()  # admitted with blocks, until vLLM finishes them
        self.params: dict[str, Any] = {}  # their SamplingParams (V2's runner keeps none)
        self.coded: set[str] = set()  # with a block that runs as code (not only batched plans)
        # may park between steps (a block, or a batched read): only these need the runner's
        # finish prediction each step; steering alone never does
        self.stepwise: set[str] = set()
        # whose state the scheduler needs every step (stop strings end them in the front end;
        # streams ship each step); others report only when something changed
        self.report_every_step: set[str] = set()
        self.reported: dict[str, tuple] = {}  # the state each last reported
        # whose blocks are all over having only read the prompt (no edit): a recompute of
        # their forward changes nothing they did
        self.read_only_done: set[str] = set()

    def admitted(self, req_id: str, blocks: list[RequestSession], params: Any, every_step: bool) -> None:
        self.sessions[req_id] = blocks
        self.traced.add(req_id)
        self.params[req_id] = params
        if not all(b.batched for b in blocks):
            self.coded.add(req_id)
        if any(b.batched_reads or not b.batched for b in blocks):
            self.stepwise.add(req_id)
        if every_step:
            self.report_every_step.add(req_id)

    def blocks_over(self, req_id: str) -> list[RequestSession]:
        """Its blocks have run to their end and shipped: no more per-step work (vLLM
        may still be generating its tokens). Returns the blocks."""
        blocks = self.sessions.pop(req_id)
        self.coded.discard(req_id)
        self.stepwise.discard(req_id)
        if all(s.read_and_shipped for s in blocks):
            self.read_only_done.add(req_id)
        return blocks

    def forget(self, req_id: str) -> list[RequestSession]:
        """vLLM finished the request: every entry goes. Returns its live blocks."""
        self.traced.discard(req_id)
        self.coded.discard(req_id)
        self.stepwise.discard(req_id)
        self.read_only_done.discard(req_id)
        self.params.pop(req_id, None)
        self.report_every_step.discard(req_id)
        self.reported.pop(req_id, None)
        return self.sessions.pop(req_id, [])


@dataclass
class QuietBatch:
    """A step in which every traced request only advanced its batched specs' step
    count. The next steps with the same requests (``spans``), no admission or finish
    (``epoch``), no spec over or failed (``batched.stale``), and ``room`` steps before
    the first of them reaches its last step (None: none has one) advance those
    sessions without walking the batch: they share one :class:`.session.StepClock`,
    so a step is one add, whatever the batch."""

    epoch: int
    spans: dict
    sessions: list[RequestSession]
    room: int | None
    clock: StepClock = field(default_factory=StepClock)

    def __post_init__(self) -> None:
        for session in self.sessions:
            session.join_clock(self.clock)

    def holds(self, epoch: int, spans: dict, stale: bool) -> bool:
        return epoch == self.epoch and not stale and (self.room is None or self.room > 0) \
            and (spans is self.spans or spans == self.spans)

    def advance(self) -> None:
        self.clock.ticks += 1
        if self.room is not None:
            self.room -= 1
