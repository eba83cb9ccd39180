"""The front end's side (``LLM``, ``AsyncLLM``, the OpenAI server): engine utilities,
requests' extra_args and prefix-cache salt, whether this process serves HTTP.
"""

from __future__ import annotations

from typing import Any

from ..payload.keys import EDITS_KEY, LOWER_KEY, PAYLOAD_KEY, STREAM_KEY
from .patching import APP_ROUTE_HOOKS, loaded

_OWN_KEYS = frozenset((PAYLOAD_KEY, STREAM_KEY, EDITS_KEY, LOWER_KEY))  # (extra_args the plugin alone reads)


def engine_utility(llm: Any, method: str, *args: Any) -> Any:
    """Call an EngineCore method of a ``vllm.LLM`` (sync)."""
    return llm.llm_engine.engine_core.call_utility(method, *args)


async def engine_utility_async(engine: Any, method: str, *args: Any) -> Any:
    """Call an EngineCore method of an ``AsyncLLM``."""
    return await engine.engine_core.call_utility_async(method, *args)


def make_llm(model: str, kwargs: dict[str, Any]) -> Any:
    """vLLM's ``LLM`` for a model (its engine starts here)."""
    from vllm import LLM

    return LLM(model=model, **kwargs)


def sampling_params(whole: bool = False, **kwargs: Any) -> Any:
    """vLLM's ``SamplingParams`` (the client builds a request's from trace and invoke
    keywords). ``whole``: only the finished output (vLLM's ``FINAL_ONLY``, which
    ``LLM`` sets itself; with ``n > 1`` it holds every sequence).

    Built fresh for one ``generate`` call and never handed back, so vLLM need not deep
    copy it per request (``skip_clone``, as vLLM's OpenAI server sets for its own
    fresh params): the deep copy was most of the front end's time per request. What
    vLLM sets per request it assigns on its shallow copy; the one nested change, the
    engine's stop ids added to a set, is the same for every request. Not where the
    caller's own ``extra_args`` ride along: vLLM's KV connectors change a request's
    ``kv_transfer_params`` in place, which requests sharing one dict would share."""
    from vllm import SamplingParams

    kwargs.setdefault("skip_clone", set(kwargs.get("extra_args") or ()) <= _OWN_KEYS)
    if whole:
        from vllm.sampling_params import RequestOutputKind

        kwargs.setdefault("output_kind", RequestOutputKind.FINAL_ONLY)
    return SamplingParams(**kwargs)


def make_async_engine(model: str, kwargs: dict[str, Any]) -> Any:
    """vLLM's ``AsyncLLM`` for a model, from ``vllm.LLM``-style keywords."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **kwargs))


def shutdown_llm(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s (or ``AsyncLLM``'s) engine processes now. An AsyncLLM's
    output task is finished on its own event loop when that loop is idle; when the
    loop is already closed nothing can finish it, and its "destroyed but pending"
    warning is dropped."""
    if hasattr(llm, "shutdown") and not hasattr(llm, "llm_engine"):
        handler = getattr(llm, "output_handler", None)
        llm.shutdown()
        if handler is not None and not handler.done():

            loop = handler.get_loop()
            if loop.is_closed():
                handler._log_destroy_pending = False
            elif not loop.is_running():
                loop.run_until_complete(_finished(handler))
        return
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


async def _finished(task: Any) -> None:
    """Wait for a cancelled task to end (on its own loop)."""
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled, or failed while shutting down: it has ended
        pass


def salt_request(engine_core_request: Any, salt: str) -> None:
    """A cache salt: no prefix-cache reads from, or writes for, requests with another.
    The plugin's comes first (the engine core tells traced requests by its prefix), the
    caller's own after it."""
    old = engine_core_request.cache_salt
    engine_core_request.cache_salt = f"{salt}|{old}" if old else salt


def sampling_extra_args(params: Any) -> dict | None:
    return getattr(params, "extra_args", None)


def engine_client(app: Any) -> Any:
    """The engine client of vLLM's OpenAI server app (``collective_rpc`` reaches the workers)."""
    return app.state.engine_client


def app_vllm_config(app: Any) -> Any:
    """The server's engine configuration (None before vLLM has put it on the app)."""
    return getattr(app.state, "vllm_config", None)


def serving_http() -> bool:
    """True in the OpenAI API server process (payloads arrive over HTTP)."""
    return any(loaded(name) for name in HTTP_SERVER_MODULES)


HTTP_SERVER_MODULES = tuple(module for module, _ in APP_ROUTE_HOOKS)


def serving_vllm_config(serving: Any) -> Any:
    """The engine config behind an OpenAI serving handler."""
    client = getattr(serving, "engine_client", None)
    return getattr(client, "vllm_config", None)
