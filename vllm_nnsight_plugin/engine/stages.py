"""Pipeline parallel: a plan's ops on the modules of every stage.

Each stage holds its own modules and admits every traced request, but only the last
stage's output reaches the scheduler (and the caller). So each stage runs the ops of a
plan on the modules it holds in its own way (:meth:`StageTransport.role`):

- an edit runs where its module is (an earlier stage edits its layers in place, and
  the next stages compute from the edited values);
- a read of a module of an earlier stage is served on the last stage, from a copy of
  the value the earlier stage sent along with the step's hidden states (after that
  stage's edits of it): the last stage then reads it as it reads its own modules
  (chunked prefill, per-step reads, saves), and the saves come back once;
- an op error on an earlier stage (an edit's rows out of range) travels the same way
  and ends its request there.

A plan that reads a module of an earlier stage before editing it is refused: the
value that travels is the edited one. Code blocks run on the last stage only, and a
block that touches an earlier stage's module is refused at the access.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from . import guards
from .batched import READ_OPS
from .taps import flatten, rebuild

PREFIX = "nnsight."  # the transport's keys among the step's intermediate tensors
_META = PREFIX + "meta"


class StageTransport:
    """The pipeline-parallel side of one stage's interleaver (see the module docstring).
    ``absent``: the module paths other stages hold; ``last``: this is the last stage."""

    def __init__(self, absent: frozenset[str], last: bool):
        self.absent, self.last = absent, last
        self.exports: dict[tuple, tuple[str, str, list[Any]]] = {}  # key -> (path, io, sessions reading it)
        self.captured: list[tuple[str, str, Any]] = []  # this step's exported values (path, io, value)
        self.errors: dict[str, str] = {}  # request -> an op error of this stage, to send on
        self.incoming: list[tuple[str, str, Any]] = []  # what earlier stages sent this step
        self.incoming_errors: dict[str, str] = {}

    def role(self, op: dict[str, Any]) -> str:
        """How this stage runs ``op``: "run" (as any op), "export" (read here, served on
        the last stage) or "skip" (another stage's)."""
        module = op.get("module")
        if module is None:  # model.logits: the last stage's
            return "run" if self.last else "skip"
        elsewhere = guards.held_elsewhere(module, self.absent)
        if self.last:
            return "skip" if elsewhere and op["op"] not in READ_OPS else "run"
        if elsewhere:
            return "skip"
        return "export" if op["op"] in READ_OPS else "run"

    def export(self, key: tuple, path: str, io: str, session: Any) -> None:
        self.exports.setdefault(key, (path, io, []))[2].append(session)

    def exporting(self, key: tuple, spans: dict[str, Any]) -> bool:
        """Whether a request of this step reads ``key`` on the last stage."""
        entry = self.exports.get(key)
        return entry is not None and any(s.active and s.req_id in spans for s in entry[2])

    def capture(self, key: tuple, value: Any) -> None:
        """Keep a copy of the value at ``key`` as this stage's edits left it (the next
        modules may change their inputs in place)."""
        path, io, _ = self.exports[key]
        self.captured.append((path, io, _copy(value)))

    def prune(self) -> None:
        for key in list(self.exports):
            path, io, sessions = self.exports[key]
            alive = [s for s in sessions if s.active and not s.ended]
            if alive:
                self.exports[key] = (path, io, alive)
            else:
                del self.exports[key]

    # ------------------------------------------------------------ the wire
    def take(self, tensors: dict[str, Any]) -> None:
        """Pop what earlier stages sent from the step's intermediate tensors (vLLM copies
        every one of those into buffers of its own, by name)."""
        self.incoming, self.incoming_errors = [], {}
        meta = tensors.pop(_META, None)
        if meta is None:
            return
        header = json.loads(bytes(meta.cpu().numpy()).decode())
        flat = [tensors.pop(f"{PREFIX}{i}") for i in range(header["tensors"])]
        at = 0
        for path, io, code in header["values"]:
            n = code.count("T")
            self.incoming.append((path, io, rebuild(code, flat[at:at + n])))
            at += n
        self.incoming_errors = dict(header["errors"])

    def send(self, tensors: dict[str, Any]) -> None:
        """Put this step's exported values and errors (and those of earlier stages,
        passed on) among the intermediate tensors the next stage receives."""
        values = self.incoming + self.captured
        errors = {**self.incoming_errors, **self.errors}
        self.incoming, self.incoming_errors, self.captured, self.errors = [], {}, [], {}
        if not values and not errors:
            return
        header: dict[str, Any] = {"values": [], "errors": errors}
        flat: list[torch.Tensor] = []
        for path, io, value in values:
            code, xs = flatten(value)
            header["values"].append([path, io, code])
            flat.extend(xs)
        header["tensors"] = len(flat)
        for i, t in enumerate(flat):
            tensors[f"{PREFIX}{i}"] = t
        tensors[_META] = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)


# ------------------------------------------------------------ a stage's step


def receive(inter: Any, carried: dict[str, Any]) -> None:
    """Step start: what earlier stages sent; their op errors end their requests."""
    transport = inter.stages
    transport.take(carried)
    for req_id, message in transport.incoming_errors.items():
        if transport.last and req_id in inter.traced:
            inter.fail_request(req_id, message)


def serve(inter: Any) -> None:
    """The last stage, once the step's layout is known: earlier stages' values to the
    ops that read them (before this stage's own modules run, as in the model)."""
    transport = inter.stages
    if not transport.last:
        return
    for path, io, value in transport.incoming:
        key = (id(inter.envoy_at(path)._module), io)
        if key in inter.batched.at or inter.waiters.get(key):
            inter.serve(key, value)
    transport.incoming = []


def send_on(inter: Any, tensors: dict[str, Any] | None) -> None:
    """An earlier stage's step end (it never samples, so it closes its step here): its
    op errors and exported values go with the step's intermediate tensors."""
    results = inter.end_step(frozenset())
    for req_id, result in results.items():
        error = result.get("error")
        if error:
            inter.stages.errors[req_id] = error.get("message") if isinstance(error, dict) else str(error)
    if tensors is not None:
        inter.stages.send(tensors)


def _copy(value: Any) -> Any:
    found = flatten(value)
    if found is None:
        raise TypeError(f"a {type(value).__name__} cannot travel between pipeline stages (tensors only)")
    code, xs = found
    return rebuild(code, [x.clone() for x in xs])
