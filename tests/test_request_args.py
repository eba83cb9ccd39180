"""A request's extra args (payload/request_args.py): one rule for the flags and the
edit names. No engine starts here."""

from __future__ import annotations

import pytest

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
