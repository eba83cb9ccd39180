"""The scheduler's side (EngineCore process): stopping a request, its outputs, the
waiting queue, the requests freed since the last ``schedule()``, the block pool.
"""

from __future__ import annotations

from typing import Any

from ..payload import request_args
from ..payload.errors import PayloadError
from ..payload.keys import STREAM_KEY


def stop_request(request: Any, reason: str) -> None:
    from vllm.v1.request import RequestStatus

    request.status = RequestStatus.FINISHED_STOPPED
    request.stop_reason = reason


def streams_saves(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    try:
        return request_args.flag(getattr(params, "extra_args", None) or {}, STREAM_KEY, False)  # (per step)
    except PayloadError:  # (refused by the front end; the worker fails such a request at admission)
        return False


def has_stop_strings(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    return bool(params is not None and params.stop)


def iter_engine_outputs(outputs: dict) -> Any:
    for batch in outputs.values():
        yield from batch.outputs


def stamp(engine_core_output: Any, key: str, value: Any) -> None:
    params = dict(engine_core_output.kv_transfer_params or {})
    params[key] = value
    engine_core_output.kv_transfer_params = params


# the scheduler's queues of waiting requests, across vLLM versions (0.26: skipped_waiting;
# 0.32: kv_holding_waiting); tests/test_vllm_boundary.py checks the installed one has no other
WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")


def waiting_requests(scheduler: Any) -> list[Any]:
    """The requests waiting to be scheduled (the queues vLLM's schedule() admits from)."""
    out: list[Any] = []
    for name in WAITING_QUEUES:
        queue = getattr(scheduler, name, None)
        if queue:
            out.extend(queue)
    return out


def finished_since_schedule(scheduler: Any) -> set[str]:
    """Ids of the requests the scheduler freed since its last ``schedule()`` (finished,
    stopped or aborted; it empties the set at the end of ``schedule()``)."""
    return scheduler.finished_req_ids


def scheduler_block_pool(scheduler: Any) -> Any:
    manager = getattr(scheduler, "kv_cache_manager", None)
    return getattr(manager, "block_pool", None)
