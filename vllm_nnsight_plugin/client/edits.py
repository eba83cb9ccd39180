"""``model.edit()``: engine-wide interventions.

    with model.edit(name="probe") as (tracer, probe):
        score = model.model.layers[1].output[0][-1].norm().save()
    outputs = model.generate(prompts, max_tokens=5)     # outputs[i].saves["score"]
    probe.clear()

The block is captured like a trace's and installed on every worker between
steps; each request admitted afterwards runs a copy of it (before the request's
own block, if it has one), across all its steps, and its saves come back on that
request's output. A request passing ``edits=[names]`` runs the named edits plus
every unnamed one; naming none runs them all.
"""

from __future__ import annotations

import sys
import uuid
from typing import TYPE_CHECKING, Any

from ..payload import codec
from .capture import SkipBlock
from .tracer import _Capturing

if TYPE_CHECKING:
    from .model import VLLM


class Edit:
    """The handle of an installed edit."""

    def __init__(self, model: VLLM, edit_id: str, name: str | None, conn: Any = None):
        self.model, self.id, self.name = model, edit_id, name
        self.conn = conn  # a served engine (client.served.Connection), or None for a local one
        self.installed = False

    def clear(self) -> None:
        """Remove this edit from the engine (requests admitted from now on run without it)."""
        if self.conn is not None:
            if self.installed:
                self.conn.request("DELETE", f"/v1/nnsight/edits/{self.id}")
                self.installed = False
            return
        if self.model.mode == "async":
            raise RuntimeError("on an async engine use: await edit.aclear() (a blocking call "
                               "here would stall the engine's event loop)")
        if self.installed:
            self.model._engine().collective_rpc("nnsight_clear_edits", args=([self.id],))
            self._forget()

    async def aclear(self) -> None:
        """:meth:`clear` on an async engine."""
        if self.installed:
            await self.model._engine().collective_rpc("nnsight_clear_edits", args=([self.id],))
            self._forget()

    def _forget(self) -> None:
        from ..engine import edits as registry

        registry.remove([self.id])
        self.installed = False
        self.model.__dict__.get("_edits", []).remove(self)

    def __repr__(self) -> str:
        return f"<Edit {self.name or self.id}{'' if self.installed else ' (cleared)'}>"


class EditContext(_Capturing):
    """``with model.edit(...) as (tracer, edit):``"""

    def __init__(self, model: VLLM, name: str | None, serve: str | None = None, api_key: str | None = None):
        from .served import Connection

        self.model = model
        conn = Connection(serve, api_key) if serve else None
        self.handle = Edit(model, f"edit-{uuid.uuid4().hex[:12]}", name, conn)
        self._block: Any = None

    def __nnsight_ref__(self) -> tuple:
        return ("tracer",)

    def __enter__(self) -> tuple[EditContext, Edit]:
        self._block = self._capture(sys._getframe(1))
        self._arm()
        return self, self.handle

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._release()
        if exc_type is not None and not issubclass(exc_type, SkipBlock):
            return False
        if self.handle.conn is not None:
            self._install_served()
            return True
        if self.model.mode == "async":
            raise RuntimeError("on an async engine use: async with model.edit(...) as (tracer, edit)")
        args = self._install_args()
        try:
            self.model._engine().collective_rpc("nnsight_install_edit", args=args)
        except Exception:
            self._installed(False)
            raise
        self._installed(True)
        return True

    def _install_served(self) -> None:
        """Install on a served engine: the block as its recorded plan (a JSON spec, which
        a server runs without opting in to code) where it is one, else as code."""
        from . import served_plans
        from .served import ServeError, noted

        conn, (block, values) = self.handle.conn, self._block
        code = codec.encode_code(codec.CodePayload(block.source, block.filename, block.lineno, values))
        payload, found = served_plans.payload_for(code, None, self.model._served(conn)[1])
        if isinstance(found, served_plans.ServedPlan) and found.lists:  # (a list's items would come back
            payload = code  # under derived names on every request's output: such an edit goes as code)
        try:
            reply = conn.request("POST", "/v1/nnsight/edits", {"payload": payload, "name": self.handle.name})
        except ServeError as exc:
            raise noted(exc, served_plans.explain(found)) from None
        self.handle.id, self.handle.installed = reply["id"], True

    async def __aenter__(self) -> tuple[EditContext, Edit]:
        self._block = self._capture(sys._getframe(1))
        self._arm()
        return self, self.handle

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._release()
        if exc_type is not None and not issubclass(exc_type, SkipBlock):
            return False
        args = self._install_args()
        try:
            await self.model._engine().collective_rpc("nnsight_install_edit", args=args)
        except Exception:
            self._installed(False)
            raise
        self._installed(True)
        return True

    def _install_args(self) -> tuple:
        from ..boundary.configuration import llm_config
        from ..boundary.frontend import refuse_untraceable
        from ..engine import edits as registry

        block, values = self._block
        model = self.model  # an access no tap serves fails here, not in every later request
        model._check_block(block, values, model._tree, None if model.llm_kwargs.get("enforce_eager") else model.taps)
        refuse_untraceable(llm_config(model._engine()))
        payload = codec.encode_code(codec.CodePayload(block.source, block.filename, block.lineno, values))
        registry.add(self.handle.id, self.handle.name)  # before the RPC: no request slips past
        return (self.handle.id, self.handle.name, payload)

    def _installed(self, ok: bool) -> None:
        from ..engine import edits as registry

        if not ok:
            registry.remove([self.handle.id])
            return
        self.handle.installed = True
        self.model.__dict__.setdefault("_edits", []).append(self.handle)
