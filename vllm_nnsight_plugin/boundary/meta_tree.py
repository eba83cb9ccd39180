"""The module tree of a model, built from its config alone (no weights, no engine).

vLLM's own model class is instantiated on the ``meta`` device in a short-lived
subprocess (it needs a one-rank process group and vLLM's global config, which a
client process should not keep), so the tree has exactly the paths vLLM loads:
``model.layers.0.self_attn.qkv_proj``, not Hugging Face's ``q_proj``. Needs a vLLM
install (the CPU build is enough); about 10 s.

    python -m vllm_nnsight_plugin.boundary.meta_tree PATH_OR_HUB_ID  # prints the tree as JSON
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any


def build(model: str, **engine_kwargs: Any) -> list[list[str]]:
    """``[[path, class], ...]`` of vLLM's model class on the meta device (in this process)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs

    from . import configuration

    engine_kwargs.setdefault("enforce_eager", True)
    config = EngineArgs(model=model, load_format="dummy", **engine_kwargs).create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        try:
            with torch.device("meta"):
                module = configuration.build_model(config)
            return [[name, type(m).__name__] for name, m in module.named_modules()]
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def meta_tree(model: str, **engine_kwargs: Any) -> dict[str, str]:
    """The tree, built in a subprocess; raises RuntimeError with its output on failure."""
    env = dict(os.environ, VLLM_NNSIGHT_DISABLE="1", VLLM_LOGGING_LEVEL="ERROR",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    keep = {k: v for k, v in engine_kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))}
    proc = subprocess.run([sys.executable, "-m", __name__, model, json.dumps(keep)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TREE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"could not build the module tree of {model!r}: {proc.stderr[-2000:]}")
    return {path: cls for path, cls in json.loads(lines[-1][5:])}


if __name__ == "__main__":
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print("TREE " + json.dumps(build(sys.argv[1], **kwargs)))
