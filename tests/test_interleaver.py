"""The interleaver driven directly on a small torch model, with vLLM's own
config objects: module access is refused on a compiled engine while logits
still work. (The compiled CPU engine itself takes minutes to build on two
cores; the real-engine paths are covered in the other test files.)"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_nnsight_plugin import make_payload
from vllm_nnsight_plugin.boundary.worker_setup import worker_setup
from vllm_nnsight_plugin.engine.interleave import Interleaver, StepLayout
from vllm_nnsight_plugin.payload import values


@pytest.fixture(scope="module")
def configs(llama_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.engine.arg_utils import EngineArgs

    return {
        eager: EngineArgs(model=llama_path, enforce_eager=eager, dtype="float32").create_engine_config()
        for eager in (True, False)
    }


def _step(inter: Interleaver, model: torch.nn.Module, blocks: dict) -> dict:
    for req_id, block in blocks.items():
        inter.admit(req_id, {"nnsight": make_payload(block)})
    spans = {"a": (0, 3), "b": (3, 5)}
    inter.begin_step(StepLayout(spans, {"a": 0, "b": 1}, 5))
    with torch.inference_mode():
        hidden = model(torch.arange(20, dtype=torch.float32).reshape(5, 4))
        logits = hidden[[2, 4]]
        inter.serve(("logits",), logits, row_based=True)
    return inter.end_step()


def read_layer(model, tracer):
    x = model[0].output.save()  # noqa: F841
    lg = model.logits.save()  # noqa: F841


def read_logits(model, tracer):
    lg = model.logits.save()  # noqa: F841


def test_compiled_engine_refuses_module_access_but_serves_logits(configs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inter = Interleaver(model, worker_setup(model, configs[False]))
    assert not inter.eager
    res = _step(inter, model, {"a": read_layer, "b": read_logits})
    err = res["a"]["error"]
    assert "needs an eager engine" in err["message"] and "enforce_eager=True" in err["message"]
    assert err["line"].startswith("x = model[0].output.save()")
    assert res["b"]["error"] is None and values.decode(res["b"]["saves"]["lg"]).shape == (1, 4)


def test_eager_engine_serves_each_request_its_rows(configs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inter = Interleaver(model, worker_setup(model, configs[True]))
    res = _step(inter, model, {"a": read_layer})
    x = values.decode(res["a"]["saves"]["x"])  # encoded in the worker, as it leaves
    ref = model[0](torch.arange(20, dtype=torch.float32).reshape(5, 4))[0:3]
    assert torch.allclose(x, ref)
    assert not inter.hooks  # hooks are removed once nobody waits


def own_and_served(model, tracer):
    out = model[0].output
    own = out * 2  # the block's own tensor
    kept = own.save()  # noqa: F841 - read back from the namespace
    served = out.save()  # noqa: F841 - vLLM's buffer: copied at save


def test_saving_copies_served_buffers_but_not_the_blocks_own_tensors(configs):
    """A saved view of a served value is copied when saved (here an in-place ReLU
    overwrites the layer's output afterwards, as vLLM's fused residual add does); a
    tensor the block computed itself is kept without a copy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 4))
    inter = Interleaver(model, worker_setup(model, configs[True]))
    inter.admit("a", {"nnsight": make_payload(own_and_served)})
    (session,) = inter.sessions["a"]
    inter.begin_step(StepLayout({"a": (0, 5)}, {"a": 0}, 5))
    x = torch.randn(5, 4)
    with torch.inference_mode():
        model(x)
    ns = dict(session.namespace)
    res = inter.end_step()
    before = model[0](x)
    assert (before < 0).any()  # the ReLU did overwrite the served buffer
    assert torch.allclose(values.decode(res["a"]["saves"]["served"]), before)
    assert ns["kept"].untyped_storage().data_ptr() == ns["own"].untyped_storage().data_ptr()  # no copy
    assert torch.allclose(values.decode(res["a"]["saves"]["kept"]), 2 * before)
    assert inter._served == set()  # no live request: the served storages are forgotten


def test_front_end_refuses_module_edits_on_a_compiled_engine(configs):
    """The check the server turns into HTTP 400 (and LLM.generate into ValueError)."""
    import json

    from vllm_nnsight_plugin.boundary.frontend import check_payload
    from vllm_nnsight_plugin.payload.codec import PayloadError

    class Params:
        n = 1

    touching = make_payload(read_layer)
    logits_only = make_payload(read_logits)
    spec_logits = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "logits_topk", "name": "t", "k": 2}]})
    with pytest.raises(PayloadError, match="--enforce-eager"):
        check_payload(touching, Params(), configs[False])
    check_payload(logits_only, Params(), configs[False])
    check_payload(spec_logits, Params(), configs[False])
    check_payload(touching, Params(), configs[True])


