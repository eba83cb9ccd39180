"""Code blocks that are exactly a whole-row read or steering run as the batched spec
(engine/lower.py). Lowered, a block must give exactly what it gives as code: the
same saved names and values, bit for bit, the same tokens, its errors at its own
lines; anything that is not one of the forms must stay code."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from conftest import HFRun, assert_close, bit_identical_in_some_try
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, make_payload, results
from vllm_nnsight_plugin.engine import batched
from vllm_nnsight_plugin.engine.envoy import WorkerEnvoy, WorkerTracer
from vllm_nnsight_plugin.engine.lower import lower_block, output_structure

# ------------------------------------------------------------------ matching


class Pair(torch.nn.Module):
    """A decoder layer's shape: (hidden, residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Plain()
        self.mlp = Unannotated()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class Plain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Unannotated(torch.nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        return x


class Triple(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x, x, x


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Pair(), Pair()])
        self.head = Plain()
        self.three = Triple()
        self.tied = Plain()
        self.also_tied = self.tied  # one module under two paths (shared weights)


TOY = Toy()
ROOT = WorkerEnvoy(TOY, "", None)
SHARED = frozenset({id(TOY.tied)})
TRACER = WorkerTracer(None)
VEC = torch.ones(8)


def _lower(source: str, **values):
    return lower_block(textwrap.dedent(source), 10, {"model": ROOT, "tracer": TRACER, **values}, torch.float32,
                       SHARED)


def _ops(source: str, **values) -> list[dict]:
    lowered = _lower(source, **values)
    assert lowered is not None, "expected the block to lower"
    return lowered.spec["ops"]


def test_annotations_give_each_modules_output_structure():
    assert output_structure(Pair) == 2 and output_structure(Plain) == 0 and output_structure(Triple) == 3
    assert output_structure(Unannotated) is None
    assert output_structure(torch.nn.Linear) == 0


def test_the_forms_lower_to_the_spec_they_are():
    assert _ops("x = model.layers[1].output[0].save()") == [
        {"op": "read", "name": "x", "module": "layers.1", "index": 0, "structure": 2, "steps": "prefill"}]
    assert _ops("""
        out = model.layers[0].output
        s = (out[0] + out[1]).save()
        h = model.layers[1].attn.output.clone().save()
        """) == [{"op": "read", "name": "s", "module": "layers.0", "sum": True, "structure": 2, "steps": "prefill"},
                 {"op": "read", "name": "h", "module": "layers.1.attn", "structure": 0, "steps": "prefill"}]
    lowered = _lower("""
        rows = []
        for _ in tracer.all():
            model.layers[0].attn.output[:] *= 0.5
            model.layers[0].output[0][:] += v
            model.layers[1].attn.output[:] = 0
            out = model.layers[-1].output
            rows.append(out[0] + out[1])
        stream = rows.save()
        """, v=VEC)
    assert lowered.spec["ops"] == [
        {"op": "scale", "module": "layers.0.attn", "structure": 0, "factor": 0.5, "steps": "all"},
        {"op": "add", "module": "layers.0", "index": 0, "structure": 2, "value": [1.0] * 8, "steps": "all"},
        {"op": "zero", "module": "layers.1.attn", "structure": 0, "steps": "all"},
        {"op": "read", "name": "stream", "module": "layers.1", "sum": True, "structure": 2, "steps": "all"}]
    assert lowered.lines == (13, 14, 15, 17)  # the block's own lines (it starts at line 10)
    assert _ops("""
        rows = list().save()
        for step in tracer.iter[:]:
            rows.append(model.layers[1].output[1].clone())
        """) == [{"op": "read", "name": "rows", "module": "layers.1", "index": 1, "structure": 2, "steps": "all"}]


