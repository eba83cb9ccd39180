"""Runs each traced request's block beside vLLM's forward, on that request's rows.

Per step the runner adapter tells the interleaver the batch layout (which rows of
the flat token batch belong to which request). Hooks are installed only on the
modules some parked block waits for, and removed when nobody waits, so an idle
engine runs with no hooks at all.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..boundary import configuration, parallel
from ..payload import codec
from . import batched, budget, cache, finite_logits, guards, host, lanes, lower, shards, taps
from .envoy import WorkerEnvoy, WorkerTracer
from .limits import limits, measure
from .rows import StepLayout, _per_token, assign_into, narrow
from .session import _NOTHING, InterventionFailure, RequestSession, Serving, Wait, engine_error, to_host
from .tree import leaves, map_tensors

logger = logging.getLogger("vllm.nnsight_plugin")
SERVED_LIMIT = 1 << 16  # distinct served storages remembered (eager engines reuse a bounded set)


class Interleaver:
    """Worker-side state: sessions, waiters, hooks, the current step's layout."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, tap_sites: Any = ()):
        self.model = model
        self.eager = configuration.runs_eager(vllm_config)
        settings = configuration.additional_config(vllm_config)
        self.limits = limits(settings)
        self.watchdog = budget.Watchdog(budget.time_limit(settings))
        self.trimmer = budget.Trimmer()
        self.taps = taps.from_settings(settings)
        # (path, kind) pairs the tap op serves in this (compiled) model (taps.on_model_loaded)
        self.tapped: set[tuple[str, str]] = set(tap_sites)
        self._tap_keys: dict[str, tuple[tuple, str]] = {}
        if self.tapped:
            taps.set_handler(self.on_tap)
        self.root = WorkerEnvoy(model, "", self)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.tracer = WorkerTracer(self)
        # code blocks are recorded into plans
        self.lowerings = lower.Lowerings(model, configuration.model_dtype(vllm_config), self.watchdog.limit_s)
        self.splits = shards.Splits(model)  # tensor parallel: which locations are split across ranks
        # pipeline parallel (this is the last stage): the modules earlier stages hold
        self.absent = frozenset(parallel.absent_modules(model)) if parallel.pipeline_stages(vllm_config) > 1 \
            else frozenset()
        self.batched = batched.BatchedEdits(self)
        self.expand_cache = cache.expander(self)  # a cache op as its reads (memoized per op)
        self.finite = finite_logits.FiniteLogits()
        self.vocab: int | None = None  # the logits' width, once seen (model.samples must stay below it)
        self._guard_memo: list | None = None  # [epoch, rows, traced ids, their rows' index, steps to a last step]
        self.sessions: dict[str, list[RequestSession]] = {}  # edit copies first, own block last
        self.traced: set[str] = set()  # requests admitted with blocks, until vLLM finishes them
        self.params: dict[str, Any] = {}  # their SamplingParams (V2's runner keeps none)
        # requests whose state the scheduler needs every step (stop strings end them in the
        # front end; streams ship each step); others report only when something changed
        self.report_every_step: set[str] = set()
        self._reported: dict[str, tuple] = {}
        self._served: set[int] | None = set()  # storages served to blocks (see owns)
        self._lane_keys: dict[tuple, str] = {}  # location key -> tap site with lanes
        self._ancestor_cache: dict[int, list[torch.nn.Module]] = {}
        self.edits: dict[str, tuple[str | None, dict[str, Any]]] = {}  # engine-wide: id -> (name, payload)
        self.waiters: dict[tuple, list[RequestSession]] = defaultdict(list)
        self.hooks: dict[tuple, Any] = {}
        self.layout: StepLayout | None = None
        self.current: RequestSession | None = None
        self.results: dict[str, dict[str, Any]] = {}
        self._unshipped: dict[str, list[RequestSession]] = {}  # requests with a fresh snapshot...
        self._moving: list[RequestSession] = []  # ...whose blocks' snapshots are still on the device
        self.coded: set[str] = set()  # requests with a block that runs (not only batched specs)
        # requests that may park between steps (a block, or a batched read): only these
        # need the runner's finish prediction each step; steering alone never does
        self.stepwise: set[str] = set()
        # requests whose blocks are all over having only read the prompt (no edit): a
        # recompute of their forward changes nothing they did
        self.read_only_done: set[str] = set()
        self._parents: dict[int, torch.nn.Module] | None = None
        self._ranks: dict[str, int] | None = None
        # a step in which every traced request only advanced its batched specs' step
        # count: (epoch, its spans, the sessions it advanced). The next step with the
        # same requests, no admission or finish (epoch) and no spec over or failed
        # (batched.stale) advances those sessions without walking the batch.
        self._epoch = 0
        self._quiet: tuple[int, dict, list[RequestSession]] | None = None
        self._chunks: dict[str, tuple[int, int, bool]] = {}  # prompts split this step (see prompt_split)

    # ------------------------------------------------------------ admission
    def admit(self, req_id: str, extra_args: dict[str, Any] | None, params: Any = None) -> None:
        """Blocks for a new request: the installed edits it selects, then its own."""
        if req_id in self.traced:  # V2 re-sends a resumed request as new: never restart its blocks
            return
        extra = extra_args or {}
        # a block whose saves stream per step binds its names as it runs: never lowered
        kept_code = "nnsight_lower is off" if not lower.wanted(extra.get(codec.LOWER_KEY, True)) else \
            "its saves stream per step" if extra.get(codec.STREAM_KEY) else None  # why blocks stay code
        blocks: list[RequestSession] = []
        max_tokens = getattr(params, "max_tokens", None)  # (plans' step ranges are read against it)
        for eid, (name, env) in self._selected_edits(extra.get(codec.EDITS_KEY)):
            blocks.append(self._session(req_id, env, label=f"edit {name or eid}", index=len(blocks),
                                        batchable=all(b.batched for b in blocks), kept_code=kept_code,
                                        max_tokens=max_tokens))
        raw = extra.get(codec.PAYLOAD_KEY)
        if raw is not None:
            blocks.append(self._session(req_id, raw, index=len(blocks), batchable=all(b.batched for b in blocks),
                                        kept_code=kept_code, max_tokens=max_tokens))
        if blocks:
            self._epoch += 1
            self.sessions[req_id] = blocks
            # how each block runs, reported once on the request's output (RequestOutput.ran_as)
            self.results.setdefault(req_id, {})["ran_as"] = "; ".join(b.ran_as for b in blocks)
            self.traced.add(req_id)
            if not all(b.batched for b in blocks):
                self.coded.add(req_id)
            if any(b.batched_reads or not b.batched for b in blocks):
                self.stepwise.add(req_id)
            self.params[req_id] = params
            if extra.get(codec.STREAM_KEY) or getattr(params, "stop", None) or params is None:
                self.report_every_step.add(req_id)
            if any(b.error for b in blocks):
                self._record(req_id)

    def _selected_edits(self, names: Any) -> list[tuple[str, tuple[str | None, dict[str, Any]]]]:
        """A request naming edits runs those plus every unnamed one; naming none runs all."""
        if names is None:
            return list(self.edits.items())
        wanted = {names} if isinstance(names, str) else set(names)
        return [(eid, e) for eid, e in self.edits.items() if e[0] is None or e[0] in wanted]

    def _session(self, req_id: str, raw: Any, label: str = "", index: int = 0, batchable: bool = True,
                 kept_code: str | None = None, max_tokens: int | None = None) -> RequestSession:
        """One block. ``batchable``: every earlier block of the request is batched, so a
        batched spec here still runs in block order (batched edits apply first).
        ``kept_code``: why a code block must run as code (None: if it is exactly a batched
        spec, it runs as that spec). Sets the session's ``ran_as``."""
        session = RequestSession(req_id, self)
        try:
            env = raw if isinstance(raw, dict) else codec.parse_envelope(raw)
            if env["kind"] == "spec":
                self._admit_spec(session, env, index if batchable else None, max_tokens)
                session.ran_as = "batched" if session.batched else "spec, per request" + \
                    ("" if batchable else " (an earlier block of the request runs as code)")
                return session
            planned = self.lowerings.get(env, self.check_module_access, self.integer_inputs) \
                if kept_code is None and batchable else None
            if isinstance(planned, lower.Lowered):
                self._admit_spec(session, planned.spec, index, max_tokens)
                session.source, session.filename, session.lineno = env["source"], env["filename"], env["lineno"]
                session.lowered = planned
                lower.STATS["lowered"] += 1
                session.ran_as = "batched"
                return session
            session.source, session.filename, session.lineno = env["source"], env["filename"], env["lineno"]
            line = planned.line if planned is not None else env["lineno"]
            why = kept_code or ("an earlier block of the request runs as code" if not batchable else planned.why)
            session.ran_as = f"code: {env['filename']}:{line} ({why})"
            values = codec.load_code(env, self._resolver()).values
            session.namespace.update({k: self._to_device(v) for k, v in values.items()})
            for name, value in values.items():  # trace-level lists the block appends to: saved
                if isinstance(value, codec.SharedList):
                    session.namespace[name] = session.save(session.namespace[name])
        except Exception as exc:  # noqa: BLE001 - a bad payload ends only its request
            session.fail(f"bad payload{' (' + label + ')' if label else ''}: {exc}")
        return session

    def install_edit(self, edit_id: str, name: str | None, raw: str) -> None:
        """An engine-wide edit: from the next admitted request on, every request runs it."""
        env = codec.parse_envelope(raw)
        guards.refuse_integer_writes(env, self.integer_inputs)
        self.edits[edit_id] = (name, env)

    def clear_edits(self, edit_ids: list[str] | None = None) -> int:
        for edit_id in list(self.edits) if edit_ids is None else edit_ids:
            self.edits.pop(edit_id, None)
        return len(self.edits)

    def _to_device(self, value: Any) -> Any:
        """Tensors the block brought along (a steering vector built on a laptop) go to
        the engine's device, so ``output += v`` works wherever the client ran."""
        return map_tensors(value, lambda t: t.to(self.device) if t.device != self.device else t)

    @functools.cached_property
    def integer_inputs(self) -> frozenset[str]:
        """Module paths whose input is an index tensor (see :mod:`.guards`)."""
        return frozenset(guards.table(self.model)["integer_inputs"])

    def _admit_spec(self, session: RequestSession, env: dict[str, Any], batch_index: int | None,
                    max_tokens: int | None = None) -> None:
        from functools import partial

        from .spec_runner import run_spec

        guards.refuse_integer_writes(env, self.integer_inputs)
        env = self.batched.with_caches(env, self.expand_cache)
        session.source, session.filename, session.lineno = "__nnsight_run_spec__(model, tracer)", "<spec>", 1
        if batch_index is not None and batched.eligible(env):  # with every identical edit, no greenlet
            env = self.batched.for_request(env, max_tokens)
            self.batched.add(session, env, batch_index)
            cache.bind(session, env)
            session.batched = True
            session.batched_reads = batched.reads(env)
            session.prefill_reads = batched.prefill_reads(env)
            session.prompt_only = batched.prompt_only(env)
            session.last_step = batched.last_step(env)
            session.replayable = batched.replayable(env)
            session.edits = batched.edits(env)
            session.wait = Wait("step", 1 << 62)
            if self.eager:
                for op in env["ops"]:
                    if "module" in op:
                        self.ensure_hook(self.envoy_at(op["module"])._module, op.get("io", "output"))
            return
        for expansion in env.get("caches", ()):  # (their reads run batched; the spec's other ops here)
            session.namespace[expansion.name] = cache.attach(self, session, expansion, 1 << 20)
        session.namespace.update(
            model=self.root,
            tracer=self.tracer,
            __nnsight_run_spec__=partial(run_spec, ops=[op for op in env["ops"] if not op.get("late")],
                                         session=session, inter=self),
        )

    def cache_for(self, session: RequestSession, op: dict[str, Any]) -> cache.ModuleCache:
        """``tracer.cache()`` in a block that runs as code."""
        from ..payload import spec

        spec.validate({"v": 1, "kind": "spec", "ops": [op]})
        return cache.attach(self, session, self.expand_cache(op), 1 << 20)

    def envoy_at(self, path: str) -> WorkerEnvoy:
        """The envoy of a dotted module path (``model.layers.1.mlp``)."""
        envoy = self.root
        for part in path.split(".") if path else ():  # submodules only (a module may be named "output")
            if part not in envoy._module._modules:
                names = ", ".join(envoy._module._modules) or "(no submodules)"
                raise AttributeError(f"{path!r} is not a module of this model; "
                                     f"{envoy._path or 'the model'} has submodules: {names}")
            envoy = envoy._child(part)
        return envoy

    def module_rank(self, path: str) -> int:
        """Position of a module in registration order (forward order for decoders)."""
        if self._ranks is None:
            self._ranks = {name: i for i, (name, _) in enumerate(self.model.named_modules())}
        if path not in self._ranks:
            self.envoy_at(path)  # raises with the available names
        return self._ranks.get(path, 0)

    def _resolver(self) -> Callable[[tuple], Any]:
        def resolve(ref: tuple) -> Any:
            kind = ref[0]
            if kind == "model":
                return self.root
            if kind == "tracer":
                return self.tracer
            if kind == "envoy":
                return self.envoy_at(ref[1])
            raise codec.PayloadError(f"unknown reference {ref!r}")

        return resolve

    def finish(self, req_ids: set[str] | list[str]) -> None:
        if any(r in self.traced or r in self.sessions for r in req_ids):
            self._epoch += 1  # (an untraced request's end leaves the steady batch as it was)
        coded = any(r in self.coded for r in req_ids)
        for req_id in req_ids:
            for session in self.sessions.pop(req_id, ()):
                self._unwait(session)
                session.ended = True  # batched edits drop it on the next prune
                session.release()
            self.results.pop(req_id, None)
            self._unshipped.pop(req_id, None)
            self.traced.discard(req_id)
            self.coded.discard(req_id)
            self.stepwise.discard(req_id)
            self.read_only_done.discard(req_id)
            self.params.pop(req_id, None)
            self.report_every_step.discard(req_id)
            self._reported.pop(req_id, None)
        if coded:
            self.trimmer.after_requests()

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
        """Only replayable batched edits (batched.replayable): a recompute or a split
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
            self._chunks[req_id] = (computed, prompt_len, computed + scheduled < prompt_len)
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
        return bool(self.sessions or self.results)

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
        if quiet is not None and not loud and not self.batched.stale and quiet[0] == self._epoch \
                and (quiet[1] is layout.spans or quiet[1] == layout.spans):
            for session in quiet[2]:  # a steady batch of batched specs: only their step counts
                session.step += 1
        else:
            self._quiet = None
            self._walk_step(layout, loud, finishing)
        self.layout = None
        if not self.sessions:  # nothing live can hold a served view: start the storage set afresh
            self._served = set()
            host.release()  # (and later reads start fresh host blocks)
        self.batched.prune()
        self._prune_hooks()
        self._ship()
        results, self.results = self.results, {}
        return results

    def _walk_step(self, layout: StepLayout, loud: set[str], finishing: set[str] | frozenset) -> None:
        """end_step's pass over the batch: advance, end and record each traced request."""
        sessions = self.sessions
        advanced: list[RequestSession] | None = [] if not loud else None  # (see self._quiet)
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
                            if session.last_step is not None:
                                advanced = None  # (it must stop at its last step: walk each step)
                            elif advanced is not None:
                                advanced.append(session)
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
                for session in blocks:
                    self._unwait(session)
                    session.release()
                del self.sessions[req_id]
                self._epoch += 1
                self.coded.discard(req_id)
                self.stepwise.discard(req_id)
                if all(s.read_and_shipped for s in blocks):
                    self.read_only_done.add(req_id)
        if advanced is not None and not self.batched.stale:
            self._quiet = (self._epoch, layout.spans, advanced)

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
        to_host(moving)
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
                if count > self.limits["max_saves"] or size > self.limits["max_saved_bytes"]:
                    self._unwait(session)
                    session.fail(
                        f"the block saved {count} values / {size} bytes, over this server's limits "
                        f"({self.limits['max_saves']} values, {self.limits['max_saved_bytes']} bytes): "
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
        if not fresh and req_id not in self.report_every_step and self._reported.get(req_id) == state \
                and req_id not in self.results:
            return  # nothing new for the scheduler this step
        warnings = [w for s in blocks for w in s.warnings]
        self._reported[req_id] = state
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

    # ------------------------------------------------------------ waiting
    def require_session(self) -> RequestSession:
        if self.current is None:
            raise RuntimeError("model locations can only be accessed inside a traced block")
        return self.current

    def check_module_access(self, path: str, kind: str = "output") -> None:
        if self.absent and guards.held_elsewhere(path, self.absent):
            raise InterventionFailure(guards.absent_message(path, self.absent))
        if self.eager or (path, kind) in self.tapped:
            return
        if self.tapped or self.taps:
            raise InterventionFailure(
                f"{path or 'model'}.{kind} is not tapped: this engine runs compiled code with CUDA "
                f"graphs and serves module values only at its taps ({self.taps.describe()}). "
                "Declare the location in taps= (--additional-config nnsight.taps for a server) "
                "or run the engine eager. model.logits and model.samples work in every mode."
            )
        if not self.eager:
            raise InterventionFailure(
                f"reading or editing module {path or 'model'!r} needs an eager engine: this engine "
                "runs compiled code / CUDA graphs, which skip Python hooks. Start it with "
                "enforce_eager=True (VLLM(...) does by default) or declare taps. "
                "model.logits and model.samples work in every mode."
            )

    def add_waiter(self, session: RequestSession, wait: Wait) -> None:
        if wait.kind == "step":
            return
        key = wait.key
        self.waiters[key].append(session)
        if wait.module is not None and self.eager:  # compiled engines: the tap op serves
            self.ensure_hook(wait.module, wait.kind)
            # A hook added while a module runs is ignored for that call (torch picks
            # its hooks at call entry), so enclosing modules get theirs now: a later
            # read of a parent's output (layer after its mlp) is then still served.
            for parent in self._ancestors(wait.module):
                self.ensure_hook(parent, "output")

    def ensure_hook(self, module: torch.nn.Module, kind: str) -> None:
        key = (id(module), kind)
        if key not in self.hooks:
            self.hooks[key] = self._install(module, kind)

    def _ancestors(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        cached = self._ancestor_cache.get(id(module))
        if cached is not None:
            return cached
        if self._parents is None:
            self._parents = {
                id(child): parent for parent in self.model.modules() for child in parent.children()
            }
        out = []
        parent = self._parents.get(id(module))
        while parent is not None:
            out.append(parent)
            parent = self._parents.get(id(parent))
        self._ancestor_cache[id(module)] = out
        return out

    def _unwait(self, session: RequestSession) -> None:
        wait = session.wait
        if wait is not None and wait.kind != "step":
            lst = self.waiters.get(wait.key)
            if lst and session in lst:
                lst.remove(session)

    def _prune_hooks(self) -> None:
        for key in [k for k, lst in self.waiters.items() if not lst]:
            del self.waiters[key]
        for key in [k for k in self.hooks if k not in self.waiters and k not in self.batched.at]:
            self.hooks.pop(key).remove()

    def _install(self, module: torch.nn.Module, kind: str) -> Any:
        if kind == "output":
            def hook(mod, args, kwargs, output):  # noqa: ANN001
                self.serve((id(mod), "output"), output)
            return module.register_forward_hook(hook, with_kwargs=True)

        def pre_hook(mod, args, kwargs):  # noqa: ANN001
            if self.waiters.get((id(mod), "inputs")):
                self.serve((id(mod), "inputs"), (args, kwargs))
            if self.waiters.get((id(mod), "input")) or (id(mod), "input") in self.batched.at:
                first = args[0] if args else next(iter(kwargs.values()), None)
                self.serve((id(mod), "input"), first)
        return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    # ------------------------------------------------------------ serving
    def on_tap(self, site: str, xs: list[torch.Tensor]) -> None:
        """The tap op ran (between two graph pieces): serve blocks parked there."""
        key, code = self._site_key(site)
        if self.layout is not None and (self.waiters.get(key) or key in self.batched.at):
            self.serve(key, taps.rebuild(code, xs))

    def needs_python(self, scheduled: dict[str, int]) -> bool:
        """Whether a block of these requests may touch a tap this step, or a batched
        spec needs more than its lanes give (the step must then run the tap op's
        Python: piecewise graphs or eager, not a full graph). ``scheduled``: tokens
        per request this step."""
        if not self.coded:  # batched specs only: the lanes serve them all, or Python must
            return not self.sessions.keys().isdisjoint(scheduled) \
                and not self.batched.lanes_cover(sum(scheduled.values()))
        lanes_checked = False
        for req_id in scheduled:
            for session in self.sessions.get(req_id, ()):
                if not session.active:
                    continue
                if session.batched:
                    if not lanes_checked:
                        if not self.batched.lanes_cover(sum(scheduled.values())):
                            return True
                        lanes_checked = True
                    continue
                wait = session.wait
                if wait is None or wait.kind != "step" or wait.step <= session.step:
                    return True
        return False

    def _site_key(self, site: str) -> tuple[tuple, str]:
        """A tap site's location key (as waiters and batched entries use) and value code."""
        found = self._tap_keys.get(site)
        if found is None:
            path, kind, code = taps.parse_site(site)
            found = self._tap_keys[site] = ((id(self.envoy_at(path)._module), kind), code)
        return found

    def lane_site(self, key: tuple) -> tuple[list, str] | None:
        """The lanes and value code of the tap site at ``key`` (None: no lanes there)."""
        sites = lanes.sites()
        if len(self._lane_keys) != len(sites):
            self._lane_keys = {self._site_key(site)[0]: site for site in sites}
        site = self._lane_keys.get(key)
        parts = lanes.lanes_at(site) if site is not None else None
        return (parts, self._site_key(site)[1]) if parts is not None else None

    def lane_site_name(self, key: tuple) -> str:
        return self._lane_keys[key]

    def _note_served(self, value: Any) -> None:
        """Remember the storages handed to blocks: a saved tensor that shares one is
        vLLM's buffer (overwritten later) and is copied; any other is the block's own."""
        if self._served is None:
            return
        for t in leaves(value):
            if isinstance(t, torch.Tensor):
                self._served.add(t.untyped_storage().data_ptr())
        if len(self._served) > SERVED_LIMIT:
            self._served = None  # copy every saved tensor until no traced request is live (always correct)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether a block made ``t`` itself (no storage vLLM served), so saving it
        needs no copy."""
        return self._served is not None and t.untyped_storage().data_ptr() not in self._served

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

    def guard_logits(self, logits: torch.Tensor) -> None:
        """Logits rows of traced requests that may edit made finite before sampling; a
        request whose rows were not fails (see :mod:`.finite_logits`). Requests that only
        read are not checked: they change no activation. On a GPU the check is read when
        the device has got there, or at once in a request's last step by ``max_tokens``.
        The checked rows' index is kept while the batch's rows and requests stay the
        same (decode steps); None when they are all the rows, in order."""
        layout = self.layout
        self.vocab = int(logits.shape[-1])
        if not self.sessions and not self.finite.waiting:
            return
        memo = self._guard_memo
        if memo is None or memo[0] != self._epoch or not (memo[1] is layout.rows or memo[1] == layout.rows):
            sessions = self.sessions
            req_ids = sorted((r for r in sessions if r in layout.rows and any(s.edits for s in sessions[r])),
                             key=layout.rows.__getitem__)
            rows = [layout.rows[r] for r in req_ids]
            if rows == list(range(logits.shape[0])):
                index = None
            else:
                index = torch.tensor(rows, dtype=torch.long)
                if logits.device.type == "cuda":
                    index = index.pin_memory().to(logits.device, non_blocking=True)
            # steps until the first of them reaches its last step by max_tokens (every request
            # of an unchanged batch advances one step per call)
            room = min((limit - (self.sessions[r][0].step + 1) for r in req_ids
                        if (limit := getattr(self.params.get(r), "max_tokens", None)) is not None), default=None)
            memo = self._guard_memo = [self._epoch, layout.rows, req_ids, index, room]
        _, _, req_ids, index, room = memo
        found = self.finite.check(logits, index, req_ids)
        if room is not None:
            memo[4] = room - 1
        if self.finite.waiting and room is not None and room <= 0:
            found += self.finite.collect()  # (a request's last step: its error must ship with it)
        for req_id in found:
            step = self.sessions[req_id][0].step if req_id in self.sessions else "?"
            self.fail_request(req_id, f"the logits held NaN or inf at step {step}: an edit made this request's "
                                      "activations overflow or become NaN, so it ends here (its KV cache blocks "
                                      "are zeroed before any other request gets them)")

    def keep_logits(self, logits: torch.Tensor) -> None:
        """Keep the logits rows of requests with a block (the sampler edits logits in
        place): samples come after logits, and a block may read ``model.logits``
        after touching ``model.samples``. One copy of the rows' range per step, not
        one per request."""
        layout = self.layout
        rows = [layout.rows[req_id] for req_id in self.coded if req_id in layout.rows
                and any(s.active and not s.batched for s in self.sessions.get(req_id, ()))]
        if rows:
            layout.kept_from = min(rows)
            layout.kept_logits = logits[layout.kept_from : max(rows) + 1].clone()

    def late_value(self, session: RequestSession, wait: Wait) -> Any:
        """A location already passed this step that can still be read, else _NOTHING."""
        layout = self.layout
        if wait.kind != "logits" or layout is None or wait.step != session.step:
            return _NOTHING
        row = layout.rows.get(session.req_id)
        kept = layout.kept_logits
        if kept is None or row is None or not 0 <= row - layout.kept_from < kept.shape[0]:
            return _NOTHING
        kept = kept[row - layout.kept_from : row - layout.kept_from + 1]
        if wait.value is not _NOTHING:
            raise InterventionFailure(
                f"model.logits at step {wait.step} can no longer be replaced: this step's "
                "token was already sampled (assign model.logits before touching model.samples)"
            )
        return kept

    def serve(self, key: tuple, value: Any, row_based: bool = False) -> None:
        """Give every session parked on ``key`` for this step its rows of ``value``;
        then the late reads (caches) see what the blocks made of it. Under tensor
        parallel a split value is served whole (:mod:`.shards`)."""
        split = self.splits.of(key) if self.splits.ranks > 1 and self.layout is not None else None
        if split is not None and self._touched(key):
            if split[0] == "refused":
                self._refuse_location(key, split[1])
                return
            whole, write_back = shards.gather(value, split, self.splits.ranks, self.splits.rank,
                                              inputs=key[-1] == "inputs")
            self._serve(key, whole, row_based)
            write_back()
            return
        self._serve(key, value, row_based)

    def _touched(self, key: tuple) -> bool:
        """Whether a block or a batched op of a request in this step touches ``key`` now
        (the same answer on every rank: they hold the same requests and blocks)."""
        spans = self.layout.spans
        for entry in self.batched.at.get(key, ()):
            session = entry.session
            if session.active and session.req_id in spans and batched.is_due(entry.op, session.step):
                return True
        return any(s.wait is not None and s.wait.key == key and s.wait.step == s.step and s.req_id in spans
                   for s in self.waiters.get(key, ()))

    def _refuse_location(self, key: tuple, why: str) -> None:
        """A location whose split value cannot be served ends the requests touching it
        (on every rank alike: they hold the same blocks)."""
        for entry in self.batched.at.get(key, ()):
            if entry.session.active:
                entry.session.fail(why)
        for session in self.waiters.pop(key, ()):
            self._end_block(session, why)

    def _serve(self, key: tuple, value: Any, row_based: bool = False) -> None:
        layout = self.layout
        if layout is not None and key in self.batched.at:
            self.batched.apply(key, value)
        waiting = self.waiters.get(key)
        if layout is not None and waiting:
            self._serve_waiting(key, value, waiting, row_based)
        if layout is not None and key in self.batched.late:
            self.batched.apply(key, value, late=True)

    def _serve_waiting(self, key: tuple, value: Any, waiting: list[RequestSession], row_based: bool) -> None:
        layout = self.layout
        self._note_served(value)
        # a fresh list: blocks served here may park on this key again (a later step), and
        # removing served sessions one by one from a list of hundreds is quadratic
        keep: list[RequestSession] = []
        self.waiters[key] = keep
        shared = not row_based and len(layout.spans) > 1 and not _per_token(value, layout.num_tokens)
        for session in waiting:
            wait = session.wait
            if wait is None or wait.key != key:
                continue  # no longer parked here
            if wait.step != session.step or session.req_id not in layout.spans:
                keep.append(session)
                continue
            if row_based:
                row = layout.rows[session.req_id]
                view = value[row : row + 1] if key == ("logits",) else value[row]
            else:
                start, end = layout.spans[session.req_id]
                view = narrow(value, start, end, layout.num_tokens)

            def assign(new: Any, view: Any = view, wait: Wait = wait) -> None:
                if shared:
                    raise ValueError(f"{wait.describe()} is not per-token (no row per token of the batch): it "
                                     "is shared by every request in the step and cannot be assigned per request")
                if key != ("samples",):
                    for t in leaves(view):
                        if isinstance(t, torch.Tensor):
                            guards.check_writable(t, wait.describe())
                assign_into(view, new, wait.describe())

            # index tensors (token ids, positions) reach a block as copies: an in-place edit
            # of one would drive vLLM's kernels out of bounds, so it fails the request instead
            given, copies = (view, ()) if row_based else guards.copy_index_tensors(view)

            if wait.value is not _NOTHING:
                try:
                    assign(wait.value)
                except Exception as exc:  # noqa: BLE001 - a bad value ends only its request
                    self._unwait(session)
                    session.fail(exc)
                    continue
                self._run(session, lambda s=session: s.resume(None))
            else:
                serving = Serving(key, session.step, given, assign)
                self._run(session, lambda s=session, v=given, sv=serving: s.resume(v, sv))
            if copies and guards.edited(copies):
                self._end_block(session, f"{wait.describe()} holds token ids or positions that vLLM indexes "
                                         "with; edits of it are refused (the block changed its copy)")
        if key == ("samples",) and self.vocab is not None:
            self._check_samples(value, waiting)

    def _check_samples(self, ids: torch.Tensor, sessions: list[RequestSession]) -> None:
        """Token ids a block wrote into ``model.samples`` must be in the vocabulary (the
        next step embeds them); out-of-range rows become 0 and their requests fail."""
        served = [s for s in sessions if s.req_id in self.layout.rows]
        if not served:
            return
        index = torch.tensor([self.layout.rows[s.req_id] for s in served], device=ids.device)
        picked = ids.index_select(0, index)
        bad = ((picked < 0) | (picked >= self.vocab)).reshape(len(served), -1).any(dim=-1)
        if not bool(bad.any()):
            return
        ids.index_copy_(0, index, torch.where(bad.reshape(-1, *[1] * (picked.dim() - 1)), 0, picked))
        for session, wrong in zip(served, bad.tolist()):
            if wrong:
                self._end_block(session, f"model.samples was set to a token id outside the vocabulary "
                                         f"(0..{self.vocab - 1}); the request ends here")
