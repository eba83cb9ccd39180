"""Methods added to vLLM's worker class, reachable by ``collective_rpc(name)``.

Results are msgpack-native (lists, dicts, str, int) so they cross vLLM's
process boundaries without insecure serialization.
"""

from __future__ import annotations

import os
from typing import Any


def nnsight_module_tree(self: Any) -> list[list[str]]:
    """``[path, class name]`` for every module of the loaded model."""
    model = self.model_runner.get_model()
    return [[name, type(module).__name__] for name, module in model.named_modules()]


def nnsight_probe(self: Any) -> dict[str, Any]:
    """Proof that the plugin is live in this worker process."""
    from . import compat

    runner_cls = type(self.model_runner)
    return {
        "pid": os.getpid(),
        "runner": runner_cls.__name__,
        "patched": all(
            compat.is_patched(cls, name)
            for name in ("execute_model", "_model_forward", "_sample", "sample_tokens")
            for cls in [next(c for c in runner_cls.__mro__ if name in c.__dict__)]
        ),
    }


def install(worker_cls: type) -> None:
    for fn in (nnsight_module_tree, nnsight_probe):
        if fn.__name__ not in worker_cls.__dict__:
            setattr(worker_cls, fn.__name__, fn)
