"""Helpers for raw ``vllm.LLM`` / OpenAI users who do not use :class:`VLLM`.

    from vllm_nnsight_plugin import make_payload, results

    def block(model, tracer):
        hidden = model.model.layers[1].output[0].save()

    params = SamplingParams(max_tokens=1, extra_args={"nnsight": make_payload(block)})
    out = llm.generate("Hello", params)[0]
    results(out)["hidden"]
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from collections.abc import Callable
from typing import Any

from .client.capture import _names_read
from .payload import codec


class _Ref:
    def __init__(self, ref: tuple):
        self._ref = ref

    def __nnsight_ref__(self) -> tuple:
        return self._ref


def make_payload(block: Callable[..., Any]) -> str:
    """The payload string for ``extra_args["nnsight"]`` running ``block``'s body.

    ``block`` is a function whose first parameter is the model and whose
    optional second one is the tracer; its body runs inside the engine, and the
    local names bound to saved values come back (see :func:`results`).
    """
    filename = inspect.getsourcefile(block) or block.__code__.co_filename
    lines, first = inspect.getsourcelines(block)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError("make_payload takes a function defined with def")
    start = fn.body[0].lineno + first - 1
    end = fn.body[-1].end_lineno + first - 1
    all_lines = linecache.getlines(filename) or lines
    source = textwrap.dedent("".join(all_lines[start - 1 : end]))
    params = [a.arg for a in fn.args.args]
    values: dict[str, Any] = {}
    code = block.__code__
    closure = dict(zip(code.co_freevars, (c.cell_contents for c in block.__closure__ or ())))
    for name in _names_read(fn.body):
        if name in closure:
            values[name] = closure[name]
        elif name in block.__globals__:
            values[name] = block.__globals__[name]
    for name, ref in zip(params, (("model",), ("tracer",))):
        values[name] = _Ref(ref)
    return codec.encode_code(codec.CodePayload(source, filename, start, values))


def results(output: Any, raise_errors: bool = True) -> dict[str, Any]:
    """The values an intervention saved on a ``RequestOutput`` (or OpenAI JSON dict).

    Raises :class:`InterventionError` when the block failed (unless
    ``raise_errors=False``). Returns ``{}`` when the output carried no payload. A saved
    ``tracer.result`` is taken from a finished ``RequestOutput``; in a JSON dict it stays
    ``{"$result": path}``.
    """
    from .boundary.outputs import raw_results
    from .client.errors import make_error
    from .client.result_paths import decoded_results

    if isinstance(output, dict):  # (the JSON of an HTTP response: a saved tracer.result keeps its path)
        res = codec.decode_results((output.get("kv_transfer_params") or {}).get(codec.PAYLOAD_KEY))
    else:  # (a saved tracer.result: that part of this output)
        res = decoded_results(output, raw_results(output))[0]
    if res is None:
        return {}
    if res.error and raise_errors:
        raise make_error(res.error)
    return res.saves
