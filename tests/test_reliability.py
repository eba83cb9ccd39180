"""Hostile and careless input against a real engine: edits of index tensors are
refused before any kernel sees them, non-finite values end only the request that
made them and leave nothing another request reads, malformed payloads are refused
with the reason, and the schema and the validator agree."""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import struct
import sys
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, results
from vllm_nnsight_plugin.boundary import frontend
from vllm_nnsight_plugin.payload import codec, spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

PROMPTS = ["The Eiffel Tower is in", "The capital of Japan is", " ".join(["One two three four five."] * 12)]


def _spec(*ops: dict) -> str:
    return json.dumps({"v": 1, "kind": "spec", "ops": list(ops)})


def _plain(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)


def _tokens_and_logprobs(output):
    comp = output.outputs[0]
    return list(comp.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in comp.logprobs]


def _assert_same(got: list, want: list) -> None:
    """Outputs equal token for token and logprob for logprob: exactly on the CPU; on a
    GPU to 1e-5, since a GEMM's last bits there depend on the batch a request joined,
    which in a plain ``generate`` depends on when it reached the engine (tests/conftest.py:
    generate_together). A NaN never passes."""
    exact = not torch.cuda.is_available()
    for a, b in zip(got, want, strict=True):
        (ta, la), (tb, lb) = _tokens_and_logprobs(a), _tokens_and_logprobs(b)
        assert ta == tb
        if exact:
            assert la == lb
        else:
            for sa, sb in zip(la, lb, strict=True):
                assert sa.keys() == sb.keys() and all(abs(sa[k] - sb[k]) <= 1e-5 for k in sa), (sa, sb)


INTEGER_EDITS = [
    {"op": "scale", "module": "model.layers.0", "io": "input", "factor": 1e6},
    {"op": "add", "module": "model.layers.0.self_attn", "io": "input", "value": 100000},
    {"op": "set", "module": "model.layers.0.self_attn.rotary_emb", "io": "input", "value": 5},
    {"op": "set", "module": "model.layers.3.self_attn.rotary_emb", "io": "input", "value": 5},  # the same module
    {"op": "set", "module": "model.embed_tokens", "io": "input", "value": 100000},
    {"op": "set", "module": "model.embed_tokens", "io": "input", "value": -5},
    {"op": "zero", "module": "model.layers.1", "io": "input", "steps": "all"},
]


@pytest.mark.parametrize("op", INTEGER_EDITS, ids=lambda op: f"{op['op']}-{op['module']}")
def test_edits_of_index_tensors_are_refused_up_front(llama, op):
    llm = llama.vllm_entrypoint  # the VLLM client learned the engine's module table at dispatch
    with pytest.raises(codec.PayloadError, match="integer tensor"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2, extra_args={"nnsight": _spec(op)}), use_tqdm=False)


def test_without_the_table_the_worker_refuses_them_and_others_go_on(llama, monkeypatch):
    """A raw vllm.LLM front end has not asked the engine for its table: the worker
    refuses the request at admission, before any forward, and the batch goes on."""
    monkeypatch.setattr(frontend, "MODULE_TABLES", {})
    llm = llama.vllm_entrypoint
    reference = llm.generate(PROMPTS[:2], [_plain(), _plain()], use_tqdm=False)
    for op in INTEGER_EDITS:
        outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4, extra_args={"nnsight": _spec(op)}), _plain()],
                            use_tqdm=False)
        with pytest.raises(InterventionError, match="integer tensor"):
            results(outs[0])
        _assert_same([outs[1]], [reference[1]])


def test_each_engine_checks_payloads_with_its_own_module_table(llama, monkeypatch):
    """Two engines of one model in a process (here a second config object, as another
    engine has) keep their tables apart: one whose earlier pipeline stage holds layer 0
    refuses a cache of it; this engine still takes it."""
    monkeypatch.setattr(frontend, "MODULE_TABLES", {})
    llm = llama.vllm_entrypoint
    config = llm.llm_engine.vllm_config
    frontend.learn_module_table(config, llm.collective_rpc("nnsight_module_table"))
    other = copy.copy(config)
    frontend.learn_module_table(other, [{"integer_inputs": [], "absent": ["model.layers.0"]}])
    cache = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "cache", "name": "c", "modules": ["model.layers.0"]}]})
    with pytest.raises(codec.PayloadError, match="earlier pipeline stage"):
        frontend.check_payload(cache, None, other)
    assert frontend.check_payload(cache, None, config)["ops"][0]["op"] == "cache"
    out = llm.generate(PROMPTS[:1], [SamplingParams(max_tokens=2, extra_args={"nnsight": cache})], use_tqdm=False)
    assert results(out[0])["c"].keys() == ["model.model.layers.0"]
    del other  # (a table does not keep its engine's config alive: the config reaches the engine's layers)
    assert list(frontend.MODULE_TABLES) == [id(config)]


