"""Read-only routes added to a stock OpenAI server (behind its ``--api-key``).

- ``GET /v1/nnsight/tree``: ``[[path, class], ...]`` of the loaded model, so a
  GPU-less client checks module paths against exactly what the server runs,
  ``taps``: null on an eager engine, else the tapped globs of a compiled one, and
  ``record``: what a client records a block's plan against (each module's output
  structure, the dtype, modules under two paths), so a served trace's blocks go as
  JSON specs, which a server runs without opting in to code.
- ``GET /v1/nnsight/schema``: the JSON Schema of declarative specs.

Added by wrapping the app builder's endpoint-plugin step, so a plain
``vllm serve`` gets them without ``VLLM_PLUGINS`` changes.
"""

# no "from __future__ import annotations": FastAPI reads these handler annotations at runtime

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..payload.codec import LARGE_PAYLOAD
from . import configuration, entrypoints, patching

logger = logging.getLogger("vllm.nnsight_plugin")


def add_routes(app: Any) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if any(getattr(r, "path", None) == "/v1/nnsight/tree" for r in app.routes):
        return

    @app.get("/v1/nnsight/tree")
    async def nnsight_tree(raw_request: Request) -> JSONResponse:
        engine = entrypoints.engine_client(raw_request.app)
        trees = await engine.collective_rpc("nnsight_module_tree")
        records = await engine.collective_rpc("nnsight_record_table")
        config = getattr(engine, "vllm_config", None)
        compiled = config is not None and not configuration.runs_eager(config)
        taps = configuration.settings(config).taps.patterns if compiled else None
        # "taps": null on an eager engine (every module reachable), else the tapped globs;
        # "record": what a client records blocks against (the last pipeline stage's, as the tree)
        return JSONResponse({"tree": trees[-1], "taps": taps, "record": records[-1]})

    @app.get("/v1/nnsight/schema")
    async def nnsight_schema() -> JSONResponse:
        from ..payload.spec import schema

        return JSONResponse(schema())

    @app.post("/v1/nnsight/edits")
    async def nnsight_install_edit(raw_request: Request) -> JSONResponse:
        """Install an engine-wide edit: ``{"payload": "<code or spec payload>", "name": null}``."""
        import uuid

        from ..boundary.frontend import check_payload, ensure_module_table, refuse_installing, refuse_untraceable
        from ..engine import edits
        from ..payload import codec

        try:
            body = await raw_request.json()
            if not isinstance(body, dict):
                raise codec.PayloadError("the body must be a JSON object {\"payload\": ..., \"name\": ...}")
            payload, name = body.get("payload"), body.get("name")
            if name is not None and not isinstance(name, str):
                raise codec.PayloadError("'name' must be a string or null")
            config = entrypoints.app_vllm_config(raw_request.app)
            refuse_untraceable(config)
            await ensure_module_table(entrypoints.engine_client(raw_request.app))
            # the same checks as a traced request's payload (policy, runner, compiled engine)
            if isinstance(payload, str) and len(payload) > LARGE_PAYLOAD:  # a thread: the event loop may run
                env = await asyncio.to_thread(check_payload, payload, None, config)
            else:
                env = check_payload(payload, None, config)
            refuse_installing(env, config)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the body is the client's
            if not isinstance(exc, codec.PayloadError):
                logger.warning("refused an edit from http: %s: %s", type(exc).__name__, str(exc)[:500])
            message = str(exc) if isinstance(exc, codec.PayloadError) else f"invalid body: {type(exc).__name__}: {exc}"
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}},
                                status_code=400)
        edit_id = f"edit-{uuid.uuid4().hex[:12]}"
        edits.add(edit_id, name)  # before the RPC: no request slips past un-salted
        try:
            await entrypoints.engine_client(raw_request.app).collective_rpc(
                "nnsight_install_edit", args=(edit_id, name, payload))
        except Exception:
            edits.remove([edit_id])
            raise
        return JSONResponse({"id": edit_id, "name": name})

    @app.get("/v1/nnsight/edits")
    async def nnsight_list_edits() -> JSONResponse:
        from ..engine import edits

        return JSONResponse({"edits": [{"id": i, "name": n} for i, n in edits.INSTALLED.items()]})

    @app.delete("/v1/nnsight/edits")
    async def nnsight_clear_all_edits(raw_request: Request) -> JSONResponse:
        return await _clear(raw_request, None)

    @app.delete("/v1/nnsight/edits/{edit_id}")
    async def nnsight_clear_edit(edit_id: str, raw_request: Request) -> JSONResponse:
        return await _clear(raw_request, [edit_id])


async def _clear(raw_request: Any, ids: list[str] | None) -> Any:
    from fastapi.responses import JSONResponse

    from ..engine import edits

    if ids is not None and ids[0] not in edits.INSTALLED:
        return JSONResponse({"error": {"message": f"no edit {ids[0]!r}", "code": 404}}, status_code=404)
    await entrypoints.engine_client(raw_request.app).collective_rpc("nnsight_clear_edits", args=(ids,))
    edits.remove(ids)
    return JSONResponse({"edits": [{"id": i, "name": n} for i, n in edits.INSTALLED.items()]})


def _attach(original: Callable) -> Callable:
    def attach(app: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(app, *args, **kwargs)
        add_routes(app)
        return result

    return attach


def install(app_module: Any) -> None:
    for module_name, function in patching.APP_ROUTE_HOOKS:
        if patching.module_name_of(app_module) == module_name and hasattr(app_module, function):
            patching.wrap_module_function(app_module, function, _attach)