def test_a_steps_saves_reach_the_host_in_one_copy_per_dtype(monkeypatch):
    """to_host: every request saving at one step shares one device-to-host copy per
    dtype (one synchronisation for 256 requests, not 256), values land in the right
    request and name, and a tensor shipped before is not copied again. (On this CPU
    machine "on the device" is simulated: the copy itself is the same code.)"""
    from vllm_nnsight_plugin.engine import host as host_mod
    from vllm_nnsight_plugin.engine.host import to_host
    from vllm_nnsight_plugin.engine.session import RequestSession

    device = set()
    monkeypatch.setattr(host_mod, "on_device", lambda t: id(t) in device)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(host_mod.torch, "cat", lambda ts, *a, **k: cats.append(len(ts)) or real_cat(ts, *a, **k))

    def mark(t):
        device.add(id(t))
        return t

    a, b = RequestSession("a", None), RequestSession("b", None)
    h_a, h_b = mark(torch.randn(3, 4)), mark(torch.randn(2, 4))
    rows = [mark(torch.randn(1, 4).to(torch.bfloat16)) for _ in range(3)]
    a.last = {"h": h_a, "rows": rows, "n": 3}
    b.last = {"h": h_b, "pair": (h_b, mark(torch.ones(2, dtype=torch.int64)))}
    to_host([a, b])
    assert sorted(cats) == [2, 3]  # float32 (h_a, h_b once), bfloat16 (3 rows); int64 alone: copied as is
    assert torch.equal(a.last["h"], h_a) and a.last["h"] is not h_a and a.last["n"] == 3
    assert all(torch.equal(x, y) for x, y in zip(a.last["rows"], rows))
    assert torch.equal(b.last["pair"][0], h_b) and b.last["pair"][0] is b.last["h"]
    monkeypatch.setattr(host_mod, "HOST_CHUNK_BYTES", 60)  # 48 B + 32 B > 60: two copies
    cats.clear()
    c = RequestSession("c", None)
    c.last = {"x": mark(torch.randn(3, 4)), "y": mark(torch.randn(2, 4)), "z": mark(torch.randn(1, 4))}
    xs = dict(c.last)
    to_host([c])
    assert cats == [2] and all(torch.equal(c.last[k], xs[k]) for k in xs)  # [x], [y, z]
    first = a.last["h"]
    cats.clear()
    a.last = {"h": h_a, "more": mark(torch.zeros(1))}  # h_a shipped before: only the new one moves
    to_host([a])
    assert cats == [] and a.last["h"] is first and torch.equal(a.last["more"], torch.zeros(1))


def test_finish_prediction_reads_the_token_only_when_a_stop_token_can_end_the_request():
    """The worker predicts a request's last step as check_stop will decide it. Under
    ignore_eos the eos id stays in all_stop_token_ids (for min_tokens masking) but
    cannot end the request: reading the sampled token there would cost a
    device-to-host wait every step (async scheduling lost)."""
    from vllm import SamplingParams

    from vllm_nnsight_plugin.boundary.runners import _stops

    def never() -> int:
        raise AssertionError("the sampled token was read")

    def params(**kw) -> SamplingParams:
        p = SamplingParams(max_tokens=10, **kw)
        p.update_from_generation_config({"eos_token_id": [2, 5]}, 2)
        return p

    ignoring = params(ignore_eos=True)
    assert 2 in ignoring.all_stop_token_ids and not _stops(ignoring, 3, 10, 100, never)
    assert _stops(ignoring, 10, 17, 100, never)  # max_tokens: no read either
    assert _stops(params(ignore_eos=True, stop_token_ids=[9]), 3, 10, 100, lambda: 9)
    normal = params()
    assert _stops(normal, 3, 10, 100, lambda: 2) and _stops(normal, 3, 10, 100, lambda: 5)
    assert not _stops(normal, 3, 10, 100, lambda: 7)
    assert not _stops(params(min_tokens=5), 3, 10, 100, never)


def test_the_cheap_finish_precheck_never_misses_a_stop():
    """may_stop (counts only) is False only where _stops is False whatever the token:
    the runners skip the walk of a request's blocks on that answer."""
    import itertools

    from vllm import SamplingParams

    from vllm_nnsight_plugin.boundary.runners import _stops, may_stop

    def variants():
        for ignore, stops, min_tokens in itertools.product((True, False), ([], [9]), (0, 5)):
            p = SamplingParams(max_tokens=10, ignore_eos=ignore, stop_token_ids=stops, min_tokens=min_tokens)
            p.update_from_generation_config({"eos_token_id": [2, 5]}, 2)
            yield p

    for p in variants():
        for outputs, total, token in itertools.product((1, 4, 9, 10, 11), (50, 99, 100), (2, 5, 7, 9)):
            if not may_stop(p, outputs, total, 100):
                assert not _stops(p, outputs, total, 100, lambda token=token: token), (p, outputs, total, token)
    assert not may_stop(None, 3, 10, 100)


