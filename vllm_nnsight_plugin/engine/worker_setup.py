"""What the interleaver is told about its worker and engine. The boundary reads it
from vLLM's config and distributed state (``boundary.worker_setup``), so the core
reads neither and a test can build one by hand."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..payload.settings import Settings, settings_of
from .shards import Collectives


@dataclass(frozen=True)
class WorkerSetup:
    settings: Settings = field(default_factory=lambda: settings_of(None))  # the operator's
    eager: bool = True  # Python hooks run on every step (no compiled graphs)
    dtype: Any = None  # the model's activation dtype
    tensor_parallel: Collectives | None = None  # None: one rank
    # top-level modules vLLM calls outside the model's forward (a cache of every module leaves them out)
    outside_forward: frozenset[str] = frozenset()
    # pipeline parallel (None: one stage): the modules other stages run, and how plans reach them
    stages: StageFacts | None = None
    # a block's own call of a module, (module, args, kwargs) -> as the whole model computes it
    # (boundary.parallel.call_whole); None: the module's forward
    call_module: Callable[[Any, tuple, dict], Any] | None = None
    # what a module returns where its forward's annotation does not say: 0 a tensor, N a
    # tuple of N (boundary.parallel.output_structure: vLLM's linears); None: unknown
    output_structure: Callable[[Any], int | None] | None = None
    # why this engine runs no traced request (boundary.configuration.untraceable: speculative
    # decoding); None: it does. The front end refuses them first: this ends those that came round it
    refusal: str | None = None


@dataclass(frozen=True)
class StageFacts:
    absent: frozenset[str]  # modules another stage runs
    last: bool  # this worker runs the last stage
    carries: bool  # plans reach earlier stages' modules (engine/stages.py)
    stand_ins: dict[int, type]  # id(placeholder module) -> the class it stands in for (recording)
