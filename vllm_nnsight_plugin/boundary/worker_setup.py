"""The interleaver's :class:`~..engine.worker_setup.WorkerSetup`, read from vLLM's
config and distributed state (the core reads neither)."""

from __future__ import annotations

from typing import Any

from ..engine.worker_setup import StageFacts, WorkerSetup
from . import configuration, parallel, runners


def worker_setup(model: Any, vllm_config: Any) -> WorkerSetup:
    stages = None
    if parallel.pipeline_stages(vllm_config) > 1:  # (every stage records alike)
        stages = StageFacts(absent=frozenset(parallel.absent_modules(model)),
                            last=parallel.pipeline_position()[1],
                            carries=parallel.stages_carry(vllm_config),
                            stand_ins=parallel.stand_in_classes(model))
    return WorkerSetup(settings=configuration.settings(vllm_config), eager=configuration.runs_eager(vllm_config),
                       dtype=configuration.model_dtype(vllm_config), tensor_parallel=parallel.tp_group(),
                       outside_forward=runners.OUTSIDE_FORWARD, stages=stages, call_module=parallel.call_whole,
                       output_structure=parallel.output_structure,
                       refusal=configuration.untraceable(vllm_config))
