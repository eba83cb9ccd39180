"""Engine-wide edits on a real engine: every request runs them (traced or not),
their saves come back per request, selection by name, clearing."""

from __future__ import annotations

import pytest
import torch
from conftest import HFRun, assert_close
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, results

PROMPTS = ["The Eiffel Tower is in", "Hello world", "The capital of Japan is", "One two three four"]


@pytest.fixture
def clean(llama):
    yield llama
    llama.clear_edits()


def _top1(output) -> float:
    return max(lp.logprob for lp in output.outputs[0].logprobs[0].values())


def test_probe_saves_arrive_on_each_of_32_outputs(clean, hf_llama):
    llama = clean
    with llama.edit(name="probe") as (tracer, probe):
        hidden, residual = llama.model.layers[1].output
        score = (hidden[-1] + residual[-1]).norm().save()  # noqa: F841 - the HF residual stream
    prompts = [PROMPTS[i % 4] + f" {i}" for i in range(32)]
    outputs = llama.generate(prompts, max_tokens=2, temperature=0.0)
    assert len(outputs) == 32
    for out in outputs:
        rec = HFRun(hf_llama, list(out.prompt_token_ids)).record("l1", hf_llama.model.layers[1])
        rec.logits()
        assert out.saves["score"].shape == ()
        assert abs(float(out.saves["score"]) - float(rec.records["l1"][-1].norm())) < 1e-4
    probe.clear()
    after = llama.generate(prompts[:2], max_tokens=1)
    assert all(not o.saves for o in after)


def test_steer_applies_to_every_request_and_every_step(clean, hf_llama):
    llama = clean
    v = torch.linspace(-0.5, 0.5, 128)
    with llama.edit() as (tracer, steer):
        for _ in tracer.all():
            llama.model.layers[0].output[0][:] += v
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1, ignore_eos=True)
    outs = llama.vllm_entrypoint.generate(PROMPTS, params, use_tqdm=False)  # plain vllm.LLM calls
    for out in outs:
        ids = list(out.prompt_token_ids)
        toks = list(out.outputs[0].token_ids)
        for k in range(3):  # prefill and generated steps are all steered
            ref = HFRun(hf_llama, ids + toks[:k]).edit(hf_llama.model.layers[0], lambda h: h + v).logits()[-1]
            assert toks[k] == int(ref.argmax())
            lp = max(x.logprob for x in out.outputs[0].logprobs[k].values())
            assert abs(lp - float(torch.log_softmax(ref, -1).max())) < 1e-4
    # a traced request sees the edit too
    with llama.trace(PROMPTS[0], temperature=0.0) as tracer:
        logits = llama.logits.save()
    ids = list(tracer.outputs[0].prompt_token_ids)
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v).logits()[-1]
    assert_close(logits[0], ref)
    steer.clear()
    with llama.trace(PROMPTS[0], temperature=0.0):
        clean_logits = llama.logits.save()
    assert_close(clean_logits[0], HFRun(hf_llama, ids).logits()[-1])  # clear restores clean outputs


def test_selection_by_name(clean, hf_llama):
    llama = clean
    v = torch.full((128,), 0.3)
    with llama.edit(name="probe") as (tracer, probe):
        seen = llama.model.layers[2].output[0][-1].sum().save()  # noqa: F841
    with llama.edit(name="steer") as (tracer, steer):
        llama.model.layers[0].output[0][:] += v
    with llama.edit() as (tracer, anonymous):
        anon = llama.model.layers[1].output[0][-1].sum().save()  # noqa: F841
    with llama.trace(PROMPTS[1], temperature=0.0, edits=["probe"]) as tracer:
        logits = llama.logits.save()
        result = tracer.result.save()
    assert {"seen", "anon"} <= set(result.saves)  # the probe ran, and the unnamed edit (it always runs)...
    ids = list(result.prompt_token_ids)
    assert_close(logits[0], HFRun(hf_llama, ids).logits()[-1])  # ...the steer did not
    with llama.trace(PROMPTS[1], temperature=0.0, edits=["probe"]) as tracer:
        seen = llama.model.layers[3].output[0][-1].sum().save()  # (the probe's name: the trace's value wins)
    rec = HFRun(hf_llama, ids).record("mlp3", hf_llama.model.layers[3].mlp).record("mlp2", hf_llama.model.layers[2].mlp)
    rec.logits()
    assert abs(float(seen) - float(rec.records["mlp3"][-1].sum())) < 1e-3
    assert abs(float(rec.records["mlp3"][-1].sum()) - float(rec.records["mlp2"][-1].sum())) > 1e-2
    anonymous.clear()
    with pytest.raises(ValueError, match="unknown edit"):
        llama.generate(PROMPTS[:1], max_tokens=1, edits=["nope"])
    with pytest.raises(ValueError, match="inplace"):
        llama.edit(inplace=False)


def test_error_in_an_edit_ends_only_that_request(clean):
    llama = clean
    with llama.edit() as (tracer, bad):
        if llama.model.layers[0].output[0].shape[0] > 5:
            raise RuntimeError("prompt too long for this probe")
    outs = llama.generate(["Hello", PROMPTS[0] + " and more words here"], max_tokens=3, ignore_eos=True)
    short, long = outs
    assert len(short.outputs[0].token_ids) == 3 and not results(short)
    with pytest.raises(InterventionError, match="prompt too long"):
        results(long)
    assert long.outputs[0].stop_reason == "nnsight_error"


def test_many_requests_with_an_edit_keep_state_flat(clean):
    import psutil

    llama = clean
    with llama.edit() as (tracer, probe):
        m = llama.model.layers[1].output[0].mean().save()  # noqa: F841
    pid = llama.vllm_entrypoint.collective_rpc("nnsight_probe")[0]["pid"]
    worker = psutil.Process(pid)
    llama.generate([f"warm {i}" for i in range(100)], max_tokens=2)
    before = worker.memory_info().rss
    for batch in range(9):
        outs = llama.generate([f"request {batch} {i}" for i in range(100)], max_tokens=2)
        assert all("m" in o.saves for o in outs)
    growth = worker.memory_info().rss - before
    stats = llama.engine_stats()
    assert stats["scheduler_results"] == 0
    assert stats["workers"][0]["sessions"] == 0 and stats["workers"][0]["hooks"] == 0
    assert growth < 64 * 2**20, f"worker RSS grew {growth / 2**20:.1f} MiB over 900 requests"


def test_prefix_cache_never_serves_kv_computed_under_an_edit(clean, hf_llama):
    llama = clean
    long = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 20)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    llm = llama.vllm_entrypoint
    with llama.edit() as (tracer, steer):
        llama.model.layers[1].mlp.output[:] *= 3.0
    steered = llm.generate([long], params, use_tqdm=False)[0]  # its KV is computed under the edit
    steer.clear()
    first = llm.generate([long], params, use_tqdm=False)[0]
    second = llm.generate([long], params, use_tqdm=False)[0]
    ids = list(first.prompt_token_ids)
    clean_lp = float(torch.log_softmax(HFRun(hf_llama, ids).logits()[-1], -1).max())
    steered_lp = max(x.logprob for x in steered.outputs[0].logprobs[0].values())
    for out in (first, second):
        assert abs(max(x.logprob for x in out.outputs[0].logprobs[0].values()) - clean_lp) < 1e-4
    assert abs(steered_lp - clean_lp) > 1e-3  # the edit did change that request
    assert second.num_cached_tokens  # clean requests still share the cache among themselves
