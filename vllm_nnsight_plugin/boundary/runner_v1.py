"""Hooks into vLLM's V1 model runner (also the CPU runner, which subclasses it).

Four wraps, each a no-op unless a traced request is in the engine:

- ``execute_model``: admit new traced requests, drop finished ones.
- ``_model_forward``: the batch layout is final here; publish it, start blocks.
- ``_sample``: serve and edit ``model.samples`` in the sampler's output.
- ``sample_tokens``: close the step and attach results to the runner output.

``model.logits`` comes from a wrap of the model's ``compute_logits`` (eager in
every mode, outside CUDA graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..engine import finite_logits, lanes, stages
from ..engine.interleave import Interleaver
from ..engine.rows import StepLayout
from ..payload import codec
from . import configuration, kv_blocks, kv_zeroing, parallel, patching, runners, tap_setup
from .worker_setup import worker_setup

logger = logging.getLogger("vllm.nnsight_plugin")

_ATTR = "_nnsight_interleaver"
_SO = "_nnsight_scheduler_output"
# the last decode-only step's (request ids, spans, rows): a step with the same ids reuses
# them (spans and rows are never changed once published), so a steady batch is not walked
_STEADY = "_nnsight_steady_layout"


def interleaver_of(runner: Any, create: bool = False) -> Interleaver | None:
    """The runner's interleaver (made on first need; every pipeline stage has one)."""
    inter = runner.__dict__.get(_ATTR)
    if inter is None and create:
        model = runners.runner_model(runner)
        inter = Interleaver(model, worker_setup(model, runner.vllm_config), runner.__dict__.get(tap_setup.SITES, ()))
        _wrap_compute_logits(model, inter)
        runner.__dict__[_ATTR] = inter
    return inter


def _wrap_compute_logits(model: Any, inter: Interleaver) -> None:
    original = model.compute_logits

    def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        logits = original(hidden_states, *args, **kwargs)
        layout = inter.layout
        # once per step: later calls (prompt logprobs, drafts) are not the sampled rows
        if layout is not None and not layout.logits_seen:
            layout.logits_seen = True
            if inter.waiters.get(("logits",)) or ("logits",) in inter.batched.at:
                inter.serve(("logits",), logits, row_based=True)
            inter.guard_logits(logits)
            inter.keep_logits(logits)
        return logits

    model.compute_logits = compute_logits


def admit_step(runner: Any, scheduler_output: Any, recomputed: Iterable[str]) -> Interleaver | None:
    """A step's admission, for both runners: drop finished requests, fail the
    ``recomputed`` ones whose state cannot be replayed, admit new traced requests
    (every new request while engine-wide edits are installed). The interleaver when
    the step has traced work, else None (the step runs untouched)."""
    new = runners.new_requests_with_params(scheduler_output)
    traced = [r for r in new if r.extra_args and codec.PAYLOAD_KEY in r.extra_args]
    inter = interleaver_of(runner, create=bool(traced))
    if inter is None:
        return None
    inter.finish(runners.finished_ids(scheduler_output))
    for req_id in recomputed:
        inter.preempted(req_id)
    inter.edits_refused = kv_zeroing.refusal(runner)
    for r in new if inter.edits else traced:
        inter.admit(r.req_id, r.extra_args, r.params)
    return inter if inter.working() else None


def close_step(inter: Interleaver, runner_output: Any, finishing: set[str]) -> None:
    """End the interleaver's step; its results ride the runner's output."""
    results = inter.end_step(finishing)
    if results:
        runners.attach_results(runner_output, results)
    late = inter.late_checks()
    if late is not None:
        runners.attach_late_results(runner_output, late)


def _execute_model(original: Callable) -> Callable:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        kv_blocks.zero_reused_blocks(self, scheduler_output)
        inter = admit_step(self, scheduler_output, runners.resumed_ids(scheduler_output))
        receive_from_stages(self, args, kwargs)
        if inter is None:
            return original(self, scheduler_output, *args, **kwargs)
        self.__dict__[_SO] = scheduler_output
        try:
            out = original(self, scheduler_output, *args, **kwargs)
        finally:
            self.__dict__[_SO] = None
        send_to_next_stage(inter, out)
        return out

    return execute_model


def receive_from_stages(runner: Any, args: tuple, kwargs: dict) -> None:
    """Pipeline parallel, a step's start: what earlier stages sent (popped from the
    intermediate tensors whenever this stage traces at all: vLLM copies every entry)."""
    inter = runner.__dict__.get(_ATTR)
    if inter is not None and inter.stages is not None:
        received = args[0] if args else kwargs.get("intermediate_tensors")
        stages.receive(inter, parallel.take_carried(received, stages.PREFIX) or {})


def send_to_next_stage(inter: Interleaver, runner_output: Any) -> None:
    """Pipeline parallel, an earlier stage's step end (see :func:`.stages.send_on`)."""
    if inter.stages is not None and not inter.stages.last:
        stages.send_on(inter, runners.intermediate_tensors_of(runner_output))


