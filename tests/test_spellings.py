"""The spelling zoo: the same interventions written the many ways researchers write
them (named constants, helpers, ``for``/``with`` step loops, aliases, unpacking,
slices, row picks) all run as one batched plan and equal a Hugging Face fp32
forward with the same weights; what a plan cannot hold runs as code, says which
line and why, and also equals Hugging Face. All in one batch of requests."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, assert_close
from vllm import SamplingParams

from vllm_nnsight_plugin import make_payload, results
from vllm_nnsight_plugin.engine.tree import leaves

V = torch.linspace(-1, 1, 128)  # a steering vector of the tiny Llama's width
LAYER = 1  # a named layer constant, as nnsight's own examples write it
STEPS = 3  # tokens each request generates (steps 0, 1, 2)
PROMPTS = ["The capital of Japan is", "Hello world!", "One two three four", "The quick brown fox"]


# ------------------------------------------------------------------ reads at the prompt

def read_hidden(model, tracer):
    x = model.model.layers[1].output[0].save()  # noqa: F841


def read_residual_sum(model, tracer):
    out = model.model.layers[1].output
    s = (out[0] + out[1]).save()  # noqa: F841


def read_named_constant(model, tracer):
    h = model.model.layers[LAYER].self_attn.output.save()  # noqa: F841


def read_last_row(model, tracer):
    last = model.model.layers[2].output[0][-1].save()  # noqa: F841


def residual_of(layer):
    out = layer.output
    return out[0] + out[1]


def read_whole_output(model, tracer):
    out = model.model.layers[1].output.save()  # noqa: F841 - (hidden, residual)


def read_a_linear(model, tracer):
    o = model.model.layers[1].self_attn.o_proj.output[0].save()  # noqa: F841 - vLLM's (output, bias)


def read_through_a_helper(model, tracer):
    r = residual_of(model.model.layers[3]).save()  # noqa: F841


def read_unpacked(model, tracer):
    hidden, residual = model.model.layers[0].output
    h = hidden.save()  # noqa: F841


def read_negative_index_clone(model, tracer):
    layers = model.model.layers
    x = layers[-1].output[0].clone().save()  # noqa: F841


def read_picked_rows(model, tracer):
    rows = model.model.layers[0].output[0][[0, 1]].save()  # noqa: F841


def read_an_input(model, tracer):
    x = model.model.layers[2].mlp.input.save()  # noqa: F841


def read_logits(model, tracer):
    logits = model.logits.save()  # noqa: F841


# ------------------------------------------------------------------ every-step capture

def capture_logits_every_step(model, tracer):
    logits = list().save()
    for step in tracer.iter[:]:  # noqa: B007 - nnsight's own spelling
        logits.append(model.logits)


def capture_iter_bounded(model, tracer):
    rows = list().save()
    for step in tracer.iter[:STEPS]:  # noqa: B007 - nnsight's own spelling
        rows.append(model.model.layers[LAYER].output[0])


def capture_all_residual(model, tracer):
    rows = []
    for _ in tracer.all():
        o = model.model.layers[2].output
        rows.append(o[0] + o[1])
    rows = rows.save()


def capture_whole_output(model, tracer):
    outs = list().save()
    for _ in tracer.all():
        outs.append(model.model.layers[2].output)


def capture_a_linears_bias(model, tracer):
    biases = list().save()
    for _ in tracer.all():
        biases.append(model.model.layers[0].self_attn.o_proj.output[1])  # (None: no bias)


def capture_with_iter_last_row(model, tracer):
    rows = list().save()
    with tracer.iter[:] as it:  # noqa: F841
        rows.append(model.model.layers[3].output[0][-1])


def capture_with_all(model, tracer):
    stream = list().save()
    with tracer.all():
        stream.append(model.model.layers[0].self_attn.output.clone())


def capture_later_steps(model, tracer):
    late = list().save()
    for step in tracer.iter[1:STEPS]:  # noqa: B007
        late.append(model.model.layers[2].output[0])


# ------------------------------------------------------------------ steering

def steer_all_read_once(model, tracer):
    for step in tracer.iter[:STEPS]:  # noqa: B007 - nnsight's own spelling
        model.model.layers[0].output[0][:] += V
        if step == 0:
            s = residual_of(model.model.layers[2]).save()  # noqa: F841


def steer_a_linear(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[1].mlp.down_proj.output[0][:] += V
        seen.append(model.model.layers[2].output[0])


def steer_and_save_the_result(model, tracer):
    seen = list().save()
    for step in tracer.iter[:]:  # noqa: B007 - nnsight's own spelling
        model.model.layers[1].output[0][:] += V
        seen.append(model.model.layers[2].output[0])
    ids = tracer.result.outputs[0].token_ids.save()  # noqa: F841 - (the finished output's, in the front end)


def steer_with_all_named(model, tracer):
    seen = list().save()
    with tracer.all():
        model.model.layers[LAYER].output[0][:] += V
        seen.append(model.model.layers[3].output[0])


def steer(layer, vec, alpha=1.0):
    layer.output[0][:] += alpha * vec


def steer_through_a_helper(model, tracer):
    seen = list().save()
    for _ in tracer.iter[:]:
        steer(model.model.layers[1], V, alpha=2.0)
        seen.append(model.model.layers[2].output[0])


def steer_prompt_only(model, tracer):
    rows = list().save()
    model.model.layers[1].output[0][:] += V
    for _ in tracer.all():
        rows.append(model.model.layers[3].output[0])


def steer_last_row(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[1].output[0][-1] += V
        seen.append(model.model.layers[2].output[0])


def steer_first_two_steps(model, tracer):
    seen = list().save()
    for step in tracer.iter[:STEPS]:  # noqa: B007 - nnsight's own spelling
        if step < 2:
            model.model.layers[0].output[0][:] += V
        seen.append(model.model.layers[1].output[0])


def steer_assigned_sum(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        h = model.model.layers[0].output[0]
        h[:] = h + V
        seen.append(model.model.layers[3].output[0])


def steer_subtracted(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[2].output[0][:] -= V
        seen.append(model.model.layers[3].output[0])


def steer_every_layer(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        for layer in model.model.layers[:2]:
            layer.output[0][:] += 0.5 * V
        seen.append(model.model.layers[3].output[0])


def steer_with_a_tensor_method(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[0].output[0].add_(V)
        seen.append(model.model.layers[3].output[0])


# ------------------------------------------------------------------ ablation

def ablate_with_zero_(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[1].mlp.output.zero_()
        seen.append(model.model.layers[2].output[0])


def ablate_mlp(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[1].mlp.output[:] = 0
        seen.append(model.model.layers[2].output[0])


def halve_attention(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[2].self_attn.output[:] *= 0.5
        seen.append(model.model.layers[3].output[0])


def zero_at_prompt(model, tracer):
    model.model.layers[1].output[0][:] = 0
    s = residual_of(model.model.layers[3]).save()  # noqa: F841


def set_every_step(model, tracer):
    seen = list().save()
    for _ in tracer.all():
        model.model.layers[1].output[0][:] = V
        seen.append(model.model.layers[2].output[0])


# ------------------------------------------------------------------ as code

def halve_if_positive(model, tracer):
    h = model.model.layers[1].output[0]
    if h.norm() > 0:  # control flow on a value: only code can run this
        h[:] *= 0.5
    s = residual_of(model.model.layers[3]).save()  # noqa: F841


def lens_over_layers(model, tracer):
    hs = []
    for i in range(4):
        hs.append(model.model.layers[i].output[0].clone())  # a list of different modules
    hs = hs.save()


def last_rows_of_every_layer(model, tracer):
    lasts = [layer.output[0][-1] for layer in model.model.layers]
    lasts = lasts.save()


def a_layer_and_the_logits(model, tracer):
    both = [model.model.layers[1].output[0], model.logits]
    both = both.save()


def argmax_of_logits(model, tracer):
    top = model.logits.argmax(-1).save()  # noqa: F841


def relu_in_place(model, tracer):
    h = model.model.layers[1].output[0]
    h[:] = torch.relu(h)
    s = residual_of(model.model.layers[3]).save()  # noqa: F841


# ------------------------------------------------------------------ Hugging Face


def hf_states(hf, ids: list[int], edits: dict[str, object] | None = None) -> dict[str, torch.Tensor]:
    """HF fp32 forward over ``ids``: per layer i ``mlp{i}`` (vLLM's output[0]),
    ``layer{i}`` (hidden + residual), ``attn{i}``, ``mlpin{i}``, and ``logits``.
    ``edits``: "mlp{i}"/"attn{i}" -> fn(rows, positions) giving the edited rows."""
    edits = edits or {}
    rec: dict[str, torch.Tensor] = {}
    handles = []

    def out_hook(name):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if name in edits:
                t = edits[name](t[0], torch.arange(t.shape[1]))[None]
            rec[name] = t[0].detach().clone()
            return (t, *out[1:]) if isinstance(out, tuple) else t
        return hook

    for i, layer in enumerate(hf.model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: rec.__setitem__(f"mlpin{i}", a[0][0].detach().clone())))
        handles.append(layer.mlp.register_forward_hook(out_hook(f"mlp{i}")))
        handles.append(layer.self_attn.register_forward_hook(out_hook(f"attn{i}")))
        handles.append(layer.register_forward_hook(out_hook(f"layer{i}")))
    try:
        with torch.no_grad():
            rec["logits"] = hf(torch.tensor([ids])).logits[0]
    finally:
        for h in handles:
            h.remove()
    return rec


def _per_step(rows: torch.Tensor, prompt_len: int, steps) -> list[torch.Tensor]:
    """An every-step read's values from a whole-sequence forward: the prompt's rows at
    step 0, one row at each later step."""
    return [rows[:prompt_len] if s == 0 else rows[prompt_len + s - 1: prompt_len + s] for s in steps]


def _add(v, rows=None, steps=None, prompt_len=0):
    """An HF edit adding ``v`` (at ``rows``: "last" of each step; at ``steps`` only)."""
    def fn(t, pos):
        keep = torch.ones(len(pos), dtype=torch.bool)
        if steps is not None:
            step = torch.clamp(pos - prompt_len + 1, min=0)
            keep = torch.isin(step, torch.tensor(steps))
        if rows == "last":  # the prompt's last row, and each generated row
            keep &= pos >= prompt_len - 1
        return t + keep[:, None] * v
    return fn


def _whole(out, h, layer: int, rows) -> list:
    """A decoder layer's whole output ``(hidden, residual)`` against HF: the hidden
    part, and the sum (HF's layer output)."""
    assert isinstance(out, tuple) and len(out) == 2, type(out)
    rows = torch.as_tensor(rows)
    return [(out[0], h[f"mlp{layer}"][rows]), (out[0] + out[1], h[f"layer{layer}"][rows])]


def _one_per_step(values: list) -> list:
    """A pair that says an every-step read holds one value per step (a split prompt's
    chunks are one step)."""
    return [(torch.tensor(float(len(values))), torch.tensor(float(STEPS)))]


def _at_prompt(prompt_len, fn):
    """An HF edit of the prompt's rows only (a block's edit outside a step loop)."""
    return lambda t, pos: torch.where((pos < prompt_len)[:, None], fn(t), t)


# name -> (block, expectation(saves, hf_run(edits), prompt_len))
ALL = range(STEPS)


def _items(got: list, want: list) -> list:
    """A saved list's items beside the expected ones: as many, in order."""
    assert isinstance(got, list) and len(got) == len(want), (type(got), len(got), len(want))
    return list(zip(got, want))


def _zoo():
    return {
        "read_hidden": (read_hidden, {}, lambda s, h, p: [(s["x"], h["mlp1"][:p])]),
        "read_residual_sum": (read_residual_sum, {}, lambda s, h, p: [(s["s"], h["layer1"][:p])]),
        "read_named_constant": (read_named_constant, {}, lambda s, h, p: [(s["h"], h["attn1"][:p])]),
        "read_last_row": (read_last_row, {}, lambda s, h, p: [(s["last"], h["mlp2"][p - 1])]),
        "read_whole_output": (read_whole_output, {}, lambda s, h, p: _whole(s["out"], h, 1, range(p))),
        "read_a_linear": (read_a_linear, {}, lambda s, h, p: [(s["o"], h["attn1"][:p])]),
        "read_through_a_helper": (read_through_a_helper, {}, lambda s, h, p: [(s["r"], h["layer3"][:p])]),
        "lens_over_layers": (lens_over_layers, {},
                             lambda s, h, p: _items(s["hs"], [h[f"mlp{i}"][:p] for i in range(4)])),
        "last_rows_of_every_layer": (last_rows_of_every_layer, {},
                                     lambda s, h, p: _items(s["lasts"], [h[f"mlp{i}"][p - 1] for i in range(4)])),
        "a_layer_and_the_logits": (a_layer_and_the_logits, {},
                                   lambda s, h, p: _items(s["both"], [h["mlp1"][:p], h["logits"][p - 1:p]])),
        "read_unpacked": (read_unpacked, {}, lambda s, h, p: [(s["h"], h["mlp0"][:p])]),
        "read_negative_index_clone": (read_negative_index_clone, {}, lambda s, h, p: [(s["x"], h["mlp3"][:p])]),
        "read_picked_rows": (read_picked_rows, {}, lambda s, h, p: [(s["rows"], h["mlp0"][:2])]),
        "read_an_input": (read_an_input, {}, lambda s, h, p: [(s["x"], h["mlpin2"][:p])]),
        "read_logits": (read_logits, {}, lambda s, h, p: [(s["logits"][0], h["logits"][p - 1])]),
        "capture_logits_every_step": (capture_logits_every_step, {},
                                      lambda s, h, p: zip(s["logits"], h["logits"][p - 1: p + 2])),
        "capture_iter_bounded": (capture_iter_bounded, {},
                                 lambda s, h, p: zip(s["rows"], _per_step(h["mlp1"], p, ALL))),
        "capture_all_residual": (capture_all_residual, {},
                                 lambda s, h, p: zip(s["rows"], _per_step(h["layer2"], p, ALL))),
        "capture_whole_output": (capture_whole_output, {}, lambda s, h, p: _one_per_step(s["outs"]) + [
            pair for out, rows in zip(s["outs"], _per_step(torch.arange(p + STEPS), p, ALL))
            for pair in _whole(out, h, 2, rows)]),
        "capture_a_linears_bias": (capture_a_linears_bias, {}, lambda s, h, p: _one_per_step(s["biases"]) + [
            (torch.tensor(float(all(b is None for b in s["biases"]))), torch.tensor(1.0))]),
        "capture_with_iter_last_row": (capture_with_iter_last_row, {},
                                       lambda s, h, p: zip(s["rows"], [r[-1] for r in _per_step(h["mlp3"], p, ALL)])),
        "capture_with_all": (capture_with_all, {}, lambda s, h, p: zip(s["stream"], _per_step(h["attn0"], p, ALL))),
        "capture_later_steps": (capture_later_steps, {},
                                lambda s, h, p: zip(s["late"], _per_step(h["mlp2"], p, [1, 2]))),
        "steer_all_read_once": (steer_all_read_once, {"mlp0": lambda p: _add(V)},
                                lambda s, h, p: [(s["s"], h["layer2"][:p])]),
        "steer_a_linear": (steer_a_linear, {"mlp1": lambda p: _add(V)},
                           lambda s, h, p: zip(s["seen"], _per_step(h["mlp2"], p, ALL))),
        "steer_and_save_the_result": (steer_and_save_the_result, {"mlp1": lambda p: _add(V)},
                                      lambda s, h, p: [*zip(s["seen"], _per_step(h["mlp2"], p, ALL)),
                                                       (torch.tensor(list(s["ids"])).float(),
                                                        h["logits"][p - 1: p - 1 + STEPS].argmax(-1).float())]),
        "steer_with_all_named": (steer_with_all_named, {"mlp1": lambda p: _add(V)},
                                 lambda s, h, p: zip(s["seen"], _per_step(h["mlp3"], p, ALL))),
        "steer_through_a_helper": (steer_through_a_helper, {"mlp1": lambda p: _add(2.0 * V)},
                                   lambda s, h, p: zip(s["seen"], _per_step(h["mlp2"], p, ALL))),
        "steer_prompt_only": (steer_prompt_only, {"mlp1": lambda p: _add(V, steps=[0], prompt_len=p)},
                              lambda s, h, p: zip(s["rows"], _per_step(h["mlp3"], p, ALL))),
        "steer_last_row": (steer_last_row, {"mlp1": lambda p: _add(V, rows="last", prompt_len=p)},
                           lambda s, h, p: zip(s["seen"], _per_step(h["mlp2"], p, ALL))),
        "steer_first_two_steps": (steer_first_two_steps, {"mlp0": lambda p: _add(V, steps=[0, 1], prompt_len=p)},
                                  lambda s, h, p: zip(s["seen"], _per_step(h["mlp1"], p, ALL))),
        "steer_assigned_sum": (steer_assigned_sum, {"mlp0": lambda p: _add(V)},
                               lambda s, h, p: zip(s["seen"], _per_step(h["mlp3"], p, ALL))),
        "steer_subtracted": (steer_subtracted, {"mlp2": lambda p: _add(-V)},
                             lambda s, h, p: zip(s["seen"], _per_step(h["mlp3"], p, ALL))),
        "steer_every_layer": (steer_every_layer, {"mlp0": lambda p: _add(0.5 * V), "mlp1": lambda p: _add(0.5 * V)},
                              lambda s, h, p: zip(s["seen"], _per_step(h["mlp3"], p, ALL))),
        "steer_with_a_tensor_method": (steer_with_a_tensor_method, {"mlp0": lambda p: _add(V)},
                                       lambda s, h, p: zip(s["seen"], _per_step(h["mlp3"], p, ALL))),
        "ablate_with_zero_": (ablate_with_zero_, {"mlp1": lambda p: (lambda t, pos: torch.zeros_like(t))},
                              lambda s, h, p: zip(s["seen"], _per_step(h["mlp2"], p, ALL))),
        "ablate_mlp": (ablate_mlp, {"mlp1": lambda p: (lambda t, pos: torch.zeros_like(t))},
                       lambda s, h, p: zip(s["seen"], _per_step(h["mlp2"], p, ALL))),
        "halve_attention": (halve_attention, {"attn2": lambda p: (lambda t, pos: t * 0.5)},
                            lambda s, h, p: zip(s["seen"], _per_step(h["mlp3"], p, ALL))),
        "zero_at_prompt": (zero_at_prompt, {"mlp1": lambda p: (lambda t, pos: t * (pos >= p)[:, None])},
                           lambda s, h, p: [(s["s"], h["layer3"][:p])]),
        "set_every_step": (set_every_step, {"mlp1": lambda p: (lambda t, pos: V.expand_as(t))},
                           lambda s, h, p: zip(s["seen"], _per_step(h["mlp2"], p, ALL))),
    }


CODE = {  # name -> (block, line (relative to the def), why, HF edits, expectation)
    "halve_if_positive": (halve_if_positive, 2, "uses .norm of a module's value",
                          {"mlp1": lambda p: _at_prompt(p, lambda t: t * 0.5)},
                          lambda s, h, p: [(s["s"], h["layer3"][:p])]),
    "argmax_of_logits": (argmax_of_logits, 1, "uses .argmax of a module's value", {},
                         lambda s, h, p: [(s["top"].float(), h["logits"][p - 1].argmax(-1, keepdim=True).float())]),
    "relu_in_place": (relu_in_place, 2, "passes a module's value to torch (relu)",
                      {"mlp1": lambda p: _at_prompt(p, torch.relu)}, lambda s, h, p: [(s["s"], h["layer3"][:p])]),
}


def _params(block) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True,
                          extra_args={"nnsight": make_payload(block)})


@pytest.fixture(scope="module")
def zoo_runs(llama):
    """Every spelling (and the code forms) in one batch, twice."""
    names = list(_zoo()) + list(CODE)
    blocks = [_zoo()[n][0] if n in _zoo() else CODE[n][0] for n in names]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    llm = llama.vllm_entrypoint
    first = llm.generate(prompts, [_params(b) for b in blocks], use_tqdm=False)
    again = llm.generate(prompts, [_params(b) for b in blocks], use_tqdm=False)
    return dict(zip(names, first)), dict(zip(names, again))


def _check(out, edits, expect, hf_llama) -> None:
    saves = results(out)
    p = len(out.prompt_token_ids)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    states = hf_states(hf_llama, ids, {k: make(p) for k, make in edits.items()})
    pairs = list(expect(saves, states, p))
    assert pairs
    for got, want in pairs:
        assert_close(got, want)
    # the generated tokens are the edited model's greedy choices
    assert list(out.outputs[0].token_ids) == [int(t) for t in states["logits"][p - 1: p - 1 + STEPS].argmax(-1)]


LONG = [" ".join([f"Sentence {i} says one two three four five six seven."] * 8) for i in range(4)]


@pytest.fixture(scope="module")
def split_runs(llama_path):
    """Every spelling again, on an engine whose token budget (64) is below every
    prompt's length: chunked prefill splits each prompt, with several requests per
    step."""
    from conftest import ENGINE_KWARGS

    from vllm_nnsight_plugin import VLLM

    model = VLLM(llama_path, dispatch=True, dtype="float32", max_model_len=512, max_num_seqs=32,
                 max_num_batched_tokens=64, enable_chunked_prefill=True, seed=0, **ENGINE_KWARGS)
    names = list(_zoo())
    outs = model.vllm_entrypoint.generate([LONG[i % len(LONG)] for i in range(len(names))],
                                          [_params(_zoo()[n][0]) for n in names], use_tqdm=False)
    yield dict(zip(names, outs))
    model.shutdown()


@pytest.mark.parametrize("name", list(_zoo()))
def test_each_spelling_on_prompts_split_by_chunked_prefill(split_runs, hf_llama, name):
    out = split_runs[name]
    assert len(out.prompt_token_ids) > 64 and out.ran_as == "batched", (len(out.prompt_token_ids), out.ran_as)
    _, edits, expect = _zoo()[name]
    _check(out, edits, expect, hf_llama)


def test_the_zoo_has_the_spellings_the_issue_asks_for():
    assert len(_zoo()) >= 25


@pytest.mark.parametrize("name", list(_zoo()))
def test_each_spelling_runs_batched_and_equals_hugging_face(zoo_runs, hf_llama, name):
    out = zoo_runs[0][name]
    assert out.ran_as == "batched", out.ran_as
    _, edits, expect = _zoo()[name]
    _check(out, edits, expect, hf_llama)


@pytest.mark.parametrize("name", list(CODE))
def test_what_a_plan_cannot_hold_runs_as_code_at_its_line_and_equals_hugging_face(zoo_runs, hf_llama, name):
    block, offset, why, edits, expect = CODE[name]
    out = zoo_runs[0][name]
    line = block.__code__.co_firstlineno + offset
    assert out.ran_as == f"code: {__file__}:{line} ({why})", out.ran_as
    _check(out, edits, expect, hf_llama)


def test_plain_vllm_outputs_take_a_saved_result_from_themselves(zoo_runs):
    """Raw ``LLM.generate`` with a payload: ``results(out)`` and ``out.saves`` give a saved
    ``tracer.result`` part from that very output."""
    out = zoo_runs[0]["steer_and_save_the_result"]
    assert list(results(out)["ids"]) == list(out.saves["ids"]) == list(out.outputs[0].token_ids)


def test_the_same_batch_twice_gives_the_same_saves_and_reports(zoo_runs):
    """Bit for bit on CPU. On a GPU a GEMM's last bits depend on which requests share
    its step, and two runs of one trace may form steps differently (a request joins the
    step running when it reaches the engine; see generate_together): equal there to 1e-5."""
    first, again = zoo_runs
    same = torch.equal if not torch.cuda.is_available() else \
        (lambda x, y: x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-5))
    for name in first:
        assert first[name].ran_as == again[name].ran_as
        assert list(first[name].outputs[0].token_ids) == list(again[name].outputs[0].token_ids)
        a, b = results(first[name]), results(again[name])
        assert sorted(a) == sorted(b)
        for key in a:
            xs, ys = list(leaves(a[key])), list(leaves(b[key]))  # (a tuple read: each element)
            assert [x is None for x in xs] == [y is None for y in ys], (name, key)
            xs, ys = [x for x in xs if x is not None], [y for y in ys if y is not None]
            assert len(xs) == len(ys) and all(same(x, y) if isinstance(x, torch.Tensor) else x == y
                                              for x, y in zip(xs, ys)), (name, key)  # (token ids: ints)


