"""A served trace's client records its blocks into the plans the workers would make
(client/served_plans.py): the same ops as the engine's own recording of the same block
on the real modules, sent in a form the server's checks take; what the server would
refuse goes as code, with the line. (End to end, against a real code-off server and
HF: tests/test_serve.py.)"""

from __future__ import annotations

import json
import signal
import types

import torch

from vllm_nnsight_plugin import make_payload
from vllm_nnsight_plugin.client import served_plans
from vllm_nnsight_plugin.client.served import ServedTree
from vllm_nnsight_plugin.engine import lower
from vllm_nnsight_plugin.payload import codec
from vllm_nnsight_plugin.payload import values as tagged

WIDTH = 8


class Layer(torch.nn.Module):
    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.mlp = torch.nn.Linear(WIDTH, WIDTH)
        self.rotary = rotary  # (one module under every layer, as vLLM's rotary embedding)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class Embed(torch.nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        rotary = torch.nn.Identity()
        self.model = torch.nn.Module()
        self.model.embed_tokens = Embed()
        self.model.layers = torch.nn.ModuleList([Layer(rotary) for _ in range(3)])


def _tree(model: torch.nn.Module, taps: list[str] | None = None) -> ServedTree:
    table = lower.record_table(model, torch.float32)
    table["integer_inputs"] = ["model.embed_tokens"]  # (as guards.table finds vLLM's embedding)
    return ServedTree({p: type(m).__name__ for p, m in model.named_modules()}, taps, json.loads(json.dumps(table)))


def _engine_plan(model: torch.nn.Module, payload: str) -> lower.Lowered | lower.Fallback:
    env = codec.parse_envelope(payload)
    rec, resolve = lower.recorder(model, torch.float32, lower.Lowerings(model, torch.float32).shared())
    return lower.plan_block(rec, env["source"], env["filename"], env["lineno"], codec.load_code(env, resolve).values)


V = torch.linspace(-1, 1, WIDTH)
LAYER = 1


def steer_and_read(model, tracer):
    first = model.model.layers[0].output
    h = (first[0] + first[1]).save()  # noqa: F841
    pair = [model.model.layers[0].output[1], model.model.layers[2].output[0]].save()  # noqa: F841
    rows = list().save()
    for step in tracer.iter[:3]:  # noqa: B007
        model.model.layers[LAYER].output[0][:] += V
        rows.append(model.model.layers[2].output[1])
    ids = tracer.result.outputs[0].token_ids.save()  # noqa: F841


def test_the_client_records_the_plan_the_engine_records():
    model = Model()
    payload = make_payload(steer_and_read)
    engine = _engine_plan(model, payload)
    client = served_plans.plan(payload, _tree(model))
    assert isinstance(engine, lower.Lowered) and isinstance(client, served_plans.ServedPlan)
    sent = codec.parse_envelope(client.payload)  # (the server's own check takes it)
    assert len(sent["ops"]) == len(engine.spec["ops"])
    for got, want in zip(sent["ops"], engine.spec["ops"]):
        if isinstance(got.get("value"), dict):  # (a base64 tensor: the same numbers)
            assert torch.equal(tagged.decode_tensor(got.pop("value")["$tensor"]).double(),
                               torch.tensor(want["value"], dtype=torch.float64))
            want = {k: v for k, v in want.items() if k != "value"}
        renamed = dict(zip(engine.lists[0][1].items, client.lists[0][1].items))
        assert got == {**want, **({"name": renamed[want["name"]]} if want.get("name") in renamed else {})}
    assert [(name, g.kind, g.items) for name, g in client.lists] == [("pair", "list", ("_l0.0", "_l0.1"))]
    assert sent["ops"][-1] == {"op": "result", "name": "ids",
                               "path": [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]}