def test_a_write_to_an_integer_tensor_is_refused_at_the_write():
    """What the table does not name is caught by the dtype check every spec write
    makes before it changes anything."""
    from vllm_nnsight_plugin.engine.guards import check_writable

    with pytest.raises(TypeError, match="integer tensor"):
        check_writable(torch.arange(4), "model.layers.0.input")
    check_writable(torch.zeros(4), "model.layers.0.output")


# (hidden + residual) overflows to inf at layer 2's fused add-norm: NaN from there on
OVERFLOW = [[{"op": "add", "module": "model.layers.1", "index": i, "value": [3e38] * 128, "steps": "all"}
             for i in (0, 1)],
            [{"op": "scale", "module": "model.layers.1", "index": i, "factor": 3e38, "steps": "all"}
             for i in (0, 1)],
            # only in the request's last step (of 8): on a GPU its check is read where vLLM
            # takes that step's output, and the error still ships with it
            [{"op": "scale", "module": "model.layers.1", "index": i, "factor": 3e38, "steps": [7]}
             for i in (0, 1)],
            # NaN cannot be a JSON number, but base64 bytes can hold it
            [{"op": "set", "module": "model.layers.0", "index": 0, "steps": "all", "value": {"$tensor": {
                "dtype": "float32", "shape": [128],
                "data": base64.b64encode(struct.pack("<128f", *[float("nan")] * 128)).decode()}}}]]


@pytest.mark.parametrize("ops", OVERFLOW, ids=["add", "scale", "last-step", "base64-nan"])
def test_non_finite_values_end_their_request_and_poison_nothing(llama, ops):
    llm = llama.vllm_entrypoint
    reference = llm.generate(PROMPTS, [_plain()] * 3, use_tqdm=False)
    traced = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True,
                            extra_args={"nnsight": _spec(*ops)})
    outs = llm.generate(PROMPTS + PROMPTS[:1], [traced] * 3 + [_plain()], use_tqdm=False)
    for out in outs[:3]:
        with pytest.raises(InterventionError, match="NaN or inf"):
            results(out)
        last = ops[0]["steps"] == [7]  # (it ends by its length in that step)
        assert out.outputs[0].stop_reason == (None if last else "nnsight_error")
        assert len(out.outputs[0].token_ids) == 8 if last else len(out.outputs[0].token_ids) < 8
    _assert_same([outs[3]], [reference[0]])  # the same batch
    for _ in range(2):  # later requests get the freed blocks: never a stale NaN in them
        again = llm.generate(PROMPTS, [_plain()] * 3, use_tqdm=False)
        _assert_same(again, reference)


def test_a_non_finite_error_ships_with_a_stop_token_ending_in_its_step(llama):
    """Every token a stop token: the request ends by one at its first step, the step
    whose logits the edit made non-finite; the error ships with that output (on a GPU
    the check is read where vLLM takes the step's output, whatever ends the request)."""
    llm = llama.vllm_entrypoint
    vocab = llm.llm_engine.model_config.get_vocab_size()
    ops = [{"op": "scale", "module": "model.layers.1", "index": i, "factor": 3e38, "steps": [0]} for i in (0, 1)]
    traced = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=list(range(vocab)),
                            extra_args={"nnsight": _spec(*ops)})
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=list(range(vocab)))
    outs = llm.generate(PROMPTS, [traced, plain, traced], use_tqdm=False)
    for out in outs:
        assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "stop"
    for out in (outs[0], outs[2]):
        with pytest.raises(InterventionError, match="NaN or inf"):
            results(out)
    assert outs[1].outputs[0].stop_reason == outs[1].outputs[0].token_ids[0]


