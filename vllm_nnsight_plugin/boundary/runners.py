"""The model runners' state (V1 ``GPUModelRunner`` and Model Runner V2): a step's
requests and rows, which requests may finish, where results ride the runner output.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from .patching import _MARK, RUNNER_V2

# top-level modules vLLM calls outside the model's forward (compute_logits, sampling):
# a cache of every module leaves them out
OUTSIDE_FORWARD = frozenset({"lm_head", "logits_processor", "sampler"})


def guard_v1_dispatcher(runner: Any, wanted: Callable[[], str | None]) -> None:
    """Wrap a V1 runner's CUDA-graph dispatcher: while ``wanted()`` says "piecewise",
    full graphs (which would skip the tap op) are excluded; "eager" excludes graphs."""
    disp = getattr(runner, "cudagraph_dispatcher", None)
    if disp is None or getattr(disp.dispatch, _MARK, False):
        return
    from vllm.config import CUDAGraphMode

    original = disp.dispatch

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        want = wanted()
        if want and kwargs.get("valid_modes") is None:  # (a given valid set: forced eager / DP sync)
            if want == "eager":
                kwargs["valid_modes"] = {CUDAGraphMode.NONE}
            else:
                kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
        return original(*args, **kwargs)

    setattr(dispatch, _MARK, True)
    disp.dispatch = dispatch


def v2_desc_is_full(batch_desc: Any) -> bool:
    mode = getattr(batch_desc, "cg_mode", None)
    return getattr(mode, "name", "") == "FULL"


class NewRequest(NamedTuple):
    """A request the scheduler sends the runner for the first time this step."""

    req_id: str
    extra_args: dict | None  # its SamplingParams' extra_args (where a payload rides)
    params: Any  # its SamplingParams (None for a pooling request)


def new_requests_with_params(scheduler_output: Any) -> list[NewRequest]:
    """The step's new requests."""
    out = []
    for new in scheduler_output.scheduled_new_reqs:
        params = new.sampling_params
        out.append(NewRequest(new.req_id, getattr(params, "extra_args", None) if params is not None else None, params))
    return out


def preempted_ids(scheduler_output: Any) -> set[str]:
    """Requests preempted this step (V2 drops their state and re-sends them as new)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def finished_ids(scheduler_output: Any) -> set[str]:
    return scheduler_output.finished_req_ids


def resumed_ids(scheduler_output: Any) -> set[str]:
    cached = scheduler_output.scheduled_cached_reqs
    return set(getattr(cached, "resumed_req_ids", ()) or ())


class V1Row(NamedTuple):
    """A request's part of a V1 runner step."""

    req_id: str
    scheduled: int  # tokens this step
    computed: int  # tokens computed before it
    prompt_len: int


class V2Row(NamedTuple):
    """A request's row of a Model Runner V2 step."""

    req_id: str
    start: int  # its first token's row of the flat batch
    end: int
    computed: int  # tokens computed before this step
    prefill_len: int  # tokens to compute before it samples
    prompt_len: int


def v1_batch(runner: Any, scheduler_output: Any) -> list[V1Row]:
    """The step's requests in flat-batch order."""
    sched = scheduler_output.num_scheduled_tokens
    out = []
    for req_id in runner.input_batch.req_ids:
        state = runner.requests[req_id]
        prompt = state.prompt_token_ids
        out.append(V1Row(req_id, sched[req_id], state.num_computed_tokens, len(prompt) if prompt is not None else 0))
    return out


def v1_decode_ids(runner: Any, scheduler_output: Any) -> list[str] | None:
    """The request ids of a V1 step in which every row decodes one token (no prompt
    rows, no draft tokens), else None: such a step has the layout of the last one when
    the ids are the same, in the same order (as :func:`v2_decode_ids`)."""
    batch = runner.input_batch
    n = batch.num_reqs
    if scheduler_output.total_num_scheduled_tokens != n \
            or not (batch.num_computed_tokens_cpu[:n] >= batch.num_prompt_tokens[:n]).all():
        return None
    return batch.req_ids[:n]  # (a copy: the batch's own list changes in place)


def will_finish(runner: Any, req_id: str, sampled: Callable[[], int]) -> bool:
    """Whether the token sampled this step ends the request (as the scheduler's
    stop check will decide). Stop strings are only seen by the front end.
    ``sampled()`` reads this step's token when async scheduling left a placeholder."""
    state = runner.requests.get(req_id)
    if state is None or not state.output_token_ids:
        return False
    out = state.output_token_ids
    prompt = len(state.prompt_token_ids or ())
    return _stops(state.sampling_params, len(out), prompt + len(out), runner.max_model_len,
                  lambda: out[-1] if out[-1] >= 0 else sampled())


def may_stop(params: Any, outputs: int, total: int, max_model_len: int) -> bool:
    """Whether :func:`_stops` can be true for these counts: False means it is not,
    without reading this step's token (most traced requests, most steps: one
    comparison each instead of a walk of their blocks)."""
    if params is None:
        return False
    if (params.max_tokens is not None and outputs >= params.max_tokens) or total >= max_model_len:
        return True
    if outputs < (params.min_tokens or 0):
        return False
    return params.eos_token_id is not None or bool(params.stop_token_ids)


def may_finish(runner: Any, req_id: str) -> bool:
    """:func:`may_stop` for a V1 runner's request."""
    state = runner.requests.get(req_id)
    if state is None or not state.output_token_ids:
        return False
    n = len(state.output_token_ids)
    return may_stop(state.sampling_params, n, len(state.prompt_token_ids or ()) + n, runner.max_model_len)