def test_what_the_server_would_refuse_goes_as_code_with_its_line():
    model = Model()

    def shared(model, tracer):
        r = model.model.layers[1].rotary.output.save()  # noqa: F841

    def index_edit(model, tracer):
        model.model.embed_tokens.input[:] = 0

    def root(model, tracer):
        out = model.output.save()  # noqa: F841

    def untapped(model, tracer):
        m = model.model.layers[0].mlp.output.save()  # noqa: F841

    for block, tree, why in ((shared, _tree(model), "two paths"), (index_edit, _tree(model), "integer tensor"),
                             (root, _tree(model), "invalid spec"),
                             (untapped, _tree(model, ["model.layers.*.output"]), "not tapped")):
        found = served_plans.plan(make_payload(block), tree)
        assert isinstance(found, lower.Fallback) and why in found.why, (block.__name__, found)
        assert found.line == block.__code__.co_firstlineno + 1
        assert why in served_plans.explain(found) and f"line {found.line}" in served_plans.explain(found)


def test_a_table_the_client_cannot_read_sends_code_and_recording_leaves_the_callers_timer():
    model = Model()
    bad = _tree(model)._replace(record={"dtype": "os.system", "structures": {}, "shared": []})
    found = served_plans.plan(make_payload(steer_and_read), bad)
    assert isinstance(found, lower.Fallback) and "record table" in found.why
    assert isinstance(served_plans.plan(make_payload(steer_and_read), _tree(model)._replace(record=None)),
                      lower.Fallback)
    previous = signal.signal(signal.SIGALRM, lambda *a: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert isinstance(served_plans.plan(make_payload(steer_and_read), _tree(model)), served_plans.ServedPlan)
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 90  # (the caller's timer, still running)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_saved_lists_come_back_whole_for_each_sequence():
    found = served_plans.plan(make_payload(steer_and_read), _tree(Model()))
    one = types.SimpleNamespace(saves={"h": 1, "_l0.0": "a", "_l0.1": "b"}, nnsight_error=None)
    one.outputs = [types.SimpleNamespace(saves=one.saves, nnsight_error=None)]
    served_plans.finish(one, found)
    assert one.saves == {"h": 1, "pair": ["a", "b"]}
    seqs = [{"_l0.0": "a0", "_l0.1": "b0"}, {"_l0.0": "a1", "_l0.1": "b1"}]
    two = types.SimpleNamespace(saves={"_l0.0": ["a0", "a1"], "_l0.1": ["b0", "b1"]}, nnsight_sequence_saves=seqs,
                                nnsight_error=None,
                                outputs=[types.SimpleNamespace(saves=s, nnsight_error=None) for s in seqs])
    served_plans.finish(two, found)
    assert two.saves == {"pair": [["a0", "b0"], ["a1", "b1"]]}  # (as merge_sequences: by sequence)
    assert [c.saves for c in two.outputs] == [{"pair": ["a0", "b0"]}, {"pair": ["a1", "b1"]}]


def test_trace_level_writes_come_back_per_sequence_and_not_for_a_failed_request():
    """A served plan's trace-level list: the values the block put there come back as each
    sequence's own objects (as decoded results are), and a request that failed brings
    no container back (the caller's stays as it was)."""
    counts = codec.SharedList([[0], 0])

    def block(model, tracer):
        counts[1] = 7
        h = model.model.layers[0].output[0].save()  # noqa: F841

    found = served_plans.plan(make_payload(block), _tree(Model()))
    assert isinstance(found, served_plans.ServedPlan) and dict(found.lists)["counts"].reads() == ()
    seqs = [{"h": 1}, {"h": 2}]
    two = types.SimpleNamespace(saves={"h": [1, 2]}, nnsight_sequence_saves=seqs, nnsight_error=None,
                                outputs=[types.SimpleNamespace(saves=s, nnsight_error=None) for s in seqs])
    served_plans.finish(two, found)
    first, second = two.saves["counts"]
    assert first == second == [[0], 7] and first[0] is not second[0]
    failed = types.SimpleNamespace(saves={"h": 1}, nnsight_error={"message": "ops[0] (h): boom"}, outputs=[])
    served_plans.finish(failed, found)
    assert "counts" not in failed.saves
