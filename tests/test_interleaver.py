"""The interleaver driven directly on a small torch model, with vLLM's own
config objects: module access is refused on a compiled engine while logits
still work. (The compiled CPU engine itself takes minutes to build on two
cores; the real-engine paths are covered in the other test files.)"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_nnsight_plugin import make_payload
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
    inter = Interleaver(model, configs[False])
    assert not inter.eager
    res = _step(inter, model, {"a": read_layer, "b": read_logits})
    err = res["a"]["error"]
    assert "needs an eager engine" in err["message"] and "enforce_eager=True" in err["message"]
    assert err["line"].startswith("x = model[0].output.save()")
    assert res["b"]["error"] is None and values.decode(res["b"]["saves"]["lg"]).shape == (1, 4)


def test_eager_engine_serves_each_request_its_rows(configs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inter = Interleaver(model, configs[True])
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
    inter = Interleaver(model, configs[True])
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

    from vllm_nnsight_plugin.engine.frontend import check_payload
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
    from vllm_nnsight_plugin.engine import session as session_mod
    from vllm_nnsight_plugin.engine.session import RequestSession, to_host

    device = set()
    monkeypatch.setattr(session_mod, "on_device", lambda t: id(t) in device)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(session_mod.torch, "cat", lambda ts, *a, **k: cats.append(len(ts)) or real_cat(ts, *a, **k))

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
    monkeypatch.setattr(session_mod, "HOST_CHUNK_BYTES", 60)  # 48 B + 32 B > 60: two copies
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

    from vllm_nnsight_plugin.engine.compat import _stops

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
