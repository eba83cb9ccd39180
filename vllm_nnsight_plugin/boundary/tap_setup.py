"""The runner's side of taps: at ``load_model`` the tap op goes into the model (on a
compiled engine with taps declared) and vLLM's graph is split there; per step, the
CUDA-graph mode a step needs when a block may touch a tap (:mod:`..engine.taps` is the
op and what it serves)."""

from __future__ import annotations

import logging
from typing import Any

from ..engine import lanes, taps
from . import configuration, runners

SITES = "_nnsight_tap_sites"  # runner attribute: the tapped (path, kind) pairs of its model
_MODE = "_nnsight_tap_mode"  # runner attribute: how a step whose blocks may touch a tap runs


def on_model_loaded(runner: Any) -> None:
    """Runner ``load_model`` epilogue: on a compiled engine with taps declared, put
    the tap op into the model and make vLLM split its graph there."""
    log = logging.getLogger("vllm.nnsight_plugin")
    config = runner.vllm_config
    settings = configuration.settings(config)
    tapset = settings.taps
    if not tapset or configuration.runs_eager(config):
        return
    model = runners.runner_model(runner)
    split = configuration.add_splitting_op(config, taps.OP_NAME)
    if not split:
        log.warning("taps: this engine compiles the model as one graph (no split points); "
                    "tapped steps run without CUDA graphs")
    # how a step whose blocks may touch a tap must run: piecewise graphs (the op runs
    # between pieces) where the graph is split at it, else without graphs
    runner.__dict__[_MODE] = "piecewise" if split else "eager"
    if settings.lanes:
        lanes.enable(configuration.max_graph_batch(config), configuration.max_requests(config))
    sites = taps.install(model, tapset)
    if not sites:
        log.error("taps %s match no module of %s", tapset.describe(), type(model).__name__)
    runner.__dict__[SITES] = sites
    log.info("taps: %d locations (%s)", len(sites), tapset.describe())


def step_graph_mode(runner: Any, inter: Any, scheduled: dict[str, int]) -> str | None:
    """None (vLLM's own choice), or "piecewise"/"eager" when a parked block of this
    step may touch a tap (or a batched spec its lanes cannot serve): the tap op's
    Python must run, so no full CUDA graph. ``inter``: the runner's interleaver (None:
    nothing traced yet); ``scheduled``: tokens per request."""
    if not runner.__dict__.get(SITES) or inter is None or not inter.needs_python(scheduled):
        return None
    return runner.__dict__.get(_MODE, "eager")
