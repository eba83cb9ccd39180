"""``tracer.cache()``: every module's value per request, by path, as nnsight returns
it, equal to a Hugging Face fp32 forward; as a plan, as code, with edits, and as a
JSON spec (prompts split by chunked prefill: ``test_parity_gpt2.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_close
from vllm import SamplingParams

from vllm_nnsight_plugin import results

PROMPT = "The quick brown fox jumps"
LAYERS = 4  # the tiny Llama's


def hf_hidden(hf, ids: list[int]) -> tuple:
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


def layer_inputs(hf, ids: list[int], edit=None) -> list[torch.Tensor]:
    """Each decoder layer's input (the residual stream before it), with ``edit``
    applied to layer 0's output: own hooks, registered before the forward, so their
    order against transformers' hidden-state recording does not matter."""
    seen: list[torch.Tensor] = []
    layers = hf.model.layers

    def before(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"])[0].clone())

    def after(module, args, output):
        if isinstance(output, tuple):
            return (edit(output[0]),) + tuple(output[1:])
        return edit(output)

    handles = [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in layers]
    if edit is not None:
        handles.append(layers[0].register_forward_hook(after))
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


def residual(value) -> torch.Tensor:
    hidden, res = value
    return hidden + res


def test_a_cache_of_every_module_equals_hf_and_runs_batched(llama, hf_llama):
    with llama.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        cache = tracer.cache()
    out = tracer.outputs[0]
    assert out.ran_as == "batched"
    keys = cache.keys()
    assert "model.model.layers.0" in keys and "model.model.layers.3.mlp.down_proj" in keys
    assert "model.model.embed_tokens" in keys and "model.model.norm" in keys
    assert not any(k.startswith(("model.lm_head", "model.logits_processor")) for k in keys)
    assert not any(k.endswith("rotary_emb") for k in keys)  # (one module under every layer's path)
    states = hf_hidden(hf_llama, list(out.prompt_token_ids))
    assert_close(cache["model.model.embed_tokens"].output, states[0][0])
    for i in range(LAYERS - 1):
        assert_close(residual(cache.model.model.layers[i].output), states[i + 1][0])
    assert_close(cache.model.model.norm.output[0], states[LAYERS][0])
    # the same node by key, by attribute, by negative index; one visit: the value itself
    assert torch.equal(cache["model.model.layers.3"].output[0], cache.model.model.layers[-1].output[0])
    assert len(cache.model.model.layers[0]) == 1
    assert "model.model.layers.2.self_attn" in cache and "model.lm_head" not in cache
    with pytest.raises(AttributeError, match="was not cached"):
        _ = cache.model.model.layers[0].nothing


def test_a_cache_over_generation_has_one_visit_per_step(llama, hf_llama):
    with llama.trace(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
        cache = tracer.cache(modules=[llama.model.layers[1], "model.model.norm"], include_inputs=True)
    out = tracer.outputs[0]
    assert out.ran_as == "batched"
    assert sorted(cache.keys()) == ["model.model.layers.1", "model.model.norm"]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    states = hf_hidden(hf_llama, ids[:-1])[2][0]  # layer 1's output at every position
    visits = cache.model.model.layers[1].output
    assert len(visits) == 3 and len(cache.model.model.layers[1]) == 3
    n = len(out.prompt_token_ids)
    assert_close(residual(visits[0]), states[:n])
    for k in (1, 2):
        assert_close(residual(visits[k]), states[n + k - 1 : n + k])
    inputs = cache.model.model.norm.inputs
    assert len(inputs) == 3 and inputs[0][1] == {} and inputs[0][0][0].shape == (n, 128)
    assert torch.equal(cache.model.model.norm.input[1], inputs[1][0][0])


def test_a_cache_holds_the_values_after_the_blocks_edits_as_plan_and_as_code(llama, hf_llama):
    """The cache sees what the forward went on with (an edited layer's value after its
    edit), whether the block runs as one plan or as code."""
    v = torch.linspace(-1, 1, 128)
    got = {}
    for lower in (True, False):
        extra = {} if lower else {"extra_args": {"nnsight_lower": False}}
        with llama.trace(PROMPT, temperature=0.0, max_tokens=1, **extra) as tracer:
            llama.model.layers[0].output[0][:] += v
            cache = tracer.cache(modules=[llama.model.layers[0], llama.model.layers[1]], dtype=torch.float64)
        got[lower] = (cache, tracer.outputs[0].ran_as)
    assert got[True][1] == "batched" and got[False][1].startswith("code:")
    ids = list(tracer.outputs[0].prompt_token_ids)
    states = layer_inputs(hf_llama, ids, edit=lambda x: x + v)
    clean = layer_inputs(hf_llama, ids)
    for cache, _ in got.values():
        layer0, layer1 = cache.model.model.layers[0].output, cache.model.model.layers[1].output
        assert layer0[0].dtype == torch.float64
        assert_close(residual(layer0), states[1])
        assert_close(residual(layer1), states[2])
        assert (residual(layer1) - clean[2]).abs().max() > 1e-2  # (the edit changed what followed)


def test_a_cache_op_in_a_json_spec(llama, hf_llama):
    spec = {"v": 1, "kind": "spec", "ops": [
        {"op": "cache", "name": "acts", "modules": ["model.layers.2"], "steps": "prefill"}]}
    params = SamplingParams(temperature=0.0, max_tokens=2, extra_args={"nnsight": json.dumps(spec)})
    out = llama.vllm_entrypoint.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.ran_as == "batched"
    cache = results(out)["acts"]
    assert cache.keys() == ["model.model.layers.2"] and len(cache.model.model.layers[2]) == 1
    states = hf_hidden(hf_llama, list(out.prompt_token_ids))
    assert_close(residual(cache.model.model.layers[2].output), states[3][0])


def test_a_cache_outside_an_invoke_is_refused(llama):
    with pytest.raises(ValueError, match="Cannot create a cache outside an invoker"):
        with llama.trace(temperature=0.0, max_tokens=1) as tracer:
            tracer.cache()
