"""Pipeline parallel without an engine: which stage runs a plan's op, and what one
stage sends the next (values, op errors, plan signatures) survives the trip whole.
The engine-level behaviour is in tests/test_tp.py."""

from __future__ import annotations

import torch
from test_batched import _Layer, _Toy, _toy, _toy_spec  # (tests/ is on the path, as conftest's folder)

from vllm_nnsight_plugin.engine.stages import StageTransport, signature

ABSENT_ON_LAST = frozenset({"model.embed_tokens", "model.layers.0", "model.layers.1"})
ABSENT_ON_FIRST = frozenset({"model.layers.2", "model.layers.3", "model.norm", "lm_head"})


def test_each_op_runs_on_the_stage_that_holds_its_module():
    first, last = StageTransport(ABSENT_ON_FIRST, False), StageTransport(ABSENT_ON_LAST, True)
    read0 = {"op": "read", "name": "h", "module": "model.layers.0"}
    edit0 = {"op": "add", "module": "model.layers.0", "value": [1.0]}
    read2 = {"op": "read", "name": "h", "module": "model.layers.2.mlp"}
    edit2 = {"op": "add", "module": "model.layers.2", "value": [1.0]}
    logits = {"op": "logits", "name": "l"}
    root = {"op": "read", "name": "m", "module": "model"}
    assert [first.role(op) for op in (read0, edit0, read2, edit2, logits, root)] == \
        ["export", "run", "skip", "skip", "skip", "skip"]
    assert [last.role(op) for op in (read0, edit0, read2, edit2, logits, root)] == \
        ["run", "skip", "run", "run", "run", "run"]


def test_what_a_stage_sends_arrives_whole():
    first, last = StageTransport(ABSENT_ON_FIRST, False), StageTransport(ABSENT_ON_LAST, True)
    hidden, residual = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(5, 7)
    before = hidden.clone()
    ids = torch.arange(3)
    first.capture_at("model.layers.0", "output", (hidden, residual))
    first.capture_at("model.layers.1", "input", ids)
    hidden.add_(1.0)  # (a later module changes its input in place: the capture is a copy)
    first.errors["r1"] = "ops[0] (add model.layers.0): position 50 is out of range"
    first.signatures["r2"] = ["abc"]
    step = {"hidden_states": torch.zeros(5, 7), "residual": torch.zeros(5, 7)}
    first.send(step)
    assert sorted(step) == ["hidden_states", "nnsight.data", "nnsight.meta", "residual"]  # (at most 2 more)
    assert not first.captured and not first.errors and not first.signatures
    last.take(step)
    assert sorted(step) == ["hidden_states", "residual"]  # (vLLM copies every entry left by name)
    (p0, io0, v0), (p1, io1, v1) = last.incoming
    assert (p0, io0, p1, io1) == ("model.layers.0", "output", "model.layers.1", "input")
    assert torch.equal(v0[0], before) and v0[0].dtype == torch.bfloat16 and torch.equal(v0[1], residual)
    assert torch.equal(v1, ids)
    assert last.incoming_errors == {"r1": "ops[0] (add model.layers.0): position 50 is out of range"}
    assert last.incoming_signatures == {"r2": ["abc"]}


def test_a_step_with_nothing_to_send_adds_nothing():
    first = StageTransport(ABSENT_ON_FIRST, False)
    step = {"hidden_states": torch.zeros(2, 3)}
    first.send(step)
    assert list(step) == ["hidden_states"]
    StageTransport(ABSENT_ON_LAST, True).take(step)
    assert list(step) == ["hidden_states"]


def test_a_plan_signature_tells_plans_and_code_apart():
    class Block:
        def __init__(self, lowered=None, batched=False):
            self.lowered, self.batched = lowered, batched

    class Lowered:
        def __init__(self, ops):
            self.spec = {"v": 1, "kind": "spec", "ops": ops}

    plan = Lowered([{"op": "add", "module": "model.layers.0", "value": [1.0]}])
    other = Lowered([{"op": "read", "name": "h", "module": "model.layers.3.mlp"}])
    assert signature(Block(plan)) == signature(Block(plan))
    assert len({signature(Block(plan)), signature(Block(other)), signature(Block()),
                signature(Block(batched=True))}) == 4


