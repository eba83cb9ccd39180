"""Shared fixtures: tiny checkpoints, real vLLM engines (one per architecture,
session-scoped: an engine takes ~30-50 s to start on 2 cores), and a Hugging Face
fp32 reference with the same weights."""

from __future__ import annotations

import json
import os
import uuid

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_nnsight_plugin import tiny  # noqa: E402

# Overrides for other machines (the GPU run sets a memory share and, if needed, a tolerance).
TOL = float(os.environ.get("NNSIGHT_TEST_TOL", "1e-4"))
ENGINE_KWARGS = json.loads(os.environ.get("NNSIGHT_TEST_ENGINE_KWARGS", "{}"))
# vLLM's CUDA LoRA kernels (Triton, `lora_expand`) take fp16/bf16 adapter weights only: an
# fp32 engine with `enable_lora` fails to start there, stock vLLM too. The fp32 LoRA tests
# run where it starts (the CPU); test_gpu_bf16's LoRA test runs on both.
FP32_LORA = not torch.cuda.is_available()
FP32_LORA_SKIP = "vLLM's CUDA LoRA kernels take fp16/bf16 adapters only (test_gpu_bf16 runs LoRA there)"


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def llama_path(ckpt_root: Path) -> str:
    return str(tiny.ensure("llama", ckpt_root))


@pytest.fixture(scope="session")
def tied_llama_path(ckpt_root: Path) -> str:
    return str(tiny.ensure("llama_tied", ckpt_root))


@pytest.fixture(scope="session")
def gpt2_path(ckpt_root: Path) -> str:
    return str(tiny.ensure("gpt2", ckpt_root))


