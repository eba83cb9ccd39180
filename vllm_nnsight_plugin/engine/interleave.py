"""Runs each traced request's block beside vLLM's forward, on that request's rows.

Per step the runner adapter tells the interleaver the batch layout (which rows of
the flat token batch belong to which request). Hooks are installed only on the
modules some parked block waits for, and removed when nobody waits, so an idle
engine runs with no hooks at all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..payload import codec
from . import batched, budget, cache, finite_logits, host, lanes, lower, shards, stages, taps
from .admission import Admission, AdmittedSpec
from .envoy import WorkerEnvoy, WorkerTracer
from .finite_logits import GuardedRows
from .limits import measure
from .logits_serving import LogitsServing
from .memo import PLANS_KEPT, IdentityMemo
from .requests import QuietBatch, TracedRequests
from .rows import Chunk, StepLayout
from .serving import SiteKey, ValueServing
from .session import RequestSession, engine_error
from .worker_setup import WorkerSetup


class Interleaver(Admission, ValueServing, LogitsServing):
    """Worker-side state: sessions, waiters, hooks, the current step's layout. Its
    parts: admitting requests (:mod:`.admission`), serving values to blocks and
    batched ops (:mod:`.serving`), and, here, the step: begin, end, results shipped."""

    def __init__(self, model: torch.nn.Module, setup: WorkerSetup, tap_sites: Any = ()):
        self.model = model
        self.setup = setup
        self.eager = setup.eager
        settings = setup.settings
        self.watchdog = budget.Watchdog(settings.code_time_limit_s)
        self.trimmer = budget.Trimmer()
        self.taps = settings.taps
        # (path, kind) pairs the tap op serves in this (compiled) model (boundary.tap_setup.on_model_loaded)
        self.tapped: set[tuple[str, str]] = set(tap_sites)
        self._tap_keys: dict[str, SiteKey] = {}  # tap site -> its location key (ValueServing._site_key)
        if self.tapped:
            taps.set_handler(self.on_tap)
        self.root = WorkerEnvoy(model, "", self)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.tracer = WorkerTracer(self)
        # code blocks are recorded into plans
        piped = setup.stages
        self.lowerings = lower.Lowerings(model, setup.dtype, self.watchdog.limit_s,
                                         piped.stand_ins if piped else None, setup.output_structure)
        # tensor parallel: which locations are split across ranks
        self.splits = shards.Splits(model, setup.tensor_parallel)
        # pipeline parallel: the modules other stages hold, and how plans reach them
        self.absent = piped.absent if piped else frozenset()
        self.stages = stages.StageTransport(self.absent, piped.last, carries=piped.carries) if piped else None
        self.batched = batched.BatchedEdits(self)
        self.expand_cache = cache.expander(self)  # a cache op as its reads (memoized per op)
        # (spec, max_tokens) -> see _admit_spec
        self._admitted_specs: IdentityMemo[AdmittedSpec] = IdentityMemo(PLANS_KEPT)
        self.finite = finite_logits.FiniteLogits()
        self.vocab: int | None = None  # the logits' width, once seen (model.samples must stay below it)
        self._guard_memo: GuardedRows | None = None
        self._checked_blocks: dict[str, Any] | None = None  # this step's checked requests' blocks
        self.requests = TracedRequests()
        self._served: set[int] | None = set()  # storages served to blocks (see owns)
        self._lane_keys: dict[tuple, str] = {}  # location key -> tap site with lanes
        self._ancestor_cache: dict[int, list[torch.nn.Module]] = {}
        self.edits: dict[str, tuple[str | None, dict[str, Any]]] = {}  # engine-wide: id -> (name, payload)
        # why blocks that may change activations are refused (the boundary sets it before each
        # admission: where KV blocks a traced request freed cannot be zeroed); None: they run
        self.edits_refused: str | None = None
        self.waiters: dict[tuple, list[RequestSession]] = defaultdict(list)
        self.hooks: dict[tuple, Any] = {}
        self.layout: StepLayout | None = None
        self.current: RequestSession | None = None
        self.results: dict[str, dict[str, Any]] = {}
        self._unshipped: dict[str, list[RequestSession]] = {}  # requests with a fresh snapshot...
        self._moving: list[RequestSession] = []  # ...whose blocks' snapshots are still on the device
        self._parents: dict[int, torch.nn.Module] | None = None
        self._ranks: dict[str, int] | None = None
        self._epoch = 0
        self._quiet: QuietBatch | None = None  # (see QuietBatch)
        self._chunks: dict[str, Chunk] = {}  # prompts split this step (see prompt_split)

    # the traced requests' state, read here; changed only by self.requests (TracedRequests)
    sessions = property(lambda self: self.requests.sessions)
    traced = property(lambda self: self.requests.traced)
    params = property(lambda self: self.requests.params)
    coded = property(lambda self: self.requests.coded)
    stepwise = property(lambda self: self.requests.stepwise)
    report_every_step = property(lambda self: self.requests.report_every_step)
    read_only_done = property(lambda self: self.requests.read_only_done)

    def finish(self, req_ids: set[str] | list[str]) -> None:
        if any(r in self.traced or r in self.sessions for r in req_ids):
            self._epoch += 1  # (an untraced request's end leaves the steady batch as it was)
        coded = any(r in self.coded for r in req_ids)
        if self.stages is not None:
            for req_id in req_ids:
                self.stages.admitted_as.pop(req_id, None)
        forgot = False
        for req_id in req_ids:
            for session in self.requests.forget(req_id):
                self._unwait(session)
                session.ended = True  # batched edits drop it on the next prune
                session.release()
                forgot = True
            self.results.pop(req_id, None)
            self._unshipped.pop(req_id, None)
        if coded:
            self.trimmer.after_requests()
        if forgot and not self.sessions:
            self._idle()  # (no traced step may follow to do it: untraced steps then run hook-free)

    def fail_request(self, req_id: str, message: str) -> None:
        blocks = [s for s in self.sessions.get(req_id, ()) if s.active]
        for session in blocks:
            self._unwait(session)
            session.fail(message)
        if blocks:
            self._record(req_id)
        elif req_id in self.traced:  # its blocks are over, but what they edited would be lost
            self.results.setdefault(req_id, {})["error"] = engine_error(message)

    def stateless(self, req_id: str) -> bool:
        """Only replayable batched edits (payload.spec.replayable): a recompute or a split
        prompt gets them again, row by row. (Not batched reads: their rows would come
        in pieces, or twice; unless the read is over, its prompt rows shipped.)"""
        blocks = self.sessions.get(req_id)
        return bool(blocks) and all((s.batched and s.active and s.replayable) or s.read_and_shipped
                                    for s in blocks)

    def preempted(self, req_id: str) -> None:
        """vLLM preempted the request and will recompute its forward."""
        if req_id in self.read_only_done:  # its prompt rows have shipped; nothing was edited
            return
        if not self.stateless(req_id):
            self.fail_request(
                req_id,
                "the request was preempted and its forward recomputed; its intervention state "
                "cannot be replayed (give the engine more KV cache or fewer concurrent requests)",
            )

    def prompt_split(self, req_id: str, prompt_len: int, computed: int, scheduled: int) -> None:
        """Chunked prefill (or a prefix-cache hit) split a traced prompt across steps.
        A request whose blocks all run batched plans takes it chunk by chunk: its step
        stays the prompt's until the last chunk, edits apply to each chunk's rows,
        positions count from the prompt's start, and prompt reads gather every chunk."""
        blocks = self.sessions.get(req_id, ())
        if any(s.active for s in blocks) and all(s.batched for s in blocks if s.active):
            self._chunks[req_id] = Chunk(computed, prompt_len, computed + scheduled < prompt_len)
            self._epoch += 1  # (no steady-batch shortcut while a prompt is in chunks)
            return
        if not self.stateless(req_id):
            self.fail_request(
                req_id,
                f"the prompt ({prompt_len} tokens) was not computed in one engine step "
                f"({computed} cached, {scheduled} scheduled): chunked prefill split it. "
                "Traced requests need the whole prompt in one step: raise "
                "max_num_batched_tokens or shorten the prompt",
            )

    def working(self) -> bool:
        """Traced work in the engine: live blocks, or results still to ship (an error
        for a recomputed request counts)."""
        # (an earlier pipeline stage also steps through its signatures still to send)
        return bool(self.sessions or self.results or self.stages is not None and self.stages.signatures)

    def active(self, req_id: str) -> bool:
        return any(s.active for s in self.sessions.get(req_id, ()))

    # ------------------------------------------------------------ steps
    def begin_step(self, layout: StepLayout) -> None:
        """Fill the lanes of batched specs, start new blocks and wake blocks waiting
        for this step."""
        self.layout = layout
        layout.chunks, self._chunks = self._chunks, {}
        self.batched.fill_lanes(layout)
        coded = self.coded  # (batched specs have no block to start or wake)
        for req_id in layout.spans if coded else ():
            if req_id not in coded:
                continue
            for session in self.sessions.get(req_id, ()):
                if not session.active or session.batched:
                    continue
                if session._glet is None:
                    self._run(session, session.start)
                elif session.wait is not None and session.wait.kind == "step" and session.wait.step <= session.step:
                    self._unwait(session)
                    self._run(session, lambda s=session: s.resume(None))

    def end_step(self, finishing: set[str] | frozenset = frozenset()) -> dict[str, dict[str, Any]]:
        """Close the step: unreached accesses fail, steps advance, blocks of requests
        that just produced their last token run to their end, results collected."""
        layout = self.layout
        if layout is None:
            return {}
        self.batched.finish_lanes(layout)
        self.batched.check_reached(layout)
        loud = self.coded | self.report_every_step | finishing  # (requests that may ship this step)
        quiet = self._quiet
        if quiet is not None and not loud and quiet.holds(self._epoch, layout.spans, self.batched.stale):
            quiet.advance()
        else:
            self._quiet = None
            self._walk_step(layout, loud, finishing)
        self.layout = None
        if not self.sessions:
            self._idle()
        else:
            self._prune()
        self._ship()
        results, self.results = self.results, {}
        return results

    def _idle(self) -> None:
        """No traced request is live: what the last ones held goes (their batched
        entries and the module hooks that served them; the storage set, as nothing live
        can hold a served view; the guard's memo, whose blocks' snapshots may hold host
        memory; the current host blocks, so later reads start fresh ones; the waiters, as
        no block is live to wait: one that failed while parked may still be listed)."""
        self.waiters.clear()
        self._served = set()
        self._guard_memo = None
        host.release()
        self._prune()

    def _prune(self) -> None:
        """Drop the entries of ended requests, then the hooks no entry needs any more."""
        self.batched.prune()
        if self.stages is not None:
            self.stages.prune()
        self._prune_hooks()

    def _walk_step(self, layout: StepLayout, loud: set[str], finishing: set[str] | frozenset) -> None:
        """end_step's pass over the batch: advance, end and record each traced request."""
        sessions = self.sessions
        advanced: list[RequestSession] | None = [] if not loud else None  # (see QuietBatch)
        room: int | None = None
        for req_id in layout.spans:
            blocks = sessions.get(req_id)
            if not blocks:
                continue
            if req_id not in loud:
                for session in blocks:
                    if (session.prefill_reads and session.step == 0 or session.step == session.last_step) \
                            if session.active else not session.final:
                        break
                else:  # batched specs only, nothing to ship yet (per-step rows ship at the
                    # end; prompt reads right after the first step, while the request decodes;
                    # a spec that is over was recorded when it ended)
                    more = layout.more_chunks(req_id)  # (its prompt's step goes on)
                    if more:
                        advanced = None
                    for session in blocks:
                        if session.active and not more:
                            session.step += 1
                            if advanced is not None:
                                advanced.append(session)
                                if session.last_step is not None:  # (its last step needs the walk)
                                    left = session.last_step - session.step
                                    room = left if room is None else min(room, left)
                    continue
            advanced = None
            for session in blocks:
                if not session.active:
                    continue
                wait = session.wait
                if wait is not None and wait.kind != "step" and wait.step <= session.step:
                    self._unwait(session)
                    session.fail(
                        f"{wait.describe()} was not reached: the forward had already passed it "
                        "(accesses must follow execution order) or vLLM never called that module "
                        "(e.g. lm_head is applied inside compute_logits: use model.logits)"
                    )
                if not layout.more_chunks(req_id):
                    session.step += 1
                if req_id in finishing:
                    self._run(session, session.end)
                elif session.last_step is not None and session.step > session.last_step:
                    session.over()  # its last step is done (prompt reads ship now); later steps skip it
            self._record(req_id)
            if not any(s.active for s in blocks):  # results shipped: no more per-step work
                for session in self.requests.blocks_over(req_id):
                    self._unwait(session)
                    session.release()
                self._epoch += 1
        if advanced is not None and not self.batched.stale:
            self._quiet = QuietBatch(self._epoch, layout.spans, advanced, room)

    def _ship(self) -> None:
        """The step's fresh snapshots to the CPU (one copy per dtype for all requests),
        merged per request (its own block's names win) and encoded here, in the
        worker: tensor bytes then cross to the engine core as one buffer per value
        (a list of 128 per-step rows is one buffer, not 128 tensors to serialise),
        and vLLM's scheduling loop only forwards them."""
        pending, self._unshipped = self._unshipped, {}
        moving, self._moving = self._moving, []
        if not pending:
            return
        host.to_host(moving)
        host.wait()  # the only wait for the copies: the bytes are read next
        for req_id, blocks in pending.items():
            entry = self.results.get(req_id)
            if entry is None:
                continue
            merged: dict[str, Any] = {}
            for session in blocks:
                merged.update(session.last)
            try:
                entry["saves"] = codec.encode_saves(merged, binary=True)
            except Exception as exc:  # noqa: BLE001 - a value that cannot be encoded ends its request only
                for session in blocks:
                    self._unwait(session)
                    session.fail(exc)
                entry["saves"] = {}
                entry["error"] = next(s.error for s in blocks if s.error is not None)

    def between_steps(self, req_id: str) -> bool:
        """A block parked until a later step (``tracer.iter``/``tracer.all()``)."""
        return any(s.active and (s.batched_reads or not s.batched) and s.wait is not None
                   and s.wait.kind == "step" for s in self.sessions.get(req_id, ()))

    def _record(self, req_id: str) -> None:
        """Merge the request's blocks into its step results (its own block's names win)."""
        blocks = self.sessions.get(req_id, ())
        fresh = False
        changed: list[str] = []
        for session in blocks:
            if session.final:
                continue
            snap = session.snapshot()
            if snap is not None:
                count, size = measure(snap)
                if count > self.setup.settings.max_saves or size > self.setup.settings.max_saved_bytes:
                    self._unwait(session)
                    session.fail(
                        f"the block saved {count} values / {size} bytes, over this server's limits "
                        f"({self.setup.settings.max_saves} values, {self.setup.settings.max_saved_bytes} bytes): "
                        "save less (fewer steps or positions)"
                    )
                    snap = {}
                session.last = snap
                self._moving.append(session)
                changed += session.changed
                fresh = True
            session.final = not session.active
        error, done, stop, nwarn = None, True, False, 0  # (one pass: this runs per request per step)
        for session in blocks:
            if error is None:
                error = session.error
            done = done and session.done
            stop = stop or session.stopped
            nwarn += len(session.warnings)
        state = (error is not None, done, stop, nwarn)
        if not fresh and req_id not in self.report_every_step and self.requests.reported.get(req_id) == state \
                and req_id not in self.results:
            return  # nothing new for the scheduler this step
        warnings = [w for s in blocks for w in s.warnings]
        self.requests.reported[req_id] = state
        entry = self.results.setdefault(req_id, {})
        if fresh:
            self._unshipped[req_id] = blocks  # moved to the CPU with the rest of the step's
            entry["saves"] = None
            entry["changed"] = changed
            entry["step"] = max((s.step for s in blocks), default=1) - 1
        entry["error"] = error
        entry["done"] = done
        entry["stop"] = stop
        entry["pending"] = next((p for p in (s.pending() for s in blocks) if p), None)
        if warnings:
            entry["warnings"] = warnings

    def _run(self, session: RequestSession, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - engine-side failure of one block
            session.fail(exc)

    def abort_step(self, exc: BaseException) -> bool:
        """vLLM raised inside this step's forward: end every traced request in the step
        (any of their interventions may have caused it) so the runner can compute the
        step again without them. False when none took part (vLLM's error stands)."""
        layout = self.layout
        if layout is None:
            return False
        victims = [r for r in layout.spans if r in self.sessions]  # (a block may have ended in the step)
        if not victims:
            return False
        for parts, _, _ in self.batched.laned.values():  # (the lanes would apply the edits again)
            for lane in parts:
                lane.done()
        self.batched.laned = {}
        lanes.settle()
        message = (f"vLLM raised {type(exc).__name__} in a step this request's intervention took part in "
                   f"({str(exc)[:300]}); the step was computed again without the interventions and the "
                   "requests that had one end here")
        for req_id in victims:
            for session in self.sessions[req_id]:
                self._end_block(session, message)
        return True

    def _end_block(self, session: RequestSession, message: str) -> None:
        """Fail a block for what it did this step, also when it has already run to its
        end (its error still ships with the step's results)."""
        if session.error is None:
            self._unwait(session)
            session.fail(message)