def test_a_traced_request_with_its_own_cache_salt_is_still_traced(llama):
    """A caller's ``cache_salt`` beside the plugin's: the request is still known as traced
    in the engine core, so its KV blocks (NaN here) are zeroed before reuse and later
    requests stay exactly as before."""
    from vllm_nnsight_plugin.boundary import entrypoints
    from vllm_nnsight_plugin.boundary.whole_prompts import traced

    class Request:
        cache_salt = "mine"

    request = Request()
    entrypoints.salt_request(request, "nnsight-abc")
    assert traced(request) and request.cache_salt.endswith("mine")
    llm = llama.vllm_entrypoint
    reference = llm.generate(PROMPTS, [_plain()] * 3, use_tqdm=False)
    poisoned = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                              extra_args={"nnsight": _spec(*OVERFLOW[3])})
    outs = llm.generate([{"prompt": p, "cache_salt": "mine"} for p in PROMPTS], [poisoned] * 3, use_tqdm=False)
    for out in outs:
        with pytest.raises(InterventionError, match="NaN or inf"):
            results(out)
    for _ in range(2):
        _assert_same(llm.generate(PROMPTS, [_plain()] * 3, use_tqdm=False), reference)


@pytest.fixture(scope="module")
def sliding(ckpt_root):
    """A Mistral whose every layer attends over a 16-token window (vLLM's sliding-window KV)."""
    from conftest import ENGINE_KWARGS

    from vllm_nnsight_plugin import VLLM, tiny

    model = VLLM(str(tiny.ensure("mistral_sliding", ckpt_root)), dispatch=True, dtype="float32",
                 max_model_len=512, max_num_seqs=32, enable_prefix_caching=True, seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def test_sliding_window_layers_blocks_are_zeroed_too(sliding):
    """vLLM's own block zeroing covers full-attention layers only; the plugin's covers
    every attention layer (without it the later requests here differ)."""
    llm = sliding.vllm_entrypoint
    assert llm.llm_engine.vllm_config.model_config.get_sliding_window() == 16
    layers = [p["kv_layers"] for p in llm.collective_rpc("nnsight_probe")]
    assert all(found is not None and len(found) == 4 for found in layers), layers
    reference = llm.generate(PROMPTS, [_plain()] * 3, use_tqdm=False)
    poisoned = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                              extra_args={"nnsight": _spec(*OVERFLOW[0])})
    for out in llm.generate(PROMPTS, [poisoned] * 3, use_tqdm=False):
        with pytest.raises(InterventionError, match="NaN or inf"):
            results(out)
    for _ in range(2):
        _assert_same(llm.generate(PROMPTS, [_plain()] * 3, use_tqdm=False), reference)