@pytest.fixture(scope="session")
def llama(llama_path: str):
    """A dispatched VLLM on the tiny Llama (default multi-process vLLM, prefix caching on)."""
    from vllm_nnsight_plugin import VLLM

    model = VLLM(llama_path, dispatch=True, dtype="float32", max_model_len=512,
                 max_num_seqs=32, enable_prefix_caching=True, seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def gpt2(gpt2_path: str):
    """A *lazy* VLLM on the tiny GPT-2: the first trace dispatches it. Its token
    budget is small, so long prompts are split by chunked prefill."""
    from vllm_nnsight_plugin import VLLM

    model = VLLM(gpt2_path, dtype="float32", max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=64, enable_chunked_prefill=True, seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def _hf(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_llama(llama_path: str):
    return _hf(llama_path)


@pytest.fixture(scope="session")
def hf_tied_llama(tied_llama_path: str):
    return _hf(tied_llama_path)


@pytest.fixture(scope="session")
def hf_gpt2(gpt2_path: str):
    return _hf(gpt2_path)


def first(x):
    return x[0] if isinstance(x, tuple) else x


class HFRun:
    """One HF forward with optional output/input edits; records module values."""

    def __init__(self, model, ids: list[int]):
        self.model = model
        self.ids = ids
        self.records: dict[str, torch.Tensor] = {}
        self._handles = []

    def record(self, name: str, module) -> HFRun:
        def hook(mod, args, output):
            self.records[name] = first(output).detach().clone()[0]
        self._handles.append(module.register_forward_hook(hook))
        return self

    def edit(self, module, fn) -> HFRun:
        def hook(mod, args, output):
            if isinstance(output, tuple):
                return (fn(output[0]),) + output[1:]
            return fn(output)
        self._handles.append(module.register_forward_hook(hook))
        return self

    def edit_input(self, module, fn) -> HFRun:
        def hook(mod, args, kwargs):
            if args:
                return (fn(args[0]),) + args[1:], kwargs
            key = next(iter(kwargs))
            kwargs[key] = fn(kwargs[key])
            return args, kwargs
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def logits(self) -> torch.Tensor:
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([self.ids]))
            return out.logits[0]
        finally:
            for h in self._handles:
                h.remove()


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    a = a.float().reshape(b.shape) if a.numel() == b.numel() else a
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= tol, f"max abs diff {diff} > {tol}"


def assert_same(a, b, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Two saved values equal through their structure (dicts, lists, tuples, a module
    cache's modules and their inputs and outputs); tensors of one dtype and shape, bit
    for bit unless a tolerance is given (then ``torch.allclose`` with it)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b) if not (rtol or atol) else torch.allclose(a, b, rtol=rtol, atol=atol), (a, b)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for name in a:
            assert_same(a[name], b[name], rtol, atol)
    elif callable(getattr(a, "keys", None)):  # a module cache (results' CacheView)
        assert a.keys() == b.keys()
        for key in a.keys():
            for part in ("input", "output"):
                assert_same(getattr(a[key], part), getattr(b[key], part), rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, rtol, atol)
    else:
        assert a == b, (a, b)


def generate_together(llm, prompts: list, params) -> list:
    """``llm.generate(prompts, params)`` whose requests all reach the scheduler before its
    first step: the scheduler is paused (vLLM's ``pause_scheduler("keep")``, which also
    empties the prefix cache) while they are added. Two runs of the same prompts then
    form the same batches, step for step; it asserts that every request took its first
    step in the same one (so the prompts must fit one step's token budget and seats, and
    every request must be valid).

    Why: a CUDA GEMM's last bits depend on the batch's token count, and in a plain
    ``generate`` which step a request joins depends on when it reaches the engine-core
    process (a traced request's payload takes longer to add), so bits compared across two
    runs could differ without the plugin touching anything. Here they cannot: a plugin
    that touched a neighbour's rows fails every time, on any device."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    assert len(params) == len(prompts)
    tag = uuid.uuid4().hex[:8]
    ids = [f"together-{tag}-{i}" for i in range(len(prompts))]
    core = engine.engine_core
    pausing = hasattr(core, "call_utility")  # (an in-process engine steps only when asked: no pause needed)
    if pausing:
        core.call_utility("pause_scheduler", "keep", True)
    added = []
    try:
        for req_id, prompt, sp in zip(ids, prompts, params):
            sp = sp.clone()
            sp.output_kind = RequestOutputKind.CUMULATIVE  # (an output per request per step)
            added.append(engine.add_request(req_id, prompt, sp))
    except BaseException:
        engine.abort_request(added, internal=True)  # (nothing of this call is left to step)
        raise
    finally:
        if pausing:
            core.call_utility("resume_scheduler")
    done, first = {}, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and outs:
            first = {out.request_id for out in outs}
        for out in outs:
            if out.finished:
                done[out.request_id] = out
    assert first == set(ids), "the requests did not all take their first step together"
    return [done[req_id] for req_id in ids]


def pending_output(inner):
    """vLLM's ``AsyncModelRunnerOutput`` for ``inner`` (a ``ModelRunnerOutput`` still
    being copied, as the V2 runner returns it): ``get_output`` hands it over."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class Pending(AsyncModelRunnerOutput):
        def __init__(self, inner):
            self.model_runner_output = inner

        def get_output(self):
            return self.model_runner_output

    return Pending(inner)


def lora_adapter(path: Path, base: str, hf, rank: int = 4, alpha: int = 8):
    """A PEFT LoRA adapter of every layer's q_proj and v_proj for a tiny Llama, written to
    ``path``; returns a copy of the HF model ``hf`` with the adapter merged into its
    weights (W + alpha / rank * B @ A), the reference for an engine that applies it."""
    import copy

    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(3)
    merged = copy.deepcopy(hf)
    tensors = {}
    for i, layer in enumerate(merged.model.layers):
        for proj in ("q_proj", "v_proj"):
            weight = getattr(layer.self_attn, proj).weight
            a = torch.randn(rank, weight.shape[1], generator=gen) * 0.1
            b = torch.randn(weight.shape[0], rank, generator=gen) * 0.1
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            with torch.no_grad():
                weight.add_(alpha / rank * b @ a)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA",
        "bias": "none", "base_model_name_or_path": base, "task_type": "CAUSAL_LM"}))
    return merged
