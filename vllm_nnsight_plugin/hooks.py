"""The plugin manager for the project's own hooks (see ``hookspecs.py``)."""

from __future__ import annotations

import functools

import pluggy

from . import hookspecs


@functools.lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    """Built once per process: builtin implementations plus entry-point plugins."""
    from . import builtin_hooks

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin_hooks, name="builtin")
    pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    return pm


def arch_adapter(architecture: str):  # noqa: ANN201 - adapter protocol in builtin_hooks
    """The first adapter that knows ``architecture``, or None."""
    for adapter in plugin_manager().hook.nnsight_arch_adapter(architecture=architecture):
        if adapter is not None:
            return adapter
    return None


def refusal(kind: str, origin: str, settings: dict | None = None) -> str | None:
    """Why a payload is refused, or None when it may run."""
    reason = plugin_manager().hook.nnsight_payload_policy(kind=kind, origin=origin, settings=settings or {})
    return reason or None