@pytest.fixture(scope="module")
def sliding_small(ckpt_root):
    """The sliding-window Mistral with a pool of a few requests' blocks: freed blocks
    come round again within a test."""
    from conftest import ENGINE_KWARGS

    from vllm_nnsight_plugin import VLLM, tiny

    model = VLLM(str(tiny.ensure("mistral_sliding", ckpt_root)), dispatch=True, dtype="float32",
                 max_model_len=512, max_num_seqs=4, enable_prefix_caching=True, seed=0,
                 num_gpu_blocks_override=96, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def test_blocks_a_sliding_window_drops_mid_request_are_zeroed_before_reuse(sliding_small):
    """A running traced request's blocks its window has left go back to the pool with
    its (edited) KV, mid-request: they are zeroed when handed out again, as the blocks
    of its end are. Counted by the worker's zeroing (``kv_zeroed_blocks``): the later
    plain requests cycle the whole pool, so every block the traced request ever held is
    zeroed before its next owner's step."""
    llm = sliding_small.vllm_entrypoint
    config = llm.llm_engine.vllm_config.cache_config
    long = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 24)
    steer = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, extra_args={"nnsight": _spec(
        {"op": "add", "module": "model.layers.0", "index": 0, "value": [0.5] * 128, "steps": "all"})})
    before = llm.collective_rpc("nnsight_lane_stats")[0]["kv_zeroed_blocks"]
    out = llm.generate([long], steer, use_tqdm=False)[0]
    results(out)  # (it ran its edit to the end)
    held = -(-(len(out.prompt_token_ids) + 15) // config.block_size)  # every block it ever had (the last token
    # needs no KV slot)
    assert held > 2 * 16 // config.block_size + 2  # (most of them out of the 16-token window mid-request)
    for i in range(3 * config.num_gpu_blocks // held):  # plain requests over the whole pool, three times
        llm.generate([f"Request {i}: {long}"], _plain(), use_tqdm=False)
    zeroed = llm.collective_rpc("nnsight_lane_stats")[0]["kv_zeroed_blocks"] - before
    assert zeroed >= held, (zeroed, held, config.block_size, config.num_gpu_blocks)


def _kv_zeroing_lost(worker) -> None:
    """In each worker: the state kv_zeroing leaves where it cannot place a layout (its
    finding is tested in test_kv_zeroing.py with vLLM's own attention groups)."""
    from vllm_nnsight_plugin.boundary import kv_zeroing

    state = worker.model_runner.__dict__
    state["_test_kv_layers"] = state.pop(kv_zeroing.LAYERS)
    state[kv_zeroing.LAYERS], state[kv_zeroing.WHY] = None, "ValueError: a layout this test made up"


def _kv_zeroing_back(worker) -> None:
    from vllm_nnsight_plugin.boundary import kv_zeroing

    state = worker.model_runner.__dict__
    state[kv_zeroing.LAYERS] = state.pop("_test_kv_layers")
    state.pop(kv_zeroing.WHY)


def _reads_layer_1(model, tracer):
    hidden = model.model.layers[1].output[0].save()  # noqa: F841


@pytest.fixture
def llama_taking_functions(llama_path, monkeypatch):
    """An engine of its own that takes functions in ``collective_rpc`` (vLLM's pickle
    fallback, read when the engine starts and by the front end when it sends one; it
    also changes how vLLM returns utility results, so the shared engines keep the default)."""
    from conftest import ENGINE_KWARGS

    from vllm_nnsight_plugin import VLLM

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = VLLM(llama_path, dispatch=True, dtype="float32", max_model_len=512, seed=0, **ENGINE_KWARGS)
    yield model
    model.shutdown()


def test_where_freed_blocks_cannot_be_zeroed_edits_are_refused_and_reads_run(llama_taking_functions):
    """An edit's NaN would stay in blocks the next owner reads: where the worker cannot
    zero them, blocks that may change activations (edits, code) end their request with
    the reason; reads, untraced requests and, once zeroing is back, edits run."""
    from vllm_nnsight_plugin import make_payload

    llm = llama_taking_functions.vllm_entrypoint
    steer = _spec({"op": "add", "module": "model.layers.1", "index": 0, "value": [1.0] * 128, "steps": "all"})
    read = _spec({"op": "read", "name": "h", "module": "model.layers.1", "index": 0})

    def traced(payload: str, **flags) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True,
                              extra_args={"nnsight": payload, **flags})

    batch = [traced(steer), traced(read), traced(make_payload(_reads_layer_1), nnsight_lower=False), _plain(4)]
    reference = llm.generate(PROMPTS[:2], [_plain(4)] * 2, use_tqdm=False)
    before = llm.generate(PROMPTS[:1] * 3 + PROMPTS[1:2], batch, use_tqdm=False)
    config = llm.llm_engine.vllm_config
    tables = dict(frontend.MODULE_TABLES)
    llm.collective_rpc(_kv_zeroing_lost)
    try:
        outs = llm.generate(PROMPTS[:1] * 3 + PROMPTS[1:2], batch, use_tqdm=False)
        # an engine-wide edit would end every request: refused when installed
        with pytest.raises(Exception, match="cannot zero the KV-cache blocks"):
            llm.collective_rpc("nnsight_install_edit", args=("edit-test", None, steer))
        # a front end that learns the workers' table refuses edits before the engine
        frontend.learn_module_table(config, llm.collective_rpc("nnsight_module_table"))
        with pytest.raises(codec.PayloadError, match="cannot zero the KV-cache blocks"):
            llm.generate(PROMPTS[:1], [traced(steer)], use_tqdm=False)
        with pytest.raises(codec.PayloadError, match="cannot zero the KV-cache blocks"):
            frontend.refuse_installing(codec.parse_envelope(steer), config)
    finally:
        frontend.MODULE_TABLES.clear()
        frontend.MODULE_TABLES.update(tables)
        llm.collective_rpc(_kv_zeroing_back)
    for refused in (outs[0], outs[2]):  # the edit, and code (which may change anything)
        with pytest.raises(InterventionError, match=r"cannot zero the KV-cache blocks a traced request leaves "
                                                    r"\(ValueError: a layout this test made up\)"):
            results(refused)
    torch.testing.assert_close(results(outs[1])["h"], results(before[1])["h"], rtol=0, atol=1e-5)  # the read ran
    _assert_same([outs[1]], [reference[0]])
    _assert_same([outs[3]], [reference[1]])
    assert _tokens_and_logprobs(before[0]) != _tokens_and_logprobs(reference[0])  # (the edit edits)
    after = llm.generate(PROMPTS[:1] * 3 + PROMPTS[1:2], batch, use_tqdm=False)  # zeroing back: all run
    _assert_same([after[0]], [before[0]])
    _assert_same([after[3]], [reference[1]])  # (the refused engine-wide edit was never installed)
    torch.testing.assert_close(results(after[2])["hidden"], results(before[2])["hidden"], rtol=0, atol=1e-5)


# ----------------------------------------------------------------- the validator


def test_malformed_json_is_refused_with_the_reason():
    cases = {
        '{"v": 1, "kind": "spec", "ops": [{"op": "scale", "module": "m", "factor": NaN}]}': "NaN is not a JSON",
        '{"v": 1, "kind": "spec", "ops": [{"op": "scale", "module": "m", "factor": Infinity}]}': "Infinity",
        '{"v": 1, "kind": "spec", "ops": [{"op": "scale", "module": "m", "factor": 1e400}]}': "not a finite",
        '{"v": true, "kind": "spec", "ops": [{"op": "zero", "module": "m"}]}': "'v' must be 1",
        '{"v": 1, "kind": "spec", "ops": [{"op": "zero", "module": "m\\n"}]}': "ops\\[0\\].module",
        "[" * 1000: "nested too deeply|not valid JSON",  # (Python 3.12's parser goes 1000 deep)
        "[" * 100_000: "nested too deeply|over the limit",
        '{"a":' * 100_000 + "1" + "}" * 100_000: "nested too deeply",
    }
    for text, match in cases.items():
        with pytest.raises(codec.PayloadError, match=match):
            codec.parse_envelope(text)


def test_a_value_wider_than_the_model_is_refused_before_its_numbers_are_read():
    text = _spec({"op": "add", "module": "model.layers.0", "value": [0.5] * 200_000})
    with pytest.raises(codec.PayloadError, match="wider than 4096"):
        codec.parse_envelope(text, max_width=4096)
    huge = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "add", "module": "m", "value": [0.5] * 300_000}]})
    with pytest.raises(codec.PayloadError, match="JSON values, over the limit"):
        codec.parse_envelope(huge)


