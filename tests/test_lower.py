"""Code blocks run as their recorded plan (engine/record.py, engine/lower.py): a
block's plan must give exactly what it gives as code: the same saved names and
values, bit for bit, the same tokens, its errors at its own lines."""

from __future__ import annotations

import pytest
import torch
from conftest import HFRun, assert_close, assert_same, generate_together
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, make_payload, results
from vllm_nnsight_plugin.engine import plan_ops


def test_a_value_that_is_not_the_annotated_structure_is_refused_naming_the_fix():
    """vLLM's annotations are sometimes wrong (a few decoder layers say a pair and
    return one tensor): a lowered op then fails its request rather than index the
    value otherwise."""
    op = {"op": "read", "name": "x", "module": "model.layers.0", "index": 0, "structure": 2}
    plan_ops.check_structure(op, (torch.zeros(2, 4), torch.zeros(2, 4)))
    with pytest.raises(TypeError, match="is a Tensor, not a tuple of 2 tensors.*nnsight_lower"):
        plan_ops.check_structure(op, torch.zeros(2, 4))
    plan_ops.check_structure(op, (torch.zeros(2, 4), None))  # (a linear without a bias)
    with pytest.raises(TypeError, match=r"a tuple of \(NoneType, Tensor\)"):
        plan_ops.check_structure(op, (None, torch.zeros(2, 4)))
    with pytest.raises(TypeError, match="is a tuple .* not a tensor"):
        plan_ops.check_structure({**op, "structure": 0}, (torch.zeros(2, 4), torch.zeros(2, 4)))
    plan_ops.check_structure({"op": "read", "name": "x", "module": "m"}, None)  # a user's spec: no check here
    assert plan_ops._code_fits(op, "(TT") and plan_ops._code_fits(op, "(TN")
    assert not plan_ops._code_fits(op, "T") and not plan_ops._code_fits(op, "(NT")


# ------------------------------------------------------------------ on the engine

PROMPTS = ["The capital of Japan is", "Hello world!", "One two three four", "The quick brown fox"]
STEER = torch.linspace(-1, 1, 128)
TOO_LONG = torch.ones(129)


def read_prompt(model, tracer):
    out = model.model.layers[0].output
    s = (out[0] + out[1]).save()  # noqa: F841
    a = model.model.layers[1].self_attn.output.clone().save()  # noqa: F841
    x = model.model.layers[1].output[0].save()  # noqa: F841


def read_every_step(model, tracer):
    rows = []
    for _ in tracer.all():
        out = model.model.layers[1].output
        rows.append(out[0] + out[1])
    stream = rows.save()  # noqa: F841


def steer_and_read(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[0].output[0][:] += STEER
        model.model.layers[1].self_attn.output[:] *= 0.5
        seen.append(model.model.layers[1].output[0].clone())


def steer_wrong_size(model, tracer):
    for _ in tracer.all():
        model.model.layers[0].output[0][:] += TOO_LONG


def _params(block, lower: bool = True, **kw) -> SamplingParams:
    extra = {"nnsight": make_payload(block)}
    if not lower:
        extra["nnsight_lower"] = False
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, **kw}, extra_args=extra)


def _lowered(llm) -> int:
    return llm.collective_rpc("nnsight_lane_stats")[0]["lowered"]


@pytest.mark.parametrize("block", [read_prompt, read_every_step, steer_and_read])
def test_a_lowered_block_gives_exactly_what_the_block_gives(llama, block):
    """Each prompt twice in one batch, the halves in the same steps: lowered and as code.
    Same tokens, same saved names, values equal bit for bit (on a GPU to 1e-5)."""
    llm = llama.vllm_entrypoint
    n = len(PROMPTS)

    before = _lowered(llm)
    outs = generate_together(llm, PROMPTS * 2, [_params(block)] * n + [_params(block, lower=False)] * n)
    assert _lowered(llm) - before == n  # the first half ran as the spec, the second as code
    lowered, code = outs[:n], outs[n:]

    for a, b in zip(lowered, code):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        saved, as_code = results(a), results(b)
        assert sorted(saved) == sorted(as_code) and saved
        # (on a GPU the spec's edit kernels may round the last bits unlike the block's
        # Python edit; on the CPU they agree bit for bit)
        tol = 1e-5 if torch.cuda.is_available() else 0.0
        assert_same(saved, as_code, rtol=tol, atol=tol)


