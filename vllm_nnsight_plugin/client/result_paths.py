"""A saved ``tracer.result`` taken from the finished output: the ``$result`` paths in a
request's results followed on that output (each of ``n`` sequences' on its own
completion), by the ``VLLM`` client, ``results()`` and vLLM's ``RequestOutput.saves``."""

from __future__ import annotations

from typing import Any

from ..payload import codec, spec


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