def test_a_result_op_names_only_attributes_and_keys_of_the_output():
    """A ``result`` op (a saved ``tracer.result``) is a path the client follows on its own
    output: public attribute names and keys, at most 16 steps; an integral float key is
    an integer."""
    def env(path):
        return json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "result", "name": "r", "path": path}]})

    ok = codec.parse_envelope(env([["attr", "outputs"], ["item", 0.0], ["attr", "token_ids"]]))
    assert ok["ops"][0]["path"] == [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]
    assert type(ok["ops"][0]["path"][1][1]) is int
    internal = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "result", "name": "__cache__cache.0", "path": []}]})
    with pytest.raises(codec.PayloadError, match=r"ops\[0\]\.name"):  # (the engine's own names: a cache's reads)
        codec.parse_envelope(internal)
    for path, match in (([["attr", "__class__"]], "not an attribute name"), ([["call", "f"]], "must be"),
                        ([["item", 2**40]], "not an integer or a string"), ([["attr", "x"]] * 17, "at most 16"),
                        ("outputs", "at most 16"), ([["item", True]], "not an integer")):
        with pytest.raises(codec.PayloadError, match=rf"ops\[0\]\.path.*{match}"):
            codec.parse_envelope(env(path))


def test_the_validator_and_the_published_schema_agree():
    """Every generated payload without a server-only rule (a model's width, the JSON
    value budget, sum with index, duplicate names) is accepted by both or by neither."""
    from fuzz_payloads import payloads
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(spec.schema())
    checked = 0
    for category, item in payloads(seed=7, n=1500, hidden=64, layers=4):
        item = item.get("nnsight") if isinstance(item, dict) and not category.startswith("edits:") else None
        if not isinstance(item, str):
            continue
        try:
            env = json.loads(item, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except (ValueError, RecursionError):
            continue
        if not isinstance(env, dict) or env.get("kind") != "spec" or "e400" in item:
            continue  # (numbers beyond the float range: a server-only rule, in the schema's text)
        ops = env.get("ops") if isinstance(env.get("ops"), list) else []
        if any(isinstance(op, dict) and op.get("sum") and op.get("index") is not None for op in ops):
            continue
        names = [op.get("name") for op in ops if isinstance(op, dict) and "name" in op]
        if len(names) != len(set(map(repr, names))):
            continue
        schema_ok = validator.is_valid(env)
        try:
            codec._parse(item, None)
            ours = True
        except codec.PayloadError:
            ours = False
        assert ours == schema_ok, item[:300]
        checked += 1
    assert checked > 300


def test_random_bytes_never_raise_anything_but_a_payload_error():
    rng = random.Random(3)
    alphabet = '{}[]":,0123456789.eE-+ntrufalsNI\\ abc\n'
    refused = 0
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        try:
            env = codec.parse_envelope(text)
        except codec.PayloadError as exc:
            refused += 1
            assert str(exc), text  # (a reason, never an empty message)
        else:
            assert isinstance(env, dict) and env["kind"] in ("spec", "code"), text
    assert refused > 2900  # (random text is almost never a payload)


# ----------------------------------------------------------------- code blocks


def _edit_token_ids(model, tracer):
    model.model.embed_tokens.input[:] = 100000


def _edit_positions(model, tracer):
    model.model.layers[0].input[:] = 10**6


def _assign_token_ids(model, tracer):
    ids = model.model.embed_tokens.input
    model.model.embed_tokens.input = ids * 0 - 5


def _samples_out_of_range(model, tracer):
    model.samples[:] = 10**6


def _samples_assigned_out_of_range(model, tracer):
    import torch

    model.samples = torch.full_like(model.samples, -3)


@pytest.mark.parametrize("block, match", [
    (_edit_token_ids, "token ids or positions"), (_edit_positions, "token ids or positions"),
    (_assign_token_ids, "integer tensor"), (_samples_out_of_range, "outside the vocabulary"),
    (_samples_assigned_out_of_range, "outside the vocabulary"),
], ids=["token-ids", "positions", "assign-token-ids", "samples", "assign-samples"])
def test_a_code_block_cannot_write_index_tensors_and_others_go_on(llama, block, match):
    """Blocks get token ids and positions as copies: an edit of one fails the request
    instead of driving vLLM's embedding or rotary kernel out of bounds; a token id
    written into model.samples must be in the vocabulary."""
    from vllm_nnsight_plugin import make_payload

    llm = llama.vllm_entrypoint
    reference = llm.generate(PROMPTS[:2], [_plain(), _plain()], use_tqdm=False)
    traced = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"nnsight": make_payload(block)})
    outs = llm.generate(PROMPTS[:2], [traced, _plain()], use_tqdm=False)
    with pytest.raises(InterventionError, match=match):
        results(outs[0])
    _assert_same([outs[1]], [reference[1]])
    again = llm.generate(PROMPTS[:2], [_plain(), _plain()], use_tqdm=False)
    _assert_same(again, reference)