def _model_forward(original: Callable) -> Callable:
    def model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        so = self.__dict__.get(_SO)
        inter = self.__dict__.get(_ATTR)
        if so is None or inter is None or not inter.working():
            lanes.settle()  # (an untraced step: lanes left from the last traced one are zeroed)
            return original(self, *args, **kwargs)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("positions")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        decode = runners.v1_decode_ids(self, so)
        last = self.__dict__.get(_STEADY)
        if decode is not None and last is not None and last[0] == decode:
            spans, rows = last[1], last[2]  # a steady decode batch: the last step's layout
            start = len(spans)  # (one token each)
        else:
            spans, rows = {}, {}
            start = 0
            for row, (req_id, scheduled, computed, prompt_len) in enumerate(runners.v1_batch(self, so)):
                spans[req_id] = (start, start + scheduled)
                rows[req_id] = row
                start += scheduled
                if req_id in inter.sessions and computed < prompt_len:
                    if computed > 0 or scheduled < prompt_len - computed:
                        inter.prompt_split(req_id, prompt_len, computed, scheduled)
            self.__dict__[_STEADY] = (decode, spans, rows) if decode is not None else None
        num_tokens = int(ids.shape[0]) if ids is not None else start
        inter.begin_step(StepLayout(spans, rows, num_tokens))
        if inter.stages is not None:
            stages.serve(inter)  # (what earlier pipeline stages read: served before this stage's modules)
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM's own error, in a step blocks took part in
            if not inter.abort_step(exc):
                raise  # nothing traced ran in this step: the error is not an intervention's
            logger.warning("vLLM raised %s in a step with interventions; running it again without them",
                           type(exc).__name__)
            return original(self, *args, **kwargs)

    return model_forward


def sample_wrapper(sampled_ids: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    """Wrap a runner's sampling method: ``model.samples`` is served (and may be edited)
    in ``sampled_ids(result)``, the sampled token ids, before anything reads them."""
    def make(original: Callable) -> Callable:
        def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            inter = self.__dict__.get(_ATTR)
            if inter is not None and inter.layout is not None:
                ids = inter.layout.sampled = sampled_ids(out)
                if inter.waiters.get(("samples",)):
                    inter.serve(("samples",), ids, row_based=True)
            return out

        return sample

    return make


_sample = sample_wrapper(lambda out: out.sampled_token_ids)


def _sample_tokens(original: Callable) -> Callable:
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        inter = self.__dict__.get(_ATTR)
        if inter is not None and inter.layout is not None:
            layout = inter.layout
            stepwise = inter.stepwise  # (requests that only steer never park between steps)
            finishing = {
                r for r in (layout.spans if stepwise else ())
                if r in stepwise and runners.may_finish(self, r) and inter.between_steps(r)
                and runners.will_finish(self, r, lambda r=r: layout.sampled_token(r))
            }
            close_step(inter, out, finishing)
        return out

    return sample_tokens


_GRAPHS = "_nnsight_graph_mode"  # set while V1 picks this step's CUDA-graph mode
LOGITS = "_nnsight_logits_format"  # (dtype name, width, whether the guard's kernel takes them)


def _load_model(original: Callable) -> Callable:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        tap_setup.on_model_loaded(self)
        _prepare_logits_guard(self)
        if self.__dict__.get(tap_setup.SITES) and not runners.is_v2_runner(self):
            runners.guard_v1_dispatcher(self, lambda: self.__dict__.get(_GRAPHS))
        return out

    return load_model


def _prepare_logits_guard(runner: Any) -> None:
    """At load, before CUDA graphs are captured (the guard runs outside them): build the
    guard's kernel for the logits this worker will check. Only the last pipeline stage
    makes logits, and only the first tensor-parallel rank launches the kernel (the
    others make their rows finite with torch ops: vLLM reads rank 0's outputs alone)."""
    fmt = configuration.logits_format(runner.vllm_config)
    if fmt is None or not parallel.pipeline_position()[1] or parallel.tp_world()[1] != 0:
        return
    kernel = finite_logits.prepare(getattr(runner, "device", "cpu"), *fmt)
    runner.__dict__[LOGITS] = (str(fmt[0]), fmt[1], kernel)


def _determine_batch_execution(original: Callable) -> Callable:
    def determine(self: Any, *args: Any, **kwargs: Any) -> Any:
        so = self.__dict__.get(_SO)
        mode = None if so is None else tap_setup.step_graph_mode(self, self.__dict__.get(_ATTR),
                                                                 so.num_scheduled_tokens)
        if mode is None:
            return original(self, *args, **kwargs)
        self.__dict__[_GRAPHS] = mode  # read by the dispatcher guard
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__[_GRAPHS] = None

    return determine


def install_load_model(runner_cls: type) -> None:
    patching.patch_method(runner_cls, "load_model", _load_model)


def install(runner_cls: type) -> None:
    install_load_model(runner_cls)
    if hasattr(runner_cls, patching.V1_GRAPH_DISPATCH):
        patching.patch_method(runner_cls, patching.V1_GRAPH_DISPATCH, _determine_batch_execution)
    patching.patch_method(runner_cls, "execute_model", _execute_model)
    patching.patch_method(runner_cls, "_model_forward", _model_forward)
    patching.patch_method(runner_cls, "_sample", _sample)
    patching.patch_method(runner_cls, "sample_tokens", _sample_tokens)
