"""Batched edits: every-step, all-rows spec edits run without a block of their own,
applied once per distinct operation over all the requests that sent it. They must
give exactly what the same edit written as a block gives, request by request."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_same, generate_together
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, make_payload, results
from vllm_nnsight_plugin.payload.spec import StepFilter, last_step, replayable, runs_batched, step_filter

PROMPTS = ["The capital of Japan is", "Hello world!", "One two three four", "The quick brown fox", "A B C"]


def _spec(vec: torch.Tensor, layer: int = 1, op: str = "add") -> str:
    body = {"op": op, "module": f"model.layers.{layer}", "index": 0, "steps": "all"}
    body.update({"value": vec.tolist()} if op in ("add", "set") else {"factor": 0.5} if op == "scale" else {})
    return json.dumps({"v": 1, "kind": "spec", "ops": [body]})


def _params(payload: str | None = None, code: bool = False) -> SamplingParams:
    """``code``: run a code block as code, not as the batched spec it is (engine/lower.py)."""
    extra = {"nnsight": payload, **({"nnsight_lower": False} if code else {})} if payload else None
    return SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True, extra_args=extra)


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
    assert runs_batched(json.loads(_spec(VEC_A)))
    once = {"op": "add", "module": "m", "value": [1], "steps": "prefill"}
    assert runs_batched({"kind": "spec", "ops": [once]}) and not replayable({"ops": [once]})
    assert last_step({"ops": [once, {**once, "steps": [2, 5]}]}) == 5
    assert runs_batched({"kind": "spec", "ops": [{"op": "read", "name": "h", "module": "m", "steps": "all"}]})
    last_row = {"op": "read", "name": "h", "module": "m", "steps": "all", "positions": [-1]}
    assert runs_batched({"kind": "spec", "ops": [last_row]})
    assert not runs_batched({"kind": "spec", "ops": [{"op": "logits_topk", "name": "t", "k": 3}]})
    steer = json.loads(_spec(VEC_A))
    assert replayable(steer) and last_step(steer) is None


def test_a_specs_steps_name_the_steps_a_block_runs_its_op_at():
    assert step_filter(None) == step_filter("prefill") == StepFilter(explicit={0}, generated=False, last=0)
    assert step_filter("generated") == step_filter("all") == StepFilter(explicit=None, generated=True, last=None)
    assert step_filter([2, "5"]) == StepFilter(explicit={2, 5}, generated=False, last=5)


def test_batched_steering_equals_the_same_steering_as_a_block(llama):
    llm = llama.vllm_entrypoint
    spec_a, spec_b = _spec(VEC_A), _spec(VEC_B)

    as_spec = generate_together(llm, PROMPTS, [_params(spec_a), _params(spec_b), _params(spec_a), _params(),
                                               _params(spec_a)])
    block_a, block_b = make_payload(_block_a), make_payload(_block_b)
    as_block = generate_together(llm, PROMPTS, [_params(block_a, code=True), _params(block_b, code=True),
                                                _params(block_a, code=True), _params(),
                                                _params(block_a, code=True)])
    # the neighbour's baseline: the same traced traffic steering by zero, in the same
    # batches (generate_together: on a GPU the last bits of a GEMM depend on the batch)
    zero = _spec(torch.zeros_like(VEC_A))
    base = generate_together(llm, PROMPTS, [_params(zero)] * 3 + [_params(), _params(zero)])
    plain = llm.generate(PROMPTS, [_params()] * len(PROMPTS), use_tqdm=False)
    # the same edit, row for row and step for step: the same tokens; logprobs equal up to
    # the last bits (a block's edit runs other kernels than the spec's)
    for (tok_s, lp_s), (tok_b, lp_b) in zip(_seen(as_spec), _seen(as_block)):
        assert tok_s == tok_b
        for step_s, step_b in zip(lp_s, lp_b, strict=True):
            assert step_s.keys() == step_b.keys()
            assert all(abs(step_s[t] - step_b[t]) <= 1e-5 for t in step_s)
    assert _seen(as_spec)[3] == _seen(base)[3]  # the untraced neighbour: bit for bit
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


def test_an_error_names_the_op_by_its_number_in_the_spec_as_sent(llama):
    """The engine expands a cache into its reads and drops result ops; an error still
    names ``ops[i]`` as the JSON numbers it, batched and per request alike."""
    llm = llama.vllm_entrypoint
    bad = {"op": "add", "module": "model.layers.1", "index": 0, "steps": "all", "value": [1.0] * 7}
    first = [{"op": "cache", "name": "acts", "modules": ["model.layers.0", "model.layers.2"], "steps": "prefill"},
             {"op": "result", "name": "r", "path": []}]
    batched = json.dumps({"v": 1, "kind": "spec", "ops": [*first, bad]})
    per_request = json.dumps({"v": 1, "kind": "spec", "ops": [*first, bad, {"op": "logits_topk", "name": "t", "k": 2}]})
    # (with the cache as its reads, the first runs batched; logits_topk makes the second per request)
    assert runs_batched({**json.loads(batched), "ops": [bad]}) and not runs_batched(json.loads(per_request))
    outs = llm.generate(PROMPTS[:3], [_params(batched), _params(), _params(per_request)], use_tqdm=False)
    for i in (0, 2):
        with pytest.raises(InterventionError, match=r"ops\[2\] \(add model\.layers\.1"):
            results(outs[i])
    assert len(outs[1].outputs[0].token_ids) == 5


def test_a_logits_read_runs_per_request_as_it_runs_batched(llama):
    """Beside a ``logits_topk`` the spec runs per request: its ``logits`` read gives
    each step's row as the batched read does."""
    llm = llama.vllm_entrypoint
    logits = {"op": "logits", "name": "l", "steps": "all"}
    batched = json.dumps({"v": 1, "kind": "spec", "ops": [logits]})
    per_request = json.dumps({"v": 1, "kind": "spec", "ops": [logits, {"op": "logits_topk", "name": "t", "k": 2}]})
    outs = llm.generate(PROMPTS[:1] * 2, [_params(batched), _params(per_request)], use_tqdm=False)
    assert [o.ran_as for o in outs] == ["batched", "spec, per request"]
    one, other = results(outs[0]), results(outs[1])
    assert len(one["l"]) == len(other["l"]) == 5
    for a, b in zip(one["l"], other["l"]):
        assert a.shape == b.shape == (1, a.shape[-1]) and torch.allclose(a, b, atol=1e-5)
    assert other["t"]["ids"].tolist() == other["l"][0][0].topk(2).indices.tolist()


