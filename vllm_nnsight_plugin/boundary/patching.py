"""Where vLLM's patched classes live, the one list of methods this package wraps
(:data:`PATCHED`, checked against the installed vLLM by tests/test_vllm_boundary.py),
and the post-import hook that wraps them when vLLM imports their module (loading the
plugin never imports vLLM's heavy runner into a process that does not run it).
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


SINGLE_TYPE_MANAGER = ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager")
KV_MANAGER_DROP = "_remove_blocks_in_range"  # (request_id, first, last): blocks a running request no longer reads


BLOCK_POOL_ALLOCATE = "get_new_blocks"  # (num_blocks) -> blocks: the only fresh allocation


SCHEDULER_REQUEST_UPDATE = "_update_request_with_output"  # per request per step: (new ids, stopped)


INPUT_PROCESSOR = ("vllm.v1.engine.input_processor", "InputProcessor")


WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")


ENGINE_CORE = ("vllm.v1.engine.core", "EngineCore")


REQUEST_OUTPUT = ("vllm.outputs", "RequestOutput")
COMPLETION_OUTPUT = ("vllm.outputs", "CompletionOutput")  # (gets a property, no wrapped method)


# msgpack between processes: decode(frames), frames[0] the message, the rest tensor data
MSGPACK_DECODER = ("vllm.v1.serial_utils", "MsgpackDecoder")


OUTPUT_PROCESSOR = ("vllm.v1.engine.output_processor", "OutputProcessor")  # front end: outputs in


# a request's state in the front end (n > 1: one per sequence; wrapped per instance)
REQUEST_STATE = ("vllm.v1.engine.output_processor", "RequestState")


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
                "_model_forward": ("self",), "_sample": ("self",), "sample_tokens": ("self",),
                "initialize_kv_cache": ("self", "kv_cache_config")},
    RUNNER_CPU: {"load_model": ("self",)},
    RUNNER_V2: {"load_model": ("self",), "execute_model": ("self", "scheduler_output"),
                "prepare_inputs": ("self", "scheduler_output"), "sample": ("self",), "sample_tokens": ("self",),
                "initialize_kv_cache": ("self", "kv_cache_config")},
    SCHEDULER: {"update_from_output": ("self", "scheduler_output", "model_runner_output"), "schedule": ("self",),
                "add_request": ("self", "request"),
                SCHEDULER_REQUEST_UPDATE: ("self", "request", "new_token_ids")},
    **{queue: {"peek_request": ("self",)} for queue in WAITING_QUEUES},
    KV_CACHE_MANAGER: {name: ("self", "request") for name in KV_MANAGER_FREES},
    BLOCK_POOL: {BLOCK_POOL_ALLOCATE: ("self", "num_blocks")},
    SINGLE_TYPE_MANAGER: {KV_MANAGER_DROP: ("self", "request_id", "first_block", "last_block")},
    INPUT_PROCESSOR: {"process_inputs": ("self", "request_id", "prompt", "params")},
    MSGPACK_DECODER: {"decode": ("self", "bufs")},
    OUTPUT_PROCESSOR: {"process_outputs": ("self", "engine_core_outputs"),
                       "add_request": ("self", "request", "prompt", "parent_req", "request_index")},
    REQUEST_STATE: {"make_request_output": ("self", "new_token_ids", "pooling_output", "finish_reason",
                                            "stop_reason", "kv_transfer_params"),
                    "_new_completion_output": ("self",)},
    SERVING_COMPLETION: {"create_completion": ("self", "request"), "completion_stream_generator": ("self", "request")},
    SERVING_CHAT: {"create_chat_completion": ("self", "request"),
                   "chat_completion_stream_generator": ("self", "request")},
}


# wrapped module functions: (positional parameters after the first, keywords passed)
PATCHED_FUNCTIONS = {(RUNNER_V2[0], V2_GRAPH_DISPATCH): (("num_reqs", "num_tokens", "uniform_token_count",
                                                         "dp_size"), ("need_eager",))}


_MARK = "__nnsight_wrapped__"
_SUBCLASS = "__nnsight_subclass__"  # on a class subclass_with made


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
        raise LookupError(f"{cls.__module__}.{cls.__name__}.{name} is not listed in boundary.patching.PATCHED")
    _wrap(cls, name, cls.__dict__.get(name) or getattr(cls, name), make)


@functools.cache
def subclass_with(cls: type, makes: tuple[tuple[str, Callable[[Callable], Callable]], ...]) -> type:
    """A subclass of ``cls`` with the methods ``makes`` names wrapped: an object switched
    to it (``obj.__class__ = ...``) takes the wraps, and no other object of ``cls`` pays a
    call. Only what :data:`PATCHED` lists for the class that defines the method (a
    subclass of a listed class that inherits it takes the same wrap). (One subclass per
    ``cls`` and wraps: made once.)"""
    if getattr(cls, _SUBCLASS, False):  # (an object switched already)
        return cls
    namespace: dict[str, Any] = {"__module__": cls.__module__, _SUBCLASS: True}
    for name, make in makes:
        owner = next((c for c in cls.__mro__ if name in c.__dict__), cls)
        if name not in PATCHED.get((owner.__module__, owner.__name__), ()):
            raise LookupError(f"{owner.__module__}.{owner.__name__}.{name} is not listed in boundary.patching.PATCHED")
        original = getattr(cls, name)
        namespace[name] = functools.update_wrapper(make(original), original)
    return type(cls.__name__, (cls,), namespace)


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
