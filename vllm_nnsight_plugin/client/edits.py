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

    def __init__(self, model: VLLM, edit_id: str, name: str | None):
        self.model, self.id, self.name = model, edit_id, name
        self.installed = False

    def clear(self) -> None:
        """Remove this edit from the engine (requests admitted from now on run without it)."""
        from ..engine import edits as registry

        if self.model.mode == "async":
            raise RuntimeError("on an async engine use: await edit.aclear()")
        if self.installed:
            self.model.vllm_entrypoint.collective_rpc("nnsight_clear_edits", args=([self.id],))
            registry.remove([self.id])
            self.installed = False
            self.model.__dict__.get("_edits", []).remove(self)

    def __repr__(self) -> str:
        return f"<Edit {self.name or self.id}{'' if self.installed else ' (cleared)'}>"


class EditContext(_Capturing):
    """``with model.edit(...) as (tracer, edit):``"""

    def __init__(self, model: VLLM, name: str | None):
        self.model = model
        self.handle = Edit(model, f"edit-{uuid.uuid4().hex[:12]}", name)
        self._block: Any = None

    def __nnsight_ref__(self) -> tuple:
        return ("tracer",)

    def __enter__(self) -> tuple[EditContext, Edit]:
        self._block = self._capture(sys._getframe(1))
        return self, self.handle

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        from ..engine import edits as registry

        self._release()
        if exc_type is not None and not issubclass(exc_type, SkipBlock):
            return False
        block, values = self._block
        payload = codec.encode_code(codec.CodePayload(block.source, block.filename, block.lineno, values))
        model, handle = self.model, self.handle
        if model.mode == "async":
            raise NotImplementedError("edits on an async engine are not available yet")
        llm = model.vllm_entrypoint
        registry.add(handle.id, handle.name)
        try:
            llm.collective_rpc("nnsight_install_edit", args=(handle.id, handle.name, payload))
        except Exception:
            registry.remove([handle.id])
            raise
        handle.installed = True
        model.__dict__.setdefault("_edits", []).append(handle)
        return True
