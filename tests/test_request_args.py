"""A request's extra args (payload/request_args.py): one rule for the flags and the
edit names, at every site that reads them; a bad value is refused at the front end
naming the key. No engine starts here."""

from __future__ import annotations

import types

import pytest
from vllm import SamplingParams

from vllm_nnsight_plugin.payload import request_args
from vllm_nnsight_plugin.payload.errors import PayloadError
from vllm_nnsight_plugin.payload.request_args import RequestArgs, parse

TRUE = [True, 1, 1.0, "true", "True", "TRUE", " true ", "1"]
FALSE = [False, 0, 0.0, "false", "False", "FALSE", "false\n", "0"]
BAD = ["yes", "no", "off", "on", "0.0", "", 2, -1, 0.5, [], {}, [0], b"0"]


@pytest.mark.parametrize("key,field", [("nnsight_stream", "stream"), ("nnsight_lower", "lower")])
def test_every_spelling_of_a_flag(key, field):
    for value in TRUE:
        assert getattr(parse({key: value}), field) is True, value
    for value in FALSE:
        assert getattr(parse({key: value}), field) is False, value


@pytest.mark.parametrize("key", ["nnsight_stream", "nnsight_lower"])
def test_a_flag_that_is_not_true_or_false_is_refused_naming_the_key(key):
    for value in BAD:
        with pytest.raises(PayloadError, match=f"extra_args\\['{key}'\\] must be true or false"):
            parse({"nnsight": "x", key: value})


def test_absent_keys_take_their_defaults():
    default = RequestArgs(payload=None, stream=False, edits=None, lower=True)
    assert parse(None) == parse({}) == parse({"other": 1}) == default
    assert parse({"nnsight_stream": None, "nnsight_lower": None, "nnsight_edits": None}) == default
    got = parse({"nnsight": "p", "nnsight_stream": 1, "nnsight_lower": "false", "nnsight_edits": ["a", "b"]})
    assert got == RequestArgs("p", True, ("a", "b"), False)
    with pytest.raises(AttributeError):
        got.stream = False  # (frozen)


def test_edit_names():
    assert parse({"nnsight_edits": "steer"}).edits == ("steer",)
    assert parse({"nnsight_edits": ["a", "b"]}).edits == ("a", "b")
    assert parse({"nnsight_edits": ("a",)}).edits == ("a",)
    assert parse({"nnsight_edits": []}).edits == ()  # (names none: the unnamed edits only)
    for bad in (5, 1.0, True, [1], ["a", None], b"ab"):
        with pytest.raises(PayloadError, match="extra_args\\['nnsight_edits'\\] must be an edit name"):
            parse({"nnsight_edits": bad})