class _Pair(torch.nn.Module):
    """Returns ``(hidden, residual)`` as vLLM's decoder layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), x


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        h, r = self.pair(x)
        return self.out(h + r)


def test_batched_per_step_reads_gather_each_requests_rows_across_host_blocks(configs, monkeypatch):
    """Per-step batched reads keep each request's rows in shared host blocks (no view
    per step) and gather them when the request ends: the shipped list equals the
    rows each step gave that request, whichever rows it had in the batch, across a
    block boundary; nothing ships before the end; the result limits count the rows;
    a tuple value (no index) is still a list of per-step tuples."""
    import json

    from vllm_nnsight_plugin.engine import host
    from vllm_nnsight_plugin.engine.limits import measure

    monkeypatch.setattr(host, "BLOCK_BYTES", 5 * 16)  # 5 float32 rows of 4 per block
    host.release()
    torch.manual_seed(0)
    model = _Net()
    inter = Interleaver(model, worker_setup(model, configs[True]))
    spec = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "h", "module": "pair", "index": 0, "steps": "all"},
        {"op": "read", "name": "pair", "module": "pair", "steps": "all"}]})
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    inter.admit("a", {"nnsight": spec}, params)
    seen: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    layouts = [  # (spans, tokens): "a" prefills 3 rows, "b" joins at step 1, order changes
        ({"a": (0, 3)}, 3),
        ({"b": (0, 2), "a": (2, 3)}, 3),
        ({"a": (0, 1), "b": (1, 2)}, 2),
        ({"b": (0, 1), "a": (1, 2)}, 2),
    ]
    shipped = {}
    for step, (spans, tokens) in enumerate(layouts):
        if step == 1:
            inter.admit("b", {"nnsight": spec}, params)
        inter.begin_step(StepLayout(spans, {r: i for i, r in enumerate(spans)}, tokens))
        x = torch.randn(tokens, 4)
        with torch.inference_mode():
            model(x)
        hidden = model.pair.lin(x)
        for req_id, (start, end) in spans.items():
            seen[req_id].append(hidden[start:end].detach())
        if step == 2:  # before the end: the rows count toward the limits
            (a,) = inter.sessions["a"]
            assert measure(a.namespace["h"]) == (3, (3 + 1 + 1) * 16)
        last = step == len(layouts) - 1
        res = inter.end_step({"a", "b"} if last else set())
        if not last:
            assert all("saves" not in r or r["saves"] is None for r in res.values())  # ships at the end
        shipped.update(res)
    for req_id in ("a", "b"):
        rows = values.decode(shipped[req_id]["saves"]["h"])
        assert len(rows) == len(seen[req_id])
        assert all(torch.allclose(r, s) for r, s in zip(rows, seen[req_id]))
        pairs = values.decode(shipped[req_id]["saves"]["pair"])
        assert all(isinstance(p, tuple) and torch.allclose(p[0], s) for p, s in zip(pairs, seen[req_id]))
    assert torch.equal(values.decode(shipped["a"]["saves"]["h"])[0], seen["a"][0])  # the 3-row prefill


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Pair() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            h, r = layer(x)
            x = h + r
        return x


class _Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Layers()


def test_lane_tables_follow_the_batch_when_steps_repeat_or_change(llama_path):
    """Lanes (tapped engines) reuse the last step's slot tables when a step has the
    same rows and entries (steady decode): each request keeps its own steering while
    the batch repeats, reorders, loses a request and gains one, and untraced rows are
    untouched bit for bit (here on CPU: the same kernels a full CUDA graph replays)."""
    import json

    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nnsight_plugin.engine import lanes, taps

    tap = {"taps": ["model.layers.1.output"]}
    config = EngineArgs(model=llama_path, enforce_eager=False, dtype="float32",
                        additional_config={"nnsight": tap}).create_engine_config()
    lanes.reset()
    lanes.enable(16)
    try:
        torch.manual_seed(0)
        root = _Root()
        inter = Interleaver(root, worker_setup(root, config), taps.install(root, taps.from_settings(tap)))

        def spec(v: float) -> str:  # steer, then read the residual stream it leaves
            return json.dumps({"v": 1, "kind": "spec", "ops": [
                {"op": "add", "module": "model.layers.1", "index": 0, "value": [v] * 4, "steps": "all"},
                {"op": "read", "name": "stream", "module": "model.layers.1", "sum": True, "steps": "all"}]})

        params = SamplingParams(max_tokens=8, ignore_eos=True)
        steer = {"a": 1.0, "b": -2.0, "c": 0.5}
        with torch.inference_mode():
            root.model(torch.zeros(3, 4))  # the first tap call makes the lanes
        inter.admit("a", {"nnsight": spec(steer["a"])}, params)
        inter.admit("b", {"nnsight": spec(steer["b"])}, params)
        layouts = [  # rows of the step; "u" is untraced
            {"a": (0, 2), "b": (2, 3), "u": (3, 4)},
            {"a": (0, 1), "b": (1, 2), "u": (2, 3)},
            {"a": (0, 1), "b": (1, 2), "u": (2, 3)},  # steady: the tables are reused
            {"a": (0, 1), "b": (1, 2), "u": (2, 3)},
            {"b": (0, 1), "u": (1, 2), "a": (2, 3)},  # reordered
            {"b": (0, 1), "u": (1, 2)},  # "a" has left
            {"b": (0, 1), "u": (1, 2), "c": (2, 4)},  # "c" joins
            {"b": (0, 1), "u": (1, 2), "c": (2, 3)},
            {"b": (0, 1), "u": (1, 2), "c": (2, 3)},
        ]
        served = lanes.STATS["lane"]
        streams: dict[str, list[torch.Tensor]] = {"b": [], "c": []}
        shipped = {}
        for step, spans in enumerate(layouts):
            if step == 5:
                inter.finish(["a"])
            if step == 6:
                inter.admit("c", {"nnsight": spec(steer["c"])}, params)
            tokens = max(end for _, end in spans.values())
            x = torch.randn(tokens, 4)
            with torch.inference_mode():  # as vLLM's execute_model runs
                inter.begin_step(StepLayout(spans, {r: i for i, r in enumerate(spans)}, tokens))
                out = root.model(x)
                shipped.update(inter.end_step({"b", "c"} if step == len(layouts) - 1 else set()))
            with torch.inference_mode():  # the same layers with no step open: nothing applied
                h0, r0 = root.model.layers[0](x)
                h1, r1 = root.model.layers[1](h0 + r0)
            for req_id, (start, end) in spans.items():
                want = h1[start:end] + r1[start:end] + steer.get(req_id, 0.0)
                if req_id == "u":
                    assert torch.equal(out[start:end], h1[start:end] + r1[start:end]), step
                else:
                    assert torch.allclose(out[start:end], want, atol=1e-6), (step, req_id)
                    if req_id in streams:
                        streams[req_id].append(want)
        for req_id, rows in streams.items():  # the lanes' reads, summed: what the edit left
            got = values.decode(shipped[req_id]["saves"]["stream"])
            assert len(got) == len(rows) and all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, rows))
        assert lanes.STATS["lane"] - served == len(layouts)  # every step served by the lanes
        assert all(s.error is None for blocks in inter.sessions.values() for s in blocks)
        # an untraced step next: a full CUDA graph replays every lane's kernels, after the
        # runner settles the lanes (the last step's slots are still in sel until then)
        parts = [lane for site in lanes.sites() for lane in lanes.lanes_at(site) if lane is not None]
        assert any(bool(lane.sel.any()) for lane in parts)
        x = torch.randn(3, 4)
        with torch.inference_mode():  # (as vLLM's worker runs every step)
            lanes.settle()
            for lane in parts:
                replayed = x.clone()
                lane.kernels(replayed)
                assert torch.equal(replayed, x)
    finally:
        lanes.reset()


def test_batched_prompt_reads_ship_after_the_first_step(configs):
    """A batched read of the prompt only is complete after the first step: it ships
    then (crossing to the caller while the request decodes), not again later."""
    import json

    from vllm import SamplingParams

    model = _Net()
    inter = Interleaver(model, worker_setup(model, configs[True]))
    spec = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "h", "module": "pair", "index": 0, "steps": "prefill"}]})
    inter.admit("p", {"nnsight": spec}, SamplingParams(max_tokens=4, ignore_eos=True))
    shipped = []
    for step, tokens in enumerate((3, 1, 1)):
        x = torch.randn(tokens, 4)
        with torch.inference_mode():
            inter.begin_step(StepLayout({"p": (0, tokens)}, {"p": 0}, tokens))
            model(x)
            res = inter.end_step({"p"} if step == 2 else set())
        shipped.append((res.get("p") or {}).get("saves"))
        if step == 0:
            want = model.pair.lin(x)
    assert torch.allclose(values.decode(shipped[0]["h"]), want)
    assert shipped[1] is None and shipped[2] is None  # not shipped again


def test_a_prompt_only_read_is_over_after_its_step_but_an_edit_beside_it_is_not(configs):
    """A spec of prompt reads only has nothing left after the first step: its session
    ends there (done, no per-step work while the request decodes). One that also
    steers stays, and its edit keeps applying at later steps. Only requests that can
    park between steps (a block, a batched read) need the runner's finish prediction."""
    import json

    from vllm import SamplingParams

    torch.manual_seed(0)
    model = _Net()
    inter = Interleaver(model, worker_setup(model, configs[True]))
    read = {"op": "read", "name": "h", "module": "pair", "index": 0, "steps": "prefill"}
    steer = {"op": "add", "module": "pair", "index": 0, "value": [1.0] * 4, "steps": "all"}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    inter.admit("p", {"nnsight": json.dumps({"v": 1, "kind": "spec", "ops": [read]})}, params)
    inter.admit("s", {"nnsight": json.dumps({"v": 1, "kind": "spec", "ops": [read, steer]})}, params)
    inter.admit("e", {"nnsight": json.dumps({"v": 1, "kind": "spec", "ops": [steer]})}, params)
    inter.admit("c", {"nnsight": make_payload(read_layer)}, params)
    # an engine-wide steering edit, then a request with its own prompt-only read: two blocks
    inter.install_edit("steer", None, json.dumps({"v": 1, "kind": "spec", "ops": [steer]}))
    inter.admit("m", {"nnsight": json.dumps({"v": 1, "kind": "spec", "ops": [read]})}, params)
    assert inter.stepwise == {"p", "s", "c", "m"}  # steering alone never parks
    for step, tokens in enumerate((2, 1, 1)):
        spans = {r: (i * tokens, (i + 1) * tokens) for i, r in enumerate(("p", "s", "e", "m"))}
        x = torch.randn(4 * tokens, 4)
        with torch.inference_mode():
            inter.begin_step(StepLayout(spans, {r: i for i, r in enumerate(spans)}, 4 * tokens))
            h, _ = model.pair(x)
            res = inter.end_step()
        clean = model.pair.lin(x)
        # the steered rows (s, e, m) got the vector at every step; p's rows did not
        assert torch.allclose(h[: tokens], clean[: tokens])
        assert torch.allclose(h[tokens:], clean[tokens:] + 1.0)
        if step == 0:
            assert res["p"]["done"] and torch.allclose(values.decode(res["p"]["saves"]["h"]), clean[:tokens])
            assert "p" not in inter.sessions and "p" not in inter.stepwise  # over: nothing per step
            inter.preempted("p")  # a recompute now changes nothing p did: no error
            inter.preempted("m")  # m's steering is batched: it applies again to the recompute
            assert not inter.results
            assert "s" in inter.sessions and "e" in inter.sessions
            # m's read saw its rows after its edit (edits first)
            assert torch.allclose(values.decode(res["m"]["saves"]["h"]), clean[3 * tokens:] + 1.0)
        else:
            assert not res  # nothing ships while they decode (m's read went at step 0)
    assert [s.step for s in inter.sessions["m"]] == [3, 1]  # the edit counts steps; the read is over