_EVERY_KIND = [
    {"op": "read", "name": "r", "module": "model.layers.1", "index": 0},
    {"op": "read", "name": "r", "module": "model.layers.1", "sum": True, "positions": [-1], "steps": "all"},
    {"op": "read", "name": "r", "module": "model.layers.2.mlp", "io": "input", "positions": 0, "steps": [0, 2]},
    {"op": "logits", "name": "r", "steps": "generated"},
    {"op": "add", "module": "model.layers.1", "index": 0, "value": [0.5] * 128, "steps": "all"},
    {"op": "set", "module": "model.layers.1.mlp", "value": [0.25] * 128, "positions": [-1], "steps": "all"},
    {"op": "scale", "module": "model.layers.0", "index": 0, "factor": 3.0, "steps": [1, 2]},
    {"op": "zero", "module": "model.layers.2.mlp", "steps": "prefill"},
    {"op": "cache", "name": "r", "modules": ["model.layers.1", "model.layers.3.mlp"]},
    {"op": "result", "name": "r", "path": [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]},
]


@pytest.mark.parametrize("op", _EVERY_KIND, ids=lambda op: op["op"])
def test_every_op_runs_per_request_as_it_runs_batched(llama, op):
    """The same op batched, and per request (a ``logits_topk`` beside it): the same
    tokens, logprobs and saves."""
    llm = llama.vllm_entrypoint
    batched = json.dumps({"v": 1, "kind": "spec", "ops": [op]})
    per_request = json.dumps({"v": 1, "kind": "spec", "ops": [op, {"op": "logits_topk", "name": "t", "k": 2}]})
    outs = llm.generate(PROMPTS[:2] * 2, [_params(batched)] * 2 + [_params(per_request)] * 2, use_tqdm=False)
    assert [o.ran_as for o in outs] == ["batched"] * 2 + ["spec, per request"] * 2
    for one, other in zip(outs[:2], outs[2:]):
        assert list(one.outputs[0].token_ids) == list(other.outputs[0].token_ids)
        for step_a, step_b in zip(one.outputs[0].logprobs, other.outputs[0].logprobs, strict=True):
            assert all(abs(step_a[t].logprob - step_b[t].logprob) <= 1e-4 for t in step_a)
        saved_a, saved_b = results(one), results(other)
        assert saved_b.pop("t")
        assert_same(saved_a, saved_b, rtol=1e-5, atol=1e-4)


# --- the interleaver's batched-edit bookkeeping, on a toy module (no engine needed) ---

class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = torch.nn.Linear(4, 4)  # never called by forward, like vLLM's

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _toy():

    from vllm_nnsight_plugin.engine.interleave import Interleaver
    from vllm_nnsight_plugin.engine.worker_setup import WorkerSetup

    model = _Toy().eval()
    return model, Interleaver(model, WorkerSetup())


def _toy_spec(*ops) -> str:
    return json.dumps({"v": 1, "kind": "spec", "ops": list(ops)})


