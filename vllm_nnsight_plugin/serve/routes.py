"""Read-only routes added to a stock OpenAI server (behind its ``--api-key``).

- ``GET /v1/nnsight/tree``: ``[[path, class], ...]`` of the loaded model, so a
  GPU-less client checks module paths against exactly what the server runs.
- ``GET /v1/nnsight/schema``: the JSON Schema of declarative specs.

Added by wrapping the app builder's endpoint-plugin step, so a plain
``vllm serve`` gets them without ``VLLM_PLUGINS`` changes.
"""

# no "from __future__ import annotations": FastAPI reads these handler annotations at runtime

from collections.abc import Callable
from typing import Any

from ..engine import compat


def add_routes(app: Any) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if any(getattr(r, "path", None) == "/v1/nnsight/tree" for r in app.routes):
        return

    @app.get("/v1/nnsight/tree")
    async def nnsight_tree(raw_request: Request) -> JSONResponse:
        engine = raw_request.app.state.engine_client
        trees = await engine.collective_rpc("nnsight_module_tree")
        return JSONResponse({"tree": trees[0]})

    @app.get("/v1/nnsight/schema")
    async def nnsight_schema() -> JSONResponse:
        from ..payload.spec import schema

        return JSONResponse(schema())


def _attach(original: Callable) -> Callable:
    def attach(app: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(app, *args, **kwargs)
        add_routes(app)
        return result

    return attach


def install(app_module: Any) -> None:
    compat.wrap_module_function(app_module, compat.APP_ROUTE_HOOK, _attach)
