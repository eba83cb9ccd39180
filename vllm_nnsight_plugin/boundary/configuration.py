"""What the plugin reads from a ``VllmConfig``: compilation mode, dtype, graph sizes,
the model's widths and the operator's ``additional_config["nnsight"]`` section.
"""

from __future__ import annotations

from typing import Any

from ..engine.memo import IdentityMemo
from ..payload.settings import Settings, settings_of


def runs_eager(vllm_config: Any) -> bool:
    """True when Python hooks run on every step (no torch.compile, no CUDA graphs)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return True
    comp = vllm_config.compilation_config
    mode = getattr(comp, "mode", None)
    graphs = getattr(comp, "cudagraph_mode", None)
    mode_none = mode is None or int(mode) == 0
    graphs_none = graphs is None or getattr(graphs, "name", str(graphs)) == "NONE"
    return mode_none and graphs_none


def speculative_method(vllm_config: Any) -> str | None:
    """The engine's speculative decoding method (``ngram``, ``eagle``, ...), None without."""
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else str(getattr(spec, "method", None) or "draft model")


def untraceable(vllm_config: Any) -> str | None:
    """Why no traced request or edit can run on this engine (None: they can). A
    speculating engine verifies several draft tokens of a request in one step and drops
    the rejected ones, so a request's rows and steps are not one token each: its reads,
    edits and ``tracer.iter`` steps would not mean what they say."""
    method = speculative_method(vllm_config) if vllm_config is not None else None
    if method is None:
        return None
    return (f"this engine runs speculative decoding ({method}), which verifies several draft tokens per "
            "request in one step and discards the rejected ones; traced requests and edits are not "
            "supported there: serve the model without a speculative config (--speculative-config, "
            "--spec-*) to trace it")


def model_dtype(vllm_config: Any) -> Any:
    """The dtype of the model's activations (``model_config.dtype``)."""
    return getattr(getattr(vllm_config, "model_config", None), "dtype", None)


def logits_format(vllm_config: Any) -> tuple[Any, int] | None:
    """The dtype and width of the rows a generating model's ``compute_logits`` returns:
    its head's dtype (the model's unless ``head_dtype`` overrides it) and its vocabulary
    (vLLM's logits processor slices a padded vocabulary off). None for a model that
    makes no logits to sample (pooling) or a config that does not say."""
    mc = getattr(vllm_config, "model_config", None)
    try:
        if getattr(mc, "runner_type", "generate") != "generate":
            return None
        return getattr(mc, "head_dtype", None) or mc.dtype, int(mc.get_vocab_size())
    except Exception:  # noqa: BLE001 - a config without these: nothing to prepare
        return None


def compiles_piecewise(vllm_config: Any) -> bool:
    """Whether vLLM compiles the model split at ``splitting_ops`` (VLLM_COMPILE)."""
    comp = vllm_config.compilation_config
    return getattr(comp, "mode", None) is not None and int(comp.mode) == 3


def max_graph_batch(vllm_config: Any) -> int:
    """Tokens in vLLM's largest CUDA-graph batch (512 where there are none, e.g. CPU)."""
    size = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None)
    return int(size) if size else 512


def max_requests(vllm_config: Any) -> int | None:
    """The most requests one step can hold (``max_num_seqs``), when the config says."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    return int(seqs) if seqs else None


def add_splitting_op(vllm_config: Any, op_name: str) -> bool:
    """Make vLLM split its compiled graph at ``op_name`` (the op then runs eagerly
    between CUDA-graph pieces). Must run before the first compile (model load).
    False when the graph is compiled whole (no split points to join)."""
    comp = vllm_config.compilation_config
    ops = comp.splitting_ops
    if not compiles_piecewise(vllm_config) or not ops:
        return False
    if op_name not in ops:
        ops.append(op_name)
    return True


def build_model(vllm_config: Any) -> Any:
    """Instantiate vLLM's model class for a config (weights not loaded)."""
    from vllm.model_executor.model_loader.utils import initialize_model

    return initialize_model(vllm_config=vllm_config)


def llm_config(llm: Any) -> Any:
    """The VllmConfig of a ``vllm.LLM`` or an ``AsyncLLM``."""
    return getattr(llm, "llm_engine", llm).vllm_config


# the width bound per model config; the model config, not the engine's whole config,
# which in-process engines share and which reaches their layers
_widths: IdentityMemo[int | None] = IdentityMemo(limit=16)


def model_width(vllm_config: Any) -> int | None:
    """An upper bound on the last dimension of any activation of the served model (a
    spec's longer value cannot fit anywhere): the vocabulary, the fused QKV and
    gate/up projections, a 4x MLP. None when the config does not say. Computed once
    per model config (the front end asks for every traced request)."""
    mc = getattr(vllm_config, "model_config", None)
    return None if mc is None else _widths.get(mc, lambda: _model_width(mc))


def _model_width(mc: Any) -> int | None:
    try:
        hf = mc.hf_text_config
        hidden, heads = mc.get_hidden_size(), getattr(hf, "num_attention_heads", 0) or 0
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 0
        return max(mc.get_vocab_size(), 4 * hidden, 2 * int(inter), (heads + 2 * kv_heads) * mc.get_head_size())
    except Exception:  # noqa: BLE001 - a config without these: no bound
        return None


_parsed: IdentityMemo[Settings] = IdentityMemo(limit=16)  # section -> its settings


def settings(vllm_config: Any) -> Settings:
    """The plugin's settings for this engine (:mod:`..payload.settings`), parsed once
    per section (the front end asks for every traced request)."""
    section = additional_config(vllm_config)
    # (an absent section is a new {} each time: settings_of caches those)
    return _parsed.get(section, lambda: settings_of(section), keep=bool(section))


def additional_config(vllm_config: Any) -> dict:
    """The operator's ``--additional-config`` entries for this plugin (key ``nnsight``)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("nnsight") if isinstance(extra, dict) else None
    return section if isinstance(section, dict) else {}


def api_servers(vllm_config: Any) -> int:
    """How many API server processes front this engine (``--api-server-count``; ``vllm
    serve --data-parallel-size N`` starts N by default)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "_api_process_count", 1) or 1)
