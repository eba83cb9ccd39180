"""The OpenAI server side: validation (HTTP 400), results in streams, routes."""

from __future__ import annotations


def install() -> None:
    from ..boundary import patching
    from . import handlers, routes

    patching.when_class(patching.SERVING_COMPLETION, handlers.install_completion)
    patching.when_class(patching.SERVING_CHAT, handlers.install_chat)
    patching.when_class(patching.OUTPUT_PROCESSOR, handlers.install_output_processor)
    for module_name, _ in patching.APP_ROUTE_HOOKS:
        patching.when_imported(module_name, routes.install)
