"""Values read and edited through a real vLLM engine equal a Hugging Face fp32
forward with the same weights (tiny random Llama)."""

from __future__ import annotations

import torch
from conftest import HFRun, assert_close

PROMPT = "The Eiffel Tower is in"


def _ids(llama, prompt: str) -> list[int]:
    return llama.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_every_layer_output_and_logits(llama, hf_llama):
    n = len(hf_llama.model.layers)
    with llama.trace(PROMPT, temperature=0.0) as tracer:
        # save each layer as it is read: vLLM's fused kernels overwrite these buffers later
        saved = [layer.output.save() for layer in llama.model.layers].save()
        logits = llama.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    hf = HFRun(hf_llama, ids)
    for i in range(n):
        hf.record(f"l{i}", hf_llama.model.layers[i])
    ref = hf.logits()
    assert len(saved) == n
    for i, (hidden, residual) in enumerate(saved):
        assert hidden.shape == (len(ids), 128)
        # vLLM's fused residual: the HF hidden state is hidden + residual
        assert_close(hidden + residual, hf.records[f"l{i}"])
    assert logits.shape == (1, ref.shape[-1])
    assert_close(logits[0], ref[-1])


def test_the_logit_lens_as_nnsight_writes_it_equals_hf(llama, hf_llama):
    """``model.lm_head(model.model.norm(h))`` in a block: vLLM's unembedding (whose
    forward refuses to run) projects each layer's residual stream to the vocabulary
    (its padding cut), as Hugging Face's ``lm_head`` does; the last layer's lens at the
    last position is the step's logits."""
    with llama.trace(PROMPT, temperature=0.0) as tracer:
        lens = list().save()
        for layer in llama.model.layers:
            out = layer.output
            lens.append(llama.lm_head(llama.model.norm(out[0] + out[1])))
        logits = llama.logits.save()
    assert tracer.outputs[0].ran_as.startswith("code:")
    ids = tracer.outputs[0].prompt_token_ids
    hf = HFRun(hf_llama, ids)
    for i, layer in enumerate(hf_llama.model.layers):
        hf.record(f"l{i}", layer)
    ref = hf.logits()
    assert len(lens) == len(hf_llama.model.layers) and lens[0].shape == (len(ids), ref.shape[-1])
    with torch.no_grad():
        for i, got in enumerate(lens):
            want = hf_llama.lm_head(hf_llama.model.norm(hf.records[f"l{i}"]))
            assert_close(got, want)
    assert_close(lens[-1][-1], logits[0])


def test_assigning_the_logits_changes_what_is_sampled_and_the_logprobs(llama):
    """``model.logits = new`` replaces the logits the sampler uses for this request, at
    the step the block is at (here every step: token 42 each time, at probability ~1)."""
    with llama.trace(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1) as tracer:
        for step in tracer.iter[:]:  # noqa: B007
            forced = torch.full_like(llama.logits, -1e4)
            forced[:, 42] = 0.0
            llama.logits = forced
    out = tracer.outputs[0].outputs[0]
    assert list(out.token_ids) == [42, 42, 42]
    assert all(abs(lp[42].logprob) < 1e-3 for lp in out.logprobs)
    with llama.trace(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True) as clean:
        pass
    assert list(clean.outputs[0].outputs[0].token_ids) != [42, 42, 42]  # (the assignment did it)


def test_mlp_ablation_matches_hf(llama, hf_llama):
    with llama.trace(PROMPT, temperature=0.0) as tracer:
        llama.model.layers[1].mlp.output[:] = 0
        mlp = llama.model.layers[1].mlp.output.save()
        logits = llama.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1].mlp, torch.zeros_like).logits()
    clean = HFRun(hf_llama, ids).logits()
    assert torch.count_nonzero(mlp) == 0
    assert (ref[-1] - clean[-1]).abs().max() > 1e-2  # the ablation matters
    assert_close(logits[0], ref[-1])


def test_steering_vector_matches_hf(llama, hf_llama):
    torch.manual_seed(1)
    v = torch.randn(128) * 0.5
    with llama.trace(PROMPT, temperature=0.0) as tracer:
        llama.model.layers[0].output[0][:] += v
        logits = llama.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v).logits()
    assert_close(logits[0], ref[-1])


def test_assigning_output_replaces_it(llama, hf_llama):
    with llama.trace(PROMPT, temperature=0.0) as tracer:
        out = llama.model.layers[2].self_attn.output
        llama.model.layers[2].self_attn.output = out * 2
        logits = llama.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[2].self_attn, lambda h: h * 2).logits()
    assert_close(logits[0], ref[-1])


def test_logits_at_step_three_under_iter(llama, hf_llama):
    with llama.trace("Hello world", temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
        for step in tracer.iter[:4]:
            if step == 3:
                l3 = llama.logits.save()
        result = tracer.result.save()
    prompt_ids = list(result.prompt_token_ids)
    generated = list(result.outputs[0].token_ids)
    assert len(generated) == 4
    ref = HFRun(hf_llama, prompt_ids + generated[:3]).logits()
    # greedy: vLLM's tokens are HF's argmax at each step
    for k in range(3):
        hf_step = HFRun(hf_llama, prompt_ids + generated[:k]).logits()
        assert int(hf_step[-1].argmax()) == generated[k]
    assert_close(l3[0], ref[-1])


def test_forced_samples_change_the_continuation(llama, hf_llama):
    forced = 7
    with llama.trace("Hello", temperature=0.0, max_tokens=3) as tracer:
        for _ in tracer.iter[:3]:
            llama.samples = torch.full_like(llama.samples, forced)
            last = llama.logits.save()
        result = tracer.result.save()
    assert list(result.outputs[0].token_ids) == [forced] * 3
    # step 2's logits were computed on the forced tokens
    ref = HFRun(hf_llama, list(result.prompt_token_ids) + [forced, forced]).logits()
    assert_close(last[0], ref[-1])


def test_seed_example_forces_token_zero(llama):
    with llama.trace("Hello", temperature=0.0, max_tokens=3) as tracer:
        for _ in tracer.iter[:3]:
            llama.samples = torch.zeros_like(llama.samples)
            last = llama.logits.save()
        result = tracer.result.save()
    assert list(result.outputs[0].token_ids) == [0, 0, 0]
    assert last.shape == (1, len(llama.tokenizer))


def test_two_invokes_are_isolated(llama, hf_llama):
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke("The Eiffel Tower is in"):
            hidden, residual = llama.model.layers[0].output
            hidden[:] = 0  # the residual stream is hidden + residual: zero both
            residual[:] = 0
            a = llama.logits.save()
        with tracer.invoke("The capital of Japan is"):
            hb = llama.model.layers[3].output.save()
            b = llama.logits.save()
    ida, idb = (o.prompt_token_ids for o in tracer.outputs)
    ref_a = HFRun(hf_llama, ida).edit(hf_llama.model.layers[0], lambda h: h * 0).logits()
    rec = HFRun(hf_llama, idb).record("l3", hf_llama.model.layers[3])
    ref_b = rec.logits()
    assert_close(a[0], ref_a[-1])
    assert_close(b[0], ref_b[-1])
    assert hb[0].shape[0] == len(idb)  # only this request's rows
    assert_close(hb[0] + hb[1], rec.records["l3"])