def test_a_row_log_with_no_rows_encodes_as_an_empty_list():
    """A request that failed before its first read still ships (its error, and an
    empty list for the read), never a crash in the engine."""
    from vllm_nnsight_plugin.engine.rowlog import RowLog

    assert values.decode(values.encode(RowLog(), binary=True)) == []
    assert values.decode(values.encode(RowLog())) == []


def test_a_row_log_encodes_one_shape_list_per_row_count():
    """An every-step read ships one shape per step; equal shapes are one list repeated,
    so a batch of 256 such requests leaves a few hundred objects for the cyclic GC to
    track, not 32 768 (with a list per step, full collections took 70 ms of every third
    ship step on the CPU: benchmarks/gpu/gather_bench.py). The values decode unchanged."""
    from vllm_nnsight_plugin.engine.rowlog import RowLog

    block = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4)
    log = RowLog()
    log.add(block, 0, 3)  # the prompt's three rows
    for row in range(3, 12):  # then one row per step
        log.add(block, row, row + 1)
    encoded = values.encode(log, binary=True)
    shapes = encoded["$tensors"]["shapes"]
    assert shapes == [[3, 4]] + [[1, 4]] * 9 and len({id(s) for s in shapes}) == 2
    got = values.decode(encoded)
    assert [t.shape for t in got] == [(3, 4)] + [(1, 4)] * 9
    assert torch.equal(torch.cat(got), block)


