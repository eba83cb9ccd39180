"""The interleaver's serving of values: hooks installed where blocks wait, the tap
op's handler, values handed to parked blocks and batched ops (split values put
together first), the logits guard, samples checked. A part of
:class:`.interleave.Interleaver` (a mixin: the state lives there)."""

from __future__ import annotations

from typing import Any

import torch

from . import guards, lanes, plan_ops, shards, taps
from .finite_logits import GuardedRows, non_finite_message
from .rows import _per_token, assign_into, narrow
from .session import _NOTHING, InterventionFailure, RequestSession, Serving, Wait, engine_error
from .tree import leaves

SERVED_LIMIT = 1 << 16  # distinct served storages remembered (eager engines reuse a bounded set)




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


    def guard_logits(self, logits: torch.Tensor) -> None:
        """Logits rows of traced requests that may edit made finite before sampling; a
        request whose rows were not fails (see :mod:`.finite_logits`). Requests that only
        read are not checked: they change no activation. On a GPU the check is read when
        the device has got there; in a request's last step by ``max_tokens``, where vLLM
        takes that step's output (``late_errors``). The checked rows are kept while the
        batch's rows and requests stay the same (:class:`.finite_logits.GuardedRows`)."""
        layout = self.layout
        self.vocab = int(logits.shape[-1])
        if not self.sessions and not self.finite.waiting:
            return
        memo = self._guard_memo
        if memo is None or memo.epoch != self._epoch or not (memo.rows is layout.rows or memo.rows == layout.rows):
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
            memo = self._guard_memo = GuardedRows(self._epoch, layout.rows, req_ids, index, room)
        req_ids, room = memo.req_ids, memo.room
        found = self.finite.check(logits, memo.index, req_ids)
        if room is not None:
            memo.room = room - 1
        if self.finite.waiting and room is not None and room <= 0:
            # a request's last step: its error must ship with its output, read where vLLM
            # takes that output (a wait here, before sampling, would stall the step)
            failed = self.finite.detach()
            steps = {r: self.sessions[r][0].step for r in req_ids if r in self.sessions}
            self.late_errors = lambda: {r: {"error": engine_error(non_finite_message(steps.get(r, "?")))}
                                        for r in failed()}
        for req_id in found:
            step = self.sessions[req_id][0].step if req_id in self.sessions else "?"
            self.fail_request(req_id, non_finite_message(step))


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
