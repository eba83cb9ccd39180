"""Wraps of vLLM's OpenAI handlers for requests that carry a payload.

- A bad payload (malformed, too large, code without the operator's opt-in, a
  module edit on a compiled engine), a flag that is not true or false, or an
  unknown edit name is answered with HTTP 400 naming the problem, before
  anything reaches the engine.
- In a stream, the results go into the chunk that carries ``finish_reason`` as
  ``kv_transfer_params`` (the same field as in the non-stream response).
- Results arrive from the engine core with raw tensor bytes; they become
  base64 here, in the server's process, before any JSON is written.
Requests without a payload take the original code path untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..engine import edits
from ..payload import codec, request_args
from ..payload import values as tagged
from ..payload.codec import LARGE_PAYLOAD
from . import configuration, engine_core, entrypoints, patching
from .frontend import check_payload, check_sequences, ensure_module_table
from .outputs import raw_results

logger = logging.getLogger("vllm.nnsight_plugin")


def _xargs(request: Any) -> dict[str, Any] | None:
    return getattr(request, "vllm_xargs", None)


def _payload(request: Any) -> Any:
    xargs = _xargs(request)
    return xargs.get(codec.PAYLOAD_KEY) if xargs else None


def _reject(serving: Any, request: Any) -> Any:
    """An ErrorResponse (HTTP 400) when the payload, a flag or the edit selection is
    refused, else None."""
    try:
        args = request_args.parse(_xargs(request))
        if args.edits is not None:
            edits.check_selection(args.edits)
        raw = args.payload
        if raw is None:
            if edits.INSTALLED:  # (installed edits trace every request)
                check_sequences(request)
            return None
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise codec.PayloadError("a traced completion takes one prompt: send one request per prompt")
        check_payload(raw, request, entrypoints.serving_vllm_config(serving))
    except codec.PayloadError as exc:
        return serving.create_error_response(str(exc))
    except Exception as exc:  # noqa: BLE001 - any other failure to check a payload is still the payload's
        logger.warning("refused a payload from http: %s: %s", type(exc).__name__, str(exc)[:500])
        return serving.create_error_response(f"invalid payload: {type(exc).__name__}: {exc}")
    return None


async def _capture(results: dict[int, Any], gen: AsyncIterator, indexed: bool) -> AsyncIterator:
    async for item in gen:
        output = item[1] if indexed else item
        raw = raw_results(output)
        if raw is not None:
            results[item[0] if indexed else 0] = raw
        yield item


async def _inject(chunks: AsyncIterator[str], results: dict[int, Any], prompt_of: Callable,
                  every_step: bool) -> AsyncIterator[str]:
    """Put results into SSE chunks: the finish_reason chunk, or (``nnsight_stream``)
    every chunk that follows a step whose output carried results."""
    sent: set[int] = set()
    async for chunk in chunks:
        if results and chunk.startswith("data: ") and not chunk.startswith("data: [DONE]"):
            try:
                obj = json.loads(chunk[6:])
            except ValueError:
                yield chunk
                continue
            choices = obj.get("choices") or []
            targets = choices if every_step else [c for c in choices if c.get("finish_reason") is not None]
            touched = False
            for choice in targets:
                res = results.get(prompt_of(choice.get("index", 0)))
                if res is None or (every_step and id(res) in sent and choice.get("finish_reason") is None):
                    continue
                sent.add(id(res))
                params = dict(obj.get("kv_transfer_params") or {})
                params[codec.PAYLOAD_KEY] = res
                obj["kv_transfer_params"] = params
                touched = True
            if touched:
                chunk = f"data: {json.dumps(obj)}\n\n"
        yield chunk


def _every_step(request: Any) -> bool:
    return request_args.parse(_xargs(request)).stream  # (_reject checked it)


def _create(original: Callable) -> Callable:
    async def create(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request_args.mentioned(_xargs(request)) or edits.INSTALLED:  # (installed edits trace every request)
            raw = _payload(request)
            if raw is not None and configuration.untraceable(entrypoints.serving_vllm_config(self)) is None:
                await ensure_module_table(getattr(self, "engine_client", None))  # (else: _reject refuses it)
            if isinstance(raw, str) and len(raw) > LARGE_PAYLOAD:  # a thread: the event loop may run
                error = await asyncio.to_thread(_reject, self, request)
            else:
                error = _reject(self, request)
            if error is not None:
                return error
        return await original(self, request, *args, **kwargs)

    return create


def _completion_stream(original: Callable) -> Callable:
    def stream(self: Any, request: Any, engine_inputs: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        if _payload(request) is None:
            return original(self, request, engine_inputs, result_generator, *args, **kwargs)
        results: dict[int, Any] = {}
        n = request.n or 1
        chunks = original(self, request, engine_inputs, _capture(results, result_generator, True), *args, **kwargs)
        return _inject(chunks, results, lambda index: index // n, _every_step(request))

    return stream


def _chat_stream(original: Callable) -> Callable:
    def stream(self: Any, request: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        if _payload(request) is None:
            return original(self, request, result_generator, *args, **kwargs)
        results: dict[int, Any] = {}
        chunks = original(self, request, _capture(results, result_generator, False), *args, **kwargs)
        return _inject(chunks, results, lambda index: 0, _every_step(request))

    return stream


def install_completion(cls: type) -> None:
    patching.patch_method(cls, "create_completion", _create)
    patching.patch_method(cls, "completion_stream_generator", _completion_stream)


def install_chat(cls: type) -> None:
    patching.patch_method(cls, "create_chat_completion", _create)
    patching.patch_method(cls, "chat_completion_stream_generator", _chat_stream)


def _json_results(original: Callable) -> Callable:
    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if entrypoints.serving_http():
            for eco in engine_core_outputs:
                raw = raw_results(eco)  # (an engine output carries them as a RequestOutput does)
                if raw is not None:
                    engine_core.stamp(eco, codec.PAYLOAD_KEY, tagged.to_json(raw))
        return original(self, engine_core_outputs, *args, **kwargs)

    return process_outputs


def install_output_processor(cls: type) -> None:
    patching.patch_method(cls, "process_outputs", _json_results)