def test_with_tensor_parallel_too_plans_reach_the_last_stage_only():
    """Under TP each rank would send its own shard of a value: a spec that touches an
    earlier stage's module is refused there, one of the last stage's runs."""
    import pytest

    from vllm_nnsight_plugin.engine import guards
    from vllm_nnsight_plugin.payload.codec import PayloadError

    early = {"v": 1, "kind": "spec", "ops": [{"op": "add", "module": "model.layers.1.mlp", "value": [1.0]}]}
    late = {"v": 1, "kind": "spec", "ops": [{"op": "read", "name": "h", "module": "model.layers.2"},
                                            {"op": "logits", "name": "l"}]}
    guards.refuse_absent(early, ABSENT_ON_LAST, carried=True)  # (one rank per stage: it travels)
    with pytest.raises(PayloadError, match=r"ops\[0\].*model.layers.1.mlp.*only with two stages, no tensor parallel"):
        guards.refuse_absent(early, ABSENT_ON_LAST, carried=False)
    guards.refuse_absent(late, ABSENT_ON_LAST, carried=False)


def test_plans_cross_stages_only_where_what_travels_arrives_whole():
    from types import SimpleNamespace

    from vllm_nnsight_plugin.boundary.parallel import stages_carry

    def config(tp, backend="mp", pp=2):
        return SimpleNamespace(parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, distributed_executor_backend=backend, pipeline_parallel_size=pp))

    assert stages_carry(config(1)) and stages_carry(config(1, "ray"))
    assert not stages_carry(config(2)) and not stages_carry(config(1, "external_launcher"))
    assert not stages_carry(config(1, pp=3))


def test_a_transport_that_cannot_be_read_ends_the_traced_requests_not_the_engine():
    import json

    from vllm_nnsight_plugin.engine import stages

    _, inter = _toy()
    inter.admit("a", {"nnsight": _toy_spec({"op": "scale", "module": "layers.0", "factor": 2.0, "steps": "all"})})
    inter.stages = StageTransport(frozenset(), True)
    broken = {"nnsight.meta": torch.frombuffer(bytearray(json.dumps({"values": [["m", "output", "T"]],
                                                                       "tensors": []}).encode()), dtype=torch.uint8)}
    stages.receive(inter, broken)
    assert "could not be read" in inter.sessions["a"][0].error["message"]
    assert "nnsight.meta" not in broken  # (popped: vLLM copies every entry left by name)


def test_the_stages_plans_must_agree_only_where_they_cross_stages():
    """The last stage ends a request whose blocks record differently on an earlier stage
    only where a difference can drop an op, block by block: the earlier stage runs some
    op of the block, or the last stage's plan of it reaches an earlier stage's module."""
    from vllm_nnsight_plugin.engine import stages

    class Block:
        lowered, batched = None, True

    first, last = StageTransport(ABSENT_ON_FIRST, False), StageTransport(ABSENT_ON_LAST, True)
    runs, skips, reaches, own = Block(), Block(), Block(), Block()
    first.note(runs, [{"op": "add", "module": "model.layers.0", "value": [1.0]}])
    first.note(skips, [{"op": "read", "name": "h", "module": "model.layers.2.mlp"}])
    last.note(reaches, [{"op": "read", "name": "h", "module": "model.layers.1"}])
    last.note(own, [{"op": "read", "name": "h", "module": "model.layers.2.mlp"}, {"op": "logits", "name": "l"}])
    assert [c for _, c in first.signatures_of([runs, skips])] == [True, False] and not first.reaching
    assert [c for _, c in last.signatures_of([reaches, own])] == [True, False] and not last.reaching

    _, inter = _toy()
    inter.stages = last
    spec = '{"v": 1, "kind": "spec", "ops": [{"op": "scale", "module": "layers.0", "factor": 2.0, "steps": "all"}]}'
    for req_id in ("a", "b", "c", "d"):
        inter.admit(req_id, {"nnsight": spec})
    last.admitted_as.update({"a": [("mine", False)], "b": [("mine", True)], "c": [("mine", False)],
                             "d": [("edit", True), ("mine", False)]})
    step = {}
    first.signatures.update({"a": [stages.NOTHING], "b": [stages.NOTHING], "c": ["theirs"],
                             "d": ["edit", stages.NOTHING]})
    first.send(step)
    stages.receive(inter, step)
    assert inter.sessions["a"][0].error is None  # (stage 0 runs nothing; the plan stays on the last stage)
    assert "different plans" in inter.sessions["b"][0].error["message"]  # (its stage-0 ops would be lost)
    assert "different plans" in inter.sessions["c"][0].error["message"]  # (stage 0 runs a plan of its own)
    assert inter.sessions["d"][0].error is None  # (an installed edit that agrees, a block of the last stage's)