def test_a_steady_batch_of_steering_specs_skips_the_walk_but_not_a_change(configs, monkeypatch):
    """Decode steps of the same requests, all steering through batched specs, only
    advance each spec's step count: end_step does not walk the batch. The edits keep
    applying, and anything that changes the batch's state (a request failing, one
    admitted or finished) takes the full walk again, so an error still ships in its step."""
    import json

    from vllm import SamplingParams

    torch.manual_seed(0)
    model = _Net()
    inter = Interleaver(model, worker_setup(model, configs[True]))
    steer = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "pair", "index": 0, "value": [1.0] * 4, "steps": "all"}]})
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for req_id in ("a", "b"):
        inter.admit(req_id, {"nnsight": steer}, params)
    walks = []
    walk = inter._walk_step
    monkeypatch.setattr(inter, "_walk_step", lambda *a: (walks.append(step), walk(*a)))
    spans = {"a": (0, 1), "u": (1, 2), "b": (2, 3)}  # one dict, as V2's steady layout reuses
    rows = {r: i for i, r in enumerate(spans)}
    shipped = []
    for step in range(8):
        if step == 4:
            inter.fail_request("a", "stopped by the test")  # (as a preemption of a stateful block)
        if step == 6:
            inter.admit("c", {"nnsight": steer}, params)  # admitted, not yet scheduled
        x = torch.randn(3, 4)
        with torch.inference_mode():
            inter.begin_step(StepLayout(spans, rows, 3))
            h, _ = model.pair(x)
            shipped.append(inter.end_step())
        clean = model.pair.lin(x)
        assert torch.equal(h[1], clean[1])  # the untraced row, bit for bit
        assert torch.allclose(h[2], clean[2] + 1.0)  # b is steered at every step
        assert torch.allclose(h[0], clean[0] + (1.0 if step < 4 else 0.0))  # a until it failed
    # step 0 walks (and notes the quiet batch), 1-3 do not; 4 walks (a failed) and 5 notes
    # the new batch; 6 walks (c was admitted); 7 does not
    assert walks == [0, 4, 5, 6]
    assert shipped[4]["a"]["error"]["message"].endswith("stopped by the test")
    assert not any(shipped[i] for i in (1, 2, 3, 5, 7))  # quiet steps ship nothing
    # an admission's step ships how each new request runs, once (RequestOutput.ran_as)
    assert {r: e["ran_as"] for r, e in shipped[0].items()} == {"a": "batched", "b": "batched"}
    assert {r: e["ran_as"] for r, e in shipped[6].items()} == {"c": "batched"}
    assert all(e.get("error") is None for i in (0, 6) for e in shipped[i].values())
    assert inter.sessions["b"][0].step == 8
    assert inter.sessions["a"][0].step == 4  # (kept, failed, until vLLM ends the request)
    assert inter.sessions["c"][0].step == 0  # never scheduled: not advanced