def _step(model, inter, spans, x):
    from vllm_nnsight_plugin.engine.interleave import StepLayout

    inter.begin_step(StepLayout(spans, {r: i for i, r in enumerate(spans)}, x.shape[0]))
    with torch.no_grad():
        model(x)
    return inter.end_step()


def test_a_batched_edit_of_a_module_the_forward_never_calls_fails():
    model, inter = _toy()
    inter.admit("a", {"nnsight": _toy_spec({"op": "scale", "module": "lm_head", "factor": 0.0, "steps": "all"})})
    assert inter.sessions["a"][0].batched
    out = _step(model, inter, {"a": (0, 2)}, torch.randn(2, 4))
    assert "was not reached" in out["a"]["error"]["message"]


def test_finished_requests_leave_no_batched_state_or_hooks():
    model, inter = _toy()
    inter.admit("b", {"nnsight": _toy_spec({"op": "add", "module": "layers.0", "value": [1, 1, 1, 1],
                                             "steps": "all"})})
    _step(model, inter, {"b": (0, 1)}, torch.randn(1, 4))
    inter.finish(["b"])  # an abort or a stop string: vLLM finishes it
    _step(model, inter, {}, torch.randn(1, 4))
    assert not inter.batched.at and not inter.hooks and not inter.traced


class _Split(torch.nn.Module):
    def forward(self, x):
        return x.view(x.shape[0], 2, 2)


