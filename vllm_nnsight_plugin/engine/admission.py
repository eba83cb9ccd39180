"""The interleaver's admission of a request: its payload parsed, its blocks recorded
into plans (or kept as code), the engine-wide edits it selects, its sessions made.
A part of :class:`.interleave.Interleaver` (a mixin: the state lives there)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from ..payload import codec, request_args, spec
from . import cache, guards, lower, stages
from .envoy import ResultRef, WorkerEnvoy
from .session import RequestSession, Wait
from .tree import map_tensors


class AdmittedSpec(NamedTuple):
    """A spec as this engine admits it (:meth:`Admission._admitted_spec`)."""

    expanded: dict[str, Any]  # its ops, caches expanded
    batched: dict[str, Any] | None  # as it runs batched for the request; None: per request
    facts: tuple  # (reads, prefill reads, prompt only, last step, replayable, edits) of ``batched``
    results: tuple[tuple[str, tuple], ...]  # its tracer.result saves: (name, path into the output)


class Admission:
    """Admitting requests (see the module docstring)."""

    # ------------------------------------------------------------ admission
    def admit(self, req_id: str, extra_args: dict[str, Any] | None, params: Any = None) -> None:
        """Blocks for a new request: the installed edits it selects, then its own."""
        if req_id in self.traced:  # V2 re-sends a resumed request as new: never restart its blocks
            return
        if self.stages is not None and not self.stages.last and not self.stages.carries:
            return  # (plans reach the last stage's modules only: see StageTransport)
        try:
            if self.setup.refusal is not None:
                raise codec.PayloadError(self.setup.refusal)
            args, refused = request_args.parse(extra_args), None
        except codec.PayloadError as exc:  # (the front end refuses these: this one came round it)
            args, refused = request_args.NONE, RequestSession(req_id, self)
            refused.edits = False  # (it changes nothing: no logits guard for its rows)
            refused.fail(f"bad request: {exc}")
        # a block whose saves stream per step binds its names as it runs: never lowered
        kept_code = "nnsight_lower is off" if not args.lower else \
            "its saves stream per step" if args.stream else None  # why blocks stay code
        blocks: list[RequestSession] = [] if refused is None else [refused]
        if self.stages is not None:
            self.stages.reaching.clear()  # (this request's blocks only: see StageTransport.note)
        max_tokens = getattr(params, "max_tokens", None)  # (plans' step ranges are read against it)
        for eid, (name, env) in self._selected_edits(args.edits) if refused is None else ():
            blocks.append(self._session(req_id, env, label=f"edit {name or eid}", index=len(blocks),
                                        batchable=all(b.batched for b in blocks), kept_code=kept_code,
                                        max_tokens=max_tokens))
        raw = args.payload
        if raw is not None:
            blocks.append(self._session(req_id, raw, index=len(blocks), batchable=all(b.batched for b in blocks),
                                        kept_code=kept_code, max_tokens=max_tokens))
        if self.stages is not None and not self.stages.last:
            self.stages.signatures[req_id] = [sig if crosses else stages.NOTHING  # (the last stage compares)
                                              for sig, crosses in self.stages.signatures_of(blocks)]
            for block in blocks:
                if block.error:  # (sent on: the last stage reports it if its own blocks did not fail)
                    self.stages.errors[req_id] = block.error.get("message", "bad payload")
            blocks = [b for b in blocks if b.batched and not b.error]  # (the last stage runs and reports the rest)
        elif self.stages is not None:
            self.stages.admitted_as[req_id] = self.stages.signatures_of(blocks)
        if blocks:
            self._epoch += 1
            self.requests.admitted(req_id, blocks, params, every_step=bool(
                args.stream or getattr(params, "stop", None) or params is None))
            # how each block runs, reported once on the request's output (RequestOutput.ran_as)
            self.results.setdefault(req_id, {})["ran_as"] = "; ".join(b.ran_as for b in blocks)
            if any(b.error for b in blocks):
                self._record(req_id)


    def _selected_edits(self, names: tuple[str, ...] | None) -> list[tuple[str, tuple[str | None, dict[str, Any]]]]:
        """A request naming edits runs those plus every unnamed one; naming none runs all."""
        if names is None:
            return list(self.edits.items())
        return [(eid, e) for eid, e in self.edits.items() if e[0] is None or e[0] in names]


    def _session(self, req_id: str, raw: Any, label: str = "", index: int = 0, batchable: bool = True,
                 kept_code: str | None = None, max_tokens: int | None = None) -> RequestSession:
        """One block. ``batchable``: every earlier block of the request is batched, so a
        batched spec here still runs in block order (batched edits apply first).
        ``kept_code``: why a code block must run as code (None: if it is exactly a batched
        spec, it runs as that spec). Sets the session's ``ran_as``."""
        session = RequestSession(req_id, self)
        try:
            env = raw if isinstance(raw, dict) else codec.parse_envelope(raw)
            if env["kind"] == "spec":  # (an installed edit's, or a text the codec keeps: one object for all)
                shared = isinstance(raw, dict) or len(raw) <= codec.LARGE_PAYLOAD
                self._admit_spec(session, env, index if batchable else None, max_tokens, shared)
                session.ran_as = "batched" if session.batched else "spec, per request" + \
                    ("" if batchable else " (an earlier block of the request runs as code)")
                return session
            planned = self.lowerings.get(env, functools.partial(self.check_module_access, planned=True),
                                         self.integer_inputs) \
                if kept_code is None and batchable else None
            if isinstance(planned, lower.Lowered):
                self._admit_spec(session, planned.spec, index, max_tokens, lower.kept(env))
                for name, items in planned.lists:  # (after the reads: they fill the namespace)
                    session.namespace[name] = session.keep(cache.ReadList(session.namespace, items))
                session.source, session.filename, session.lineno = env["source"], env["filename"], env["lineno"]
                session.lowered = planned
                lower.STATS["lowered"] += 1
                session.ran_as = "batched"
                return session
            session.source, session.filename, session.lineno = env["source"], env["filename"], env["lineno"]
            if self.stages is not None and not self.stages.last:
                return session  # (code runs on the last pipeline stage only: admit drops it here)
            line = planned.line if planned is not None else env["lineno"]
            why = kept_code or ("an earlier block of the request runs as code" if not batchable else planned.why)
            session.ran_as = f"code: {env['filename']}:{line} ({why})"
            if self.edits_refused:  # (code may change anything)
                raise codec.PayloadError(self.edits_refused)
            values = codec.load_code(env, self._resolver()).values
            session.namespace.update({k: self._to_device(v) for k, v in values.items()})
            for name, value in values.items():  # trace-level lists and dicts the block writes into: saved
                if isinstance(value, (codec.SharedList, codec.SharedDict)):
                    session.namespace[name] = session.save(session.namespace[name])
        except Exception as exc:  # noqa: BLE001 - a bad payload ends only its request
            session.fail(f"bad payload{' (' + label + ')' if label else ''}: {exc}")
        return session


    def install_edit(self, edit_id: str, name: str | None, raw: str) -> None:
        """An engine-wide edit: from the next admitted request on, every request runs it."""
        env = codec.parse_envelope(raw)
        if self.edits_refused and spec.may_edit(env):  # (it would end every request; first, as in _admit_spec)
            raise codec.PayloadError(self.edits_refused)
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
                    max_tokens: int | None = None, shared: bool = False) -> None:
        """``shared``: other requests send this very spec object (a payload text the codec
        or the lowerings cache, an installed edit): what admitting it finds is kept for
        them (a large payload is parsed anew for each request: these caches keep none)."""
        if self.edits_refused and spec.edits(env):  # (before the spec's other checks, kept or not)
            raise codec.PayloadError(self.edits_refused)
        # (_admitted_spec raises for a spec this engine refuses: nothing kept)
        admitted = self._admitted_specs.get(env, lambda: self._admitted_spec(env, max_tokens, shared),
                                            max_tokens, keep=shared)
        session.source, session.filename, session.lineno = "__nnsight_run_spec__(model, tracer)", "<spec>", 1
        for name, path in admitted.results:  # (batched or not: the client takes that part of the finished output)
            session.namespace[name] = session.keep(ResultRef(path))
        if batch_index is not None and admitted.batched is not None:  # with every identical edit, no greenlet
            env = admitted.batched
            self.batched.add(session, env, batch_index, shared)
            cache.bind(session, env)
            session.batched = True
            (session.batched_reads, session.prefill_reads, session.prompt_only, session.last_step,
             session.replayable, session.edits) = admitted.facts
            session.wait = Wait("step", 1 << 62)
            if self.stages is not None:
                self.stages.note(session, env["ops"])
            if self.eager:
                for op in env["ops"]:
                    if "module" in op and (self.stages is None or self.stages.role(op) != "skip"):
                        self.ensure_hook(self.envoy_at(op["module"])._module, op.get("io", "output"))
            return
        from .spec_runner import run_spec

        env = admitted.expanded
        for expansion in env.get("caches", ()):  # (their reads run batched; the spec's other ops here)
            session.namespace[expansion.name] = cache.attach(self, session, expansion, 1 << 20)
        session.namespace.update(
            model=self.root,
            tracer=self.tracer,
            __nnsight_run_spec__=functools.partial(run_spec, ops=[
                (number, op) for number, op in spec.numbered(env) if op["op"] != spec.RESULT and not op.get("late")],
                session=session, inter=self),
        )

    def _admitted_spec(self, env: dict[str, Any], max_tokens: int | None, shared: bool) -> AdmittedSpec:
        """What admitting a spec finds, the same for every request that sent it with
        ``max_tokens``: its checks against this engine, its ops with caches expanded
        and, where it runs batched, as it runs for such a request and what it does
        (checked before: edits only where the engine takes them)."""
        guards.refuse_integer_writes(env, self.integer_inputs)
        if self.stages is not None and self.stages.last:
            guards.refuse_absent(env, self.absent, self.stages.carries)
        elif self.stages is not None:  # (caches reach the last stage's modules only: refuse_absent)
            env = spec.keeping(env, lambda op: op["op"] != "cache")
        expanded = self.batched.with_caches(env, self.expand_cache, shared)
        results = tuple((op["name"], tuple(map(tuple, op["path"])))
                        for op in expanded["ops"] if op["op"] == spec.RESULT)
        if not spec.runs_batched(expanded):
            return AdmittedSpec(expanded, None, (), results)
        batched = self.batched.for_request(expanded, max_tokens, shared)
        return AdmittedSpec(expanded, batched, (
            spec.reads(batched), spec.prefill_reads(batched), spec.prompt_only(batched), spec.last_step(batched),
            spec.replayable(batched), spec.edits(batched)), results)

    def cache_for(self, session: RequestSession, op: dict[str, Any]) -> cache.ModuleCache:
        """``tracer.cache()`` in a block that runs as code."""
        spec.validate(codec.spec_envelope([op]))
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