@pytest.mark.parametrize("source", [
    "x = model.head.output[0].save()",  # a tensor's first row, not a tuple's element
    "x = model.layers[0].output.save()",  # a whole tuple
    "x = model.layers[0].mlp.output.save()",  # unknown structure
    "x = (model.three.output[0] + model.three.output[1]).save()",  # not the whole sum
    "x = model.layers[0].output[2].save()",  # out of range: the block's own IndexError
    "x = model.layers[5].output[0].save()",
    "x = model.layers[0].output[0].save()\ny = 1",  # another statement
    "x = model.layers[0].output[0]",  # not saved
    "for _ in tracer.all():\n    model.layers[0].output[0][:] += w",  # float64: rounded differently
    "for _ in tracer.all():\n    model.layers[0].output[0][:] += 0.1",  # a constant
    "for _ in tracer.all():\n    model.layers[0].output[0][1:] += v",  # not whole rows
    "for _ in tracer.iter[:3]:\n    model.layers[0].output[0][:] += v",  # bounded steps
    "model.layers[0].output[0][:] += v",  # the prompt only
    "rows = []\nfor _ in tracer.all():\n    rows.append(model.layers[0].output[0])\nstream = rows.save()",  # a view
    "rows = []\nfor _ in tracer.all():\n    rows.append(model.layers[0].output[0].clone())",  # never saved
    "rows = []\nfor _ in tracer.all():\n    model.layers[0].output[0][:] += v\n"
    "    rows.append(model.layers[0].output[1].clone())\ns = rows.save()",  # a read beside an edit
    "for _ in tracer.all():\n    model.layers[0].output[0][:] += v\nfor _ in tracer.all():\n    pass",
    "model = 1\nx = model.layers[0].output[0].save()",  # the name rebound
    "v = model.layers[0].output\nfor _ in tracer.all():\n    model.layers[1].output[0][:] += v",
    "x = model.layers[1].output[0].save()\ny = model.layers[0].output[0].save()",  # out of order
    "x = model.layers[0].output[0].save()\ny = model.layers[0].attn.output.save()",  # the parent first
    "x = model.head.output.save()\ny = model.layers[0].output[0].save()",  # siblings: order unknown
    "x = model.layers[1].output[0].save()\nfor _ in tracer.all():\n    model.layers[0].output[0][:] += v",
    # an alias holds what was served when it was bound: not a later step's values...
    "out = model.layers[0].output\nrows = []\nfor _ in tracer.all():\n    rows.append(out[0] + out[1])\n"
    "stream = rows.save()",
    "out = model.layers[0].output\nfor _ in tracer.all():\n    out[0][:] += v",
    # ...nor, after another access, values vLLM may have overwritten in place
    "out = model.layers[0].output\ny = model.layers[1].output[0].save()\ns = (out[0] + out[1]).save()",
    "for _ in tracer.all():\n    model.tied.output[:] += v",  # shared: called twice a step
    "for _ in tracer.all():\n    model.head.output[:] += one",  # broadcasts in a block; lanes take rows
    "list = model.layers[0].output\nrows = list().save()\nfor _ in tracer.all():\n"
    "    rows.append(model.layers[1].output[0].clone())",  # list() is not the builtin
    "for _ in tracer.all():\n    model.head.output[:] *= 18446744073709551616",  # OverflowError in a block
    "for _ in tracer.all():\n    model.head.output[:] *= 1e999",  # inf
    "x = model.layers[" + "-" * 2000 + "1].output[0].save()",  # too deep to match: runs as code
])
def test_anything_else_stays_code(source):
    assert _lower(source, v=VEC, w=VEC.double(), one=torch.ones(1)) is None


def test_names_the_caller_had_are_rebound_by_the_block():
    """The client ships every name the block mentions that its frame has (a second
    run of a cell has the first run's ``rows`` and ``stream``): the block rebinds them."""
    ops = _ops("rows = []\nfor _ in tracer.all():\n    rows.append(model.layers[0].output[0].clone())\n"
               "stream = rows.save()", rows=[1], stream=torch.zeros(1), _=3)
    assert ops[0]["name"] == "stream"


def test_an_envoy_the_caller_made_names_its_module():
    layer = ROOT.layers[1]
    assert _ops("x = layer.output[0].save()", layer=layer)[0]["module"] == "layers.1"


def test_an_alias_used_at_once_in_its_own_scope_lowers():
    ops = _ops("""
        out = model.layers[0].output
        s = (out[0] + out[1]).save()
        rows = []
        for _ in tracer.all():
            h = model.layers[1].output
            rows.append(h[0] + h[1])
        stream = rows.save()
        """)
    assert [(op["name"], op["module"], op["steps"]) for op in ops] == [
        ("s", "layers.0", "prefill"), ("stream", "layers.1", "all")]


def test_a_value_that_is_not_the_annotated_structure_is_refused_naming_the_fix():
    """vLLM's annotations are sometimes wrong (a few decoder layers say a pair and
    return one tensor): a lowered op then fails its request rather than index the
    value otherwise."""
    op = {"op": "read", "name": "x", "module": "model.layers.0", "index": 0, "structure": 2}
    batched.check_structure(op, (torch.zeros(2, 4), torch.zeros(2, 4)))
    with pytest.raises(TypeError, match="is a Tensor, not a tuple of 2 tensors.*nnsight_lower"):
        batched.check_structure(op, torch.zeros(2, 4))
    with pytest.raises(TypeError, match=r"a tuple of \(Tensor, NoneType\)"):
        batched.check_structure(op, (torch.zeros(2, 4), None))
    with pytest.raises(TypeError, match="is a tuple .* not a tensor"):
        batched.check_structure({**op, "structure": 0}, (torch.zeros(2, 4), torch.zeros(2, 4)))
    batched.check_structure({"op": "read", "name": "x", "module": "m"}, None)  # a user's spec: no check here
    assert batched._code_fits(op, "(TT") and not batched._code_fits(op, "T") and not batched._code_fits(op, "(TN")