class _Heads(torch.nn.Module):
    """``heads``: a per-token output of two dimensions a row (two heads of two)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.heads = _Split()

    def forward(self, x):
        return self.heads(self.proj(x))


def test_a_batched_value_of_one_rows_shape_broadcasts_over_its_requests_rows():
    """As in eager torch, a (2, 2) value adds to every (2, 2) row of an (N, 2, 2) output;
    a value of three rows on an (N, 4) output (as many dimensions: a row per token) is refused."""
    from vllm_nnsight_plugin.engine.interleave import Interleaver, StepLayout
    from vllm_nnsight_plugin.engine.worker_setup import WorkerSetup

    torch.manual_seed(0)
    model = _Heads().eval()
    inter = Interleaver(model, WorkerSetup())
    value = [[1.0, 2.0], [3.0, 4.0]]
    inter.admit("a", {"nnsight": _toy_spec({"op": "add", "module": "heads", "value": value, "steps": "all"})})
    inter.admit("r", {"nnsight": _toy_spec({"op": "add", "module": "proj", "value": [[1.0] * 4] * 3,
                                             "steps": "all"})})
    x = torch.randn(6, 4)
    with torch.no_grad():
        clean = model(x)
        inter.begin_step(StepLayout({"u": (0, 1), "a": (1, 4), "r": (4, 6)}, {"u": 0, "a": 1, "r": 2}, 6))
        steered = model(x)
    out = inter.end_step()
    assert out.get("a", {}).get("error") is None
    assert torch.equal(steered[0], clean[0])  # (an untraced request's row)
    assert torch.allclose(steered[1:4], clean[1:4] + torch.tensor(value))
    assert "is not one row" in out["r"]["error"]["message"]
    assert torch.equal(steered[4:], clean[4:])  # (refused before any row changed)


def test_the_last_traced_request_to_finish_takes_its_hooks_along():
    """Untraced steps after traced work run without the plugin's module hooks, whether
    or not a traced step follows (vLLM finishes requests at the next step's start)."""
    model, inter = _toy()
    spec = {"nnsight": _toy_spec({"op": "add", "module": "layers.0", "value": [1, 1, 1, 1], "steps": "all"})}
    inter.admit("b", spec)
    inter.admit("c", spec)
    _step(model, inter, {"b": (0, 1), "c": (1, 2)}, torch.randn(2, 4))
    assert inter.hooks and model.layers[0]._forward_hooks  # (the edit's hook while it runs)
    inter.finish(["b"])  # (another traced request is live: its edit keeps the hook)
    assert inter.hooks and model.layers[0]._forward_hooks
    inter.finish(["c"])
    assert not inter.batched.at and not inter.hooks and not inter.waiters
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_batched_edits_keep_each_requests_block_order():
    """Installed edits run before the request's own block, whoever else shares the batch."""
    model, inter = _toy()
    scale = _toy_spec({"op": "scale", "module": "layers.0", "factor": 0.5, "steps": "all"})
    inter.admit("q", {"nnsight": scale})  # its scale group exists first
    inter.install_edit("e1", "steer", _toy_spec({"op": "add", "module": "layers.0", "value": [10.0] * 4,
                                                  "steps": "all"}))
    inter.admit("r", {"nnsight": scale, "nnsight_edits": ["steer"]})
    seen = {}
    handle = model.layers[0].register_forward_hook(lambda mod, args, out: seen.setdefault("out", out.clone()))
    x = torch.zeros(2, 4)
    with torch.no_grad():
        raw = model.layers[0](x).clone()
    seen.clear()
    _step(model, inter, {"q": (0, 1), "r": (1, 2)}, x)
    handle.remove()
    torch.testing.assert_close(seen["out"][0], raw[0] * 0.5)
    torch.testing.assert_close(seen["out"][1], (raw[1] + 10) * 0.5)


def test_a_step_range_in_a_steady_batch_ends_at_its_last_step():
    """A batched edit of steps 0-3 in requests that keep generating: the steady batch
    takes the shortcut that only counts steps, and still stops at step 3 (edited at
    steps 0-3 only, the block over after step 3 while its request goes on)."""
    model, inter = _toy()
    four = _toy_spec({"op": "add", "module": "layers.0", "value": [10.0] * 4, "steps": [0, 1, 2, 3]})
    params = SamplingParams(max_tokens=7)
    inter.admit("a", {"nnsight": four}, params)
    inter.admit("b", {"nnsight": four}, params)
    edited, shortcut = [], []
    handle = model.layers[0].register_forward_hook(lambda mod, args, out: edited.append(bool(out.abs().min() > 5)))
    x = torch.zeros(2, 4)
    for _ in range(7):
        shortcut.append(inter._quiet is not None)
        _step(model, inter, {"a": (0, 1), "b": (1, 2)}, x)
    handle.remove()
    assert edited == [True] * 4 + [False] * 3
    assert any(shortcut[:4])  # (the shortcut ran while the edit was live)
    assert not any(s.active for r in ("a", "b") for s in inter.sessions.get(r, ()))


def test_the_steady_batch_shortcut_changes_nothing_but_the_work(monkeypatch):
    """Random batches of batched edits and reads over step lists, every step and the
    prompt: with the shortcut that only counts steps, the same edits, results, step
    counts and ended blocks as walking every step."""
    import random

    from vllm_nnsight_plugin.engine import requests

    def run(specs: dict[str, str], steps: int) -> tuple:
        torch.manual_seed(0)
        model, inter = _toy()
        for req_id, spec in specs.items():
            inter.admit(req_id, {"nnsight": spec}, SamplingParams(max_tokens=steps))
        edited, results, shortcut = [], [], 0
        handle = model.layers[0].register_forward_hook(
            lambda mod, args, out: edited.append((out.abs() > 5).any(dim=1).tolist()))
        spans = {r: (i, i + 1) for i, r in enumerate(specs)}
        for _ in range(steps):
            shortcut += inter._quiet is not None
            out = _step(model, inter, spans, torch.zeros(len(specs), 4))
            results.append(repr(sorted((r, sorted((k, repr(v)) for k, v in e.items())) for r, e in out.items())))
        handle.remove()
        state = {r: [(s.step, s.active) for s in inter.sessions.get(r, ())] for r in specs}
        return (edited, results, state), shortcut

    rng = random.Random(0)
    used = 0
    for _ in range(60):
        specs = {}
        for i in range(rng.randint(1, 3)):
            steps = rng.choice(["all", "prefill", "list", "list"])
            if steps == "list":
                steps = sorted(rng.sample(range(8), rng.randint(1, 4)))
            op = {"op": "add", "module": "layers.0", "value": [10.0] * 4} if rng.random() < 0.6 \
                else {"op": "read", "name": "h", "module": "layers.0"}
            specs[f"r{i}"] = _toy_spec({**op, "steps": steps})
        with_shortcut, used_now = run(specs, 10)
        with monkeypatch.context() as patch:
            patch.setattr(requests.QuietBatch, "holds", lambda self, *args: False)
            walked, _ = run(specs, 10)
        assert with_shortcut == walked, specs
        used += used_now
    assert used > 100  # (the shortcut ran)


def test_a_steady_batch_reuses_its_picks_and_changes_nothing_else(monkeypatch):
    """Random batches of batched edits and reads (every step, the prompt, generated
    steps, step lists, a picked position; prompts of three rows, then one row a step;
    requests ending at different steps, one failing a step before its request leaves
    the batch; requests of one spec whose rows others split): reusing the last steady
    step's picks and their row index gives the same edits, results and sessions as
    building both every step, and they are reused."""
    import random

    from vllm_nnsight_plugin.engine import batched
    from vllm_nnsight_plugin.engine.interleave import StepLayout
    from vllm_nnsight_plugin.engine.plan_ops import _flat

    def run(specs: dict[str, str], ends: dict[str, int], fail: tuple[str, int] | None) -> tuple:
        torch.manual_seed(0)
        model, inter = _toy()
        for req_id, spec in specs.items():
            inter.admit(req_id, {"nnsight": spec}, SamplingParams(max_tokens=ends[req_id]))
        edited, results = [], []
        handle = model.layers[0].register_forward_hook(lambda mod, args, out: edited.append(out.tolist()))
        spans = rows = None
        for step in range(max(ends.values())):
            live = [r for r in specs if ends[r] > step]
            widths = [3 if step == 0 else 1 for _ in live]
            new = {r: (sum(widths[:i]), sum(widths[:i + 1])) for i, r in enumerate(live)}
            if new != spans:  # (the runner publishes a new layout only when the batch changes)
                spans, rows = new, {r: i for i, r in enumerate(live)}
            inter.begin_step(StepLayout(spans, rows, sum(widths)))
            with torch.no_grad():
                model(torch.arange(sum(widths) * 4, dtype=torch.float32).reshape(-1, 4) / 10)
            out = inter.end_step()
            results.append(repr(sorted((r, sorted((k, repr(v)) for k, v in e.items())) for r, e in out.items())))
            inter.finish([r for r in live if ends[r] == step + 1])
            if fail is not None and fail[1] == step and inter.sessions.get(fail[0]):
                # (its error ended it; under async scheduling its request still runs a step)
                inter.sessions[fail[0]][0].fail("ended")
        handle.remove()
        state = {r: [(s.step, s.active) for s in inter.sessions.get(r, ())] for r in specs}
        return edited, results, state

    picks = {"n": 0}
    original = batched.BatchedEdits._pick

    def counted(groups, layout, per_request=False):
        picks["n"] += 1
        return original(groups, layout, per_request)

    monkeypatch.setattr(batched.BatchedEdits, "_pick", staticmethod(counted))
    rng = random.Random(1)
    reused = 0
    for _ in range(60):
        pool = []
        for _ in range(rng.randint(1, 3)):
            steps = rng.choice(["all", "all", "prefill", "generated", "list"])
            if steps == "list":
                steps = sorted(rng.sample(range(8), rng.randint(1, 4)))
            kind = rng.random()
            op = {"op": "add", "module": "layers.0", "value": [10.0] * 4} if kind < 0.4 else \
                {"op": "scale", "module": "layers.0", "factor": 2.0} if kind < 0.6 else \
                {"op": "read", "name": "h", "module": "layers.0"}
            if rng.random() < 0.3:
                op["positions"] = [-1]
            pool.append(_toy_spec({**op, "steps": steps}))
        # (requests of one spec text share its ops: one group, whose rows others may split)
        specs = {f"r{i}": rng.choice(pool) for i in range(rng.randint(1, 6))}
        ends = {r: rng.randint(2, 9) for r in specs}
        fail = (rng.choice(list(specs)), rng.randint(1, 6)) if rng.random() < 0.4 else None
        picks["n"] = 0
        reusing = run(specs, ends, fail)
        walks = picks["n"]
        with monkeypatch.context() as patch:  # (the reference: every step's picks and row index built anew)
            patch.setattr(batched.BatchedEdits, "steady", lambda self, layout: False)
            patch.setattr(batched.BatchedEdits, "_rows_of", lambda self, picked, device: torch.cat(
                [torch.arange(s, e) for s, e in sorted(_flat(picked))]).to(device))
            picks["n"] = 0
            walking = run(specs, ends, fail)
        assert reusing == walking, (specs, ends, fail)
        reused += picks["n"] - walks
    assert reused > 50  # (steady steps took the last step's picks)


def _caches_then_fails(model, tracer):
    tracer.cache(modules=["layers.0"])
    n = 0
    for _ in tracer.all():
        model.layers[1].output.save()
        n += 1
        if n == 3:
            raise ValueError("over at its third step")


def _caches(model, tracer):
    tracer.cache(modules=["layers.0"])


def test_a_code_block_that_ends_takes_its_cache_reads_out_of_a_steady_batch():
    """Two code blocks cache the same module (one read op, one group); one fails at
    its third step while its request stays in the batch a step longer (async
    scheduling). The other's cache still gets its row at every step: the steady batch
    does not reuse picks that hold the ended block."""
    from vllm_nnsight_plugin.engine.interleave import StepLayout

    model, inter = _toy()
    inter.admit("a", {"nnsight": make_payload(_caches_then_fails), "nnsight_lower": False})
    inter.admit("b", {"nnsight": make_payload(_caches), "nnsight_lower": False})
    lives = inter.sessions["b"][0]
    prompt, decode, rows = {"a": (0, 3), "b": (3, 6)}, {"a": (0, 1), "b": (1, 2)}, {"a": 0, "b": 1}
    cached, errors = [], {}
    for step in range(6):
        spans = prompt if step == 0 else decode  # (one dict for every decode step, as the runners keep it)
        width = sum(e - s for s, e in spans.values())
        inter.begin_step(StepLayout(spans, rows, width))
        with torch.no_grad():
            model(torch.randn(width, 4))
        for req_id, entry in inter.end_step().items():
            if entry.get("error"):
                errors[req_id] = entry["error"]["message"]
        logs = [v for k, v in lives.namespace.items() if k.startswith("__cache__")]
        cached.append(sum(len(log) for log in logs))
    assert "third step" in errors["a"] and "b" not in errors
    assert cached == [1, 2, 3, 4, 5, 6]


def test_a_recomputed_request_whose_blocks_are_over_fails_and_is_not_restarted():
    """vLLM preempts a request and recomputes it (V2 re-sends it as new): the edit its
    finished block made at prefill would be missing from the recompute, so say so."""
    model, inter = _toy()
    once = _toy_spec({"op": "add", "module": "layers.0", "value": [1.0] * 4})  # prefill only
    inter.admit("a", {"nnsight": once})
    out = _step(model, inter, {"a": (0, 2)}, torch.randn(2, 4))
    assert out["a"]["error"] is None and "a" not in inter.sessions  # the block is over
    inter.fail_request("a", "the request was preempted and its forward recomputed")
    inter.admit("a", {"nnsight": once})  # re-sent as new
    assert "a" not in inter.sessions
    out = _step(model, inter, {"a": (0, 3)}, torch.randn(3, 4))
    assert "preempted" in out["a"]["error"]["message"]


def test_an_exception_in_the_tap_handler_never_breaks_the_forward(caplog):
    from vllm_nnsight_plugin.engine import taps

    def broken(site, xs):
        xs[0].add_(1.0)  # (an edit made before the failure stays: the block fails as unreached)
        raise RuntimeError("boom")

    value = torch.zeros(2)
    taps.set_handler(broken)
    try:
        with caplog.at_level("ERROR", logger="vllm.nnsight_plugin"):
            taps._tap([value], "model.layers.0|output|T")  # logged, not raised
    finally:
        taps.set_handler(None)
    assert value.tolist() == [1.0, 1.0]
    assert any("tap model.layers.0|output|T failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_batched_reads_at_every_step_equal_hugging_face(llama, hf_llama):
    """Whole-row reads run batched too: one copy of the location per step for every
    request, each request getting its own rows, prefill then one row per token."""
    from conftest import assert_close

    spec = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "hidden", "module": "model.layers.1", "index": 0, "steps": "all"},
        {"op": "read", "name": "residual", "module": "model.layers.1", "index": 1, "steps": "all"},
        {"op": "read", "name": "first", "module": "model.layers.1", "index": 0},
        {"op": "read", "name": "stream", "module": "model.layers.1", "sum": True, "steps": "all"},
    ]})
    assert runs_batched(json.loads(spec))
    prompts = PROMPTS[:4]
    outs = llama.vllm_entrypoint.generate(prompts, [_params(spec)] * 4, use_tqdm=False)
    for out in outs:
        saves = results(out)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0]
        n = len(out.prompt_token_ids)
        assert len(saves["hidden"]) == 5  # prefill + 4 generated steps that ran a forward
        assert_close(saves["hidden"][0] + saves["residual"][0], ref[:n])
        for k in range(1, 5):
            assert_close(saves["hidden"][k] + saves["residual"][k], ref[n - 1 + k : n + k])
        torch.testing.assert_close(saves["first"], saves["hidden"][0])
        # "sum": the residual stream itself, half the bytes of both halves
        assert len(saves["stream"]) == 5
        assert_close(saves["stream"][0], ref[:n])
        for k in range(1, 5):
            torch.testing.assert_close(saves["stream"][k], saves["hidden"][k] + saves["residual"][k])


