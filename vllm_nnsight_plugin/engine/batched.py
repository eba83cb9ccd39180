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
from typing import TYPE_CHECKING, Any

import torch

from ..payload.spec import READ_OPS, RESULT, is_single, numbered
from . import arith, lanes
from .guards import check_writable
from .host import host_copy, put_rows
from .lane_plans import LanePlans
from .like_edits import LikeEdits
from .memo import PLANS_KEPT, IdentityMemo
from .plan_ops import (
    LOGITS,
    Entry,
    Rows,
    _chunk_rows,
    _flat,
    _gathered,
    _one_row,
    _per_token_tensor,
    _view,
    _where,
    check_structure,
    is_due,
    row_index,
)
from .rowlog import RowLog, TupleLog
from .rows import per_token
from .spec_runner import absolute_rows, pick_index, read_value

if TYPE_CHECKING:
    from .interleave import Interleaver
    from .rows import Chunk
    from .session import RequestSession



class BatchedEdits(LanePlans):
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
        self._pick_memo: dict[tuple, tuple] = {}  # (key, late) -> the last steady step's picks (see _step_picks)
        self._steady: tuple | None = None  # (layout, version, whether steady): see steady
        self._row_indexes: dict[tuple, tuple[list, Any]] = {}  # see _rows_of
        self._seqs: dict[int, tuple[dict[str, Any], int]] = {}  # id(op) -> (op, its seq)
        # (spec, max_tokens) -> see for_request
        self._for_request: IdentityMemo[dict[str, Any]] = IdentityMemo(PLANS_KEPT)
        self._next_seq = 0
        self.late: set[tuple] = set()  # locations with late entries (cache reads: after every edit)
        self._expanded: IdentityMemo[dict[str, Any]] = IdentityMemo(PLANS_KEPT)  # spec -> see with_caches
        self._placed: IdentityMemo[tuple[list, list, list]] = IdentityMemo(PLANS_KEPT)  # spec -> where its ops register
        self._like = LikeEdits()  # like edits with a value each, applied as one (see apply)

    def add(self, session: RequestSession, env: dict[str, Any], block: int, shared: bool = False) -> None:
        """Register a request's ops (applied in block then spec order per location).
        Under pipeline parallel, only this stage's part (:meth:`.stages.StageTransport.role`).
        ``shared``: other requests send this very spec object (a payload text the codec
        caches): where its ops register is kept for them."""
        # (_place raises for an op this engine refuses: nothing registered)
        row_logs, entries, exports = self._placed.get(env, lambda: self._place(env), keep=shared)
        for name, squeeze in row_logs:
            session.namespace[name] = session.keep(RowLog(squeeze=squeeze))
        for key, path, kind, op in exports:
            self.inter.stages.export(key, path, kind, session, op)
        at, late = self.at, self.late
        for key, op, number in entries:
            at[key].append(Entry(session, op, number, block, self._seq(op)))
            if op.get("late"):
                late.add(key)
        self._version += 1

    def _place(self, env: dict[str, Any]) -> tuple[list, list, list]:
        """Where a spec's ops register, the same for every request that sent it: the
        read ops that keep a row log per step (name, squeeze), the entries' (location,
        op, number) and this pipeline stage's exports; every op checked first."""
        stages = self.inter.stages
        row_logs, entries, exports = [], [], []
        for number, op in numbered(env):
            if op["op"] == RESULT:  # (nothing to run: admission binds its name)
                continue
            role = stages.role(op) if stages is not None else "run"
            if role == "skip":
                continue
            if role == "run" and op["op"] in READ_OPS and not is_single(op):  # one row block per step
                row_logs.append((op["name"], _one_row(op)))
            if op["op"] == "logits":
                entries.append((LOGITS, op, number))
                continue
            envoy = self.inter.envoy_at(op["module"])
            kind = op.get("io", "output")
            self.inter.check_module_access(op["module"], kind, planned=True)
            key = (id(envoy._module), kind)
            if role == "export":
                exports.append((key, op["module"], kind, op))
            else:
                entries.append((key, op, number))
        return row_logs, entries, exports

    def with_caches(self, env: dict[str, Any], expand: Any, shared: bool = True) -> dict[str, Any]:
        """The spec with each ``cache`` op replaced by its reads (``expand(op)``: an
        :class:`.cache.Expansion`), listed under ``"caches"``. Cached per spec where it
        is ``shared`` (see :meth:`add`), so requests of one spec share the reads (their
        ops group by identity)."""
        if not any(op["op"] == "cache" for op in env["ops"]):
            return env
        return self._expanded.get(env, lambda: self._expand(env, expand), keep=shared)

    @staticmethod
    def _expand(env: dict[str, Any], expand: Any) -> dict[str, Any]:
        ops: list[dict[str, Any]] = []
        numbers: list[int] = []  # (each op's number in the spec as sent: a cache's reads take the cache's)
        caches = []
        for number, op in numbered(env):
            if op["op"] != "cache":
                ops.append(op)
                numbers.append(number)
                continue
            expansion = expand(op)
            caches.append(expansion)
            ops.extend(expansion.reads)
            numbers.extend([number] * len(expansion.reads))
        return {**env, "ops": ops, "caches": caches, "numbers": numbers}

    def for_request(self, env: dict[str, Any], max_tokens: int | None, shared: bool = True) -> dict[str, Any]:
        """The spec as it runs for a request of ``max_tokens`` steps: an op whose
        explicit steps are every step from 0 (or 1) to the request's last means "all"
        ("generated"), so ``tracer.iter[:n]`` with ``max_tokens=n`` runs as
        ``tracer.all()`` does (the steady-batch shortcuts need no per-step check).
        Cached per (spec, max_tokens) where it is ``shared`` (see :meth:`add`):
        requests of one spec still share its ops."""
        if not max_tokens or not any(isinstance(op.get("steps"), list) for op in env["ops"]):
            return env
        return self._for_request.get(env, lambda: self._steps_as_run(env, max_tokens), max_tokens, keep=shared)

    @staticmethod
    def _steps_as_run(env: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        ops = []
        for op in env["ops"]:
            steps = op.get("steps")
            if isinstance(steps, list) and steps and steps[0] in (0, 1) and steps[-1] >= max_tokens - 1 \
                    and steps == list(range(steps[0], steps[-1] + 1)):
                op = {**op, "steps": "all" if steps[0] == 0 else "generated"}
            ops.append(op)
        return {**env, "ops": ops}

    def _seq(self, op: dict[str, Any]) -> int:
        """The op's admission number: a payload's parsed ops are shared by every request
        that sent its text, so identical ops group under the first one's number."""
        known = self._seqs.get(id(op))
        if known is None or known[0] is not op:
            known = self._seqs[id(op)] = (op, self._next_seq)
            self._next_seq += 1
        return known[1]

    def prune(self) -> None:
        """At a step's end: drop entries of finished or failed requests (once one has ended: see
        :attr:`stale`)."""
        self._steady = None  # (the step's layout is over: not held past it)
        if not self.stale:
            return
        self.stale = False
        self._like.forget()
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
        for run in self._like.runs((key, late), self._step_picks((key, late), groups, layout)):
            if len(run) > 1:  # (like edits with a value each: one application, see like_edits)
                run = self._apply_like((key, late), run, value, layout.num_tokens)
            for pick in run:
                self._apply_pick(pick, value, rows, layout.num_tokens)

    def _apply_pick(self, pick: tuple, value: Any, rows: int, num_tokens: int) -> None:
        _, entry, spans, sessions = pick
        try:
            if entry.op["op"] in READ_OPS:
                self._read(entry.op, value, spans, sessions, rows)
                return
            self._apply_one(entry.op, value, spans, num_tokens)
        except Exception as exc:  # noqa: BLE001 - a bad edit ends the requests that sent it
            if not entry.op.get("optional"):  # (a cached module whose value has no row per token: left out)
                self._fail(pick, exc)

    @staticmethod
    def _fail(pick: tuple, exc: Exception) -> None:
        """A pick's requests end with its op's error."""
        for session in pick[3]:
            session.fail(f"{_where(pick[1])}: {exc}")

    def _apply_like(self, where: tuple, run: list[tuple], value: Any, num_tokens: int) -> list[tuple]:
        """A run of like edits as one (:mod:`.like_edits`); the picks left to apply one by one."""
        op = run[0][1].op
        try:
            check_structure(op, value)
            target = _per_token_tensor(op, value, num_tokens)
            check_writable(target, f"{op['module']}.{op.get('io', 'output')}")
        except Exception:  # noqa: BLE001 - each pick then fails with its own op's error
            return run
        return self._like.apply(where, run, target, lambda o: self._value(o, target), self._fail)

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

    def _step_picks(self, memo_key: tuple, groups: list[tuple], layout: Any) -> list[tuple]:
        """:meth:`_pick` for this step. A decode step of a steady batch (the layout the
        last step published, no entry changed, none of its requests at its first step,
        no op due at listed steps only, no session ended or failed since) picks what the
        last step picked: no walk of the requests."""
        memo = self._pick_memo.get(memo_key)
        if memo is not None and memo[0] == self._version and memo[1] is layout.spans \
                and memo[2] is layout.rows and not self.stale:
            return memo[3]
        picked = self._pick(groups, layout, memo_key[0] == LOGITS)
        if not self.stale and self.steady(layout):
            self._pick_memo[memo_key] = (self._version, layout.spans, layout.rows, picked)
        else:
            self._pick_memo.pop(memo_key, None)
        return picked

    def steady(self, layout: Any) -> bool:
        """Whether every op's due steps and rows stay as they are while the batch does:
        no request of the step at its first step (prefill ops end, positions refer to
        its prompt) and no op due at listed steps only. Worked out once per step and
        registry version (every location asks)."""
        known = self._steady
        if known is not None and known[0] is layout and known[1] == self._version:
            return known[2]
        spans = layout.spans
        steady = not any((e.session.step == 0 and e.session.req_id in spans) or isinstance(e.op.get("steps"), list)
                         for entries in self.at.values() for e in entries)
        self._steady = (layout, self._version, steady)
        return steady

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


    def check_reached(self, layout: Any) -> None:
        """End of step: an edit whose location the forward never served did not apply
        (say so, as for a block), e.g. ``lm_head`` (vLLM applies it in compute_logits)."""
        for key, entries in self.at.items():
            if key in self.served:
                continue
            for entry in entries:
                session = entry.session
                # (pipeline parallel: an earlier stage sends a value only when a read of it is due)
                if session.active and session.req_id in layout.spans and not entry.op.get("optional") \
                        and (self.inter.stages is None or is_due(entry.op, session.step)):
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
            self._read_tuple(op, value, spans, sessions, num_tokens, chunks if chunked else None)
            return
        picked = pick_index(value, op.get("index"))
        if isinstance(picked, torch.nn.Parameter) or (picked is None and op.get("index") is not None):
            self._read_shared(op, picked, sessions, chunks)  # (a linear's bias, or None: the same for all)
            return
        rows = _per_token_tensor({}, picked, num_tokens)[:last]  # (the op's index: picked above)
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
    def _read_tuple(op: dict[str, Any], value: Any, spans: list[tuple[int, int]], sessions: list[RequestSession],
                    num_tokens: int, chunks: dict[str, Chunk] | None) -> None:
        """A read of a whole tuple: each request's rows of every element that has a row
        per token; an element that has not (a linear's bias) as it is, one copy for all.
        In a step where prompts come in chunks, each request's value is a
        :class:`.rowlog.TupleLog` that gathers its prompt's chunks."""
        name, once, squeeze = op["name"], is_single(op), _one_row(op)
        kind = list if isinstance(value, list) else tuple  # (a named tuple encodes as a tuple)
        split = [per_token(v, num_tokens) for v in value]
        for v, s in zip(value, split):
            if not s and v is not None and not isinstance(v, torch.nn.Parameter):
                _per_token_tensor({}, v, num_tokens)  # (raises: neither per token nor a linear's bias)
        last = max(end for _, end in spans)
        kept = [None if s else host_copy(v) if v is not None else None for v, s in zip(value, split)]
        if chunks is None:
            parts = [host_copy(v[:last]) if s else k for v, s, k in zip(value, split, kept)]
            for (start, end), session in zip(spans, sessions):
                view = kind(_view(p, start, end, op) if s else p for p, s in zip(parts, split))
                if once:
                    session.namespace[name] = session.keep(view)
                else:
                    session.namespace[name].append(view)  # shipped when the request ends
            return
        placed = [put_rows(v[:last]) if s else None for v, s in zip(value, split)]
        for (start, end), session in zip(spans, sessions):
            chunk = chunks.get(session.req_id) if session.step == 0 else None
            cont = chunk is not None and chunk.start > 0
            held = session.namespace.get(name) if once else session.namespace[name].latest()
            if not (cont and isinstance(held, TupleLog)):
                held = TupleLog(kind, [RowLog(squeeze=squeeze, single=True) if s else k for s, k in zip(split, kept)])
                if once:
                    session.namespace[name] = held
                else:
                    session.namespace[name].append(held)
            held.add(placed, start, end, cont)
            if once:
                session.keep(held)  # (shipped again as it grows)

    @staticmethod
    def _read_shared(op: dict[str, Any], value: torch.Tensor | None, sessions: list[RequestSession],
                     chunks: dict[str, Chunk] | None) -> None:
        """A read of a value that is the same for every request (a linear's bias, None
        where it has none): one copy, once per step (a later chunk of a split prompt
        continues its step: nothing more)."""
        copy = host_copy(value) if value is not None else None
        for session in sessions:
            chunk = chunks.get(session.req_id) if chunks and session.step == 0 else None
            held = session.namespace.get(op["name"])
            if chunk is not None and chunk.start > 0 and (held is not None if is_single(op) else len(held) > 0):
                continue  # (the prompt's step has its value from an earlier chunk)
            if is_single(op):
                session.namespace[op["name"]] = session.keep(copy)
            else:
                session.namespace[op["name"]].append(copy)

    @staticmethod
    def _read_chunks(op: dict[str, Any], rows: torch.Tensor, spans: list[tuple[int, int]],
                     sessions: list[RequestSession], chunks: dict[str, Chunk]) -> None:
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
            log.add(block, first + start, first + end, cont=chunk is not None and chunk.start > 0)
            if once:
                session.keep(log)  # (shipped again as it grows)

    def _apply_one(self, op: dict[str, Any], value: Any, spans: list[tuple[int, int]], num_tokens: int) -> None:
        check_structure(op, value)
        value = _per_token_tensor(op, value, num_tokens)
        check_writable(value, f"{op['module']}.{op.get('io', 'output')}")
        rows = self._rows_of(spans, value.device)
        target = value[rows] if isinstance(rows, slice) else value.index_select(0, rows)
        operand = self._value(op, value) if "value" in op else None
        arith.apply(op["op"], target, operand, op.get("factor", 1.0))  # (index_select made a copy)
        if not isinstance(rows, slice):
            value.index_copy_(0, rows, target)

    def _rows_of(self, picked: list[Any], device: torch.device) -> slice | torch.Tensor:
        """The rows of a group's picks: a slice where they are contiguous, else one index
        tensor on ``device`` (built with numpy, uploaded once). Kept for the list of picks
        it came from: a steady batch's picks are the same list every step."""
        key = (id(picked), device)
        known = self._row_indexes.get(key)
        if known is not None and known[0] is picked:
            return known[1]
        if len(self._row_indexes) > 256:  # (past steps' picks; a step with more groups rebuilds)
            self._row_indexes.clear()
        rows = row_index(sorted(_flat(picked)), device)
        self._row_indexes[key] = (picked, rows)
        return rows

    def _value(self, op: dict[str, Any], like: torch.Tensor) -> arith.Operand:
        """The op's value on the device, decoded once; one row, broadcast over the rows
        (as eager torch broadcasts it: a value of fewer dimensions than ``like`` is one
        row; one of as many is one only where its first dimension is 1)."""
        key = (id(op), like.dtype)
        cached = self._values.get(key)
        if cached is None or cached[0] is not op:
            if len(self._values) > 1024:
                self._values.clear()
            value = arith.operand(op["value"], like)
            if isinstance(value, torch.Tensor) and value.dim() > 1 and value.dim() >= like.dim() \
                    and value.shape[0] != 1:
                raise ValueError(f"the value (shape {tuple(value.shape)}) is not one row: it is added "
                                 "to every row of the request")
            cached = self._values[key] = (op, value)
        return cached[1]
