"""Every private vLLM name the plugin relies on exists in the installed vLLM, with the
parameters its wrappers expect: a vLLM upgrade that moves one fails here, naming it
(boundary/patching.py lists them; patch_method refuses a method it does not list)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re

import pytest

from vllm_nnsight_plugin.boundary import engine_core, patching


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
    # (in a process of its own: importing the server module makes this one count as the API server)
    import subprocess
    import sys

    code = ("import importlib, sys\nfrom vllm_nnsight_plugin.boundary import patching\n"
            "def has(m, f):\n    try:\n        return hasattr(importlib.import_module(m), f)\n"
            "    except ModuleNotFoundError:\n        return False\n"
            "print(sum(has(m, f) for m, f in patching.APP_ROUTE_HOOKS))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    found = done.stdout.strip().splitlines()[-1:]
    assert done.returncode == 0 and found and int(found[0]) > 0, \
        f"no app route hook of patching.APP_ROUTE_HOOKS exists in this vLLM: {done.stderr[-2000:]}"
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


def _vllm_imports() -> list[tuple[str, int, str, str]]:
    """``(file, line, module, name)`` of every ``from vllm... import name`` in the package,
    at any depth (most are inside functions: imported when first needed)."""
    import vllm_nnsight_plugin

    root = pathlib.Path(vllm_nnsight_plugin.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                found += [(str(path.relative_to(root)), node.lineno, node.module, a.name) for a in node.names]
    return found


def test_every_vllm_name_the_package_imports_exists():
    """The names the boundary imports when it first needs them resolve in the installed
    vLLM: an upgrade that moves one fails here, with the file and line, not later in a
    worker."""
    imports = _vllm_imports()
    assert len(imports) > 15 and any(f.startswith("boundary/") for f, *_ in imports)
    missing = []
    for file, line, module_name, name in imports:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{file}:{line} {module_name}")
            continue
        if not hasattr(module, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{file}:{line} {module_name}.{name}")
    assert not missing, f"not in this vLLM: {missing}"


def test_only_the_boundary_names_vllm():
    """Every import of vLLM, at any depth, is in ``boundary/`` (the package's other
    modules reach vLLM through it), and nothing else imports ``vllm`` whole."""
    import vllm_nnsight_plugin

    root = pathlib.Path(vllm_nnsight_plugin.__file__).parent
    plain = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
                plain.append(f"{path.relative_to(root)}:{node.lineno}")
    outside = [f"{f}:{line} {m}" for f, line, m, _ in _vllm_imports() if not f.startswith("boundary/")]
    assert _vllm_imports() and not outside and not plain, (outside, plain)


def test_the_core_does_not_import_the_boundary():
    """engine/ and payload/ reach vLLM only through what the boundary hands them (a
    ``WorkerSetup``, the runner's calls): no import of ``boundary`` at any depth."""
    import vllm_nnsight_plugin

    root = pathlib.Path(vllm_nnsight_plugin.__file__).parent
    boundary = "vllm_nnsight_plugin.boundary"
    found = []
    for package in ("engine", "payload"):
        for path in sorted((root / package).rglob("*.py")):
            here = ["vllm_nnsight_plugin", *path.relative_to(root).parent.parts]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = ".".join([*here[: len(here) - node.level + 1], *([node.module] if node.module else [])]) \
                        if node.level else node.module
                    names = [base, *(f"{base}.{a.name}" for a in node.names)]
                else:
                    continue
                if any(n == boundary or n.startswith(boundary + ".") for n in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_attributes_read_with_a_default_exist():
    """Attributes the boundary reads with ``getattr(..., default)`` (a missing one would
    quietly switch a part off rather than fail): each is still set by this vLLM."""
    from vllm.v1.core.sched import output, scheduler
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker import utils as worker_utils

    runner = inspect.getsource(gpu_model_runner)
    assert "self.cudagraph_dispatcher =" in runner  # runners.guard_v1_dispatcher: taps under full graphs
    # kv_zeroing: each runner's attention groups and kernel block sizes, each group's fields
    assert "def _kv_cache_spec_attn_group_iterator" in runner and "self._kernel_block_sizes =" in runner
    assert "self.runner_only_attn_layers" in runner
    runner_v2 = (pathlib.Path(gpu_model_runner.__file__).parent / "gpu" / "model_runner.py").read_text()
    assert re.search(r"self\.attn_groups,[^=]*self\.kernel_block_sizes,?\s*\)?\s*= init_attn_backend", runner_v2)
    fields = {f.name for f in dataclasses.fields(worker_utils.AttentionGroup)}
    assert {"backend", "layer_names", "kv_cache_spec", "kv_cache_group_id"} <= fields, fields
    assert "resumed_req_ids" in inspect.signature(output.CachedRequestData).parameters  # runners.resumed_ids
    # kv_blocks: a finished traced request's blocks zeroed once the pool holds them free
    from vllm.v1 import request as vllm_request
    from vllm.v1.core import block_pool, kv_cache_utils

    pool_init = inspect.getsource(block_pool.BlockPool.__init__)
    assert "self.blocks: list[KVCacheBlock]" in pool_init and "self.null_block =" in pool_init
    assert "ref_cnt" in {f.name for f in dataclasses.fields(kv_cache_utils.KVCacheBlock)}
    assert callable(vllm_request.Request.is_finished)
    queues = set(re.findall(r"self\.(\w+) = create_request_queue", inspect.getsource(scheduler.Scheduler.__init__)))
    assert "waiting" in queues and queues <= set(engine_core.WAITING_QUEUES), queues  # engine_core.waiting_requests


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


def test_late_results_ride_the_output_vllm_takes():
    """Results known once the device has finished a step (the logits check of a
    request's last step): merged where vLLM takes an asynchronous output, from any
    thread, after the step's own results and without overwriting an error the step
    recorded first; merged at once into an output that is not asynchronous."""
    import threading

    from conftest import pending_output
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_nnsight_plugin.boundary import runners

    def output():
        return ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})

    late = {"a": {"error": {"message": "late a"}}, "b": {"error": {"message": "late b"}}}
    pending = pending_output(output())
    # (the step's entries are the worker's: every recorded request says "error", None if none)
    own = {"a": {"saves": {}, "error": None}, "b": {"error": {"message": "the step's own"}}, "c": {"saves": {}}}
    runners.attach_results(pending, {k: dict(v) for k, v in own.items()})
    runners.attach_late_results(pending, lambda: late)
    assert runners.take_results(pending.model_runner_output) == own
    taken = []
    thread = threading.Thread(target=lambda: taken.append(pending.get_output()))  # (vLLM's output thread)
    thread.start()
    thread.join()
    assert taken[0] is pending.model_runner_output
    assert runners.take_results(taken[0]) == {**own, "a": {"saves": {}, "error": {"message": "late a"}}}
    now = output()
    runners.attach_late_results(now, lambda: late)
    assert runners.take_results(now) == late
    quiet = output()
    runners.attach_late_results(quiet, dict)  # (nothing found: nothing attached)
    assert runners.take_results(quiet) is None