def test_a_step_range_covering_the_whole_request_runs_as_every_step():
    """tracer.iter[:n] with max_tokens=n records steps 0..n-1: for such a request that
    is every step (the steady-batch shortcuts apply); a shorter range stays as it is,
    and requests of one spec and length share the same ops."""
    _, inter = _toy()
    ops = [{"op": "scale", "module": "layers.0", "factor": 0.5, "steps": [0, 1, 2]},
           {"op": "read", "name": "h", "module": "layers.0", "steps": [1, 2]},
           {"op": "scale", "module": "layers.0", "factor": 2.0, "steps": [0, 2]}]
    env = {"v": 1, "kind": "spec", "ops": ops}
    three = inter.batched.for_request(env, 3)
    assert [op["steps"] for op in three["ops"]] == ["all", "generated", [0, 2]]
    assert inter.batched.for_request(env, 3) is three and three["ops"][2] is ops[2]
    assert inter.batched.for_request(env, 4)["ops"][0]["steps"] == [0, 1, 2]
    assert inter.batched.for_request(env, None) is env


def test_batched_and_recorded_steering_equal_hf(llama, hf_llama):
    """The steering a batched spec applies, and the same steering written as nnsight code
    (recorded into its plan), equal a Hugging Face fp32 forward steered the same way;
    without the steering the logits differ."""
    from conftest import HFRun, assert_close

    llm = llama.vllm_entrypoint
    spec = json.loads(_spec(VEC_A))
    spec["ops"].append({"op": "logits", "name": "logits"})
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"nnsight": json.dumps(spec)})
    as_spec = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    with llama.trace(PROMPTS[0], temperature=0.0, max_tokens=1) as tracer:
        logits = list().save()
        for _ in tracer.all():
            llama.model.layers[1].output[0][:] += VEC_A
            logits.append(llama.logits)
    assert tracer.outputs[0].ran_as == "batched" and as_spec.ran_as == "batched"
    ids = list(as_spec.prompt_token_ids)
    steered = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1], lambda h: h + VEC_A).logits()[-1]
    assert_close(results(as_spec)["logits"], steered)
    assert len(logits) == 1
    assert_close(logits[0], steered)
    assert (steered - HFRun(hf_llama, ids).logits()[-1]).abs().max() > 1e-2


