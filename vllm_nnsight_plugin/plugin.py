"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` once in every process it starts (front end,
EngineCore, each worker). It is cheap and re-entrant: it only arranges patches
that apply when vLLM imports the modules they change.
"""

from __future__ import annotations

import os

DISABLE_ENV = "VLLM_NNSIGHT_DISABLE"


def register() -> None:
    """Install the plugin in this process, unless ``VLLM_NNSIGHT_DISABLE=1``."""
    if os.environ.get(DISABLE_ENV) == "1":
        return
    from .boundary.install import install

    install()
