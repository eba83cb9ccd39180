"""The interleaver's logits and samples: the guard that keeps traced requests' logits
finite before sampling, the copy of logits rows a block may still read after the
sampler ran, and the check of token ids a block wrote into ``model.samples``. A part
of :class:`.interleave.Interleaver` (a mixin: the state lives there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .finite_logits import GuardedRows, non_finite_message
from .session import _NOTHING, InterventionFailure, RequestSession, Wait, engine_error


class LogitsServing:
    def guard_logits(self, logits: torch.Tensor) -> None:
        """Logits rows of traced requests that may edit made finite before sampling; a
        request whose rows were not fails (see :mod:`.finite_logits`). Requests that only
        read are not checked: they change no activation. On a GPU the check is read where
        vLLM takes the step's output (:meth:`late_checks`). The checked rows are kept
        while the batch's rows and requests stay the same
        (:class:`.finite_logits.GuardedRows`)."""
        layout = self.layout
        self.vocab = int(logits.shape[-1])
        if not self.sessions:
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
            memo = self._guard_memo = GuardedRows(self._epoch, layout.rows, req_ids, index,
                                                  {r: sessions[r][0] for r in req_ids})
        # (on a GPU, a tensor-parallel rank but the first only makes its rows finite: vLLM
        # reads the first rank's outputs alone; on the CPU every rank fails the request now)
        group = self.setup.tensor_parallel
        report = group is None or group.rank == 0 or logits.device.type != "cuda"
        self._checked_blocks = memo.blocks  # (whose steps name what late_checks finds)
        for req_id in self.finite.check(logits, memo.index, memo.req_ids, report):  # (the CPU's, found now)
            self.fail_request(req_id, non_finite_message(memo.blocks[req_id].step))

    def late_checks(self) -> Callable[[], dict[str, dict[str, Any]]] | None:
        """This step's checks still on the device, as results to merge where vLLM takes
        the step's output (``runners.attach_late_results``): the error of a request
        whose rows were not finite, on the output of the step that found it, whether or
        not that step is its last. None: nothing to read."""
        failed = self.finite.detach()
        # (this step's blocks: the memo may change or go before the output is taken; read
        # after the step's close, a block's step count has moved past the step that found it)
        blocks, self._checked_blocks = self._checked_blocks, None
        if failed is None:
            return None
        return lambda: {r: {"error": engine_error(non_finite_message(max(blocks[r].step - 1, 0)))}
                        for r in failed()}

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

    def check_samples(self, ids: torch.Tensor, sessions: list[RequestSession]) -> None:
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