def test_a_non_finite_error_read_late_rides_the_output_of_its_step():
    """On a GPU the non-finite check's flags land after the step, so each step's check
    is read where vLLM takes that step's output (``runners.attach_late_results``).
    Simulated by flags that have not landed when the step ends: a request's error
    reaches the output of the very step that found it, whether that step is its last
    (over the worker's own entry for it, which says ``"error": None``) or not (a
    request a stop token would end next must not lose it); the others' stay clean.
    The wiring under test: the logits guard, the step's close, the merge into vLLM's
    async output."""
    from conftest import pending_output
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_nnsight_plugin.boundary import runners
    from vllm_nnsight_plugin.boundary.runner_v1 import close_step
    from vllm_nnsight_plugin.engine import finite_logits
    from vllm_nnsight_plugin.engine.interleave import StepLayout

    class NotLanded:  # (a CUDA event whose copy is still in flight; synchronize: it lands)
        def synchronize(self):
            pass

    model, inter = _toy()
    finite = inter.finite

    def check_on_a_device(logits, index, req_ids, report=True):  # FiniteLogits.check on a GPU, not landed
        part = logits if index is None else logits.index_select(0, index)
        maxima = part.amax(dim=-1).numpy().copy()
        torch.nan_to_num(logits, neginf=float("-inf"), out=logits)
        finite._pending.append((req_ids, finite_logits._Buffer(torch.from_numpy(maxima), maxima, NotLanded())))
        return []

    finite.check = check_on_a_device

    def blow_up(step):  # (every logit +inf: whatever the row held)
        return _toy_spec({"op": "set", "module": "layers.1", "value": [3e38] * 4, "steps": [step]},
                         {"op": "scale", "module": "layers.1", "factor": 10.0, "steps": [step]})

    inter.admit("a", {"nnsight": blow_up(1)}, SamplingParams(max_tokens=3))
    inter.admit("b", {"nnsight": blow_up(2)}, SamplingParams(max_tokens=3))
    inter.admit("c", {"nnsight": _toy_spec({"op": "scale", "module": "layers.1", "factor": 1.0})},
                SamplingParams(max_tokens=3))
    rows = {"a": 0, "b": 1, "c": 2}
    x = 100 * torch.randn(3, 4)
    errors = []
    for step in range(3):
        inter.begin_step(StepLayout({r: (i, i + 1) for r, i in rows.items()}, rows, 3))
        with torch.no_grad():
            logits = model(x)
        inter.guard_logits(logits)
        pending = pending_output(ModelRunnerOutput(req_ids=list(rows), req_id_to_index=rows))
        close_step(inter, pending, set(rows) if step == 2 else set())
        taken = runners.take_results(pending.get_output()) or {}
        errors.append({r: e["error"]["message"] for r, e in taken.items() if e.get("error")})
    # (taken right after the step's close, as without async scheduling: the very step named)
    assert errors[0] == {}
    assert list(errors[1]) == ["a"] and "NaN or inf by step 1:" in errors[1]["a"]
    assert list(errors[2]) == ["b"] and "NaN or inf by step 2:" in errors[2]["b"]
    assert not finite._pending and len(finite._read) == 3  # (every step's buffer read, to be reused)
    # once no traced request is left, nothing holds their blocks (or what those hold)
    inter.finish(list(rows))
    inter.begin_step(StepLayout({}, {}, 0))
    inter.end_step()
    assert inter._guard_memo is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_logits_guard_names_the_rows_that_were_not_finite(dtype):
    """NaN or +inf in a row: that request is named and its row made finite; a row whose
    only non-finite values are -inf (a mask) is kept as it is. The maxima a GPU copies
    to the host read the same through their numpy view, bfloat16's bits included
    (numpy has no bfloat16), large finite values too."""
    from vllm_nnsight_plugin.engine import finite_logits

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, nan, 0.0], [-inf, 0.5, -inf], [inf, 0.0, 1.0]], dtype=dtype)
    guard = finite_logits.FiniteLogits()
    assert guard.check(logits.clone(), None, ["a", "b", "c", "d"]) == ["b", "d"]
    part = logits.clone()
    assert guard.check(part, torch.tensor([1, 2]), ["b", "c"]) == ["b"]
    assert torch.isfinite(part[1]).all() and torch.equal(part[2], logits[2]) and torch.isinf(part[3, 0])
    whole = logits.clone()
    guard.check(whole, None, ["a", "b", "c", "d"])
    assert torch.isfinite(whole[[0, 1, 3]]).all() and torch.equal(whole[2], logits[2])

    class Landed:
        def synchronize(self):
            pass

    big = torch.tensor([[-3e38 if dtype != torch.float16 else -6e4, 1.0]], dtype=dtype)
    maxima = torch.cat([logits.amax(dim=-1), big.amax(dim=-1), -big.amin(dim=-1)])
    view = finite_logits.host_view(maxima)
    assert view is not None and view.dtype == (np.uint16 if dtype == torch.bfloat16 else maxima.numpy().dtype)
    guard._pending.append((["a", "b", "c", "d", "e", "f"], finite_logits._Buffer(maxima, view, Landed())))
    failed = guard.detach()
    assert guard.detach() is None and failed() == ["b", "d"]
    quiet = logits.clone()  # (not reporting: a tensor-parallel rank vLLM reads no output of)
    assert guard.check(quiet, None, ["a", "b", "c", "d"], report=False) == [] and guard.detach() is None
    assert torch.isfinite(quiet[[0, 1, 3]]).all() and torch.equal(quiet[2], logits[2])
    assert guard._buffer(6, dtype).host is maxima and not guard._read  # (read on another thread: reused)

    # landed buffers are reused: one of the batch's exact size first, else the first that holds it
    guard._spare.clear()
    sizes = (512, 256, 200)
    guard._spare.extend(finite_logits._Buffer(torch.empty(n, dtype=dtype), None, Landed()) for n in sizes)
    assert guard._buffer(200, dtype).host.shape[0] == 200
    assert guard._buffer(100, dtype).host.shape[0] == 512
    assert guard._buffer(256, dtype).host.shape[0] == 256 and not guard._spare


