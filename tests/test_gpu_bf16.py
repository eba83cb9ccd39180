"""bf16 functional checks (the dtype production runs): an ablation and a steering
vector change vLLM's logits the way they change Hugging Face's in bf16. Runs on
CPU in CI and on the GPU machine (benchmarks/gpu/remote.sh tests)."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_KWARGS, HFRun

PROMPT = "The Eiffel Tower is in"


@pytest.fixture(scope="module")
def bf16(llama_path):
    from vllm_nnsight_plugin import VLLM

    model = VLLM(llama_path, dispatch=True, dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                 seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def hf_bf16(llama_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.bfloat16).eval()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def _trace(bf16, edit):
    with bf16.trace(PROMPT, temperature=0.0) as tracer:
        if edit == "ablate":
            bf16.model.layers[1].mlp.output[:] = 0
        elif edit is not None:
            bf16.model.layers[0].output[0][:] += edit
        logits = bf16.logits.save()
    return logits[0].float(), tracer.outputs[0].prompt_token_ids


def test_ablation_changes_logits_as_in_hf_bf16(bf16, hf_bf16):
    clean, ids = _trace(bf16, None)
    ablated, _ = _trace(bf16, "ablate")
    hf_clean = HFRun(hf_bf16, ids).logits()[-1].float()
    hf_ablated = HFRun(hf_bf16, ids).edit(hf_bf16.model.layers[1].mlp, torch.zeros_like).logits()[-1].float()
    assert _cos(clean, hf_clean) > 0.999
    delta, hf_delta = ablated - clean, hf_ablated - hf_clean
    assert delta.abs().max() > 0.1  # the ablation matters
    assert _cos(delta, hf_delta) > 0.98


def test_steering_sign_and_scale_bf16(bf16, hf_bf16):
    torch.manual_seed(3)
    v = torch.randn(128, dtype=torch.bfloat16) * 0.05
    clean, ids = _trace(bf16, None)
    deltas = {k: _trace(bf16, k * v)[0] - clean for k in (1, -1, 2)}
    hf_clean = HFRun(hf_bf16, ids).logits()[-1].float()
    hf_delta = HFRun(hf_bf16, ids).edit(hf_bf16.model.layers[0], lambda h: h + v).logits()[-1].float() - hf_clean
    assert _cos(deltas[1], hf_delta) > 0.95  # same direction as HF's
    assert _cos(deltas[1], -deltas[-1]) > 0.95  # sign flips the change
    ratio = deltas[2].norm() / deltas[1].norm()
    assert 1.6 < ratio < 2.4  # twice the vector, about twice the change (near-linear regime)


def test_a_lora_adapter_changes_logits_as_in_hf_bf16(llama_path, hf_bf16, tmp_path):
    """LoRA in a dtype vLLM's CUDA LoRA kernels take (fp32 LoRA: test_conformance, on the
    CPU): the adapter's trace reads the adapted model, its logits and an MLP output
    pointing as HF's with the adapter merged into a bf16 copy, and the adapter's change of
    the logits pointing as HF's; a trace without it reads the base model."""
    from conftest import lora_adapter
    from vllm.lora.request import LoRARequest

    from vllm_nnsight_plugin import VLLM

    adapted_hf = lora_adapter(tmp_path / "lora", llama_path, hf_bf16)
    model = VLLM(llama_path, dispatch=True, enable_lora=True, max_lora_rank=8, dtype="bfloat16",
                 max_model_len=256, max_num_seqs=4, seed=0, **ENGINE_KWARGS)
    try:
        lora = LoRARequest("probe", 1, str(tmp_path / "lora"))
        with model.trace(PROMPT, temperature=0.0, max_tokens=1, lora_request=lora) as tracer:
            adapted = model.logits.save()
            mlp = model.model.layers[1].mlp.output.save()
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            base = model.logits.save()
    finally:
        model.shutdown()
    assert tracer.outputs[0].ran_as == "batched"
    run = HFRun(adapted_hf, list(tracer.outputs[0].prompt_token_ids)).record("mlp1", adapted_hf.model.layers[1].mlp)
    hf_adapted = run.logits()[-1].float()
    hf_base = HFRun(hf_bf16, list(tracer.outputs[0].prompt_token_ids)).logits()[-1].float()
    assert _cos(adapted[0], hf_adapted) > 0.999
    assert _cos(mlp, run.records["mlp1"]) > 0.99
    delta, hf_delta = adapted[0].float() - base[0].float(), hf_adapted - hf_base
    assert delta.abs().max() > 0.1  # the adapter matters
    assert _cos(delta, hf_delta) > 0.95