def test_the_per_request_switch_reads_as_the_openai_server_passes_it():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_nnsight_plugin.engine.lower import wanted as lowering_wanted

    xargs = CompletionRequest(model="m", prompt="x", vllm_xargs={"nnsight_lower": False}).vllm_xargs
    assert not lowering_wanted(xargs["nnsight_lower"])  # (pydantic made it 0)
    assert not any(lowering_wanted(v) for v in (False, 0, "false", "0"))
    assert all(lowering_wanted(v) for v in (True, 1, "true"))


BIG = torch.ones(20_000)  # 80 KB: its payload is over the lowering cache's size


def _steer_toy(model, tracer):
    for _ in tracer.all():
        model.layers[0].output[0][:] += VEC


def _steer_toy_big(model, tracer):
    for _ in tracer.all():
        model.layers[0].output[0][:] += BIG


def test_lowerings_are_cached_by_payload_text_unless_large():
    import json

    from vllm_nnsight_plugin.engine.lower import Lowerings

    lowerings = Lowerings(TOY, torch.float32)

    def resolve(ref: tuple):
        return ROOT if ref[0] == "model" else TRACER

    def serves(path: str, kind: str) -> None:
        pass

    env = json.loads(make_payload(_steer_toy))
    first, values = lowerings.get(env, resolve, serves)
    assert first is not None and set(values) == {"model", "tracer", "VEC"}
    again, values = lowerings.get(env, resolve, serves)
    assert again is first and values is None  # the same ops (they batch), nothing unpickled
    big = json.loads(make_payload(_steer_toy_big))
    one, _ = lowerings.get(big, resolve, serves)
    two, values = lowerings.get(big, resolve, serves)
    assert one is not None and two is not None and two is not one and values is not None

    def untapped(path: str, kind: str) -> None:
        raise ValueError("not tapped")

    assert Lowerings(TOY, torch.float32).get(env, resolve, untapped)[0] is None  # the block says it itself


def test_a_lowered_error_names_the_blocks_line():
    lowered = _lower("for _ in tracer.all():\n    model.layers[0].output[0][:] += v", v=VEC)
    assert lowered.relabel("ops[0] (add layers.0): the size is wrong") == ("the size is wrong", 11)
    assert lowered.relabel("ops[0] (add layers.0.output) was not reached") == \
        ("add layers.0.output was not reached", 11)
    assert lowered.relabel("something else") == ("something else", None)
    assert ast.parse("x = 1")  # (the module parses the block with ast: a syntax error never lowers)


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


def _same(a, b, tol: float = 0.0) -> None:
    """Equal bit for bit (``tol``: up to that relative difference)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) if not tol else torch.allclose(a, b, rtol=tol, atol=tol)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for name in a:
            _same(a[name], b[name], tol)
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, tol)


@pytest.mark.parametrize("block", [read_prompt, read_every_step, steer_and_read])
def test_a_lowered_block_gives_exactly_what_the_block_gives(llama, block):
    """Each prompt twice in one batch: lowered and as code. Same tokens, same saved
    names, values equal bit for bit."""
    llm = llama.vllm_entrypoint
    n = len(PROMPTS)

    def run() -> tuple:
        before = _lowered(llm)
        outs = llm.generate(PROMPTS * 2, [_params(block)] * n + [_params(block, lower=False)] * n, use_tqdm=False)
        assert _lowered(llm) - before == n  # the first half ran as the spec, the second as code
        return outs[:n], outs[n:]

    def same(lowered, code) -> bool:
        try:
            for a, b in zip(lowered, code):
                _same(results(a), results(b))
        except AssertionError:
            return False
        return True

    # on a GPU the two halves may join different steps, whose GEMMs differ in the last
    # bits (see bit_identical_in_some_try); on CPU the first try is bit for bit
    lowered, code = bit_identical_in_some_try(run, same)
    for a, b in zip(lowered, code):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        saved, as_code = results(a), results(b)
        assert sorted(saved) == sorted(as_code) and saved
        if torch.cuda.is_available() and not same([a], [b]):
            for name in saved:
                _same(saved[name], as_code[name], tol=1e-5)
        else:
            _same(saved, as_code)


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
        ({"nnsight": make_payload(_halve_if_positive)}, "(not one of the forms the engine batches)"),
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
