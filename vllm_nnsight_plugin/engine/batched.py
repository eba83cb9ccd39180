"""Batched specs: declarative edits and reads applied for many requests at once.

A spec whose operations are all edits (``add``/``scale``/``zero``/``set``) and
reads of modules (at any steps and positions) - a steering vector, an ablation, a
capture - needs no block of its own: it is a fixed function of the request's
rows. Such requests skip the greenlet; at each location an edit is
applied once per distinct operation over the rows of every request that sent
it (one kernel for a batch of 256 steered requests instead of 256 block
switches), and a read copies the location to the host once per step (without
waiting: see :mod:`.host`), each request keeping a view of its rows.
Identical payload texts share one parsed spec (the codec caches them), so their
operations are the same objects and group by identity.
Results, errors and the request lifecycle still go through the request's
:class:`~.session.RequestSession`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..payload.spec import is_single
from . import arith, lanes, taps
from .cache import Dropped
from .guards import check_writable
from .host import host_copy, put_rows
from .rowlog import RowLog
from .spec_runner import absolute_rows, pick_index, read_value

if TYPE_CHECKING:
    from .interleave import Interleaver
    from .session import RequestSession

EDIT_OPS = ("add", "scale", "zero", "set")
READ_OPS = ("read", "logits")
LOGITS = ("logits",)  # the location key of the logits rows (one per request, before sampling)


def _batchable(op: dict[str, Any]) -> bool:
    return op["op"] in EDIT_OPS or op["op"] in READ_OPS


def eligible(env: dict[str, Any]) -> bool:
    """Whether a spec can run batched: every op reads or edits a module or reads the
    logits (a ``logits_topk`` runs per request)."""
    return env.get("kind") == "spec" and all(_batchable(op) for op in env["ops"])


def replayable(env: dict[str, Any]) -> bool:
    """Edits only, of whole rows at every step: a recomputed forward, a split prompt or
    a prefix-cache hit computed under the same edits gets them again, row by row."""
    return all(op["op"] in EDIT_OPS and op.get("steps") == "all" and op.get("positions") is None
               for op in env["ops"])


def edits(env: dict[str, Any]) -> bool:
    """Whether the spec changes activations (else its requests' logits need no check)."""
    return any(op["op"] in EDIT_OPS for op in env["ops"])


def last_step(env: dict[str, Any]) -> int | None:
    """The spec's last step (None: it runs to the request's end)."""
    last = 0
    for op in env["ops"]:
        steps = op.get("steps", "prefill")
        if steps in ("all", "generated"):
            return None
        last = max(last, 0 if steps == "prefill" else max(steps))
    return last


def reads(env: dict[str, Any]) -> bool:
    return any(op["op"] in READ_OPS for op in env["ops"])


def prefill_reads(env: dict[str, Any]) -> bool:
    return any(op["op"] in READ_OPS and is_single(op) for op in env["ops"])


def prompt_only(env: dict[str, Any]) -> bool:
    """Only reads at the prompt: nothing is left to do after the first step."""
    return all(op["op"] in READ_OPS and is_single(op) for op in env["ops"])


@dataclass
class Entry:
    session: RequestSession
    op: dict[str, Any]
    number: int  # position in the spec (order within a location, error messages)
    block: int  # position of the spec among the request's blocks (edits first)
    seq: int  # the op's first admission: identical ops share it; groups apply in this order


class BatchedEdits:
    """Registry of batched edits per location, applied when the location is served."""

    def __init__(self, inter: Interleaver):
        self.inter = inter
        self.at: dict[tuple, list[Entry]] = defaultdict(list)
        self.served: set[tuple] = set()  # locations applied this step
        self.laned: dict[tuple, tuple] = {}  # locations the lanes serve this step -> (parts, code, reads)
        self._values: dict[tuple[int, torch.dtype], tuple[dict[str, Any], torch.Tensor]] = {}
        self._version = 0  # bumped when entries change (caches groups, lane plans, lanes_cover)
        self._lane_cache: dict[tuple, tuple[int, tuple | None]] = {}
        self._group_cache: dict[tuple, tuple[int, list[tuple]]] = {}
        self._cover: tuple[int, bool] = (-1, False)
        self.stale = False  # a batched session ended or failed since the last prune
        self._fill_memo: tuple | None = None  # the last step's lane tables (see fill_lanes)
        self._seqs: dict[int, tuple[dict[str, Any], int]] = {}  # id(op) -> (op, its seq)
        self._for_request: dict[tuple, tuple[dict[str, Any], dict[str, Any]]] = {}  # see for_request
        self._next_seq = 0
        self.late: set[tuple] = set()  # locations with late entries (cache reads: after every edit)
        self._expanded: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # see with_caches

    def add(self, session: RequestSession, env: dict[str, Any], block: int) -> None:
        """Register a request's ops (applied in block then spec order per location)."""
        entries = []
        for op in env["ops"]:
            if op["op"] in READ_OPS and not is_single(op):  # one row block per step
                session.namespace[op["name"]] = session.keep(RowLog(squeeze=_one_row(op)))
        for number, op in enumerate(env["ops"]):
            if op["op"] == "logits":
                entries.append((LOGITS, Entry(session, op, number, block, self._seq(op))))
                continue
            envoy = self.inter.envoy_at(op["module"])
            kind = op.get("io", "output")
            self.inter.check_module_access(op["module"], kind)
            entries.append(((id(envoy._module), kind), Entry(session, op, number, block, self._seq(op))))
        for key, entry in entries:  # all ops checked first: a refused spec registers nothing
            self.at[key].append(entry)
            if entry.op.get("late"):
                self.late.add(key)
        self._version += 1

    def with_caches(self, env: dict[str, Any], expand: Any) -> dict[str, Any]:
        """The spec with each ``cache`` op replaced by its reads (``expand(op)``: an
        :class:`.cache.Expansion`), listed under ``"caches"``. Cached per spec, so
        requests of one spec share the reads (their ops group by identity)."""
        if not any(op["op"] == "cache" for op in env["ops"]):
            return env
        known = self._expanded.get(id(env))
        if known is not None and known[0] is env:
            return known[1]
        ops: list[dict[str, Any]] = []
        caches = []
        for op in env["ops"]:
            if op["op"] != "cache":
                ops.append(op)
                continue
            expansion = expand(op)
            caches.append(expansion)
            ops.extend(expansion.reads)
        if len(self._expanded) > 64:
            self._expanded.clear()
        out = {**env, "ops": ops, "caches": caches}
        self._expanded[id(env)] = (env, out)
        return out

    def for_request(self, env: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
        """The spec as it runs for a request of ``max_tokens`` steps: an op whose
        explicit steps are every step from 0 (or 1) to the request's last means "all"
        ("generated"), so ``tracer.iter[:n]`` with ``max_tokens=n`` runs as
        ``tracer.all()`` does (the steady-batch shortcuts need no per-step check).
        Cached per (spec, max_tokens): requests of one spec still share its ops."""
        if not max_tokens or not any(isinstance(op.get("steps"), list) for op in env["ops"]):
            return env
        key = (id(env), max_tokens)
        known = self._for_request.get(key)
        if known is not None and known[0] is env:
            return known[1]
        ops = []
        for op in env["ops"]:
            steps = op.get("steps")
            if isinstance(steps, list) and steps and steps[0] in (0, 1) and steps[-1] >= max_tokens - 1 \
                    and steps == list(range(steps[0], steps[-1] + 1)):
                op = {**op, "steps": "all" if steps[0] == 0 else "generated"}
            ops.append(op)
        if len(self._for_request) > 64:  # (keeps the specs alive: a few, as large payloads are not cached)
            self._for_request.clear()
        out = {**env, "ops": ops}
        self._for_request[key] = (env, out)
        return out

    def _seq(self, op: dict[str, Any]) -> int:
        """The op's admission number: a payload's parsed ops are shared by every request
        that sent its text, so identical ops group under the first one's number."""
        known = self._seqs.get(id(op))
        if known is None or known[0] is not op:
            known = self._seqs[id(op)] = (op, self._next_seq)
            self._next_seq += 1
        return known[1]

    def prune(self) -> None:
        """Drop entries of finished or failed requests (once one has ended: see
        :attr:`stale`)."""
        if not self.stale:
            return
        self.stale = False
        for key in list(self.at):
            alive = [e for e in self.at[key] if e.session.active and not e.session.ended]
            if len(alive) == len(self.at[key]):
                continue
            self._version += 1
            if alive:
                self.at[key] = alive
            else:
                del self.at[key]
                self.late.discard(key)
        live = {id(e.op) for entries in self.at.values() for e in entries}
        self._seqs = {k: v for k, v in self._seqs.items() if k in live}

    def apply(self, key: tuple, value: Any, late: bool = False) -> None:
        """Apply every batched edit registered at ``key`` to this step's rows; ``late``:
        the late reads instead (a cache's, after the blocks parked here have run)."""
        layout = self.inter.layout
        self.served.add(key)
        if key in self.laned:  # the tap op's lane kernels applied them (see finish_lanes)
            return
        lanes.STATS["python"] += 1
        rows = layout.num_tokens if key != LOGITS else value.shape[0]
        groups = self._groups(key)
        if key in self.late:
            groups = [g for g in groups if bool(g[1].op.get("late")) is late]
        for _, entry, spans, sessions in self._pick(groups, layout, key == LOGITS):
            try:
                if entry.op["op"] in READ_OPS:
                    self._read(entry.op, value, spans, sessions, rows)
                    continue
                self._apply_one(entry.op, value, spans, layout.num_tokens)
            except Exception as exc:  # noqa: BLE001 - a bad edit ends the requests that sent it
                if entry.op.get("optional"):
                    continue  # (a cached module whose value has no row per token: left out)
                for session in sessions:
                    session.fail(f"{_where(entry)}: {exc}")

    def _groups(self, key: tuple) -> list[tuple[tuple, Entry, list[RequestSession]]]:
        """A location's entries grouped per (block, op, identical op), in the order they
        apply (a request's own order is kept): ``(gkey, entry, sessions)``. Cached
        until the entries change; a step picks its rows with :meth:`_pick`."""
        cached = self._group_cache.get(key)
        if cached is None or cached[0] != self._version:
            groups: dict[tuple, tuple[Entry, list[RequestSession]]] = {}
            for entry in self.at.get(key, ()):
                if entry.session.active:
                    gkey = (entry.block, entry.number, entry.seq)
                    groups.setdefault(gkey, (entry, []))[1].append(entry.session)
            cached = self._group_cache[key] = (self._version, [(g, *groups[g]) for g in sorted(groups)])
        return cached[1]

    @staticmethod
    def _pick(groups: list[tuple], layout: Any, per_request: bool = False) -> list[tuple]:
        """This step's part of ``groups``: ``(gkey, entry, spans, sessions)`` for the
        active sessions in the batch whose op is due at their step; a span is the
        session's ``(start, end)`` rows, or :class:`Rows` where the op picks positions.
        ``per_request``: a value with one row per request (the logits), which a prompt
        has only at its last chunk."""
        spans_of, chunks = layout.spans, layout.chunks
        if per_request:
            spans_of = {r: (i, i + 1) for r, i in layout.rows.items() if not layout.more_chunks(r)}
        out = []
        for gkey, entry, sessions in groups:
            spans, due = [], []
            positions = entry.op.get("positions")
            for session in sessions:
                span = spans_of.get(session.req_id)
                if span is not None and session.active and is_due(entry.op, session.step):
                    if positions is not None:
                        chunk = chunks.get(session.req_id) if chunks and session.step == 0 else None
                        try:
                            span = Rows(span[0] + r for r in absolute_rows(span[1] - span[0], positions)) \
                                if chunk is None else _chunk_rows(span, positions, chunk)
                        except IndexError as exc:
                            session.fail(f"{_where(entry)}: {exc}")
                            continue
                        if not span:
                            continue  # (its positions lie in another chunk of the prompt)
                    spans.append(span)
                    due.append(session)
            if due:
                out.append((gkey, entry, spans, due))
        return out


    # ------------------------------------------------------------ lanes
    def lanes_cover(self, num_tokens: int) -> bool:
        """Whether the lanes can serve every batched spec in a step of ``num_tokens``
        (then the step needs no Python in the forward and may replay a full graph)."""
        if not lanes.enabled() or num_tokens > lanes.capacity():
            return False
        if self._cover[0] != self._version:  # (logits are read after the forward: no lanes needed)
            self._cover = (self._version, all(self._lane_groups(key, None) is not None
                                              for key in self.at if key != LOGITS))
        return self._cover[1]

    def fill_lanes(self, layout: Any) -> None:
        """Before the forward: each laneable location's slot per row and slot tables.
        A step with the same rows as the last (decode steps of a steady batch) and no
        change to the entries keeps the last step's tables, no per-request work."""
        self._fill_lanes(layout)
        lanes.settle()

    def _fill_lanes(self, layout: Any) -> None:
        self.laned = {}
        if not self.at or not lanes.enabled() or layout.num_tokens > lanes.capacity():
            return
        memo = self._fill_memo
        if memo is not None and memo[0] == self._version and memo[1] == layout.num_tokens \
                and (memo[2] is layout.spans or memo[2] == layout.spans):
            for key, (parts, code, reads, tables, read_parts) in memo[3].items():
                for part, table in tables:
                    parts[part].set_table(table)
                for part in read_parts:
                    parts[part].reading = True
                self.laned[key] = (parts, code, reads)
            return
        filled: dict[tuple, tuple] = {}
        steady = True  # and no request at its first step (what is due changes after it)
        for key in self.at:
            if key == LOGITS:
                continue
            plan = self._lane_groups(key, layout)
            if plan is None:
                continue
            parts, code, edits, reads = plan
            tables = []
            try:
                for part, groups in edits.items():
                    lane = parts[part]
                    ops = tuple(entry.op for _, entry, _, _ in groups)
                    if len(ops) != len(lane.slot_keys) or any(a is not b for a, b in zip(ops, lane.slot_keys)):
                        lane.slot_keys = ()
                        for slot, op in enumerate(ops, 1):
                            value = self._value(op, lane.read) if op["op"] in ("add", "set") else None
                            lane.set_slot(slot, op["op"], value, float(op.get("factor", 1.0)))
                        lane.slot_keys = ops
                    tables.append((part, lane.set_rows([(start, end, slot) for slot, (_, _, spans, _)
                                                        in enumerate(groups, 1) for start, end in _flat(spans)])))
            except Exception as exc:  # noqa: BLE001 - a bad value ends the requests that sent it
                for groups in edits.values():
                    for _, entry, _, sessions in groups:
                        for session in sessions:
                            session.fail(f"{_where(entry)}: {exc}")
                for lane in parts:
                    lane.done()
                steady = False
                continue
            read_parts = [part for _, entry, _, _ in reads for part in self._read_parts(entry.op, code)]
            for part in read_parts:
                parts[part].reading = True
            self.laned[key] = (parts, code, reads)
            filled[key] = (parts, code, reads, tables, read_parts)
        spans = layout.spans
        # (an op due at some steps only may be due now and not next step: never reuse then)
        steady = steady and not any((e.session.step == 0 and e.session.req_id in spans)
                                    or isinstance(e.op.get("steps"), list)
                                    for entries in self.at.values() for e in entries)
        # (a layout's spans are never changed once published: keep the dict itself)
        self._fill_memo = (self._version, layout.num_tokens, layout.spans, filled) if steady else None

    def finish_lanes(self, layout: Any) -> None:
        """After the forward: lane reads to the host (as :meth:`_read`), lanes reset."""
        laned, self.laned = self.laned, {}
        for key, (parts, code, reads) in laned.items():
            self.served.add(key)
            lanes.STATS["lane"] += 1
            if lanes.take_failed(self.inter.lane_site_name(key)):
                for entry in self.at.get(key, ()):
                    if entry.session.active and entry.session.req_id in layout.spans:
                        entry.session.fail(f"{_where(entry)}: the tap's batched kernels failed this step "
                                           "(see the server log)")
            elif reads:
                value = taps.rebuild(code, [lane.read[: layout.num_tokens] for lane in parts])
                for _, entry, spans, sessions in reads:
                    try:
                        self._read(entry.op, value, spans, sessions, layout.num_tokens)
                    except Exception as exc:  # noqa: BLE001 - as in apply
                        for session in sessions:
                            session.fail(f"{_where(entry)}: {exc}")
            for lane in parts:
                lane.done()

    @staticmethod
    def _read_parts(op: dict[str, Any], code: str) -> list[int]:
        if op.get("index") is None:
            return list(range(code.count("T")))
        part = lanes.part_of(code, op["index"])
        return [] if part is None else [part]

    def _lane_groups(self, key: tuple, layout: Any) -> tuple | None:
        """How the lanes serve a location's entries this step (``layout`` None: any
        step): ``(parts, code, edits per part, reads)``, each group's rows picked as
        in :meth:`_pick`, or None when they cannot (see :meth:`_lane_plan`). The plan
        is cached until the entries change; a step only picks its rows."""
        cached = self._lane_cache.get(key)
        if cached is None or cached[0] != self._version:
            cached = self._lane_cache[key] = (self._version, self._lane_plan(key))
        plan = cached[1]
        if plan is None or layout is None:
            return plan
        parts, code, edits, reads = plan
        step_edits = {part: picked for part, groups in edits.items() if (picked := self._pick(groups, layout))}
        return parts, code, step_edits, self._pick(reads, layout)

    def _lane_plan(self, key: tuple) -> tuple | None:
        """The lanes' plan for a location's active entries, or None when they cannot
        serve them: no lanes there, two edits of one request's tensor, a read
        ordered before an edit of its tensor, more than lanes.SLOTS distinct edits, a
        value split across tensor-parallel ranks (the tap op's Python puts it together)."""
        found = self.inter.lane_site(key)
        if found is None or self.inter.splits.of(key) is not None:
            return None
        parts, code = found
        if any(lane is None for lane in parts):
            return None
        if any(not _code_fits(entry.op, code) for _, entry, _ in self._groups(key)):
            return None  # (then the Python path fails the op, naming the mismatch)
        edits: dict[int, list[tuple]] = {}
        reads: list[tuple] = []
        read_parts: set[int] = set()
        edited: set[tuple[int, str]] = set()
        for group in self._groups(key):
            _, entry, sessions = group
            if entry.op["op"] == "read":
                touched = self._read_parts(entry.op, code)
                if not touched:
                    return None
                read_parts.update(touched)
                reads.append(group)
                continue
            part = lanes.part_of(code, entry.op.get("index"))
            if part is None or part in read_parts or not parts[part].read.is_floating_point():
                return None  # (an integer tensor: the Python path refuses the edit)
            for session in sessions:
                if (part, session.req_id) in edited:
                    return None
                edited.add((part, session.req_id))
            edits.setdefault(part, []).append(group)
            if len(edits[part]) > lanes.SLOTS:
                return None
        return parts, code, edits, reads

    def check_reached(self, layout: Any) -> None:
        """End of step: an edit whose location the forward never served did not apply
        (say so, as for a block), e.g. ``lm_head`` (vLLM applies it in compute_logits)."""
        for key, entries in self.at.items():
            if key in self.served:
                continue
            for entry in entries:
                session = entry.session
                if session.active and session.req_id in layout.spans and not entry.op.get("optional"):
                    session.fail(
                        f"ops[{entry.number}] ({entry.op['op']} {entry.op.get('module', 'logits')}."
                        f"{entry.op.get('io', 'output')}) was not reached at step {session.step}: vLLM "
                        "never called that module this step (e.g. lm_head is applied inside "
                        "compute_logits: use model.logits)"
                    )
        self.served.clear()

    def _read(self, op: dict[str, Any], value: Any, spans: list[tuple[int, int]],
              sessions: list[RequestSession], num_tokens: int) -> None:
        """One copy of the location's rows this step, straight to (pinned) host memory
        without waiting for it. A prefill read keeps a view of the request's rows; a
        per-step read notes where its rows are (:class:`.rowlog.RowLog`)."""
        check_structure(op, value)
        name = op["name"]
        once = is_single(op)
        if op.get("sum"):  # the residual stream: one tensor, summed on the device
            value = read_value(value, op)
        if op.get("positions") is not None:  # the picked rows, gathered: then one span each
            value, spans, num_tokens = _gathered(op, value, spans, num_tokens)
        last = max(end for _, end in spans)
        chunks = self.inter.layout.chunks if self.inter.layout is not None else None
        chunked = bool(chunks) and any(s.req_id in chunks and s.step == 0 for s in sessions)
        if op.get("index") is None and isinstance(value, (tuple, list)):  # e.g. (hidden, residual)
            if chunked:
                kept = []
                for span, session in zip(spans, sessions):
                    if session.req_id in chunks and session.step == 0:
                        if op.get("optional"):  # (a cache leaves the module out for this request)
                            session.namespace[name] = Dropped()
                        else:
                            session.fail(f"{op['module']}: a read of a whole tuple cannot gather a prompt "
                                         "split by chunked prefill; read one element (index) or the sum")
                    else:
                        kept.append((span, session))
                if not kept:
                    return
                spans, sessions = [k[0] for k in kept], [k[1] for k in kept]
            parts = [host_copy(_per_token_tensor({}, v, num_tokens)[:last]) if v is not None else None
                     for v in value]
            kind = type(value)
            for (start, end), session in zip(spans, sessions):
                view = kind(_view(p, start, end, op) if p is not None else None for p in parts)
                if once:
                    session.namespace[name] = session.keep(view)
                else:
                    session.namespace[name].append(view)  # shipped when the request ends
            return
        rows = _per_token_tensor(op, value, num_tokens)[:last]
        if chunked:
            self._read_chunks(op, rows, spans, sessions, chunks)
            return
        if once:
            rows = host_copy(rows)
            for (start, end), session in zip(spans, sessions):
                session.namespace[name] = session.keep(_view(rows, start, end, op))
            return
        block, first = put_rows(rows)
        for (start, end), session in zip(spans, sessions):
            session.namespace[name].add(block, first + start, first + end)

    @staticmethod
    def _read_chunks(op: dict[str, Any], rows: torch.Tensor, spans: list[tuple[int, int]],
                     sessions: list[RequestSession], chunks: dict[str, tuple[int, int, bool]]) -> None:
        """A read in a step where some prompts come in chunks: every request's rows go
        to a host block; a later chunk's rows continue its prompt's step, and a read of
        the prompt alone is one tensor of every chunk's rows (:class:`.rowlog.RowLog`)."""
        block, first = put_rows(rows)
        name, once = op["name"], is_single(op)
        for (start, end), session in zip(spans, sessions):
            chunk = chunks.get(session.req_id) if session.step == 0 else None
            log = session.namespace.get(name)
            if once and not isinstance(log, RowLog):
                log = session.namespace[name] = RowLog(squeeze=_one_row(op), single=True)
            log.add(block, first + start, first + end, cont=chunk is not None and chunk[0] > 0)
            if once:
                session.keep(log)  # (shipped again as it grows)

    def _apply_one(self, op: dict[str, Any], value: Any, spans: list[tuple[int, int]], num_tokens: int) -> None:
        check_structure(op, value)
        value = _per_token_tensor(op, value, num_tokens)
        check_writable(value, f"{op['module']}.{op.get('io', 'output')}")
        spans = sorted(_flat(spans))
        start, end = spans[0][0], spans[-1][1]
        if sum(e - s for s, e in spans) == end - start:  # contiguous rows: one view
            rows: Any = slice(start, end)
            target = value[rows]
        else:
            rows = torch.cat([torch.arange(s, e) for s, e in spans]).to(value.device, non_blocking=True)
            target = value.index_select(0, rows)
        operand = self._value(op, value) if "value" in op else None
        arith.apply(op["op"], target, operand, op.get("factor", 1.0))  # (index_select made a copy)
        if not isinstance(rows, slice):
            value.index_copy_(0, rows, target)

    def _value(self, op: dict[str, Any], like: torch.Tensor) -> arith.Operand:
        """The op's value on the device, decoded once; one row, broadcast over the rows."""
        key = (id(op), like.dtype)
        cached = self._values.get(key)
        if cached is None or cached[0] is not op:
            if len(self._values) > 1024:
                self._values.clear()
            value = arith.operand(op["value"], like)
            if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[0] != 1:
                raise ValueError(f"the value (shape {tuple(value.shape)}) is not one row: it is added "
                                 "to every row of the request")
            cached = self._values[key] = (op, value)
        return cached[1]


def check_structure(op: dict[str, Any], value: Any) -> None:
    """An op of a lowered block (engine/lower.py) assumed its module returns
    ``structure`` (0: one tensor, N: a tuple of N tensors), from the forward's
    annotation: refuse a value that is not that, rather than index it otherwise."""
    want = op.get("structure")
    if want is None:
        return
    if want == 0:
        fits = isinstance(value, torch.Tensor)
    else:
        fits = type(value) is tuple and len(value) == want and all(isinstance(v, torch.Tensor) for v in value)
    if not fits:
        got = f"a tuple of ({', '.join(type(v).__name__ for v in value)})" if isinstance(value, tuple) \
            else f"a {type(value).__name__}"
        said = "a tensor" if want == 0 else f"a tuple of {want} tensors"
        raise TypeError(f"{op['module']}.output is {got}, not {said} as its forward's annotation says; the "
                        "block ran as a batched spec on that annotation: send it with extra_args "
                        "{'nnsight_lower': False} to run it as code")


def _code_fits(op: dict[str, Any], code: str) -> bool:
    """Whether a tap site's value (its code, see taps.rebuild) is the op's ``structure``."""
    want = op.get("structure")
    return want is None or code == ("T" if want == 0 else "(" + "T" * want)


def _where(entry: Entry) -> str:
    """How an error names the op: ``ops[N] (add model.layers.8)``."""
    return f"ops[{entry.number}] ({entry.op['op']} {entry.op.get('module', 'logits')})"


def is_due(op: dict[str, Any], step: int) -> bool:
    steps = op.get("steps", "prefill")
    if steps == "all":
        return True
    if steps == "prefill":
        return step == 0
    if steps == "generated":
        return step != 0
    return step in _step_set(steps)


_STEP_SETS: dict[int, tuple[list[int], frozenset[int]]] = {}


def _step_set(steps: list[int]) -> frozenset[int]:
    """An explicit step list as a set (once per list: a payload's ops are shared)."""
    known = _STEP_SETS.get(id(steps))
    if known is None or known[0] is not steps:
        if len(_STEP_SETS) > 4096:
            _STEP_SETS.clear()
        known = _STEP_SETS[id(steps)] = (steps, frozenset(steps))
    return known[1]


def _chunk_rows(span: tuple[int, int], positions: list[int] | int, chunk: tuple[int, int, bool]) -> Rows:
    """The rows of ``positions`` (counted in the whole prompt) in this chunk of it."""
    computed, prompt_len, _ = chunk
    rows = absolute_rows(prompt_len, positions)
    return Rows(span[0] + q - computed for q in rows if computed <= q < computed + span[1] - span[0])


class Rows(tuple):
    """A request's rows an op picks with ``positions`` (row numbers in the batch)."""


def _flat(spans: list[Any]) -> list[tuple[int, int]]:
    """Spans and picked rows as ``(start, end)`` runs."""
    out = []
    for span in spans:
        if isinstance(span, Rows):
            out.extend((r, r + 1) for r in span)
        else:
            out.append(span)
    return out


def _gathered(op: dict[str, Any], value: Any, spans: list[Any], num_tokens: int) -> tuple[Any, list, int]:
    """A read's picked rows of every request, gathered in request order: the value
    to read, each request's span in it, and its row count."""
    index = [r for span in spans for r in span]
    local, at = [], 0
    for span in spans:
        local.append((at, at + len(span)))
        at += len(span)

    def pick(t: Any) -> Any:
        t = _per_token_tensor({}, t, num_tokens)
        return t.index_select(0, torch.tensor(index, device=t.device))

    if isinstance(value, (tuple, list)):  # (every tensor: index picks one afterwards)
        return type(value)(pick(v) if isinstance(v, torch.Tensor) else v for v in value), local, len(index)
    return pick(value), local, len(index)


def _view(rows: torch.Tensor, start: int, end: int, op: dict[str, Any]) -> torch.Tensor:
    """A request's rows of a read; one picked position (an int) drops the row dimension."""
    return rows[start] if _one_row(op) else rows[start:end]


def _one_row(op: dict[str, Any]) -> bool:
    """The op picks one position (an int): its value per step is that row, a vector."""
    return isinstance(op.get("positions"), int)


def _per_token_tensor(op: dict[str, Any], value: Any, num_tokens: int) -> torch.Tensor:
    value = pick_index(value, op.get("index"))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the value is a {type(value).__name__}: set 'index'")
    if value.dim() == 0 or value.shape[0] != num_tokens:
        raise ValueError(f"the value (shape {tuple(value.shape)}) has no row per token of the batch "
                         f"({num_tokens}): it cannot be split per request")
    return value