def _stops(params: Any, outputs: int, total: int, max_model_len: int, last: Callable[[], int]) -> bool:
    """The scheduler's stop check for ``outputs`` tokens (``total`` with the prompt);
    ``last()`` (the newest token) is read only when a stop token could match."""
    if params is None:
        return False
    if params.max_tokens is not None and outputs >= params.max_tokens:
        return True
    if total >= max_model_len:
        return True
    if outputs < (params.min_tokens or 0):
        return False
    # the tokens check_stop ends on: eos (None under ignore_eos) and stop_token_ids; not
    # all_stop_token_ids, which also holds the eos ids kept only for min_tokens masking
    eos = params.eos_token_id
    stops = params.stop_token_ids or ()
    if eos is None and not stops:
        return False  # no stop token to check: no device->host read (keeps async scheduling)
    token = last()
    return token == eos or token in stops


def is_v2_runner(runner: Any) -> bool:
    mod = sys.modules.get(RUNNER_V2[0])
    return mod is not None and isinstance(runner, getattr(mod, RUNNER_V2[1]))


def v2_runner_module() -> Any:
    return sys.modules[RUNNER_V2[0]]


def v2_batch(runner: Any, batch: Any) -> list[V2Row]:
    """Each row of a V2 ``InputBatch`` (its order is rebuilt every step: decodes
    first). Whole arrays to Python at once: this runs every step over every row."""
    n = batch.num_reqs
    qsl = batch.query_start_loc_np[: n + 1].tolist()
    prompt = runner.req_states.prompt_len.np[batch.idx_mapping_np[:n]].tolist()
    return list(map(V2Row._make, zip(batch.req_ids[:n], qsl[:-1], qsl[1:], batch.num_computed_tokens_np[:n].tolist(),
                                     batch.prefill_len_np[:n].tolist(), prompt)))


def v2_decode_ids(batch: Any) -> list[str] | None:
    """The request ids of a V2 ``InputBatch`` in which every row decodes one token (no
    prompt rows, no draft tokens), else None. Such a step has the layout of the last
    one when the ids are the same, in the same order."""
    n = batch.num_reqs
    if batch.num_tokens != n or not (batch.num_computed_tokens_np[:n] >= batch.prefill_len_np[:n]).all():
        return None
    return batch.req_ids[:n]


def v2_padded_tokens(batch: Any) -> int:
    return int(batch.num_tokens_after_padding)


def v2_sampled(sample_result: Any) -> Any:
    """``sampled_token_ids`` ([num_reqs, 1], device) of V2's ``sample()`` result."""
    return sample_result[0].sampled_token_ids


def v2_will_finish(runner: Any, params: Any, computed_after: int, prefill_len: int, prompt_len: int,
                   sampled: Callable[[], int]) -> bool:
    """As :func:`will_finish`, from V2's arrays (no per-request Python state there)."""
    if computed_after < prefill_len:  # a prefill chunk samples nothing
        return False
    return _stops(params, computed_after + 1 - prompt_len, computed_after + 1, runner.max_model_len, sampled)


def v2_may_finish(runner: Any, params: Any, computed_after: int, prefill_len: int, prompt_len: int) -> bool:
    """:func:`may_stop` from V2's arrays."""
    return computed_after >= prefill_len and may_stop(params, computed_after + 1 - prompt_len, computed_after + 1,
                                                      runner.max_model_len)


def runner_model(runner: Any) -> Any:
    return runner.get_model()


def attach_results(model_runner_output: Any, results: dict) -> None:
    """Results ride the runner output as an extra attribute (pickles with it)."""
    target = _inner_output(model_runner_output)
    if target is None or type(target).__name__ != "ModelRunnerOutput":
        return
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if target is EMPTY_MODEL_RUNNER_OUTPUT:
        return
    target.nnsight = results


def attach_late_results(runner_output: Any, late: Callable[[], dict]) -> None:
    """Results known only once the device has finished the step: merged in where vLLM
    takes an asynchronous output (``get_output``, after its own wait for the step's
    sampled tokens, which the results' copies precede on the stream), else now."""
    def merge(output: Any) -> Any:
        found = late()
        if found:
            results = take_results(_inner_output(output)) or {}
            for req_id, update in found.items():  # (an error the step recorded first stays;
                entry = results.setdefault(req_id, {})  # a step's entry says "error": None)
                for key, value in update.items():
                    if entry.get(key) is None:
                        entry[key] = value
            attach_results(output, results)
        return output

    get_output = getattr(runner_output, "get_output", None)
    if get_output is None:
        merge(runner_output)
        return
    # (on this instance only; vLLM may call it from its output thread.) The wrapper must
    # not hold the output: the output holding it would make a cycle, and every step's
    # output (its token lists, pinned buffers) would wait for Python's collector, a
    # young collection every few steps
    method = getattr(get_output, "__func__", None)
    try:
        owner = weakref.ref(runner_output) if getattr(get_output, "__self__", None) is runner_output else None
    except TypeError:  # (an output type without weak references: the cycle, left to the collector)
        owner = None
    if method is not None and owner is not None:
        runner_output.get_output = lambda: merge(method(owner()))
    else:
        runner_output.get_output = lambda: merge(get_output())


def _inner_output(runner_output: Any) -> Any:
    for attr in ("_model_runner_output", "model_runner_output"):  # async-scheduling wrappers
        inner = getattr(runner_output, attr, None)
        if inner is not None:
            return inner
    return runner_output


def intermediate_tensors_of(runner_output: Any) -> dict[str, Any] | None:
    """The tensors an earlier pipeline stage's ``execute_model`` hands the next stage
    (an ``IntermediateTensors``); None for any other output."""
    tensors = getattr(runner_output, "tensors", None)
    return tensors if isinstance(tensors, dict) else None


def take_results(model_runner_output: Any) -> dict | None:
    return getattr(model_runner_output, "nnsight", None)
