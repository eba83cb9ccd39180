"""What one invoke becomes on the way to vLLM and back: its prompt in a form vLLM
takes, its sampling keywords, and the results put back on its ``RequestOutput``."""

from __future__ import annotations

from typing import Any

from ..payload import codec
from .result_paths import decoded_results


def check_one_prompt(prompt: Any) -> None:
    """Refuse several prompts where one request's goes (each invoke is one vLLM request)."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (str, dict)) for p in prompt):
        raise ValueError(f"one prompt per invoke, got a list of {len(prompt)}: use model.trace() with one "
                         "tracer.invoke(prompt) block for each prompt")


def to_prompt(prompt: Any) -> Any:
    """A vLLM prompt from a str, token ids, a tokenizer encoding or a prompt dict."""
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist") and not isinstance(prompt, dict):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        check_one_prompt(prompt)
        if prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise ValueError("one prompt per invoke: got a batch of token id lists")
            prompt = prompt[0]
        return {"prompt_token_ids": [int(t) for t in prompt]}
    if isinstance(prompt, dict) or hasattr(prompt, "keys"):
        keys = set(prompt.keys())
        if "input_ids" in keys:
            ids = prompt["input_ids"]
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            if ids and isinstance(ids[0], list):
                if len(ids) != 1:
                    raise ValueError("one prompt per invoke: got a batch of encodings")
                ids = ids[0]
            mask = prompt.get("attention_mask") if hasattr(prompt, "get") else None
            if mask is not None:
                mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
                if mask and isinstance(mask[0], list):
                    mask = mask[0]
                ids = [t for t, m in zip(ids, mask) if m]
            return {"prompt_token_ids": [int(t) for t in ids]}
        return dict(prompt)
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")


def sampling_kwargs(trace_kw: dict[str, Any], invoke_kw: dict[str, Any], default_max: int | None) -> dict:
    """Invoke keywords win for the fields they name; ``max_new_tokens`` is ``max_tokens``;
    ``edits=[names]`` selects installed edits. (``lora_request`` stays in: the caller
    gives it to vLLM's ``generate``, beside the ``SamplingParams``.)"""
    merged: dict[str, Any] = {}
    for source in (trace_kw, invoke_kw):
        for key, value in source.items():
            merged["max_tokens" if key == "max_new_tokens" else key] = value
    if default_max is not None:
        merged.setdefault("max_tokens", default_max)
    if "edits" in merged:
        extra = dict(merged.get("extra_args") or {})
        extra[codec.EDITS_KEY] = list(merged.pop("edits"))
        merged["extra_args"] = extra
    return merged


def attach_results(output: Any) -> None:
    """Decode results onto the output: ``.saves``, ``.nnsight_error``, warnings, and each
    sequence's onto its ``outputs[i]``. With ``n > 1`` the output's are merged as
    nnsight merges them (``codec.merge_sequences``), and ``.nnsight_sequence_saves``
    keeps each sequence's saves for the trace's shared containers."""
    from ..boundary.outputs import raw_results

    res, decoded = decoded_results(output, raw_results(output))
    if decoded is None:
        if res is not None and len(output.outputs) == 1:
            output.outputs[0].saves, output.outputs[0].nnsight_error = res.saves, res.error
    else:
        for completion in output.outputs:
            one = decoded[completion.index] if completion.index < len(decoded) else None
            if one is not None:
                completion.saves, completion.nnsight_error = one.saves, one.error
        output.nnsight_sequence_saves = [r.saves if r is not None else {} for r in decoded]
    if res is None:
        return
    output.saves = res.saves
    output.nnsight_error = res.error
    output.nnsight_warnings = res.warnings
