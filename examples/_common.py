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


def heatmap(path: Path, values: Any, columns: list[str], title: str, xlabel: str, colour: str,
            cmap: str = "viridis", limits: tuple[float, float] | None = None,
            cells: list[list[str]] | None = None) -> None:
    """A layers × positions picture (layer 0 at the bottom), saved as a PNG;
    ``cells``: text written in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = values.numpy() if hasattr(values, "numpy") else values
    layers, positions = values.shape
    low, high = limits if limits is not None else (float(values.min()), float(values.max()))
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * positions, 1.0 + 0.5 * layers))
    im = ax.imshow(values, aspect="auto", cmap=cmap, vmin=low, vmax=high, origin="lower")
    for i, row in enumerate(cells or ()):
        for j, text in enumerate(row):
            dark = values[i, j] < low + 0.6 * (high - low)
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(positions), columns, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(layers), [str(i) for i in range(layers)])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=colour)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