def _spec(*ops: dict) -> str:
    import json

    return json.dumps({"v": 1, "kind": "spec", "ops": list(ops)})


_STEER = {"op": "add", "module": "pair", "index": 0, "value": [1.0] * 4, "steps": "all"}
_FUZZ_SPECS = [
    _spec(_STEER), _spec(_STEER), _spec(_STEER),
    _spec({"op": "scale", "module": "out", "factor": 2.0, "steps": "all"}),  # unreached on some steps
    _spec({"op": "add", "module": "pair", "index": 0, "value": [1.0] * 3, "steps": "all"}),  # fails
    _spec({"op": "read", "name": "g", "module": "pair", "index": 0, "steps": "generated"}),
    _spec({"op": "read", "name": "a", "module": "pair", "index": 0, "steps": "all"}),
    _spec({"op": "read", "name": "p", "module": "pair", "index": 0, "steps": "prefill"}),
    _spec({"op": "read", "name": "p", "module": "pair", "index": 0, "steps": "prefill"}, _STEER),
]


def _comparable(results: dict) -> dict:
    out = {}
    for req_id, entry in results.items():
        entry = dict(entry)
        if entry.get("saves"):
            entry["saves"] = {k: repr(values.decode(v)) for k, v in entry["saves"].items()}
        if entry.get("error"):
            entry["error"] = entry["error"]["message"]
        out[req_id] = entry
    return out


def test_the_steady_batch_path_does_what_the_full_walk_does(configs):
    """Differential: random admissions (steering, reads, a failing and an unreached
    spec, stop strings), finishes, failures and preemptions between steps, changing
    and repeating batches. An interleaver that takes the steady-batch path where it
    can and one that always walks give the same outputs, results and session states."""
    steady = sum(_steady_against_walk(configs[True], seed) for seed in range(16))
    assert steady > 100  # of 960 steps: the steady path was taken, and checked, often