def test_an_output_with_late_results_is_freed_without_the_collector():
    """The wrapper of an asynchronous output's ``get_output`` does not hold the output:
    each step's output (its token lists, its device tensors) goes when vLLM drops it,
    not at Python's next collection (a cycle per step made a steering batch's engine
    core collect about three times as often)."""
    import gc
    import weakref

    from conftest import pending_output
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_nnsight_plugin.boundary import runners

    late = {"a": {"error": {"message": "late a"}}}
    gc.disable()
    try:
        for take in (False, True):
            pending = pending_output(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))
            runners.attach_late_results(pending, lambda: late)
            if take:
                assert runners.take_results(pending.get_output()) == late
            gone = weakref.ref(pending)
            del pending
            assert gone() is None
    finally:
        gc.enable()


def test_an_error_in_the_engine_cores_store_outlives_later_steps_entries():
    """A step's output may carry a request's error (read late, after the step) while the
    request takes no token in that step, so vLLM does not stop it there; the worker's
    entries of later steps say ``"error": None``. The error stays, and the request
    stays halting."""
    from vllm_nnsight_plugin.boundary import results

    store, halting = {}, set()
    results.merge(store, {"a": {"error": {"message": "NaN"}}, "b": {"saves": {}, "error": None}}, halting)
    results.merge(store, {"a": {"saves": {}, "error": None, "done": False}, "b": {"error": None}}, halting)
    assert store["a"]["error"] == {"message": "NaN"} and store["a"]["done"] is False
    assert store["b"]["error"] is None and halting == {"a"}


def test_a_steps_new_requests_carry_their_extra_args_and_params():
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_nnsight_plugin.boundary import runners

    traced = SamplingParams(extra_args={"nnsight": "payload"})
    plain = SamplingParams()
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a", sampling_params=traced),
                                              SimpleNamespace(req_id="b", sampling_params=plain),
                                              SimpleNamespace(req_id="c", sampling_params=None)])
    new = runners.new_requests_with_params(out)
    assert new == [runners.NewRequest("a", {"nnsight": "payload"}, traced),
                   runners.NewRequest("b", None, plain), runners.NewRequest("c", None, None)]
    assert new[0].extra_args is traced.extra_args and new[1].params is plain