def test_through_trace_with_many_invokes_every_spelling_is_batched(llama, hf_llama):
    """The README's shape: one trace, an invoke per prompt, nnsight's own spellings."""
    with llama.trace(temperature=0.0, max_tokens=STEPS, ignore_eos=True) as tracer:
        with tracer.invoke(PROMPTS[0]):
            a = list().save()
            for step in tracer.iter[:STEPS]:  # noqa: B007 - nnsight's own spelling
                llama.model.layers[LAYER].output[0][:] += V
                a.append(llama.model.layers[3].output[0][-1])
        with tracer.invoke(PROMPTS[1]):
            b = llama.model.layers[2].output[0][-1].save()
        with tracer.invoke(PROMPTS[2]):
            with tracer.all():
                llama.model.layers[0].mlp.output[:] *= 0.0
    outs = tracer.outputs
    assert [o.ran_as for o in outs] == ["batched"] * 3
    p = len(outs[0].prompt_token_ids)
    states = hf_states(hf_llama, list(outs[0].prompt_token_ids) + list(outs[0].outputs[0].token_ids),
                       {"mlp1": _add(V)})
    for got, want in zip(a, [r[-1] for r in _per_step(states["mlp3"], p, ALL)]):
        assert_close(got, want)
    p = len(outs[1].prompt_token_ids)
    assert_close(b, hf_states(hf_llama, list(outs[1].prompt_token_ids))["mlp2"][p - 1])
    assert TOL <= 1e-4


