"""Builtin implementations of the project's hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .hookspecs import hookimpl
from .payload.settings import ALLOW_CODE_ENV, settings_of


@hookimpl(trylast=True)
def nnsight_payload_policy(kind: str, origin: str, settings: dict) -> str | None:
    """Code payloads over HTTP are remote code execution: only with operator opt-in."""
    if kind == "code" and origin == "http" and not settings_of(settings).allow_code:
        return (
            "code payloads (pickled Python) are refused by this server: they execute "
            f"arbitrary code. The operator can allow them with {ALLOW_CODE_ENV}=1 or "
            """--additional-config '{"nnsight": {"allow_code": true}}'"""
        )
    return None


@dataclass(frozen=True)
class ArchAdapter:
    """Where an architecture keeps its decoder layers, what a layer returns, and the
    final norm and unembedding that turn a residual stream into logits (a logit lens)."""

    layers_path: str
    layer_returns_residual: bool
    final_norm: str
    unembed: str

    def residual_stream(self, layer_output: Any) -> Any:
        """The HF-equivalent hidden state from a decoder layer's vLLM output."""
        if self.layer_returns_residual:
            hidden, residual = layer_output
            return hidden + residual
        return layer_output


_LLAMA_LIKE = ArchAdapter("model.layers", True, "model.norm", "lm_head")
_ADAPTERS = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "GPT2LMHeadModel": ArchAdapter("transformer.h", False, "transformer.ln_f", "lm_head"),
    "OPTForCausalLM": ArchAdapter("model.decoder.layers", False, "model.decoder.final_layer_norm", "lm_head"),
}


@hookimpl(trylast=True)
def nnsight_arch_adapter(architecture: str) -> ArchAdapter | None:
    return _ADAPTERS.get(architecture)
