"""How the lanes (:mod:`.lanes`, inside full CUDA graphs) serve a step's batched
ops: whether they cover every op at the step's locations, the slot tables filled
before the forward, the reads taken after it. A part of
:class:`.batched.BatchedEdits` (a mixin: the state lives there)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import lanes, taps

if TYPE_CHECKING:
    pass


from .plan_ops import LOGITS, _code_fits, _flat, _where


class LanePlans:
    """The lanes' side of the batched plans (see the module docstring)."""

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
                and (memo[2] is layout.spans or memo[2] == layout.spans) and not self.stale:
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
                        coefficients, bad = self._coefficients(lane, groups)
                        if bad:  # (their requests fail; the others keep their slots, in order)
                            steady = False
                            groups = [group for group in groups if id(group) not in bad]
                            ops = tuple(entry.op for _, entry, _, _ in groups)
                            coefficients = [c for c in coefficients if c is not None]
                        lane.set_slots(coefficients)
                        lane.slot_keys = ops
                    tables.append((part, lane.set_rows([(start, end, slot) for slot, (_, _, spans, _)
                                                        in enumerate(groups, 1) for start, end in _flat(spans)])))
            except Exception as exc:  # noqa: BLE001 - the tables could not be filled: the lanes' requests end
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
        steady = steady and not self.stale and self.steady(layout)
        # (a layout's spans are never changed once published: keep the dict itself)
        self._fill_memo = (self._version, layout.num_tokens, layout.spans, filled) if steady else None

    def _coefficients(self, lane: Any, groups: list[tuple]) -> tuple[list[tuple | None], set[int]]:
        """Each group's slot coefficients, in order; a group whose value does not fit the
        lane (another width) fails its own requests only, with eager PyTorch's error,
        and gets None (``bad`` holds the ids of those groups)."""
        coefficients: list[tuple | None] = []
        bad: set[int] = set()
        for group in groups:
            _, entry, _, sessions = group
            op = entry.op
            try:
                value = self._value(op, lane.read) if op["op"] in ("add", "set") else None
                coefficients.append(lane.coefficients(op["op"], value, float(op.get("factor", 1.0))))
            except Exception as exc:  # noqa: BLE001 - a bad value ends the requests that sent it
                coefficients.append(None)
                bad.add(id(group))
                for session in sessions:
                    session.fail(f"{_where(entry)}: {exc}")
        return coefficients, bad

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
        ordered before an edit of its tensor, more distinct edits than a lane has slots, a
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
            if len(edits[part]) > parts[part].slots:
                return None
        return parts, code, edits, reads
