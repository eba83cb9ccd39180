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
    assert res["b"]["error"] is None and res["b"]["saves"]["lg"].shape == (1, 4)


def test_eager_engine_serves_each_request_its_rows(configs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inter = Interleaver(model, configs[True])
    res = _step(inter, model, {"a": read_layer})
    x = res["a"]["saves"]["x"]
    ref = model[0](torch.arange(20, dtype=torch.float32).reshape(5, 4))[0:3]
    assert torch.allclose(x, ref)
    assert not inter.hooks  # hooks are removed once nobody waits


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
