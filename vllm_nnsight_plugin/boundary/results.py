"""Results onto vLLM's own output path (EngineCore process).

The worker attaches each step's results to its ``ModelRunnerOutput``. Here, in
the scheduler's ``update_from_output``, they are merged per request and stamped
on the request's final ``EngineCoreOutput`` as ``kv_transfer_params["nnsight"]``
(the one free-form per-request field that reaches ``RequestOutput`` and the
OpenAI JSON). The worker has already encoded the saves (tensor data as raw
bytes, which msgpack carries as they are): this hot loop only forwards them; the
OpenAI server makes them base64 in its own process (``server_streams``). A block
that failed or called ``tracer.stop()`` stops its request in the same step; other
requests are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..payload import codec
from . import engine_core, patching, runners

logger = logging.getLogger("vllm.nnsight_plugin")

_STORE = "_nnsight_results"
_HALTING = "_nnsight_halting"  # ids whose block failed or stopped: their requests stop
_OVERRIDE = patching.SCHEDULER_REQUEST_UPDATE  # vLLM's per-request update, wrapped per instance


def _store(scheduler: Any) -> dict[str, dict[str, Any]]:
    store = scheduler.__dict__.get(_STORE)
    if store is None:
        store = scheduler.__dict__[_STORE] = {}
    return store


def merge(store: dict[str, dict[str, Any]], step_results: dict[str, dict[str, Any]],
          halting: set[str]) -> None:
    """Fold a step's results into the store; ids whose block failed or stopped join
    ``halting``."""
    for req_id, update in step_results.items():
        entry = store.setdefault(req_id, {"saves": {}, "warnings": []})
        if "saves" in update:
            entry["saves"] = update["saves"]
            entry["dirty"] = True
            changed = update.get("changed", list(update["saves"]))
            entry["step_saves"] = {n: update["saves"][n] for n in changed if n in update["saves"]}
            entry["step"] = update.get("step", 0)
        for key in ("error", "done", "stop", "pending", "ran_as"):
            if key in update and not (key == "error" and entry.get("error")):  # (an error stays)
                entry[key] = update[key]
        if update.get("warnings"):
            entry["warnings"] = update["warnings"]
        if entry.get("error") or entry.get("stop"):
            halting.add(req_id)


def finalize(entry: dict[str, Any]) -> dict[str, Any]:
    """The JSON-safe results of a finished request."""
    error = entry.get("error")
    warnings = list(entry.get("warnings") or [])
    pending = entry.get("pending")
    if error is None and pending and not entry.get("done") and not entry.get("stop"):
        warnings.append(
            f"the request ended while the block waited for {pending['desc']} (e.g. a stop string or "
            "an abort), so the block did not run to its end; values saved so far are returned"
        )
    return codec.results_of(entry.get("saves") or {}, error, warnings, entry.get("ran_as"))  # encoded by the worker


def _update_from_output(original: Callable) -> Callable:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        step_results = runners.take_results(model_runner_output)
        store = self.__dict__.get(_STORE)
        if step_results:
            store = _store(self)
            merge(store, step_results, self.__dict__.setdefault(_HALTING, set()))
        if not store:
            return original(self, scheduler_output, model_runner_output)
        halting = self.__dict__.get(_HALTING)
        if halting:
            halting.intersection_update(store)
        if halting:  # this step only: untraced steps keep vLLM's own per-request update
            self.__dict__[_OVERRIDE] = _halting_update(
                getattr(type(self), _OVERRIDE).__get__(self), halting, store)
        try:
            outputs = original(self, scheduler_output, model_runner_output)
        finally:
            self.__dict__.pop(_OVERRIDE, None)
        finished = engine_core.finished_since_schedule(self)
        # only requests with fresh results or that just finished have anything to stamp:
        # a steady batch of traced requests costs no walk of the step's outputs
        if step_results or not finished.isdisjoint(store):
            _stamp_outputs(self, outputs, store, halting)
        if finished:  # (also forgets requests aborted since: they are no longer scheduled)
            for req_id in [r for r in store if r not in self.requests]:
                del store[req_id]
                if halting:
                    halting.discard(req_id)
        return outputs

    return update_from_output


def _stamp_outputs(scheduler: Any, outputs: Any, store: dict[str, dict[str, Any]], halting: set[str] | None) -> None:
    """Stamp the results of this step's outputs: a finished request's final results, a
    streaming request's saves of this step, the latest results of a request with stop
    strings (the front end, not the scheduler, may end it)."""
    for eco in engine_core.iter_engine_outputs(outputs):
        entry = store.get(eco.request_id)
        if entry is None:
            continue
        if eco.finish_reason is not None:
            if halting:
                halting.discard(eco.request_id)
            final = finalize(store.pop(eco.request_id))
            final["final"] = True
            engine_core.stamp(eco, codec.PAYLOAD_KEY, final)
        elif entry.pop("dirty", False):
            request = scheduler.requests.get(eco.request_id)
            step_saves = entry.pop("step_saves", None)
            if request is not None and engine_core.streams_saves(request):
                # per-step delivery: what the block saved during this step
                partial = codec.results_of(step_saves or {}, entry.get("error"), [])
                partial["step"] = entry.get("step", 0)
                engine_core.stamp(eco, codec.PAYLOAD_KEY, partial)
            elif request is not None and engine_core.has_stop_strings(request):
                # Stop strings end requests in the front end, where this scheduler
                # never sees the finish: keep the latest results on every output.
                engine_core.stamp(eco, codec.PAYLOAD_KEY, finalize(entry))


def _halting_update(update: Callable, halting: set[str], store: dict[str, dict[str, Any]]) -> Callable:
    """vLLM's per-request update, stopping the requests in ``halting`` (their block
    failed or called ``tracer.stop()``) in this step. Installed on the scheduler
    instance only for a step that has such a request: a wrapper on every request of
    every step would cost the untraced traffic a Python call each."""
    def update_request_with_output(request: Any, new_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        new_token_ids, stopped = update(request, new_token_ids, *args, **kwargs)
        if not stopped and request.request_id in halting:
            errored = store.get(request.request_id, {}).get("error")
            engine_core.stop_request(request, "nnsight_error" if errored else "nnsight_stop")
            stopped = True
        return new_token_ids, stopped

    return update_request_with_output


def install(scheduler_cls: type) -> None:
    patching.patch_method(scheduler_cls, "update_from_output", _update_from_output)