def test_a_module_every_stage_builds_belongs_to_the_stage_that_runs_it():
    """vLLM builds some modules on every pipeline stage but runs them on one (GPT-2's
    wte, wpe and ln_f; a tied input embedding): those before the split layer list are
    the first stage's, those after it the last stage's; placeholders are another's."""
    import torch

    from vllm_nnsight_plugin.boundary.parallel import stage_absent

    class Missing(torch.nn.Module):
        pass

    class GPT2(torch.nn.Module):
        def __init__(self, first):
            super().__init__()
            self.transformer = torch.nn.Module()
            self.transformer.wte = torch.nn.Embedding(4, 2)
            self.transformer.wpe = torch.nn.Embedding(4, 2)
            blocks = [torch.nn.Linear(2, 2), Missing()] if first else [Missing(), torch.nn.Linear(2, 2)]
            self.transformer.h = torch.nn.ModuleList(blocks)
            self.transformer.ln_f = torch.nn.LayerNorm(2)
            self.lm_head = Missing() if first else torch.nn.Linear(2, 4)

    def absent(first):
        return stage_absent(list(GPT2(first).named_modules()), lambda m: isinstance(m, Missing), first, not first)

    assert absent(True) == ["transformer.h.1", "lm_head", "transformer.ln_f"]
    assert absent(False) == ["transformer.h.0", "transformer.wte", "transformer.wpe"]
    one = GPT2(True)
    assert stage_absent(list(one.named_modules()), lambda m: False, True, True) == []  # (no pipeline)


def test_the_architecture_adapter_places_the_model_end_on_the_last_stage():
    """A final norm registered before the split layer list (as OPT's decoder does) runs
    on the last stage: the architecture's adapter names it, and the engine asks the
    adapter (``parallel.absent_modules``) before the registration-order rule."""
    import torch
    from vllm.model_executor.models.utils import PPMissingLayer as Missing

    from vllm_nnsight_plugin.boundary import parallel

    class OPTForCausalLM(torch.nn.Module):  # (vLLM's class name is the architecture)
        def __init__(self, first):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.decoder = torch.nn.Module()
            self.model.decoder.embed_tokens = torch.nn.Embedding(4, 2)
            self.model.decoder.final_layer_norm = torch.nn.LayerNorm(2)
            blocks = [torch.nn.Linear(2, 2), Missing()] if first else [Missing(), torch.nn.Linear(2, 2)]
            self.model.decoder.layers = torch.nn.ModuleList(blocks)
            self.lm_head = Missing() if first else torch.nn.Linear(2, 4)

    def by_order(first):
        named = list(OPTForCausalLM(first).named_modules())
        return parallel.stage_absent(named, lambda m: isinstance(m, Missing), first, not first)

    assert "model.decoder.final_layer_norm" not in by_order(True)  # (the order alone: the wrong stage)
    first = parallel.absent_modules(OPTForCausalLM(True), position=(True, False))
    last = parallel.absent_modules(OPTForCausalLM(False), position=(False, True))
    assert "model.decoder.final_layer_norm" in first and "model.decoder.final_layer_norm" not in last
    assert "model.decoder.embed_tokens" in last and "model.decoder.embed_tokens" not in first


