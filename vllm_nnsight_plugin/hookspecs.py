"""The project's extension points, declared once (pluggy, as pytest does).

Implementations live elsewhere (``builtin_hooks.py`` here; third parties via the
``vllm_nnsight_plugin`` entry-point group) and are collected by
:func:`vllm_nnsight_plugin.hooks.plugin_manager`.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "vllm_nnsight_plugin"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def nnsight_payload_policy(kind: str, origin: str, settings: dict) -> str | None:
    """Decide whether a payload may run; return a refusal reason, or None to allow.

    ``kind`` is the payload kind (``"code"``: pickled Python, remote code
    execution; ``"spec"``: declarative JSON); ``origin`` is ``"python"`` for an
    in-process ``vllm.LLM`` / ``AsyncLLM`` caller or ``"http"`` for the OpenAI
    server; ``settings`` is the operator's ``--additional-config``
    ``{"nnsight": {...}}`` section. Called in the front
    end before a request reaches the engine. The first non-None answer wins;
    return ``""`` to allow explicitly and stop later implementations.
    """


@hookspec
def nnsight_arch_adapter(architecture: str) -> Any:
    """Return an adapter for a vLLM model architecture (e.g. ``"LlamaForCausalLM"``).

    An adapter (``builtin_hooks.ArchAdapter``) knows an architecture's module quirks:
    where its decoder layers are, how a layer's vLLM output maps to the Hugging Face
    residual stream (a Llama layer returns ``(hidden, residual)``; HF's hidden state
    is their sum), and its final norm and unembedding. The engine asks for one in each
    worker: under pipeline parallel, the final norm and unembedding run on the last
    stage whatever their registration order (``boundary.parallel.absent_modules``). The
    demo and the examples ask for one too (``hooks.arch_adapter``). A third party's
    answer comes before the builtin table. Return None for architectures you do not know.
    """
