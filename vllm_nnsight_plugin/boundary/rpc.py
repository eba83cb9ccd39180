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


def nnsight_record_table(self: Any) -> dict[str, Any]:
    """What a client records a served trace's blocks against (:func:`.lower.record_table`),
    as this worker's interleaver records them."""
    from ..engine.lower import record_table
    from .worker_setup import worker_setup

    model = self.model_runner.get_model()
    setup = worker_setup(model, self.vllm_config)
    return record_table(model, setup.dtype, setup.stages.stand_ins if setup.stages else None,
                        setup.output_structure)


def nnsight_module_table(self: Any) -> dict[str, Any]:
    """What the front end checks specs against before they reach the engine (see
    :func:`.guards.table`), and the modules other pipeline stages hold."""
    from ..engine.guards import table
    from . import kv_zeroing, parallel

    model = self.model_runner.get_model()
    return {**table(model), "absent": parallel.absent_modules(model),
            "edits_refused": kv_zeroing.refusal(self.model_runner)}


def nnsight_probe(self: Any) -> dict[str, Any]:
    """Proof that the plugin is live in this worker process, and what it prepared at
    model load: the logits' dtype and width and whether the guard's kernel takes them
    (None on a worker that guards no logits with it), how many builds of that
    kernel this process has made, and the KV tensors it zeroes for blocks traced
    requests freed (shape, blocks dimension, kernel blocks per block: :mod:`.kv_zeroing`)."""
    from ..engine import guard_kernel
    from . import patching, runner_v1, runners

    runner_cls = type(self.model_runner)
    v2 = runners.is_v2_runner(self.model_runner)
    names = ("execute_model", "prepare_inputs", "sample", "sample_tokens") if v2 else \
        ("execute_model", "_model_forward", "_sample", "sample_tokens")
    return {
        "pid": os.getpid(),
        "runner": f"{runner_cls.__module__}.{runner_cls.__name__}",
        "v2": v2,
        "logits": self.model_runner.__dict__.get(runner_v1.LOGITS),
        "guard_builds": guard_kernel.builds(),
        "kv_layers": _kv_layers(self.model_runner),
        "patched": all(
            patching.is_patched(cls, name)
            for name in names
            for cls in [next(c for c in runner_cls.__mro__ if name in c.__dict__)]
        ),
    }


def _kv_layers(runner: Any) -> list[list[Any]] | None:
    from .kv_zeroing import layers_of

    layers = layers_of(runner)
    return None if layers is None else [[list(layer.tensor.shape), layer.dim, layer.ratio] for layer in layers]


def nnsight_stats(self: Any) -> dict[str, int]:
    """What the worker holds for traced requests (all zero when none are in flight)."""
    from .runner_v1 import interleaver_of

    inter = interleaver_of(self.model_runner)
    if inter is None:
        return {"sessions": 0, "hooks": 0, "waiters": 0, "results": 0}
    return {
        "sessions": len(inter.sessions),
        "hooks": len(inter.hooks),
        "waiters": sum(len(v) for v in inter.waiters.values()),
        "results": len(inter.results),
    }


def nnsight_lane_stats(self: Any) -> dict[str, int]:
    """Counters since start: location-steps of batched specs served by lanes (inside
    the forward's own kernels) and by Python (the tap op's handler or a hook), code
    blocks run as batched specs (``lowered``: see :mod:`.lower`), edits applied as part of
    a run of like edits with a value each (``joined``: :mod:`.like_edits`), and under tensor
    parallel the split values this rank put together and their bytes (:mod:`.shards`),
    and the passes that zeroed KV blocks traced requests freed, and their blocks
    (:mod:`.kv_zeroing`)."""
    from ..engine import lanes, like_edits, lower, shards
    from . import kv_zeroing

    return {**lanes.STATS, **like_edits.STATS, **lower.STATS, **shards.STATS, **kv_zeroing.STATS}


def nnsight_install_edit(self: Any, edit_id: str, name: str | None, payload: str) -> bool:
    """Install an engine-wide edit (between steps: RPCs never run during a forward)."""
    from . import kv_zeroing
    from .frontend import refuse_untraceable
    from .runner_v1 import interleaver_of

    refuse_untraceable(getattr(self, "vllm_config", None))
    inter = interleaver_of(self.model_runner, create=True)
    inter.edits_refused = kv_zeroing.refusal(self.model_runner)
    inter.install_edit(edit_id, name, payload)
    return True


def nnsight_clear_edits(self: Any, edit_ids: list[str] | None = None) -> int:
    """Remove edits (all when ``edit_ids`` is None); returns how many remain."""
    from .runner_v1 import interleaver_of

    inter = interleaver_of(self.model_runner)
    return inter.clear_edits(edit_ids) if inter is not None else 0


def engine_nnsight_stats(self: Any) -> dict[str, Any]:
    """EngineCore utility: the scheduler's pending results plus every worker's stats."""
    store = getattr(self.scheduler, "__dict__", {}).get("_nnsight_results") or {}
    return {"scheduler_results": len(store), "workers": self.model_executor.collective_rpc("nnsight_stats")}


def install_engine_core(engine_core_cls: type) -> None:
    if "nnsight_stats" not in engine_core_cls.__dict__:
        engine_core_cls.nnsight_stats = engine_nnsight_stats


def install(worker_cls: type) -> None:
    for fn in (nnsight_module_tree, nnsight_record_table, nnsight_module_table, nnsight_probe, nnsight_stats,
               nnsight_lane_stats, nnsight_install_edit, nnsight_clear_edits):
        if fn.__name__ not in worker_cls.__dict__:
            setattr(worker_cls, fn.__name__, fn)
