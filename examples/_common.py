"""What every example shares: which model, local or served, where files go."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="a local checkpoint or hub id (default: a tiny random-weight Llama, built here)")
    p.add_argument("--serve", metavar="URL", help="trace a running `vllm serve` of the same model instead of a "
                   "local engine (blocks that call modules need the server's code opt-in: VLLM_NNSIGHT_ALLOW_CODE=1)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="the server's --api-key")
    p.add_argument("--out", default="examples/out", help="folder for the pictures and numbers")
    p.add_argument("--dtype", default="auto", help="local engines: the weights' dtype (the tiny model: float32)")
    return p


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from vllm_nnsight_plugin import tiny

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return str(tiny.ensure("llama"))


def open_model(args: argparse.Namespace, **engine: Any) -> tuple[Any, dict[str, Any]]:
    """``(model, trace keywords)``: a local engine, or a GPU-less client of ``--serve``
    whose traces carry ``serve=`` and ``api_key=``."""
    from vllm_nnsight_plugin import VLLM

    path = model_path(args)
    if args.serve:
        return VLLM(path), {"serve": args.serve, "api_key": args.api_key}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    dtype = "float32" if args.dtype == "auto" and not args.model else args.dtype
    return VLLM(path, dispatch=True, dtype=dtype, **{"max_model_len": 1024, **engine}), {}


def out_dir(args: argparse.Namespace) -> Path:
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def walk(envoy: Any, path: str) -> Any:
    """The envoy at a dotted path (``model.layers``) below ``envoy``."""
    for part in path.split("."):
        envoy = getattr(envoy, part)
    return envoy


def architecture(model: Any) -> str:
    return next(iter(model.meta_tree().values()))