def _steady_against_walk(config, seed: int) -> int:
    """One random run (see the test above): the number of steps the steady path took."""
    import copy
    import random

    from vllm import SamplingParams

    rnd = random.Random(seed)
    torch.manual_seed(seed)
    models = [_Net()]
    models.append(copy.deepcopy(models[0]))
    fast, walk = (Interleaver(m, worker_setup(m, config)) for m in models)
    live: dict[str, int] = {}  # request -> steps scheduled
    walked: list[int] = []
    walk_step = fast._walk_step
    fast._walk_step = lambda *a: (walked.append(step), walk_step(*a))
    spans_before, count = None, 0
    for step in range(60):
        event = rnd.random()
        if event < 0.12 or not live:
            count += 1
            req_id, spec, stop = f"r{count}", rnd.choice(_FUZZ_SPECS), rnd.random() < 0.1
            for inter in (fast, walk):
                inter.admit(req_id, {"nnsight": spec},
                            SamplingParams(max_tokens=64, ignore_eos=True, stop=["x"] if stop else None))
            live[req_id] = 0
        elif event > 0.85:
            req_id = rnd.choice(sorted(live))
            for inter in (fast, walk):
                if event > 0.92:
                    inter.finish([req_id])
                elif event > 0.88:
                    inter.fail_request(req_id, "ended from outside the step")
                else:
                    inter.preempted(req_id)
            if event > 0.92:
                del live[req_id]
        elif event > 0.8:  # an untraced request ends: nothing traced changed
            for inter in (fast, walk):
                inter.finish([f"plain{step}"])
        ids = sorted(live) + ["untraced"]
        if rnd.random() < 0.15:
            ids = [r for r in ids if rnd.random() < 0.7] or ids[:1]
        spans, tokens = {}, 0
        for req_id in ids:
            n = rnd.randint(1, 3) if live.get(req_id) == 0 else 1  # a prompt, then one token a step
            spans[req_id], tokens = (tokens, tokens + n), tokens + n
        if spans == spans_before and rnd.random() < 0.7:
            spans = spans_before  # the same dict, as V2's steady layout hands it over
        spans_before = spans
        for req_id in spans:
            if req_id in live:
                live[req_id] += 1
        finishing = {r for r in spans if r in fast.stepwise and rnd.random() < 0.05}
        whole = rnd.random() < 0.9  # else only `pair` runs: an edit of `out` is not reached
        x = torch.randn(tokens, 4)
        outs, shipped = [], []
        for inter, model in ((fast, models[0]), (walk, models[1])):
            if inter is walk:
                inter._quiet = None  # never the steady path
            with torch.inference_mode():
                inter.begin_step(StepLayout(spans, {r: i for i, r in enumerate(spans)}, tokens))
                outs.append(model(x) if whole else model.pair(x)[0])
                shipped.append(_comparable(inter.end_step(finishing)))
        assert torch.equal(outs[0], outs[1]), step
        assert shipped[0] == shipped[1], step
        assert [(r, [(s.step, s.active, s.error, s.final) for s in blocks]) for r, blocks in fast.sessions.items()] \
            == [(r, [(s.step, s.active, s.error, s.final) for s in blocks]) for r, blocks in walk.sessions.items()]
        for req_id in finishing:
            for inter in (fast, walk):
                inter.finish([req_id])
            live.pop(req_id, None)
    return 60 - len(walked)


def test_a_prompt_chunk_picks_the_positions_it_holds():
    """A prompt of 10 split by chunked prefill: this step computes its positions 4..7
    in the batch's rows 2..5, and more of it follows."""
    from vllm_nnsight_plugin.engine.plan_ops import _chunk_rows
    from vllm_nnsight_plugin.engine.rows import Chunk

    chunk = Chunk(start=4, prompt_len=10, more_chunks=True)
    layout = StepLayout({"a": (2, 6), "b": (6, 7)}, {"a": 0, "b": 1}, 7, chunks={"a": chunk})
    assert layout.more_chunks("a") and not layout.more_chunks("b")
    assert not StepLayout({"a": (0, 6)}, {"a": 0}, 6, chunks={"a": chunk._replace(more_chunks=False)}).more_chunks("a")
    assert _chunk_rows((2, 6), [0, 4, 5, -3, -1], chunk) == (2, 3, 5)  # positions 4, 5, 7; 0 and 9 lie elsewhere


def test_a_tap_site_parses_back_to_its_parts():
    from vllm_nnsight_plugin.engine import taps

    site = taps._site("model.layers.1", "output", "(TN")
    assert taps.parse_site(site) == taps.TapSite(path="model.layers.1", kind="output", code="(TN")


