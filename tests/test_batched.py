"""Batched edits: every-step, all-rows spec edits run without a block of their own,
applied once per distinct operation over all the requests that sent it. They must
give exactly what the same edit written as a block gives, request by request."""

from __future__ import annotations

import json

import torch
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, make_payload, results
from vllm_nnsight_plugin.engine import batched

PROMPTS = ["The capital of Japan is", "Hello world!", "One two three four", "The quick brown fox", "A B C"]


def _spec(vec: torch.Tensor, layer: int = 1, op: str = "add") -> str:
    body = {"op": op, "module": f"model.layers.{layer}", "index": 0, "steps": "all"}
    body.update({"value": vec.tolist()} if op in ("add", "set") else {"factor": 0.5} if op == "scale" else {})
    return json.dumps({"v": 1, "kind": "spec", "ops": [body]})


def _params(payload: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True,
                          extra_args={"nnsight": payload} if payload else None)


def _seen(outputs) -> list:
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
            for o in outputs]


VEC_A = torch.linspace(-2, 2, 128)
VEC_B = torch.linspace(1, -1, 128)


def _block_a(model, tracer):
    for _ in tracer.all():
        model.model.layers[1].output[0][:] += VEC_A


def _block_b(model, tracer):
    for _ in tracer.all():
        model.model.layers[1].output[0][:] += VEC_B


def test_steering_specs_qualify_for_the_batched_path():
    assert batched.eligible(json.loads(_spec(VEC_A)))
    once = {"op": "add", "module": "m", "value": [1], "steps": "prefill"}
    assert not batched.eligible({"kind": "spec", "ops": [once]})
    assert not batched.eligible({"kind": "spec", "ops": [{"op": "read", "name": "h", "module": "m", "steps": "all"}]})


def test_batched_steering_equals_the_same_steering_as_a_block(llama):
    llm = llama.vllm_entrypoint
    spec_a, spec_b = _spec(VEC_A), _spec(VEC_B)
    as_spec = llm.generate(PROMPTS, [_params(spec_a), _params(spec_b), _params(spec_a), _params(), _params(spec_a)],
                           use_tqdm=False)
    as_block = llm.generate(PROMPTS, [_params(make_payload(_block_a)), _params(make_payload(_block_b)),
                                      _params(make_payload(_block_a)), _params(), _params(make_payload(_block_a))],
                            use_tqdm=False)
    plain = llm.generate(PROMPTS, [_params()] * len(PROMPTS), use_tqdm=False)
    assert _seen(as_spec) == _seen(as_block)  # row for row, step for step
    assert _seen(as_spec)[3] == _seen(plain)[3]  # the untraced neighbour
    assert all(_seen(as_spec)[i] != _seen(plain)[i] for i in (0, 1, 2, 4))
    for out in as_spec[:3]:
        assert results(out) == {}


def test_a_bad_batched_edit_ends_only_its_requests(llama):
    llm = llama.vllm_entrypoint
    bad = _spec(torch.ones(7))  # wrong width for a 128-wide hidden state
    outs = llm.generate(PROMPTS[:3], [_params(bad), _params(), _params(bad)], use_tqdm=False)
    for i in (0, 2):
        try:
            results(outs[i])
            raise AssertionError("no error reported")
        except InterventionError as err:
            assert "ops[0] (add model.layers.1)" in str(err)
    assert len(outs[1].outputs[0].token_ids) == 5
