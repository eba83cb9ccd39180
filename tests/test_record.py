"""Recording a code block into its plan (engine/record.py, engine/lower.py), on a
toy module tree: what each spelling becomes, and what runs as code and why. The
engine tests (test_lower.py, test_spellings.py) check the plans' values."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from vllm_nnsight_plugin import make_payload
from vllm_nnsight_plugin.engine.lower import Fallback, Lowered, Lowerings, output_structure, plan_block, recorder
from vllm_nnsight_plugin.payload.spec import runs_batched


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


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Pair(), Pair(), Pair()])
        self.head = Plain()
        self.tied = Plain()
        self.also_tied = self.tied  # one module under two paths (shared weights)


TOY = Toy()
SHARED = frozenset({id(TOY.tied)})
VEC = torch.ones(8)


def _plan(source: str, **values) -> Lowered | Fallback:
    rec, resolve = recorder(TOY, torch.float32, SHARED)
    return plan_block(rec, textwrap.dedent(source), "<block>", 10,
                      {"model": resolve(("model",)), "tracer": resolve(("tracer",)), **values})


def _ops(source: str, **values) -> list[dict]:
    found = _plan(source, **values)
    assert isinstance(found, Lowered), found
    assert runs_batched(found.spec)
    return found.spec["ops"]


def test_annotations_give_each_modules_output_structure():
    assert output_structure(Pair) == 2 and output_structure(Plain) == 0
    assert output_structure(Unannotated) is None
    assert output_structure(torch.nn.Linear) == 0


STEER_ALL = {"op": "add", "module": "layers.0", "index": 0, "structure": 2, "value": [1.0] * 8, "steps": "all"}


@pytest.mark.parametrize("source", [
    "for _ in tracer.all():\n    model.layers[0].output[0][:] += v",
    "for _ in tracer.iter[:]:\n    model.layers[0].output[0][:] += v",
    "with tracer.all():\n    model.layers[0].output[0][:] += v",
    "with tracer.iter[:] as it:\n    model.layers[0].output[0][:] += v",
    "LAYER = 0\nfor step in tracer.all():\n    model.layers[LAYER].output[0][:] += v",
    "def steer(layer, vec):\n    layer.output[0][:] += vec\nfor _ in tracer.all():\n    steer(model.layers[0], v)",
    "layers = model.layers\nfor _ in tracer.all():\n    h = layers[0].output[0]\n    h += v",
    "for _ in tracer.all():\n    model.layers[0].output[0][:] = model.layers[0].output[0] + v",
    "for _ in tracer.all():\n    model.layers[0].output[0][:] -= -v",
    "for _ in tracer.all():\n    hidden, residual = model.layers[0].output\n    hidden[:] += v",
    "for _ in tracer.all():\n    for layer in model.layers[:1]:\n        layer.output[0][:] += v",
    "for _ in tracer.all():\n    model.layers[0].output[0].add_(v)",
    "for _ in tracer.all():\n    model.layers[0].output[0].sub_(-v)",
])
def test_spellings_of_one_steering_record_one_op(source):
    assert _ops(source, v=VEC) == [STEER_ALL]


def test_bounded_loops_unroll_into_one_op_with_its_steps():
    steps = {"op": "add", "module": "layers.0", "index": 0, "structure": 2, "value": [1.0] * 8}
    assert _ops("for s in tracer.iter[:3]:\n    model.layers[0].output[0][:] += v", v=VEC) == \
        [{**steps, "steps": [0, 1, 2]}]
    assert _ops("with tracer.iter[2:6:2]:\n    model.layers[0].output[0][:] += v", v=VEC) == \
        [{**steps, "steps": [2, 4]}]
    assert _ops("for s in tracer.iter[1:]:\n    model.layers[0].output[0][:] += v", v=VEC) == \
        [{**steps, "steps": "generated"}]
    assert _ops("model.layers[0].output[0][:] += v", v=VEC) == [{**steps, "steps": "prefill"}]
    # the step number steers Python: each step records what it did
    assert _ops("for s in tracer.iter[:4]:\n    if s % 2 == 0:\n        model.layers[0].output[0][:] += v",
                v=VEC) == [{**steps, "steps": [0, 2]}]
    # tracer.all() after a bounded loop starts at that loop's last step, as in a block
    assert _ops("for s in tracer.iter[:2]:\n    model.layers[1].output[0][:] *= 2\n"
                "for s in tracer.all():\n    model.layers[0].output[0][:] += v", v=VEC)[1]["steps"] == "generated"


def test_in_place_tensor_methods_are_the_edits_they_make():
    where = {"module": "layers.1.attn", "structure": 0, "steps": "all"}
    assert _ops("for _ in tracer.all():\n    model.layers[1].attn.output.zero_()") == [{"op": "zero", **where}]
    assert _ops("for _ in tracer.all():\n    model.layers[1].attn.output.mul_(0.5)") == [
        {"op": "scale", "factor": 0.5, **where}]
    assert _ops("for _ in tracer.all():\n    model.layers[1].attn.output.copy_(v)", v=VEC) == [
        {"op": "set", "value": [1.0] * 8, **where}]
    assert _ops("for _ in tracer.all():\n    model.layers[1].attn.output.fill_(2)") == [
        {"op": "set", "value": 2.0, **where}]


def test_copies_are_the_blocks_own_until_written_back():
    """clone() and x[[rows]] copy, as in torch: editing a copy edits nothing of the
    model, writing it back unchanged edits those rows, and restoring a copy taken
    before an edit of the module runs as code."""
    steer = {"op": "add", "module": "layers.0", "index": 0, "structure": 2, "value": [1.0] * 8, "steps": "prefill"}
    ops = _ops("h = model.layers[0].output[0].clone()\nh += v\ny = model.layers[1].output[0].save()", v=VEC)
    assert [op["op"] for op in ops] == ["read"]
    assert _ops("model.layers[0].output[0][[0, 1]] += v", v=VEC) == [{**steer, "positions": [0, 1]}]
    assert _ops("rows = model.layers[0].output[0][[0, 1]]\nrows += v\ny = model.layers[1].output[0].save()",
                v=VEC)[0]["op"] == "read"
    assert _ops("c = model.layers[0].output[0].clone()\nc[:] = 0\nmodel.layers[0].output[0][:] = c") == [
        {**{k: v for k, v in steer.items() if k != "value"}, "op": "zero"}]
    found = _plan("a = model.layers[0].output[0].clone()\nmodel.layers[0].output[0][:] += v\n"
                  "model.layers[0].output[0][:] = a", v=VEC)
    assert isinstance(found, Fallback) and "edited since" in found.why and found.line == 12
    assert _ops("b = model.layers[0].output[0]\na = model.layers[0].output[0]\nb[:] = 0\na += v", v=VEC) == [
        {**{k: v for k, v in steer.items() if k != "value"}, "op": "zero"}, steer]  # in the order made


def test_an_edit_before_a_loop_and_the_same_edit_in_it_both_apply():
    steer = {"op": "add", "module": "layers.0", "index": 0, "structure": 2, "value": [1.0] * 8}
    assert _ops("model.layers[0].output[0][:] += v\nfor _ in tracer.all():\n    model.layers[0].output[0][:] += v",
                v=VEC) == [{**steer, "steps": "prefill"}, {**steer, "steps": "all"}]
    assert _ops("model.layers[0].output[0][:] += v\nfor _ in tracer.iter[:3]:\n    model.layers[0].output[0][:] += v",
                v=VEC) == [{**steer, "steps": [0, 1, 2]}, {**steer, "steps": "prefill"}]


def test_reads_are_saved_values_and_saved_lists():
    assert _ops("x = model.layers[1].output[0].save()") == [
        {"op": "read", "name": "x", "module": "layers.1", "index": 0, "structure": 2, "steps": "prefill"}]
    assert _ops("""
        out = model.layers[0].output
        s = (out[0] + out[1]).save()
        h = model.layers[1].attn.output.clone().save()
        last = model.layers[2].output[0][-1].save()
        both = model.layers[2].output.save()
        """) == [{"op": "read", "name": "s", "module": "layers.0", "sum": True, "structure": 2, "steps": "prefill"},
                 {"op": "read", "name": "h", "module": "layers.1.attn", "structure": 0, "steps": "prefill"},
                 {"op": "read", "name": "last", "module": "layers.2", "index": 0, "structure": 2, "positions": -1,
                  "steps": "prefill"},
                 {"op": "read", "name": "both", "module": "layers.2", "structure": 2, "steps": "prefill"}]
    every = {"op": "read", "module": "layers.1", "index": 1, "structure": 2}
    assert _ops("rows = list().save()\nfor step in tracer.iter[:]:\n    rows.append(model.layers[1].output[1])") \
        == [{**every, "name": "rows", "steps": "all"}]
    assert _ops("rows = []\nwith tracer.iter[0:3]:\n    rows.append(model.layers[1].output[1].clone())\n"
                "rows = rows.save()") == [{**every, "name": "rows", "steps": [0, 1, 2]}]
    # a list saved before the loop is the saved one; saved after it, a copy of what it held
    assert _ops("rows = []\nfor _ in tracer.all():\n    rows.append(model.layers[1].output[1])\n"
                "stream = rows.save()") == [{**every, "name": "stream", "steps": "all"}]


def test_a_saved_list_of_several_locations_at_the_prompt_is_one_read_per_item():
    """The logit lens's list: each item a prompt read under a derived name (never
    shipped itself), gathered into the saved list by the engine (``Lowered.lists``)."""
    found = _plan("hs = [layer.output[0] for layer in model.layers]\nhs.append(model.logits)\nhs = hs.save()")
    assert isinstance(found, Lowered), found
    names = tuple(f"__list__hs.{i}" for i in range(4))
    assert [(name, g.kind, g.items) for name, g in found.lists] == [("hs", "list", names)]
    assert found.spec["ops"] == [
        *({"op": "read", "name": names[i], "module": f"layers.{i}", "index": 0, "structure": 2, "steps": "prefill"}
          for i in range(3)),
        {"op": "logits", "name": names[3], "steps": "prefill"}]
    assert runs_batched(found.spec)
    # after the prompt a plan holds one location per saved list
    later = _plan("for _ in tracer.iter[1:2]:\n    hs = [model.layers[0].output[0], model.layers[1].output[0]]\n"
                  "    hs = hs.save()")
    assert isinstance(later, Fallback) and "different modules" in later.why, later
    # an item edited after it was copied is not what its read gives: code
    edited = _plan("c = model.layers[0].output[0].clone()\nc += v\nhs = [c, model.layers[1].output[0]]\n"
                   "hs = hs.save()", v=VEC)
    assert isinstance(edited, Fallback) and "that the block edited" in edited.why, edited
    steps = _plan("ls = []\nfor _ in tracer.iter[:2]:\n    c = model.layers[0].output[0].clone()\n    c *= 2\n"
                  "    ls.append(c)\nls = ls.save()")
    assert isinstance(steps, Fallback) and "that the block edited" in steps.why, steps


def test_trace_level_containers_go_back_as_the_block_left_them():
    """A trace-level list or dict an invoke writes into (client/shared.py merges each
    invoke's copy): a read at the prompt per module value put into it, every other item
    kept as it is; one location's values appended step by step stay one per-step read;
    an untouched container goes back not at all; a step's value in a slot runs as code."""
    from vllm_nnsight_plugin.engine.cache import Kept
    from vllm_nnsight_plugin.payload.codec import SharedDict, SharedList

    appended = _plan("res.append(model.layers[0].output[0])\nres.append(model.layers[1].output[0])",
                     res=SharedList())
    assert isinstance(appended, Lowered) and appended.lists[0][1].kind == "list", appended
    assert appended.lists[0][1].items == ("__list__res.0", "__list__res.1")
    slots = _plan("slots[i] = model.layers[1].output[0]\ncounts[i] = i + 1\nrows[key] = model.logits",
                  slots=SharedList([None, None, None]), counts=SharedList([0, 0, 0]), rows=SharedDict({"a": 1}),
                  i=1, key="b")
    assert isinstance(slots, Lowered), slots
    gathered = dict(slots.lists)
    assert [type(v) for v in gathered["slots"].items] == [Kept, str, Kept]
    assert [v.value for v in gathered["counts"].items] == [0, 2, 0] and gathered["counts"].reads() == ()
    assert gathered["rows"].kind == "dict" and gathered["rows"].keys == ("a", "b")
    assert {op["op"] for op in slots.spec["ops"]} == {"read", "logits"}
    built = gathered["slots"].build(lambda name: f"value of {name}")
    assert built == [None, "value of __list__slots.0", None]
    # the same block in two invokes, each its own slot: the same ops (they batch together)
    other = _plan("slots[i] = model.layers[1].output[0]", slots=SharedList([None, None]), i=0)
    again = _plan("slots[i] = model.layers[1].output[0]", slots=SharedList([None, None]), i=1)
    assert other.spec["ops"] == again.spec["ops"]
    per_step = _plan("for _ in tracer.iter[:2]:\n    outs.append(model.layers[0].output[0])", outs=SharedList())
    assert isinstance(per_step, Lowered) and not per_step.lists
    assert per_step.spec["ops"][0]["steps"] == [0, 1]
    untouched = _plan("h = model.layers[0].output[0].save()", outs=SharedList([1]))
    assert isinstance(untouched, Lowered) and not untouched.lists
    nested = _plan("outs[1].append(model.layers[0].output[0])", outs=SharedList([[], [5]]))
    assert isinstance(nested, Lowered), nested
    inner = dict(nested.lists)["outs"]
    assert inner.reads() == ("__list__outs.0",) and inner.build(str) == [[], [5, "__list__outs.0"]]
    per_step_inner = _plan("for _ in tracer.iter[:2]:\n    outs[0].append(model.layers[0].output[0])",
                           outs=SharedList([[]]))
    assert isinstance(per_step_inner, Fallback) and "after the prompt" in per_step_inner.why, per_step_inner
    # beside a step loop only module values may go in: a count kept per step would be the
    # recording's (two passes of an open-ended loop, every step of a bounded one), not the run's
    for loop in ("tracer.iter[:]", "tracer.iter[:3]"):
        counted = _plan(f"for _ in {loop}:\n    counts[0] += 1\n    outs.append(model.logits)",
                        counts=SharedList([0]), outs=SharedList())
        assert isinstance(counted, Fallback) and "beside a step loop" in counted.why, counted
        marked = _plan(f"for _ in {loop}:\n    marks.append(None)\n    model.layers[0].output[0][:] += 1",
                       marks=SharedList())
        assert isinstance(marked, Fallback) and "beside a step loop" in marked.why, marked
    steered = _plan("slots[1] = model.logits\nrows['k'] = [model.layers[1].output[0]]\n"
                    "for _ in tracer.iter[:]:\n    model.layers[0].output[0][:] += 1",
                    slots=SharedList([None, None]), rows=SharedDict())
    assert isinstance(steered, Lowered), steered
    many = _plan("s[0] = list(range(1000))\nh = model.layers[0].output[0].save()", s=SharedList([None]))
    words = _plan("s[0] = 'x' * 100000\nh = model.layers[0].output[0].save()", s=SharedList([None]))
    assert isinstance(many, Fallback) and isinstance(words, Fallback) and "KiB" in words.why, (many, words)
    later = _plan("for _ in tracer.iter[1:2]:\n    slots[0] = model.layers[0].output[0]", slots=SharedList([None]))
    assert isinstance(later, Fallback) and "after the prompt" in later.why, later
    odd = _plan("slots[0] = model.layers[0]", slots=SharedList([None]))
    assert isinstance(odd, Fallback) and "cannot carry" in odd.why, odd
    # a tensor the container brought, changed in place, goes back (the client's merge compares it)
    changed = _plan("acc[0] += 1\nh = model.layers[0].output[0].save()", acc=SharedList([torch.zeros(3)]))
    assert isinstance(changed, Lowered) and torch.equal(dict(changed.lists)["acc"].items[0].value, torch.ones(3))
    # what a plan keeps is bounded (a cached plan holds it) and measured by the saved-value limits
    big = _plan("s[0] = torch.zeros(1 << 20)\nh = model.layers[0].output[0].save()", s=SharedList([None]),
                torch=torch)
    assert isinstance(big, Fallback) and "KiB" in big.why, big
    from vllm_nnsight_plugin.engine.cache import Gather, ReadList
    from vllm_nnsight_plugin.engine.limits import measure

    assert measure(ReadList({}, Gather("list", (Kept(torch.zeros(4)), Kept(None))))) == (2, 16)
    only_numbers = _plan("counts[0] = 5", counts=SharedList([0]))
    assert isinstance(only_numbers, Fallback) and "reads and edits nothing" in only_numbers.why, only_numbers


def test_logits_reads_are_a_plan_of_their_own():
    assert _ops("l = model.logits.save()") == [{"op": "logits", "name": "l", "steps": "prefill"}]
    assert _ops("ls = list().save()\nfor _ in tracer.iter[:4]:\n    ls.append(model.logits)") == [
        {"op": "logits", "name": "ls", "steps": [0, 1, 2, 3]}]


def test_a_saved_tracer_result_is_a_result_op_of_the_plan():
    """``tracer.result`` is the finished output, which only the client has: saved whole
    or in part (inside a step loop too) it is a path; computing with it runs as code."""
    assert _ops("r = tracer.result.save()") == [{"op": "result", "name": "r", "path": []}]
    assert _ops("for _ in tracer.all():\n    model.layers[0].output[0][:] += v\n"
                "ids = tracer.result.outputs[0].token_ids.save()", v=VEC)[-1] == {
        "op": "result", "name": "ids", "path": [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]}
    assert _ops("for _ in tracer.all():\n    r = tracer.result\n    model.layers[0].output[0][:] += v\n"
                "out = r.save()", v=VEC)[-1]["op"] == "result"
    for source, why in (("n = len(tracer.result.outputs)", "raised TypeError"),
                        ("r = tracer.result._hidden.save()", "a plan cannot name")):
        found = _plan(source)
        assert isinstance(found, Fallback) and why in found.why and found.line == 10, (source, found)


def test_what_a_plan_cannot_hold_runs_as_code_naming_line_and_why():
    cases = {
        "h = model.layers[0].output[0]\nif h.norm() > 0:\n    h[:] *= 0.5": (11, "uses .norm"),
        "x = model.layers[0].output[0]\nn = x.sum().item()": (11, "uses .sum"),
        "h = model.layers[0].output[0]\nh[:] = torch.relu(h)": (11, "passes a module's value to torch (relu)"),
        "print(1)\nx = model.layers[0].output[0].save()": (10, "calls print()"),
        "x = model.layers[0].output[0].save()\nimport not_a_loaded_module": (11, "imports not_a_loaded_module"),
        "for _ in tracer.all():\n    model.tied.output[:] += v": (11, "two paths"),
        "x = model.layers[0].mlp.output[0].save()": (10, "does not say whether"),
        "model.logits[:] = 0": (10, "edits model.logits"),
        "s = model.samples.save()": (10, "uses model.samples"),
        "for _ in tracer.all():\n    model.layers[0].output[0][:] += v\n"
        "    model.layers[0].output[1][:] += v\n    y = model.layers[1].output[0]\n"
        "x = model.layers[0].output[0].save()": (14, "after an open-ended step loop"),
        "for _ in tracer.all():\n    if _ > 2:\n        pass": (11, "step number of an open-ended"),
        "for _ in tracer.all():\n    for _ in tracer.iter[:2]:\n        pass": (11, "inside a step loop"),
        "for s in tracer.iter[:2]:\n    x = model.layers[0].output[0].save()": (11, "after the prompt"),
        "for _ in tracer.all():\n    model.layers[0].output[0][:] += v\n    break": (12, "leaves an open-ended"),
        "x = model.layers[0].output[0].save()\nfor _ in tracer.all():\n    model.layers[0].output[0][:] += v":
            (10, "beside an edit"),
        "for _ in tracer.all():\n    model.layers[0].output[0][:] += w": (11, "torch.float64"),
        "for _ in tracer.all():\n    model.layers[0].output[0][:] *= 1e999": (11, "not finite"),
        "x = model.layers[5].output[0].save()": (10, "raised IndexError"),
        "while True:\n    pass": (10, "while being recorded"),
        "n = 0\nfor _ in tracer.all():\n    if n < 3:\n        model.layers[0].output[0][:] += v\n    n += 1":
            (11, "from one step to the next"),
        "for k, _ in enumerate(tracer.all()):\n    if k == 0:\n        model.layers[0].output[0][:] += v":
            (10, "from one step to the next"),
        "while True:\n    try:\n        pass\n    except BaseException:\n        pass": (10, "while being recorded"),
        "model.layers[0].output[0][:] += torch.randn(8)": (10, "draws random numbers"),
        "for _ in tracer.all():\n    model.layers[0].output[0][:] += torch.randn(8)": (10, "from one step to the next"),
        "for s in tracer.iter[:5000]:\n    pass": (10, "more than 4096 steps"),
        "model.layers[0].output = (v, v)": (10, "assigns layers.0.output"),
        "y = model.layers[0].output[0][:, 3].save()": (10, "a plan picks whole rows"),
        "try:\n    x = model.layers[0].output[0].tolist()\nexcept Exception:\n    pass": (11, "uses .tolist"),
        "d = {}\nd['h'] = model.layers[0].output[0].save()": (11, "saves no value under a name"),
        "box = []\nbox.append(model.layers[1].output[0].save())": (11, "saves no value under a name"),
    }
    for source, (line, why) in cases.items():
        found = _plan(source, v=VEC, w=VEC.double(), torch=torch)
        assert isinstance(found, Fallback), source
        assert why in found.why and found.line == line, (source, found)


def test_names_the_caller_had_are_rebound_by_the_block():
    """The client ships every name the block mentions that its frame has (a second
    run of a cell has the first run's ``rows`` and ``stream``): the block rebinds them."""
    ops = _ops("rows = []\nfor _ in tracer.all():\n    rows.append(model.layers[0].output[0].clone())\n"
               "stream = rows.save()", rows=[1], stream=torch.zeros(1), _=3)
    assert [op["name"] for op in ops] == ["stream"]


def test_an_envoy_the_caller_made_names_its_module():
    rec, resolve = recorder(TOY, torch.float32, SHARED)
    found = plan_block(rec, "x = layer.output[0].save()", "<block>", 1, {"layer": resolve(("envoy", "layers.1"))})
    assert found.spec["ops"][0]["module"] == "layers.1"


BIG = torch.ones(20_000)  # 80 KB: its payload is over the plan cache's size


def _steer_toy(model, tracer):
    for _ in tracer.all():
        model.layers[0].output[0][:] += VEC


def _steer_toy_big(model, tracer):
    for _ in tracer.all():
        model.layers[0].output[0][:] += BIG


def test_plans_are_cached_by_payload_text_unless_large():
    lowerings = Lowerings(TOY, torch.float32)

    def serves(path: str, kind: str) -> None:
        pass

    env = json.loads(make_payload(_steer_toy))
    first = lowerings.get(env, serves)
    assert isinstance(first, Lowered) and lowerings.get(env, serves) is first  # one spec: its ops batch
    big = json.loads(make_payload(_steer_toy_big))
    one, two = lowerings.get(big, serves), lowerings.get(big, serves)
    assert isinstance(one, Lowered) and isinstance(two, Lowered) and two is not one

    # one block with each invoke's own value (``slots[i] = ...``): plans of their own whose like ops
    # are one object, so the batched runner groups their requests
    from vllm_nnsight_plugin.payload.codec import SharedList

    def slot_plan(i: int) -> Lowered:
        slots = SharedList([None, None])

        def block(model, tracer):
            slots[i] = model.layers[0].output[0]

        return lowerings.get(json.loads(make_payload(block)), serves)

    a, b = slot_plan(0), slot_plan(1)
    assert a is not b and dict(a.lists)["slots"].items != dict(b.lists)["slots"].items
    assert a.spec["ops"][0] is b.spec["ops"][0]

    def untapped(path: str, kind: str) -> None:
        raise ValueError("not tapped")

    refused = Lowerings(TOY, torch.float32).get(env, untapped)
    assert isinstance(refused, Fallback) and "not tapped" in refused.why  # the block says it itself


def test_a_sweeps_plans_stay_cached_least_recently_used_first(monkeypatch):
    """Invokes with a strength each have a plan each: all are kept (a sweep sent again
    records nothing), the least recently used plan goes first, and the kept plans'
    edit values are bounded in numbers as well as in count."""
    from vllm_nnsight_plugin.engine import lower

    lowerings = Lowerings(TOY, torch.float32)
    strengths, newer = [0.5 * k for k in range(300)], [0.25 * k for k in range(3)]

    def env_adding(coefs: list, k: int) -> dict:
        def block(model, tracer):
            for _ in tracer.all():
                model.layers[0].output[0][:] += coefs[k] * VEC

        return json.loads(make_payload(block))

    def sweep_env(k: int) -> dict:
        return env_adding(strengths, k)

    def other(k: int) -> dict:
        return env_adding(newer, k)

    def serves(path: str, kind: str) -> None:
        pass

    first = [lowerings.get(sweep_env(k), serves) for k in range(300)]
    assert all(isinstance(p, Lowered) for p in first)
    assert all(lowerings.get(sweep_env(k), serves) is first[k] for k in range(300))  # (> the old 256)
    monkeypatch.setattr(lower, "CACHED_PLANS", 300)
    lowerings.get(sweep_env(0), serves)  # (used again: the oldest is now 1)
    lowerings.get(sweep_env(300 - 1), serves)
    lowerings.get(other(0), serves)
    assert lowerings.get(sweep_env(0), serves) is first[0] and lowerings.get(sweep_env(1), serves) is not first[1]
    assert lower._numbers([[0.5] * 8]) == lower._numbers([0.5] * 8) == 8  # (a value of shape (1, 8) holds 8)
    monkeypatch.setattr(lower, "CACHED_NUMBERS", 3 * VEC.numel())
    kept = [lowerings.get(other(k), serves) for k in range(3)]
    assert len(lowerings._cache) == 3 and all(lowerings.get(other(k), serves) is kept[k] for k in range(3))


def test_a_plans_error_names_the_blocks_line():
    found = _plan("for _ in tracer.all():\n    model.layers[0].output[0][:] += v", v=VEC)
    assert found.relabel("ops[0] (add layers.0): the size is wrong") == ("the size is wrong", 11)
    assert found.relabel("ops[0] (add layers.0.output) was not reached") == \
        ("add layers.0.output was not reached", 11)
    assert found.relabel("something else") == ("something else", None)


def test_a_recording_off_the_main_thread_is_bounded_too():
    import threading

    found = []
    thread = threading.Thread(target=lambda: found.append(_plan("while True:\n    pass")))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(found[0], Fallback) and "while being recorded" in found[0].why


def test_names_bound_to_none_or_other_values_are_not_saves():
    ops = _ops("edit = None\nflag = False\nx = model.layers[1].output[0].save()", edit=None)
    assert [op["name"] for op in ops] == ["x"]