def test_lowered_blocks_match_hugging_face(llama, hf_llama):
    llm = llama.vllm_entrypoint
    read, steered = llm.generate(PROMPTS[:2], [_params(read_every_step), _params(steer_and_read)], use_tqdm=False)
    ids = list(read.prompt_token_ids)
    stream = results(read)["stream"]
    assert len(stream) == 4 and stream[0].shape[0] == len(ids)
    run = HFRun(hf_llama, ids).record("layer1", hf_llama.model.layers[1])
    run.logits()
    assert_close(stream[0], run.records["layer1"])  # hidden + residual: the layer's output
    ids = list(steered.prompt_token_ids)
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + STEER) \
        .edit(hf_llama.model.layers[1].self_attn, lambda h: h * 0.5).logits()[-1]
    assert steered.outputs[0].token_ids[0] == int(ref.argmax())


def test_a_lowered_steering_error_ends_only_its_request_at_its_line(llama):
    llm = llama.vllm_entrypoint
    outs = llm.generate(PROMPTS[:3], [_params(read_prompt), _params(steer_wrong_size), _params(read_prompt)],
                        use_tqdm=False)
    with pytest.raises(InterventionError) as info:
        results(outs[1])
    err = info.value
    assert "model.model.layers[0].output[0][:] += TOO_LONG" in str(err)
    assert "129" in str(err) and "ops[" not in str(err)
    for out in (outs[0], outs[2]):
        assert results(out)["x"].shape[0] == len(out.prompt_token_ids)
    code = llm.generate(PROMPTS[1:2], _params(steer_wrong_size, lower=False), use_tqdm=False)[0]
    with pytest.raises(InterventionError) as as_code:
        results(code)
    assert as_code.value.lineno == err.lineno  # the same line as the block's own error


def test_the_readme_form_through_trace_is_lowered(llama):
    """The saved list rebound to its own name, sent by ``VLLM.trace``."""
    llm = llama.vllm_entrypoint
    vec = STEER
    before = _lowered(llm)
    with llama.trace(PROMPTS[0], temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
        stream = []
        for _ in tracer.all():
            llama.model.layers[0].output[0][:] += vec
            llama.model.layers[1].self_attn.output[:] *= 0.5
            out = llama.model.layers[2].output
            stream.append(out[0] + out[1])
        stream = stream.save()
    assert _lowered(llm) - before == 1
    assert len(stream) == 3 and stream[0].shape[0] == len(tracer.outputs[0].prompt_token_ids)


def _halve_every_step(model, tracer):
    for _ in tracer.all():
        model.model.layers[0].output[0][:] *= 0.5


def _halve_if_positive(model, tracer):
    h = model.model.layers[0].output[0]
    if h.norm() > 0:  # Python control flow on a tensor's value: only code can run this
        h[:] *= 0.5


def test_each_request_reports_how_its_blocks_ran(llama):
    """RequestOutput.ran_as: "batched" for a batched spec and for a block the engine
    runs as one, "code: <file>:<line> (<why>)" otherwise, for every request (also one
    that only steers and saves nothing)."""
    import json

    steer = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "scale", "module": "model.layers.0.mlp", "factor": 0.5, "steps": "all"}]})
    cases = [
        ({"nnsight": steer}, "batched"),
        ({"nnsight": make_payload(_halve_every_step)}, "batched"),
        ({"nnsight": make_payload(_halve_every_step), "nnsight_lower": False}, "(nnsight_lower is off)"),
        ({"nnsight": make_payload(_halve_if_positive)},
         f":{_halve_if_positive.__code__.co_firstlineno + 2} (uses .norm of a module's value)"),
    ]
    outs = llama.vllm_entrypoint.generate(
        ["Hello"] * len(cases), [SamplingParams(max_tokens=3, extra_args=extra) for extra, _ in cases], use_tqdm=False)
    for out, (_, want) in zip(outs, cases):
        if want == "batched":
            assert out.ran_as == "batched", out.ran_as
        else:
            assert out.ran_as.startswith(f"code: {__file__}:") and out.ran_as.endswith(want), out.ran_as
    plain = llama.vllm_entrypoint.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.ran_as is None
