"""Every private vLLM name the plugin relies on exists in the installed vLLM, with the
parameters its wrappers expect: a vLLM upgrade that moves one fails here, naming it
(boundary/patching.py lists them; patch_method refuses a method it does not list)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from vllm_nnsight_plugin.boundary import patching


def _has(module_name: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module_name), name)
    except ModuleNotFoundError:  # (a module of another vLLM version)
        return False


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


@pytest.mark.parametrize("where", sorted(patching.PATCHED), ids=lambda w: f"{w[0]}.{w[1]}")
def test_every_wrapped_method_exists_with_its_parameters(where):
    module_name, class_name = where
    cls = getattr(importlib.import_module(module_name), class_name)
    for method, leading in patching.PATCHED[where].items():
        fn = getattr(cls, method, None)
        if fn is None and method in patching.KV_MANAGER_FREES:
            continue  # (either name of the free: the one this vLLM has is wrapped)
        assert callable(fn), f"{module_name}.{class_name}.{method} is missing"
        params = _params(fn)
        assert params[: len(leading)] == leading, f"{class_name}.{method}{params} no longer starts with {leading}"
    if where == patching.KV_CACHE_MANAGER:
        assert any(hasattr(cls, name) for name in patching.KV_MANAGER_FREES)


def test_wrapped_functions_and_other_names_exist():
    for (module_name, name), (positional, keywords) in patching.PATCHED_FUNCTIONS.items():
        params = _params(getattr(importlib.import_module(module_name), name))
        assert params[1 : 1 + len(positional)] == positional and set(keywords) <= set(params), (name, params)
    for module_name, class_name in (patching.WORKER_BASE, patching.ENGINE_CORE, patching.REQUEST_OUTPUT):
        assert isinstance(getattr(importlib.import_module(module_name), class_name), type)
    hooks = [(m, f) for m, f in patching.APP_ROUTE_HOOKS if _has(m, f)]
    assert hooks, "no app route hook of patching.APP_ROUTE_HOOKS exists in this vLLM"
    from vllm.distributed import (  # noqa: F401 - tensor parallel (engine/shards.py)
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.v1.core.sched import scheduler

    # engine_core.finished_since_schedule: the ids freed since the last schedule(), emptied by it
    source = inspect.getsource(scheduler)
    for needed in ("self.finished_req_ids.add(request", "self.finished_req_ids = set()"):
        assert needed in source, f"vLLM's Scheduler no longer has {needed}"

    for cls, attrs in ((ColumnParallelLinear, ("gather_output", "output_partition_sizes", "tp_size")),
                       (RowParallelLinear, ("input_is_parallel", "reduce_results", "tp_size"))):
        source = inspect.getsource(cls.__init__) + inspect.getsource(cls.__mro__[1].__init__)
        for attr in attrs:
            assert f"self.{attr}" in source, f"{cls.__name__} no longer sets {attr}"


def test_patch_method_refuses_a_method_it_does_not_list():
    class Scheduler:  # (a stand-in: only the refusal is under test)
        def step(self) -> None: ...

    Scheduler.__module__ = patching.SCHEDULER[0]
    with pytest.raises(LookupError, match="not listed in boundary.patching.PATCHED"):
        patching.patch_method(Scheduler, "step", lambda original: original)


def test_the_core_imports_no_vllm():
    """The plan/executor core (engine/), the payload and the client's tracer import
    without vLLM: every vLLM name is reached through the boundary package, at call time."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None\n"
            "import importlib, pkgutil, vllm_nnsight_plugin.engine as e, vllm_nnsight_plugin.payload as p\n"
            "for pkg in (e, p):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
