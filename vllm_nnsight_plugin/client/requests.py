"""What one invoke becomes on the way to vLLM and back: its prompt in a form vLLM
takes, its sampling keywords, and the results put back on its ``RequestOutput``."""

from __future__ import annotations

from typing import Any

from ..payload import codec, spec


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


class _OneSequence:
    """``tracer.result`` of one of ``n`` sequences' blocks: the request's output with
    only that sequence's ``outputs``."""

    def __init__(self, output: Any, completion: Any):
        self._output, self.outputs = output, [completion]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._output, name)


# what the plugin puts on an output (the results being decoded): not part of the output vLLM made
_OWN = frozenset({"saves", "nnsight_error", "nnsight_warnings", "nnsight_sequence_saves", "ran_as"})


def result_resolver(output: Any) -> Any:
    """``$result`` paths (a saved ``tracer.result``) resolved on ``output`` once it has
    finished. A path a result op cannot hold (``payload.spec.check_result_path``:
    attribute names not starting with ``_``, 32-bit integer or short string keys, at
    most 16 steps), one into what the plugin puts on the output (``saves``: the results
    being decoded), one this output lacks, or an unfinished output's, stays as it came:
    ``{"$result": path}``."""
    def resolve(path: list) -> Any:
        steps = tuple(tuple(step) if isinstance(step, list) and len(step) == 2 else (None, None) for step in path) \
            if isinstance(path, list) else None
        if steps is None or not spec.check_result_path(steps) or not getattr(output, "finished", True) \
                or (steps and steps[0][1] in _OWN):
            return {"$result": path}
        value = output
        try:
            for op, arg in steps:
                value = getattr(value, arg) if op == "attr" else value[arg]
        except (LookupError, AttributeError, TypeError):
            return {"$result": path}
        return value

    return resolve


def decoded_results(output: Any, raw: Any) -> tuple[codec.Results | None, list[codec.Results | None] | None]:
    """The output's raw results decoded, a saved ``tracer.result`` taken from the output
    (each of ``n`` sequences' from its own completion); with ``n > 1`` also each
    sequence's results, in sequence order (None for one that carried none)."""
    each = codec.sequences_of(raw) if raw is not None else None
    if each is None:
        return codec.decode_results(raw, result_resolver(output)), None
    decoded: list[codec.Results | None] = [None] * len(each)
    for completion in getattr(output, "outputs", ()):  # (by index: choices in order, or not)
        if completion.index < len(each):
            decoded[completion.index] = codec.decode_results(
                each[completion.index], result_resolver(_OneSequence(output, completion)))
    return codec.merge_sequences(decoded), decoded


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