def test_tracer_result_saved_whole_in_part_or_alone_is_batched(llama, hf_llama):
    """nnsight's ``tracer.result`` (the finished ``RequestOutput``, which only the front
    end holds) saved in a block is one more op of the plan: the engine ships its path,
    and the client takes that part of the output."""
    with llama.trace(temperature=0.0, max_tokens=STEPS, ignore_eos=True) as tracer:
        with tracer.invoke(PROMPTS[0]):
            for step in tracer.iter[:]:  # noqa: B007 - nnsight's own spelling
                llama.model.layers[LAYER].output[0][:] += V
            result = tracer.result.save()
        with tracer.invoke(PROMPTS[1]):
            h = llama.model.layers[2].output[0][-1].save()
            ids = tracer.result.outputs[0].token_ids.save()
        with tracer.invoke(PROMPTS[2]):
            alone = tracer.result.save()
    outs = tracer.outputs
    assert [o.ran_as for o in outs] == ["batched"] * 3
    assert result is outs[0] and alone is outs[2] and list(ids) == list(outs[1].outputs[0].token_ids)
    p = len(result.prompt_token_ids)  # (the steered request's tokens: the steered model's greedy choices)
    states = hf_states(hf_llama, list(result.prompt_token_ids) + list(result.outputs[0].token_ids), {"mlp1": _add(V)})
    assert list(result.outputs[0].token_ids) == states["logits"][p - 1: p - 1 + STEPS].argmax(-1).tolist()
    p = len(outs[1].prompt_token_ids)
    assert_close(h, hf_states(hf_llama, list(outs[1].prompt_token_ids))["mlp2"][p - 1])


def test_a_result_op_beside_an_op_that_runs_per_request(llama):
    """A JSON spec whose ``logits_topk`` runs it per request (not batched) still takes
    its saved ``tracer.result`` from the finished output."""
    import json

    spec = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "logits_topk", "name": "top", "k": 2},
        {"op": "result", "name": "ids", "path": [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]}]})
    out = llama.vllm_entrypoint.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                                     ignore_eos=True, extra_args={"nnsight": spec}),
                                         use_tqdm=False)[0]
    saves = results(out)
    assert out.ran_as.startswith("spec, per request") and set(saves) == {"top", "ids"}
    assert list(saves["ids"]) == list(out.outputs[0].token_ids)
