"""Hooks into vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``), the
CUDA default for dense models since vLLM 0.2x.

V2 has no ``_model_forward``: the forward is inline in ``execute_model``, and
uniform-decode steps replay a full CUDA graph without calling the model at all.
So the step's layout is published from ``prepare_inputs`` (the batch order is
final there, and it runs on every real step), and steps in which a block may
touch a tap are dispatched off full graphs (``dispatch_cg_and_sync_dp``).
V2 keeps no ``SamplingParams`` per request; the interleaver keeps those of the
requests it traces (the finish prediction needs them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine import lanes, stages
from ..engine.rows import StepLayout
from . import kv_blocks, patching, runners, tap_setup
from .runner_v1 import (
    _ATTR,
    _SO,
    _STEADY,
    _load_model,
    admit_step,
    close_step,
    receive_from_stages,
    sample_wrapper,
    send_to_next_stage,
)

_BATCH = "_nnsight_input_batch"  # this step's (InputBatch, v2_batch table), until sample_tokens
_graph_mode: str | None = None  # "piecewise"/"eager" per step (execute_model), read by the dispatch wrap


def _execute_model(original: Callable) -> Callable:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        global _graph_mode
        if kwargs.get("dummy_run"):
            lanes.settle()
            return original(self, scheduler_output, *args, **kwargs)
        kv_blocks.zero_reused_blocks(self, scheduler_output)
        # V2 drops a preempted request's state and later re-sends it as new
        inter = admit_step(self, scheduler_output, runners.preempted_ids(scheduler_output))
        receive_from_stages(self, args, kwargs)
        if inter is None:
            lanes.settle()  # (an untraced step: lanes left from the last traced one are zeroed)
            return original(self, scheduler_output, *args, **kwargs)
        self.__dict__[_SO] = scheduler_output
        _graph_mode = tap_setup.step_graph_mode(self, inter, scheduler_output.num_scheduled_tokens)
        try:
            out = original(self, scheduler_output, *args, **kwargs)
        finally:
            self.__dict__[_SO] = None
            _graph_mode = None
        send_to_next_stage(inter, out)
        return out

    return execute_model


def _prepare_inputs(original: Callable) -> Callable:
    def prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        batch = original(self, scheduler_output, *args, **kwargs)
        inter = self.__dict__.get(_ATTR)
        if self.__dict__.get(_SO) is None or inter is None or not inter.working():
            return batch
        ids = runners.v2_decode_ids(batch)
        last = self.__dict__.get(_STEADY)
        if ids is not None and last is not None and last[0] == ids:
            spans, rows = last[1], last[2]  # a steady decode batch: the last step's layout
            table = runners.v2_batch(self, batch) if inter.stepwise else None
        else:
            spans, rows = {}, {}
            table = runners.v2_batch(self, batch)
            sessions = inter.sessions
            for row, (req_id, start, end, computed, prefill_len, _) in enumerate(table):
                spans[req_id], rows[req_id] = (start, end), row
                if computed < prefill_len and req_id in sessions and (computed > 0 or end < start + prefill_len):
                    inter.prompt_split(req_id, prefill_len, computed, end - start)
            self.__dict__[_STEADY] = (ids, spans, rows) if ids is not None else None
        self.__dict__[_BATCH] = (batch, table)
        inter.begin_step(StepLayout(spans, rows, runners.v2_padded_tokens(batch)))
        if inter.stages is not None:
            stages.serve(inter)  # (what earlier pipeline stages read: served before this stage's modules)
        return batch

    return prepare_inputs


_sample = sample_wrapper(runners.v2_sampled)  # V2's sample() returns (SamplerOutput, ...)


def _sample_tokens(original: Callable) -> Callable:
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        inter = self.__dict__.get(_ATTR)
        kept = self.__dict__.pop(_BATCH, None)
        if inter is None or inter.layout is None or kept is None:
            return out
        layout = inter.layout
        params = inter.params

        finishing = set()
        stepwise = inter.stepwise  # (requests that only steer never park between steps)
        for req_id, start, end, computed, prefill_len, prompt_len in kept[1] if stepwise and kept[1] else ():
            if req_id not in stepwise or req_id not in params or not runners.v2_may_finish(
                    self, params[req_id], computed + end - start, prefill_len, prompt_len):
                continue  # (it cannot finish this step: no walk of its blocks, no token read)
            if inter.between_steps(req_id) and runners.v2_will_finish(
                self, params[req_id], computed + end - start, prefill_len, prompt_len,
                lambda r=req_id: layout.sampled_token(r),
            ):
                finishing.add(req_id)
        close_step(inter, out, finishing)
        return out

    return sample_tokens


def _dispatch(original: Callable) -> Callable:
    """A step whose blocks may touch a tap is kept off full graphs (they would skip the
    tap op): piecewise where a graph without the uniform-decode shortcut is not full,
    else eager. With data parallel each call is an agreement across the ranks (a
    collective every rank makes once per step), so there the step is asked eager in one
    call, and without microbatches where vLLM offers them (a microbatched step picks its
    graph before the ranks' modes count; one rank's no keeps every rank off them): the
    ranks then agree on the lowest mode any rank asked, so all of them run it eager."""
    def dispatch(manager: Any, num_reqs: int, num_tokens: int, uniform_token_count: Any,
                 *args: Any, **kwargs: Any) -> Any:
        if _graph_mode is None:
            return original(manager, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
        dp_size = args[0] if args else kwargs.get("dp_size", 1)
        if _graph_mode == "piecewise" and dp_size == 1:
            out = original(manager, num_reqs, num_tokens, None, *args, **kwargs)
            if not runners.v2_desc_is_full(out[0]):
                return out
        kwargs["need_eager"] = True
        if dp_size > 1 and "allow_ubatching" in kwargs:
            kwargs["allow_ubatching"] = False
        return original(manager, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)

    return dispatch


def install(runner_cls: type) -> None:
    patching.patch_method(runner_cls, "load_model", _load_model)
    patching.patch_method(runner_cls, "execute_model", _execute_model)
    patching.patch_method(runner_cls, "prepare_inputs", _prepare_inputs)
    patching.patch_method(runner_cls, "sample", _sample)
    patching.patch_method(runner_cls, "sample_tokens", _sample_tokens)
    patching.wrap_module_function(runners.v2_runner_module(), patching.V2_GRAPH_DISPATCH, _dispatch)
