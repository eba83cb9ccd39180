"""The interleaver's serving of values: hooks installed where blocks wait, the tap
op's handler, values handed to parked blocks and batched ops (split values put
together first). The logits and samples are :mod:`.logits_serving`'s. A part of
:class:`.interleave.Interleaver` (a mixin: the state lives there)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import guards, lanes, plan_ops, shards, taps
from .rows import _per_token, assign_into, narrow
from .session import _NOTHING, InterventionFailure, RequestSession, Serving, Wait
from .tree import leaves

SERVED_LIMIT = 1 << 16  # distinct served storages remembered (eager engines reuse a bounded set)


class SiteKey(NamedTuple):
    """A tap site as the interleaver serves it (resolved once per site)."""

    key: tuple  # its location key, ``(id(module), kind)``, as waiters and batched entries use
    code: str  # how its value is built from the op's tensors (taps.flatten)


class ValueServing:
    """Serving module values, logits and samples to the step's requests (see the module docstring)."""

    # ------------------------------------------------------------ waiting
    def require_session(self) -> RequestSession:
        if self.current is None:
            raise RuntimeError("model locations can only be accessed inside a traced block")
        return self.current


    def check_module_access(self, path: str, kind: str = "output", planned: bool = False) -> None:
        """Refuse a module value this engine cannot serve. ``planned``: for an op of a
        plan, which reaches the modules of every pipeline stage (:mod:`.stages`)."""
        if self.absent and guards.held_elsewhere(path, self.absent):
            if not planned or self.stages is None:
                raise InterventionFailure(guards.absent_message(path, self.absent))
            if self.eager or self.taps.matches(path, kind):
                return  # (its stage serves it; a tap there when compiled)
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
        exports = self.stages.exports if self.stages is not None else {}
        for key in [k for k in self.hooks if k not in self.waiters and k not in self.batched.at and k not in exports]:
            self.hooks.pop(key).remove()


    def _install(self, module: torch.nn.Module, kind: str) -> Any:
        if kind == "output":
            def hook(mod, args, kwargs, output):  # noqa: ANN001
                self.serve((id(mod), "output"), output)
            return module.register_forward_hook(hook, with_kwargs=True)

        def pre_hook(mod, args, kwargs):  # noqa: ANN001
            if self.waiters.get((id(mod), "inputs")):
                self.serve((id(mod), "inputs"), (args, kwargs))
            if self.waiters.get((id(mod), "input")) or (id(mod), "input") in self.batched.at \
                    or self._exporting((id(mod), "input")):
                first = args[0] if args else next(iter(kwargs.values()), None)
                self.serve((id(mod), "input"), first)
        return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    # ------------------------------------------------------------ serving
    def on_tap(self, site: str, xs: list[torch.Tensor]) -> None:
        """The tap op ran (between two graph pieces): serve blocks parked there."""
        key, code = self._site_key(site)
        if self.layout is not None and (self.waiters.get(key) or key in self.batched.at or self._exporting(key)):
            self.serve(key, taps.rebuild(code, xs))


    def _exporting(self, key: tuple) -> bool:
        """Whether this (earlier pipeline) stage sends the value at ``key`` on this step."""
        return self.stages is not None and self.layout is not None and self.stages.exporting(key, self.layout.spans)


    def needs_python(self, scheduled: dict[str, int]) -> bool:
        """Whether a block of these requests may touch a tap this step, or a batched
        spec needs more than its lanes give (the step must then run the tap op's
        Python: piecewise graphs or eager, not a full graph). ``scheduled``: tokens
        per request this step."""
        if self.stages is not None and self.stages.exports:
            return True  # (a value another stage reads is copied in the tap op's Python)
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


    def _site_key(self, site: str) -> SiteKey:
        """A tap site's location key and value code."""
        found = self._tap_keys.get(site)
        if found is None:
            tap = taps.parse_site(site)
            found = self._tap_keys[site] = SiteKey((id(self.envoy_at(tap.path)._module), tap.kind), tap.code)
        return found


    def lane_site(self, key: tuple) -> tuple[list, str] | None:
        """The lanes and value code of the tap site at ``key`` (None: no lanes there)."""
        sites = lanes.sites()
        if len(self._lane_keys) != len(sites):
            self._lane_keys = {self._site_key(site).key: site for site in sites}
        site = self._lane_keys.get(key)
        parts = lanes.lanes_at(site) if site is not None else None
        return (parts, self._site_key(site).code) if parts is not None else None


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


    def _parameter_storages(self) -> frozenset[int]:
        """The model's parameters' storages, once (after its weights are loaded)."""
        found = self.__dict__.get("_parameters_seen")
        if found is None:
            found = self.__dict__["_parameters_seen"] = frozenset(
                p.untyped_storage().data_ptr() for p in self.model.parameters()) - {0}  # (0: an empty one)
        return found


    def owns(self, t: torch.Tensor) -> bool:
        """Whether a block made ``t`` itself (no storage vLLM served), so saving it
        needs no copy."""
        return self._served is not None and t.untyped_storage().data_ptr() not in self._served


    def serve(self, key: tuple, value: Any, row_based: bool = False) -> None:
        """Give every session parked on ``key`` for this step its rows of ``value``;
        then the late reads (caches) see what the blocks made of it. Under tensor
        parallel a split value is served whole (:mod:`.shards`)."""
        split = self.splits.of(key) if self.splits.ranks > 1 and self.layout is not None else None
        if split is not None and self._touched(key):
            if split.kind == "refused":
                self._refuse_location(key, split.reason)
                return
            whole, write_back = shards.gather(value, split, self.splits.group,
                                              inputs=key[-1] == "inputs")
            self._serve(key, whole, row_based)
            if self._exporting(key):
                self.stages.capture(key, whole)
            write_back()
            return
        self._serve(key, value, row_based)
        if self._exporting(key):
            self.stages.capture(key, value)


    def _touched(self, key: tuple) -> bool:
        """Whether a block or a batched op of a request in this step touches ``key`` now
        (the same answer on every rank: they hold the same requests and blocks)."""
        spans = self.layout.spans
        for entry in self.batched.at.get(key, ()):
            session = entry.session
            if session.active and session.req_id in spans and plan_ops.is_due(entry.op, session.step):
                return True
        return any(s.wait is not None and s.wait.key == key and s.wait.step == s.step and s.req_id in spans
                   for s in self.waiters.get(key, ())) or self._exporting(key)


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
        parameters = self._parameter_storages()
        protect = not row_based and guards.holds_protected(value, parameters)  # (once: each view is alike)
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

            # index tensors (token ids, positions) and parameters (a bias) reach a block as
            # copies: an in-place edit of one would drive vLLM's kernels out of bounds or
            # change the model for everyone, so it fails the request instead
            given, copies = guards.copy_protected(view, parameters) if protect else (view, ())

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
            why = guards.edited(copies) if copies else None
            if why:
                self._end_block(session, f"{wait.describe()} {why}")
        if key == ("samples",) and self.vocab is not None:
            self.check_samples(value, waiting)