def test_two_stages_admitting_the_same_requests_agree_where_they_must():
    """The wiring from admission to the last stage's check, on two toy stages (stage 0
    holds layer 0, the last stage layer 1; each has a childless placeholder for the
    other's): a block of the last stage's submodules, which stage 0 can only keep as
    code, runs; the same block editing stage 0's layer as well ends with an error (stage
    0 could not run that edit); a spec editing stage 0's layer runs there."""

    from vllm import SamplingParams

    from vllm_nnsight_plugin.engine import stages
    from vllm_nnsight_plugin.engine.interleave import Interleaver
    from vllm_nnsight_plugin.engine.worker_setup import WorkerSetup
    from vllm_nnsight_plugin.payload import codec

    def stage(last):
        model = _Toy().eval()
        model.layers[0 if last else 1] = torch.nn.Identity()  # (the other stage's layer: no children)
        inter = Interleaver(model, WorkerSetup())
        inter.absent = frozenset({"layers.0" if last else "layers.1", *(() if last else ("lm_head",))})
        inter.stages = StageTransport(inter.absent, last)
        return inter

    first, last = stage(False), stage(True)
    assert isinstance(last.model.layers[1], _Layer)

    class Model:  # (the caller's model, as a block's payload refers to it)
        def __nnsight_ref__(self):
            return ("model",)

    def code(source):
        values = {"model": Model(), "v": torch.ones(4)}
        return {"nnsight": codec.encode_code(codec.CodePayload(source, "<t>", 1, values))}

    requests = {
        "own": code("x = model.layers[1].lin.output.save()"),
        "mixed": code("model.layers[0].output[:] += v\nx = model.layers[1].lin.output.save()"),
        "spec": {"nnsight": '{"v": 1, "kind": "spec", "ops": [{"op": "add", "module": "layers.0", '
                            '"value": [1, 1, 1, 1], "steps": "all"}]}'},
    }
    params = SamplingParams(max_tokens=2)
    for req_id, extra in requests.items():
        first.admit(req_id, extra, params)
        last.admit(req_id, extra, params)
    assert first.stages.signatures["own"] == [stages.NOTHING]  # (code there: it runs nothing of it)
    assert first.stages.signatures["spec"] != [stages.NOTHING]  # (it runs the edit)
    step = {}
    first.stages.send(step)
    stages.receive(last, step)
    assert all(s.error is None for s in last.sessions["own"]) and last.sessions["own"][0].ran_as == "batched"
    assert "different plans" in last.sessions["mixed"][0].error["message"]
    assert all(s.error is None for s in last.sessions["spec"])


def test_an_earlier_stage_admits_the_requests_of_one_spec_from_one_look_at_it(monkeypatch):
    """A stage but the last drops a spec's cache ops before admitting it (a copy): the
    requests that send one spec's text still share one admission of it."""
    _, inter = _toy()
    inter.stages = StageTransport(frozenset({"layers.1"}), False, carries=True)
    looks, places = [], []
    admitted, place = inter._admitted_spec, inter.batched._place
    monkeypatch.setattr(inter, "_admitted_spec", lambda *a: (looks.append(1), admitted(*a))[1])
    monkeypatch.setattr(inter.batched, "_place", lambda env: (places.append(1), place(env))[1])
    spec = _toy_spec({"op": "scale", "module": "layers.0", "factor": 2.0, "steps": "all"})
    for req_id in ("a", "b", "c"):
        inter.admit(req_id, {"nnsight": spec})
    assert [s.error for r in ("a", "b", "c") for s in inter.sessions[r]] == [None] * 3
    assert len(looks) == 1 and len(places) == 1