def _makes_vllm_raise(model, tracer):
    """Stands in for an intervention that makes one of vLLM's kernels fail: a pre-hook
    on layer 2 (outside the plugin's hooks) that raises once, inside vLLM's forward."""
    module = model.model.layers[2]._module

    def boom(mod, args):
        handle.remove()
        raise RuntimeError("a kernel refused its input")

    handle = module.register_forward_pre_hook(boom)
    hidden = model.model.layers[1].output[0].save()  # noqa: F841


@pytest.mark.skipif(os.environ.get("NNSIGHT_TEST_EXPECT_RUNNER") == "v2",
                    reason="Model Runner V2 runs the forward inline in execute_model: no step to compute again "
                           "(README: such an error ends a V2 engine, as in stock vLLM)")
def test_an_exception_inside_vllms_forward_ends_the_traced_requests_not_the_engine(llama):
    from vllm_nnsight_plugin import make_payload

    llm = llama.vllm_entrypoint
    reference = llm.generate(PROMPTS[:2], [_plain(), _plain()], use_tqdm=False)
    traced = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"nnsight": make_payload(_makes_vllm_raise)})
    outs = llm.generate(PROMPTS[:2], [traced, _plain()], use_tqdm=False)
    with pytest.raises(InterventionError, match="RuntimeError.*computed again without the interventions"):
        results(outs[0])
    _assert_same([outs[1]], [reference[1]])
    again = llm.generate(PROMPTS[:2], [_plain(), _plain()], use_tqdm=False)
    _assert_same(again, reference)