def test_a_per_request_spec_reads_at_its_listed_steps_and_ends_after_the_last(configs):
    """A spec with a logits op runs per request (engine/spec_runner.py): a read listed
    at steps 0 and 1 gives one value per step, and the request is done after step 1."""
    import json

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inter = Interleaver(model, worker_setup(model, configs[True]))
    inter.admit("a", {"nnsight": json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "h", "module": "0", "steps": [0, 1]},
        {"op": "logits_topk", "name": "t", "k": 2}]})})
    seen, results = [], []
    for n in (3, 1):
        inter.begin_step(StepLayout({"a": (0, n)}, {"a": 0}, n))
        with torch.inference_mode():
            x = torch.arange(4 * n, dtype=torch.float32).reshape(n, 4)
            seen.append(model[0](x))
            inter.serve(("logits",), model(x)[[n - 1]], row_based=True)
        results.append(inter.end_step()["a"])
    assert not results[0]["done"] and results[1]["done"] and results[1]["error"] is None
    h = values.decode(results[1]["saves"]["h"])
    assert len(h) == 2 and all(torch.allclose(a, b) for a, b in zip(h, seen))


def test_two_blocks_alike_are_two_sessions():
    """A request's installed edit and its own block may be the same code: each is its own
    session (a waiter list removes the one that was served, never compares namespaces),
    and a steady batch's shared step count moves only the sessions that joined it."""
    from vllm_nnsight_plugin.engine.requests import QuietBatch
    from vllm_nnsight_plugin.engine.session import RequestSession

    first, second = RequestSession("r", None), RequestSession("r", None)
    first.namespace["h"] = second.namespace["h"] = torch.ones(3)
    assert first != second
    waiting = [first, second]
    waiting.remove(second)
    assert waiting == [first] and waiting[0] is first
    quiet = QuietBatch(0, {}, [first], None)
    quiet.advance()
    quiet.advance()
    second.step += 1
    assert (first.step, second.step) == (2, 1)
    QuietBatch(1, {}, [first, second], None).advance()  # (a later batch: the old clock no longer ticks)
    assert (first.step, second.step) == (3, 2)


def test_requests_of_one_spec_share_its_admission_but_not_a_refusal(configs, monkeypatch):
    """The requests that send one spec's text are admitted from one look at the spec
    (where its ops register, what it does), each with its own row log; a spec this
    engine refuses is refused for every request that sends it, not remembered as admitted."""

    from vllm import SamplingParams

    torch.manual_seed(0)
    model = _Net()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    read_and_steer = _spec({"op": "read", "name": "a", "module": "pair", "index": 0, "steps": "all"}, _STEER)
    eager = Interleaver(model, worker_setup(model, configs[True]))
    places = []
    place = eager.batched._place
    monkeypatch.setattr(eager.batched, "_place", lambda env: (places.append(env), place(env))[1])
    for req_id in ("a", "b", "c"):
        eager.admit(req_id, {"nnsight": read_and_steer}, params)
    assert len(places) == 1
    sessions = [eager.sessions[r][0] for r in ("a", "b", "c")]
    assert all(s.batched and s.edits and s.batched_reads and s.error is None for s in sessions)
    assert len({id(s.namespace["a"]) for s in sessions}) == 3  # (each request's rows apart)
    compiled = Interleaver(model, worker_setup(model, configs[False]))
    for req_id in ("a", "b"):
        compiled.admit(req_id, {"nnsight": read_and_steer}, params)
        assert "needs an eager engine" in compiled.sessions[req_id][0].error["message"]
    assert not compiled.batched.at
    # the engine's refusal of edits is read per request, before the spec's other checks
    bad_cache = _spec(_STEER, {"op": "cache", "name": "c", "modules": ["nope"]})
    eager.edits_refused = "EDITS REFUSED HERE"
    for req_id, text in (("d", read_and_steer), ("e", bad_cache)):
        eager.admit(req_id, {"nnsight": text}, params)
        assert eager.sessions[req_id][0].error["message"].endswith("EDITS REFUSED HERE")
    eager.edits_refused = None
    eager.admit("f", {"nnsight": read_and_steer}, params)
    assert eager.sessions["f"][0].error is None and len(places) == 1
    # a payload text too large for the codec to keep is parsed anew per request: kept by nothing
    eager.finish(["a", "b", "c", "d", "e", "f"])
    large = read_and_steer[:-1] + " " * 70_000 + "}"
    eager.admit("g", {"nnsight": large}, params)
    assert eager.sessions["g"][0].batched and len(places) == 2
    assert len(eager._admitted_specs) == len(eager.batched._placed) == 1  # (the small spec's only)
