"""vllm-nnsight-plugin: nnsight-style tracing of any stock vLLM engine.

Public API (imported lazily, so vLLM's plugin loader pays nothing for it):

- :class:`VLLM` -- nnsight's ``VLLM`` API over ``vllm.LLM``.
- :func:`make_payload` -- a payload for ``SamplingParams.extra_args["nnsight"]``
  from a function ``def block(model, tracer): ...``.
- :func:`results` -- the decoded saves/error of a ``RequestOutput``.
- :class:`InterventionError` -- raised for errors inside the engine.
"""

from __future__ import annotations

from typing import Any

from .payload.keys import PAYLOAD_KEY  # (torch-free: the entry point stays cheap)

__all__ = ["VLLM", "make_payload", "results", "InterventionError", "PAYLOAD_KEY"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "VLLM":
        from .client.model import VLLM

        return VLLM
    if name == "InterventionError":
        from .client.errors import InterventionError

        return InterventionError
    if name in ("make_payload", "results"):
        from . import helpers

        return getattr(helpers, name)
    raise AttributeError(name)
