"""GPT-2 through a lazily dispatched VLLM: vLLM's own module tree
(``transformer.h[i]``), ``.input`` reads and writes, and chunked prefill."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ENGINE_KWARGS, HFRun, assert_close
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, results

PROMPT = "The capital of Japan is"


def test_construction_starts_nothing_and_shows_the_module_tree(gpt2_path, hf_gpt2):
    from vllm_nnsight_plugin import VLLM

    # its own instance: the shared fixture may have been dispatched by an earlier test
    model = VLLM(gpt2_path, dtype="float32", max_model_len=512, **ENGINE_KWARGS)
    try:
        assert not model.dispatched and model.vllm_entrypoint is None
        assert len(model.transformer.h) == len(hf_gpt2.transformer.h)  # vLLM's tree, built on meta
        assert not model.dispatched
    finally:
        model.shutdown()  # (nothing to stop, unless construction started an engine)


def test_a_trace_on_the_lazy_model_runs_and_every_block_equals_hugging_face(gpt2, hf_gpt2):
    with gpt2.trace(PROMPT, temperature=0.0) as tracer:
        blocks = [block.output.save() for block in gpt2.transformer.h].save()
        logits = gpt2.logits.save()
    assert gpt2.dispatched
    ids = tracer.outputs[0].prompt_token_ids
    hf = HFRun(hf_gpt2, ids)
    for i, block in enumerate(hf_gpt2.transformer.h):
        hf.record(f"h{i}", block)
    ref = hf.logits()
    for i, out in enumerate(blocks):
        assert_close(out, hf.records[f"h{i}"])
    assert_close(logits[0], ref[-1])


def test_input_read_and_assign(gpt2, hf_gpt2):
    with gpt2.trace(PROMPT, temperature=0.0) as tracer:
        seen = gpt2.transformer.h[2].input.save()
        gpt2.transformer.h[2].input = seen * 0.25
        logits = gpt2.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    rec = HFRun(hf_gpt2, ids).record("h1", hf_gpt2.transformer.h[1])
    rec.logits()
    assert_close(seen, rec.records["h1"])  # block 2's input is block 1's output
    ref = HFRun(hf_gpt2, ids).edit_input(hf_gpt2.transformer.h[2], lambda x: x * 0.25).logits()
    assert_close(logits[0], ref[-1])


def test_the_logit_lens_through_a_tied_unembedding_equals_hf(gpt2, hf_gpt2):
    """GPT-2 ties its unembedding to the input embedding, so vLLM's ``lm_head`` is
    ``transformer.wte``: called with hidden states it projects them to the vocabulary,
    called with token ids it embeds them."""
    ids = [5, 17, 99]
    with gpt2.trace(PROMPT, temperature=0.0) as tracer:
        lens = gpt2.lm_head(gpt2.transformer.ln_f(gpt2.transformer.h[1].output)).save()
        emb = gpt2.transformer.wte(torch.tensor(ids, device=gpt2.transformer.wte.weight.device)).save()
    prompt = tracer.outputs[0].prompt_token_ids
    rec = HFRun(hf_gpt2, prompt).record("h1", hf_gpt2.transformer.h[1])
    rec.logits()
    with torch.no_grad():
        assert_close(lens, hf_gpt2.lm_head(hf_gpt2.transformer.ln_f(rec.records["h1"])))
        assert_close(emb, hf_gpt2.transformer.wte(torch.tensor(ids)))


def test_steering_gpt2(gpt2, hf_gpt2):
    v = torch.linspace(-1, 1, 128)
    with gpt2.trace(PROMPT, temperature=0.0) as tracer:
        gpt2.transformer.h[1].output[:] += v
        logits = gpt2.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    ref = HFRun(hf_gpt2, ids).edit(hf_gpt2.transformer.h[1], lambda h: h + v).logits()
    assert_close(logits[0], ref[-1])


def test_a_code_block_on_a_split_prompt_gets_a_clear_per_request_error(gpt2):
    """A block that runs as code sees its prompt in one step: a prompt longer than the
    whole token budget cannot be, so that request ends naming the setting; a plan
    (below) gathers the chunks instead."""
    long = " ".join(["One two three four five six seven eight nine ten."] * 12)
    with pytest.raises(InterventionError, match="chunked prefill"):
        with gpt2.trace(long, temperature=0.0):
            h = gpt2.transformer.h[0].output
            if h.norm() > 0:  # control flow on a value: runs as code
                h.save()
    plain = gpt2.vllm_entrypoint.generate([long], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(plain.prompt_token_ids) > 64 and len(plain.outputs[0].token_ids) == 2
    read = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "h", "module": "transformer.h.0", "steps": "all"}]})
    out = gpt2.vllm_entrypoint.generate([long], SamplingParams(max_tokens=2, extra_args={"nnsight": read}),
                                        use_tqdm=False)[0]
    steps = results(out)["h"]
    assert [t.shape[0] for t in steps] == [len(out.prompt_token_ids), 1]


def test_a_tensor_valued_layer_is_indexed_as_the_block_indexes_it(gpt2):
    """vLLM's GPT-2 block returns one tensor: ``output[0]`` is its first row, so the
    block stays code (engine/lower.py) and means what it says."""
    with gpt2.trace("Hello world, this is", temperature=0.0):
        first = gpt2.transformer.h[0].output[0].save()
        whole = gpt2.transformer.h[0].output.save()
    assert first.dim() == 1 and torch.equal(first, whole[0])


def test_a_lowered_steering_block_applies_to_every_chunk_of_a_split_prompt(gpt2, hf_gpt2):
    """Run as the batched spec it is, a steering block is a fixed function of each
    row: chunked prefill applies it to every chunk (as code it must fail instead)."""
    long = " ".join(["One two three four five six seven eight nine ten."] * 12)
    v = torch.linspace(-1, 1, 128)
    with gpt2.trace(long, temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        logits = gpt2.logits.save()  # (a read of the logits only: the block still runs batched)
        for _ in tracer.all():
            gpt2.transformer.h[1].output[:] += v
    out = tracer.outputs[0]
    assert out.ran_as == "batched", out.ran_as
    ids = list(out.prompt_token_ids)
    assert len(ids) > 64  # split: the engine's token budget is 64
    ref = HFRun(hf_gpt2, ids).edit(hf_gpt2.transformer.h[1], lambda h: h + v).logits()[-1]
    assert_close(logits, ref)  # every chunk's rows were steered: the last row's logits say so
    clean = HFRun(hf_gpt2, ids).logits()[-1]
    assert (ref - clean).abs().max() > 1e-2  # (without the steering this test fails)
    with pytest.raises(InterventionError, match="chunked prefill"):
        with gpt2.trace(long, temperature=0.0, max_tokens=2, extra_args={"nnsight_lower": False}) as tracer:
            for _ in tracer.all():
                gpt2.transformer.h[1].output[:] += v


def test_traced_prompts_are_scheduled_whole_under_chunked_prefill(gpt2, hf_gpt2):
    """Four traced prompts of 30-40 tokens in one trace, with a token budget of 64 per
    step: chunked prefill would split the second prompt across steps. Each traced
    prompt waits for a step it fits in whole instead, so every block reads its whole
    prompt (equal to Hugging Face); an untraced prompt in the same batch is chunked
    as usual."""
    prompts = [" ".join([f"Sentence {i} says one two three four five six seven."] * 3) for i in range(4)]
    with gpt2.trace(temperature=0.0, max_tokens=2, extra_args={"nnsight_lower": False}) as tracer:
        saved = list().save()
        for prompt in prompts:
            with tracer.invoke(prompt):
                saved.append(gpt2.transformer.h[1].output)
    outputs = tracer.outputs
    assert len(saved) == len(prompts) and all(o.ran_as.startswith("code:") for o in outputs)
    assert all(30 <= len(o.prompt_token_ids) <= 64 for o in outputs)
    assert sum(len(o.prompt_token_ids) for o in outputs) > 64  # they cannot share one step
    for out, value in zip(outputs, saved):
        ids = out.prompt_token_ids
        rec = HFRun(hf_gpt2, ids).record("h1", hf_gpt2.transformer.h[1])
        rec.logits()
        assert value.shape[0] == len(ids)
        assert_close(value, rec.records["h1"])


def test_plans_read_and_edit_prompts_split_by_chunked_prefill(gpt2, hf_gpt2):
    """Three prompts longer than the engine's token budget (64) in one trace: chunked
    prefill splits every one of them. Each block runs as its plan, chunk by chunk: a
    prompt read returns every row in order, positions count from the prompt's start
    (rows in different chunks), a prompt-only edit and a last-row edit apply where the
    block put them; all equal Hugging Face."""
    prompts = [" ".join([f"Sentence {i} says one two three four five six seven."] * 8) for i in range(3)]
    v = torch.linspace(-1, 1, 128)
    with gpt2.trace(temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
        with tracer.invoke(prompts[0]):
            h = gpt2.transformer.h[1].output.save()
            last = gpt2.transformer.h[2].output[-1].save()
            two = gpt2.transformer.h[2].mlp.output[[0, 70]].save()
        with tracer.invoke(prompts[1]):
            rows = list().save()
            for step in tracer.iter[:3]:  # noqa: B007 - nnsight's own spelling
                gpt2.transformer.h[0].output[-1] += v
                rows.append(gpt2.transformer.h[3].output)
        with tracer.invoke(prompts[2]):
            gpt2.transformer.h[1].output[:] += v
            s = gpt2.transformer.h[3].output.save()
    outs = tracer.outputs
    assert [o.ran_as for o in outs] == ["batched"] * 3
    assert all(len(o.prompt_token_ids) > 70 for o in outs)  # each one split: the budget is 64

    def hf(out, edit=None):
        p = len(out.prompt_token_ids)
        run = HFRun(hf_gpt2, list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
        if edit is not None:
            run.edit(*edit(p))
        run.record("h1", hf_gpt2.transformer.h[1]).record("h2", hf_gpt2.transformer.h[2])
        run.record("mlp2", hf_gpt2.transformer.h[2].mlp).record("h3", hf_gpt2.transformer.h[3])
        logits = run.logits()
        assert list(out.outputs[0].token_ids) == [int(t) for t in logits[p - 1: p + 2].argmax(-1)]
        return run.records, p

    rec, p = hf(outs[0])
    assert h.shape[0] == p
    assert_close(h, rec["h1"][:p])
    assert last.dim() == 1
    assert_close(last, rec["h2"][p - 1])
    assert_close(two, rec["mlp2"][[0, 70]])

    def last_rows(p):
        return hf_gpt2.transformer.h[0], lambda t: t + (torch.arange(t.shape[1]) >= p - 1)[None, :, None] * v

    rec, p = hf(outs[1], last_rows)
    assert [r.shape[0] for r in rows] == [p, 1, 1]
    for got, want in zip(rows, [rec["h3"][:p], rec["h3"][p:p + 1], rec["h3"][p + 1:p + 2]]):
        assert_close(got, want)

    def prompt_rows(p):
        return hf_gpt2.transformer.h[1], lambda t: t + (torch.arange(t.shape[1]) < p)[None, :, None] * v

    rec, p = hf(outs[2], prompt_rows)
    assert_close(s, rec["h3"][:p])


def test_a_cache_of_a_prompt_split_by_chunked_prefill(gpt2, hf_gpt2):
    """The tiny GPT-2 engine's budget is 64 tokens: a 150-token prompt comes in three
    chunks; each cached module's prompt rows are gathered whole, in order."""
    prompt = list(range(5, 155))
    with gpt2.trace(temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        for p in (prompt, prompt[::-1]):
            with tracer.invoke({"prompt_token_ids": p}):
                cache = tracer.cache(modules=["model.transformer.h.0", gpt2.transformer.h[1]]).save()
    assert all(o.ran_as == "batched" for o in tracer.outputs)
    out = tracer.outputs[1]  # (the last invoke's names are the ones bound)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.no_grad():
        states = hf_gpt2(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    for i in (0, 1):
        visits = cache.model.transformer.h[i].output
        assert len(visits) == 2
        assert_close(visits[0], states[i + 1][0][:150])
        assert_close(visits[1], states[i + 1][0][150:151])
