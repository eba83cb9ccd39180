"""Taps: module locations that stay readable and editable in a compiled engine.

vLLM's default engine runs ``torch.compile``d code replayed as CUDA graphs, where
Python hooks never run. A tap puts one opaque custom op, ``nnsight::tap``, into
the model's forward at a declared location before the first compile trace. vLLM
splits its compiled graph at the op (it is added to ``splitting_ops``), so the
op runs eagerly between two CUDA-graph pieces, on the pieces' own static
buffers: reading saves the live values, in-place edits land in the memory the
next piece reads. Steps with no parked block at a tap keep vLLM's own choice of
graphs (full graphs for decode); steps with one run piecewise (see
``runner_v1``/``runner_v2``), so the op is never skipped.

Declared as globs over module paths (``*`` is one path segment), optionally
ending in ``.output`` or ``.input`` (both when absent):
``VLLM(path, taps=["model.layers.*.output"])`` or, for a server,
``--additional-config '{"nnsight": {"taps": ["model.layers.*.output"]}}'``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..payload.tapset import TapSet, from_settings
from . import lanes

OP_NAME = "nnsight::tap"
__all__ = ["TapSet", "from_settings", "install"]

_handler: Callable[[str, list[torch.Tensor]], None] | None = None


def set_handler(handler: Callable[[str, list[torch.Tensor]], None] | None) -> None:
    """The worker's interleaver: called with ``(site, tensors)`` on every tap."""
    global _handler
    _handler = handler


def _tap(xs: list[torch.Tensor], site: str) -> None:
    """Hand the live tensors of a location to the interleaver (which may edit them
    in place). Opaque to the compiler: vLLM splits its graph here. The site's
    lanes (batched specs, also inside full CUDA graphs) run first."""
    lanes.guarded_run(site, xs)
    if _handler is not None:
        try:
            _handler(site, xs)
        except Exception:  # noqa: BLE001 - never break vLLM's forward; parked blocks then fail as unreached
            logging.getLogger("vllm.nnsight_plugin").exception("tap %s failed", site)


def _tap_fake(xs: list[torch.Tensor], site: str) -> None:
    return None


@functools.cache
def register_op() -> None:
    """Define ``nnsight::tap`` (once per process, only where a model is tapped)."""
    op = torch.library.custom_op(OP_NAME, mutates_args=("xs",))(_tap)
    op.register_fake(_tap_fake)


# ----------------------------------------------------------------- in the model


def flatten(value: Any) -> tuple[str, list[torch.Tensor]] | None:
    """A flat code for a module value: ``T`` (a tensor) or ``(TN...`` (a tuple/list
    of tensors and Nones), plus its tensors. Anything else cannot be tapped."""
    if isinstance(value, torch.Tensor):
        return "T", [value]
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in value):
        code = ("(" if isinstance(value, tuple) else "[") + "".join("N" if v is None else "T" for v in value)
        return code, [v for v in value if v is not None]
    return None


def rebuild(code: str, xs: list[torch.Tensor]) -> Any:
    """The module value a tap site saw, from its code and tensors (no copies)."""
    if code == "T":
        return xs[0]
    it = iter(xs)
    items = [None if c == "N" else next(it) for c in code[1:]]
    return tuple(items) if code[0] == "(" else items


class TapSite(NamedTuple):
    """A tap site: the op's string argument ``"path|kind|code"``, parsed (once per
    site: the interleaver keeps each site's location key)."""

    path: str  # the module's path
    kind: str  # "output" or "input"
    code: str  # how the value is built from the op's tensors (see flatten)


def _site(path: str, kind: str, code: str) -> str:
    return f"{path}|{kind}|{code}"


def parse_site(site: str) -> TapSite:
    path, kind, code = site.split("|")
    return TapSite(path, kind, code)


def install(model: torch.nn.Module, taps: TapSet) -> list[tuple[str, str]]:
    """Put the tap op at every tapped location of ``model`` (before compilation).
    Returns the tapped ``(path, kind)`` sites."""
    register_op()
    sites = taps.sites(name for name, _ in model.named_modules())
    modules = dict(model.named_modules())
    for path, kind in sites:
        module = modules[path]
        if getattr(module, "_nnsight_tapped_" + kind, False):
            continue
        setattr(module, "_nnsight_tapped_" + kind, True)
        if kind == "output":
            module.register_forward_hook(_output_hook(path))
        else:
            module.register_forward_pre_hook(_input_hook(path), with_kwargs=True)
    return sites


def _output_hook(path: str) -> Callable:
    def hook(module: Any, args: Any, output: Any) -> None:
        found = flatten(output)
        if found is not None:
            code, xs = found
            torch.ops.nnsight.tap(xs, _site(path, "output", code))

    return hook


def _input_hook(path: str) -> Callable:
    def hook(module: Any, args: Any, kwargs: Any) -> None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor):
            torch.ops.nnsight.tap([first], _site(path, "input", "T"))

    return hook