def test_flags_as_the_openai_server_passes_them():
    """Pydantic turns JSON ``false``/``true`` in ``vllm_xargs`` into 0/1; a string stays one."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for sent, want in ((False, False), (True, True), ("false", False), ("0", False), (1, True), (0.0, False)):
        xargs = CompletionRequest(model="m", prompt="x",
                                  vllm_xargs={"nnsight_lower": sent, "nnsight_stream": sent}).vllm_xargs
        got = parse(xargs)
        assert got.lower is want and got.stream is want, (sent, xargs)
    xargs = CompletionRequest(model="m", prompt="x", vllm_xargs={"nnsight_edits": ["a"]}).vllm_xargs
    assert parse(xargs).edits == ("a",)


def test_mentioned():
    assert not request_args.mentioned(None) and not request_args.mentioned({"session_id": "s"})
    assert all(request_args.mentioned({k: 0}) for k in request_args.KEYS)


# ------------------------------------------------------------------ the sites

def test_the_front_end_refuses_a_bad_flag_before_the_engine():
    from vllm_nnsight_plugin.boundary import frontend
    from vllm_nnsight_plugin.engine import edits

    assert not edits.INSTALLED
    passed = []
    process = frontend._process_inputs(lambda self, rid, prompt, params, *a, **k: passed.append(rid) or rid)
    me = types.SimpleNamespace()  # (no vllm_config: the payload's own checks only)
    with pytest.raises(PayloadError, match="nnsight_stream"):
        process(me, "bad", "p", SamplingParams(extra_args={"nnsight_stream": "maybe"}))
    with pytest.raises(PayloadError, match="nnsight_lower"):
        process(me, "bad", "p", SamplingParams(extra_args={"nnsight_lower": "no"}))
    assert not passed
    process(me, "fine", "p", SamplingParams(extra_args={"nnsight_stream": "false"}))
    process(me, "plain", "p", SamplingParams())
    assert passed == ["fine", "plain"]


def test_the_server_answers_a_bad_flag_with_a_400_and_reads_false_as_false():
    from vllm_nnsight_plugin.boundary import server_streams

    serving = types.SimpleNamespace(create_error_response=lambda message: ("400", message))

    def request(**xargs):
        return types.SimpleNamespace(vllm_xargs=xargs, prompt="p")

    error = server_streams._reject(serving, request(nnsight_stream="maybe"))
    assert error[0] == "400" and "extra_args['nnsight_stream'] must be true or false" in error[1]
    error = server_streams._reject(serving, request(nnsight_edits=[1]))
    assert error[0] == "400" and "nnsight_edits" in error[1]
    assert server_streams._reject(serving, request(nnsight_stream="false")) is None
    for value in FALSE:
        assert server_streams._every_step(request(nnsight="p", nnsight_stream=value)) is False, value
    for value in TRUE:
        assert server_streams._every_step(request(nnsight="p", nnsight_stream=value)) is True, value
    assert server_streams._every_step(request(nnsight="p")) is False
    assert server_streams._every_step(types.SimpleNamespace(vllm_xargs=None)) is False


def test_the_scheduler_streams_only_a_true_flag():
    from vllm_nnsight_plugin.boundary import engine_core

    def request(extra):
        return types.SimpleNamespace(sampling_params=SamplingParams(extra_args=extra))

    assert not engine_core.streams_saves(request({"nnsight": "p", "nnsight_stream": "false"}))
    assert not engine_core.streams_saves(request({"nnsight": "p", "nnsight_stream": "0"}))
    assert not engine_core.streams_saves(request(None))
    assert not engine_core.streams_saves(types.SimpleNamespace())
    assert not engine_core.streams_saves(request({"nnsight_stream": "maybe"}))  # (its request fails in the worker)
    assert engine_core.streams_saves(request({"nnsight": "p", "nnsight_stream": "true"}))
    assert engine_core.streams_saves(request({"nnsight": "p", "nnsight_stream": 1}))


def _read_block(model, tracer):
    h = model.layers[0].output.save()  # noqa: F841


def test_admission_reads_false_as_false():
    """``nnsight_stream: "false"`` neither streams (the request reports at its end only)
    nor keeps a block as code; ``"true"`` does both; ``nnsight_lower: "0"`` keeps it
    as code; a bad flag that came round the front end fails its request only."""
    from test_batched import _toy, _toy_spec  # (tests/ is on the path, as conftest's folder)

    from vllm_nnsight_plugin import make_payload

    _, inter = _toy()
    params = SamplingParams(max_tokens=3)
    spec = _toy_spec({"op": "read", "name": "h", "module": "layers.0", "steps": "all"})
    inter.admit("off", {"nnsight": spec, "nnsight_stream": "false"}, params)
    inter.admit("on", {"nnsight": spec, "nnsight_stream": "TRUE"}, params)
    assert "off" not in inter.report_every_step and "on" in inter.report_every_step
    block = make_payload(_read_block)
    inter.admit("code-off", {"nnsight": block, "nnsight_stream": "0"}, params)
    inter.admit("code-on", {"nnsight": block, "nnsight_stream": "1"}, params)
    inter.admit("unlowered", {"nnsight": block, "nnsight_lower": "false"}, params)
    ran_as = {r: inter.results[r]["ran_as"] for r in ("code-off", "code-on", "unlowered")}
    assert ran_as["code-off"] == "batched", ran_as
    assert ran_as["code-on"].endswith("(its saves stream per step)"), ran_as
    assert ran_as["unlowered"].endswith("(nnsight_lower is off)"), ran_as
    inter.admit("bad", {"nnsight": spec, "nnsight_stream": "maybe"}, params)
    error = inter.results["bad"]["error"]
    assert "bad request" in error["message"] and "nnsight_stream" in error["message"], error


def test_the_clients_params_are_copied_per_request_only_where_the_caller_rides_along():
    """The client's params skip vLLM's per-request deep copy (built fresh per generate
    call), but not where the caller's own extra_args ride along: vLLM's KV connectors
    change ``kv_transfer_params`` in place, so each request needs a dict of its own."""
    from vllm_nnsight_plugin.boundary.entrypoints import sampling_params

    own = sampling_params(max_tokens=1, extra_args={"nnsight": "{}", "nnsight_stream": 1})
    assert own.clone().extra_args is own.extra_args  # (vLLM's shallow copy)
    theirs = sampling_params(max_tokens=1, extra_args={"nnsight": "{}", "kv_transfer_params": {"do_remote": True}})
    copy = theirs.clone()
    assert copy.extra_args["kv_transfer_params"] == {"do_remote": True}
    assert copy.extra_args["kv_transfer_params"] is not theirs.extra_args["kv_transfer_params"]
