"""``mode="async"``: a trace submits its request to vLLM's ``AsyncLLM`` and returns.

``tracer.backend`` streams vLLM's ``RequestOutput``s::

    async for output in tracer.backend:   # the finished one carries .saves
        ...
    last = await tracer.backend            # or: drain and return the last

The request is submitted when the ``with`` block exits (a task pumps its outputs
into a queue), so many traces run concurrently from asyncio tasks. A consumer
that stops early (``break``) cancels the pump, which aborts the request in the
engine; the worker and scheduler then drop everything they held for it. An error
in the block is raised when the stream ends, with the user's line.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

_END = object()


def _worded(exc: BaseException) -> BaseException:
    """AsyncLLM re-raises a refusal (a payload the front end refused) as an error with no
    words of its own: the refusal itself, which says why."""
    return exc.__cause__ if not str(exc) and isinstance(exc.__cause__, ValueError) else exc


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class AsyncBackend:
    """The stream of one traced request's outputs (consumable once)."""

    def __init__(self, engine: Any, prompt: Any, params: Any, attach: Any, lora: Any = None):
        self._attach = attach
        self._queue: asyncio.Queue = asyncio.Queue()
        self._consumed = False
        self.request_id = f"nnsight-{uuid.uuid4().hex}"
        self._task = asyncio.get_running_loop().create_task(self._pump(engine, prompt, params, lora))

    async def _pump(self, engine: Any, prompt: Any, params: Any, lora: Any) -> None:
        try:
            async for output in engine.generate(prompt, params, self.request_id, lora_request=lora):
                await self._queue.put(output)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to the consumer
            await self._queue.put(_Failure(_worded(exc)))
        finally:
            self._queue.put_nowait(_END)

    def __aiter__(self) -> AsyncIterator[Any]:
        if self._consumed:
            raise RuntimeError("a traced stream can be consumed once")
        self._consumed = True
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        from .errors import make_error

        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                self._attach(item)
                if item.finished and getattr(item, "nnsight_error", None):
                    raise make_error(item.nnsight_error)
                yield item
        finally:
            if not self._task.done():
                self._task.cancel()  # stopped early: abort the request in the engine
                try:
                    await self._task
                except BaseException:  # noqa: BLE001 - cancellation is the point
                    pass

    async def _drain(self) -> Any:
        last = None
        async for output in self:
            last = output
        return last

    def __await__(self) -> Any:
        return self._drain().__await__()


async def generate_all(engine: Any, prompts: list[Any], params: Any, attach: Any, lora: Any = None) -> list[Any]:
    """``await model.generate(prompts)`` on an async engine: one request per prompt, run
    concurrently; each finished output with its results attached (installed edits'
    saves), in the prompts' order. ``lora``: one adapter for all, or a list, one per
    prompt (as ``vllm.LLM.generate`` takes it)."""
    async def one(prompt: Any, adapter: Any) -> Any:
        last = None
        try:
            async for output in engine.generate(prompt, params, f"nnsight-{uuid.uuid4().hex}", lora_request=adapter):
                last = output
        except Exception as exc:  # noqa: BLE001 - re-raised, with its words
            worded = _worded(exc)
            if worded is exc:
                raise
            raise worded from None
        attach(last)
        return last

    adapters = lora if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
    if len(adapters) != len(prompts):
        raise ValueError(f"lora_request holds {len(adapters)} adapters for {len(prompts)} prompts")
    return list(await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters))))