SWEEP = [0.5, 1.0, -1.0, 2.0]


def test_a_strength_sweep_runs_as_one_edit_and_each_invoke_equals_hf(llama, hf_llama):
    """Invokes that steer by a strength of their own (``SWEEP[i] * VEC_A``: a plan per
    invoke, the value in it) are applied as one edit at each step (``joined``), and each
    invoke's tokens and log-probabilities at every step equal a Hugging Face forward
    steered by its own strength."""
    from conftest import HFRun

    llm = llama.vllm_entrypoint
    before = llm.collective_rpc("nnsight_lane_stats")[0]["joined"]
    with llama.trace(temperature=0.0, max_tokens=3, logprobs=5) as tracer:
        for i, prompt in enumerate(PROMPTS[:4]):
            with tracer.invoke(prompt):
                for _ in tracer.all():
                    llama.model.layers[1].output[0][:] += SWEEP[i] * VEC_A
    outs = tracer.outputs
    assert [o.ran_as for o in outs] == ["batched"] * 4
    joined = llm.collective_rpc("nnsight_lane_stats")[0]["joined"] - before
    assert joined >= 4 * 2, joined  # (every decode step's four edits as one, at least)
    for out, strength in zip(outs, SWEEP):
        ids, made = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        for step in range(3):  # (the prompt's step, then decode steps: their rows joined)
            steered = HFRun(hf_llama, ids + made[:step]).edit(
                hf_llama.model.layers[1], lambda h, s=strength: h + s * VEC_A).logits()
            expected = torch.log_softmax(steered[-1].double(), dim=-1)
            assert made[step] == int(expected.argmax()), (strength, step)
            seen = out.outputs[0].logprobs[step]
            assert len(seen) >= 5
            for token, logprob in seen.items():
                assert abs(logprob.logprob - expected[token].item()) <= 1e-4, (strength, step, token)
        clean = torch.log_softmax(HFRun(hf_llama, ids).logits()[-1].double(), dim=-1)
        steered = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1], lambda h, s=strength: h + s * VEC_A).logits()
        assert (torch.log_softmax(steered[-1].double(), dim=-1) - clean).abs().max() > 1e-2
