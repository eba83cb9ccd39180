"""The OpenAI server side: validation (HTTP 400), results in streams, routes."""

from __future__ import annotations


def install() -> None:
    from ..engine import compat
    from . import handlers, routes

    compat.when_class(compat.SERVING_COMPLETION, handlers.install_completion)
    compat.when_class(compat.SERVING_CHAT, handlers.install_chat)
    compat.when_class(compat.OUTPUT_PROCESSOR, handlers.install_output_processor)
    for module_name, _ in compat.APP_ROUTE_HOOKS:
        compat.when_imported(module_name, routes.install)