def test_the_width_bound_is_computed_once_per_model_config():
    from types import SimpleNamespace

    from vllm_nnsight_plugin.boundary import configuration

    asked = []

    class ModelConfig:
        hf_text_config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=300)

        def get_hidden_size(self) -> int:
            asked.append(self)
            return 64

        def get_vocab_size(self) -> int:
            return 1000

        def get_head_size(self) -> int:
            return 16

    one, two = SimpleNamespace(model_config=ModelConfig()), SimpleNamespace(model_config=ModelConfig())
    assert configuration.model_width(one) == configuration.model_width(one) == 1000
    assert len(asked) == 1  # (the second answer was the memo's)
    assert configuration.model_width(two) == 1000 and len(asked) == 2  # (another model config: computed)
    assert configuration.model_width(SimpleNamespace()) is None


def test_the_logits_format_is_the_heads_dtype_and_the_vocabulary(llama_path, monkeypatch):
    """What the guard's kernel is built for at load (``configuration.logits_format``),
    from this vLLM's own configs: the head's dtype, which ``head_dtype`` can set apart
    from the model's, and nothing for a pooling model (no logits to sample)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nnsight_plugin.boundary import configuration

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

    def fmt(**kwargs):
        return configuration.logits_format(EngineArgs(model=llama_path, **kwargs).create_engine_config())

    vocab = EngineArgs(model=llama_path).create_model_config().get_vocab_size()
    assert fmt(dtype="float32") == (torch.float32, vocab)
    assert fmt(dtype="bfloat16") == (torch.bfloat16, vocab)
    assert fmt(dtype="bfloat16", hf_overrides={"head_dtype": "float32"}) == (torch.float32, vocab)
    assert fmt(dtype="float32", runner="pooling") is None


def test_a_block_pool_looks_at_the_blocks_it_hands_out_only_while_some_are_dirty():
    """Blocks a traced request left with its KV are zeroed when vLLM's own pool hands
    them out again; a pool with none to look for runs vLLM's ``get_new_blocks`` alone
    (untraced traffic pays no call there)."""
    from vllm.v1.core.block_pool import BlockPool

    from vllm_nnsight_plugin.boundary import kv_blocks

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(7)  # (every block but the null block)
    assert type(pool) is BlockPool
    pool.free_blocks(blocks)  # (back to the free queue in this order)
    kv_blocks._mark_dirty(pool, [blocks[-1].block_id])
    assert type(pool) is not BlockPool and isinstance(pool, BlockPool)
    pool.get_new_blocks(6)  # (the clean ones first)
    assert type(pool) is not BlockPool and not pool.__dict__.get(kv_blocks.PENDING)
    assert [b.block_id for b in pool.get_new_blocks(1)] == [blocks[-1].block_id]
    assert pool.__dict__[kv_blocks.PENDING] == [blocks[-1].block_id]  # (zeroed before the next step)
    assert type(pool) is BlockPool
    # the null block (in a sliding window's tables) and another pool's ids are never handed
    # out here: they do not keep the pool looking
    kv_blocks._mark_dirty(pool, [pool.null_block.block_id, 8, 1000])
    assert type(pool) is BlockPool and not pool.__dict__[kv_blocks.DIRTY]
    kv_blocks._mark_dirty(pool, [pool.null_block.block_id, blocks[0].block_id])
    assert pool.__dict__[kv_blocks.DIRTY] == {blocks[0].block_id}


def test_a_subclass_of_vllms_block_pool_looks_as_its_base_does():
    """A pool of a subclass that inherits ``get_new_blocks`` (vLLM's HiSparse pool) takes
    the same wrap: switching it does not raise, and it switches back to its own class
    (vLLM releases without HiSparse, e.g. CUDA 0.26.0, skip)."""
    from vllm.v1.core.block_pool import BlockPool

    SharedEventQueueBlockPool = pytest.importorskip("vllm.v1.hisparse.block_pool").SharedEventQueueBlockPool

    from vllm_nnsight_plugin.boundary import kv_blocks

    owner = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    pool = SharedEventQueueBlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16, event_owner=owner)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    kv_blocks._mark_dirty(pool, [block.block_id])
    assert isinstance(pool, SharedEventQueueBlockPool) and type(pool) is not SharedEventQueueBlockPool
    pool.get_new_blocks(3)  # (every free block: the dirty one among them)
    assert pool.__dict__[kv_blocks.PENDING] == [block.block_id]
    assert type(pool) is SharedEventQueueBlockPool
