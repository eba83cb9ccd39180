"""The wire format and the block capture, without an engine."""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import re

import numpy as np
import pytest
import torch

from vllm_nnsight_plugin.client.model import VLLM
from vllm_nnsight_plugin.payload import codec, values
from vllm_nnsight_plugin.payload.codec import PayloadError


def test_tagged_values_round_trip():
    obj = {
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "i": torch.tensor([[7]]),
        "tuple": (1, 2.5, None, "s", True),
        "list": [torch.zeros(0), float("inf")],
        "size": torch.Size([3, 4]),
        1: "int key",
    }
    back = values.decode(json.loads(json.dumps(values.encode(obj))))
    assert torch.equal(back["t"], obj["t"]) and back["t"].dtype == torch.float32
    assert torch.equal(back["bf"], obj["bf"]) and back["bf"].dtype == torch.bfloat16
    assert torch.equal(back["i"], obj["i"])
    assert back["tuple"] == obj["tuple"]
    assert back["list"][0].shape == (0,) and math.isinf(back["list"][1])
    assert back["size"] == torch.Size([3, 4]) and back[1] == "int key"


def test_tensor_format_decodes_with_numpy_alone():
    t = torch.randn(2, 5)
    enc = values.encode(t)["$tensor"]
    arr = np.frombuffer(base64.b64decode(enc["data"]), dtype=enc["dtype"]).reshape(enc["shape"])
    assert np.array_equal(arr, t.numpy())


def test_a_list_of_tensors_travels_as_one_buffer():
    rows = [torch.randn(3, 4).to(torch.bfloat16), torch.randn(1, 4).to(torch.bfloat16),
            torch.randn(1, 4).to(torch.bfloat16), torch.randn(1, 4).to(torch.bfloat16),
            torch.empty(0, 4, dtype=torch.bfloat16), torch.randn(4).to(torch.bfloat16),
            torch.randn(4).to(torch.bfloat16)]  # (runs of one shape decode as one unbind)
    enc = values.encode(rows)
    assert list(enc) == ["$tensors"] and enc["$tensors"]["shapes"] == [[3, 4], [1, 4], [1, 4], [1, 4], [0, 4],
                                                                        [4], [4]]
    back = values.decode(json.loads(json.dumps(enc)))
    assert len(back) == len(rows)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(rows, back, strict=True))
    mixed = values.decode(values.encode([torch.ones(2), torch.ones(2, dtype=torch.int64)]))
    assert [t.dtype for t in mixed] == [torch.float32, torch.int64]  # mixed dtypes: a plain list
    with pytest.raises(ValueError):
        values.decode({"$tensors": {"dtype": "float32", "shapes": [[4]], "data": "AAAA"}})


def test_binary_results_cross_msgpack_as_frames_and_become_the_json_form():
    """Inside vLLM tensor data is a uint8 array: vLLM's msgpack sends it as a frame of
    its own (no copy into the message), the front end puts the frame back
    (resolve_frames); the OpenAI server's to_json gives exactly the JSON form."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    obj = {"h": torch.randn(30, 40).to(torch.bfloat16), "steps": [torch.randn(1, 4), torch.randn(1, 4)],
           "pair": (torch.ones(2, dtype=torch.int64), 2.5)}
    binary = values.encode(obj, binary=True)
    assert isinstance(binary["$dict"][0][1]["$tensor"]["data"], np.ndarray)
    frames = MsgpackEncoder().encode(binary)
    assert len(frames) == 2  # (the 2400-byte tensor as a frame; small ones inline)
    wire = MsgpackDecoder().decode(frames)  # what vLLM's msgpack does to Any
    values.resolve_frames(wire, frames)
    back = values.decode(wire)
    assert torch.equal(back["h"], obj["h"]) and all(torch.equal(a, b) for a, b in zip(back["steps"], obj["steps"]))
    assert torch.equal(back["pair"][0], obj["pair"][0]) and back["pair"][1] == 2.5
    assert values.to_json(wire) == values.encode(obj)
    back["h"] += 1  # decoded tensors own writable memory
    import pickle  # the worker -> engine-core hop (vLLM pickles the runner output)

    again = values.decode(pickle.loads(pickle.dumps(binary, protocol=pickle.HIGHEST_PROTOCOL)))
    assert all(torch.equal(a, b) for a, b in zip(again["steps"], obj["steps"]))
    with pytest.raises(ValueError, match="bytes"):
        values.decode({"$tensor": {"dtype": "float32", "shape": [2], "data": b"\0" * 7}})


def test_large_result_buffers_reuse_freed_memory_and_never_a_buffer_in_use():
    """Result buffers over warm_buffers.SMALL come from a pool of freed blocks (memory
    already faulted in); a buffer still referenced (by a tensor made from it) is never
    handed out again."""
    import gc

    from vllm_nnsight_plugin.payload import warm_buffers

    size = warm_buffers.SMALL + 12345
    first = values.buffer(size)
    assert first.size == size and first.dtype == np.uint8
    held = torch.from_numpy(first)  # the tensor keeps the buffer alive
    piece = first.reshape(-1)[:10]  # ...and so does any array numpy derives from it
    address = first.__array_interface__["data"][0]
    del first
    gc.collect()
    second = values.buffer(size)
    assert second.__array_interface__["data"][0] != address  # in use: not reused
    held.fill_(7)
    assert not np.shares_memory(second, held.numpy())
    del held
    gc.collect()
    assert values.buffer(size).__array_interface__["data"][0] != address  # the slice still holds it
    assert (piece == 7).all()
    del piece
    gc.collect()
    third = values.buffer(size - 100)  # (same size class)
    assert third.__array_interface__["data"][0] == address  # freed: its memory is reused
    assert warm_buffers.size_class(size) >= size and warm_buffers.size_class(size) <= size * 1.125 + 1


def test_decoded_frames_are_private_copies_in_reused_memory_and_ran_as_needs_no_decode(monkeypatch):
    """The client copies a large frame (an every-token result: half a megabyte per
    request) into a pooled buffer: the tensor is its own (writing it leaves the frame
    as it was), its block is not reused while any view of it lives, and once dropped
    the block returns to the pool for the next decode. A request's
    ``ran_as`` is read without decoding its saves (which would cost a second full decode)."""
    import gc

    from vllm_nnsight_plugin.boundary.outputs import install_saves_property
    from vllm_nnsight_plugin.payload import warm_buffers

    monkeypatch.setattr(warm_buffers, "_free", {})  # (an empty pool: blocks earlier tests freed are not counted)
    monkeypatch.setattr(warm_buffers, "_kept", 0)
    rows = torch.randn(128, 1, 2048).to(torch.bfloat16)
    frame = bytes(rows.reshape(-1).view(torch.uint8).numpy())  # (read-only, as a received frame)
    wire = {"dtype": "bfloat16", "shapes": [[1, 2048]] * 128, "data": memoryview(frame)}
    size_class = warm_buffers.size_class(len(frame))
    got = values.decode_tensors(wire)
    assert len(got) == 128 and all(torch.equal(a, b) for a, b in zip(got, rows.unbind(0)))
    got[0].fill_(1)
    assert frame == bytes(rows.reshape(-1).view(torch.uint8).numpy())  # a copy of its own
    kept = got[-1]  # (a view of the block: the block stays in use)
    del got
    gc.collect()
    assert not warm_buffers._free.get(size_class)  # not back in the pool while `kept` lives
    again = values.decode_tensors(wire)
    assert kept.data_ptr() not in range(again[0].data_ptr(), again[-1].data_ptr() + 4096)
    assert torch.equal(kept, rows[-1])
    del kept, again
    gc.collect()
    assert len(warm_buffers._free.get(size_class, ())) == 2  # both blocks returned for the next decode

    class Output:  # (the attributes vLLM's RequestOutput carries)
        kv_transfer_params = {codec.PAYLOAD_KEY: {"saves": {"x": {"$tensor": {"dtype": "float32", "shape": [2],
                                                                              "data": b"\0" * 7}}},
                                                  "ran_as": "batched"}}

    install_saves_property(Output)
    assert Output().ran_as == "batched"  # (the malformed save is never decoded for it)
    with pytest.raises(ValueError, match="bytes"):
        Output().saves  # noqa: B018


def test_unsupported_and_malformed_values():
    with pytest.raises(TypeError, match="object"):
        values.encode(object())
    with pytest.raises(ValueError):
        values.decode({"$tensor": {"dtype": "float32", "shape": [4], "data": "AAAA"}})
    with pytest.raises(ValueError):
        values.decode({"$nope": 1})


def _capture(model: VLLM, layer: int, v: torch.Tensor) -> str:
    """Capture a block the way trace() does, without running it."""
    captured = {}

    def fake_run(invokes, sampling, serve=None):
        inv = invokes[0]
        captured["payload"] = codec.encode_code(
            codec.CodePayload(inv.block.source, inv.block.filename, inv.block.lineno, inv.values)
        )
        return []

    object.__setattr__(model, "_run_invokes", fake_run)
    idx = layer
    with model.trace("Hello"):
        model.model.layers[idx].output[0][:] += v
        h = model.model.layers[idx].output.save()  # noqa: F841
    return captured["payload"]


@pytest.mark.parametrize("depth", [4, 32])
def test_payload_is_small_and_flat_in_depth(depth):
    model = VLLM("/nonexistent")
    tree = {"": "LlamaForCausalLM", "model": "LlamaModel", "model.layers": "ModuleList"}
    tree.update({f"model.layers.{i}": "LlamaDecoderLayer" for i in range(depth)})
    object.__setattr__(model, "_tree", tree)
    payload = _capture(model, 1, torch.ones(16))
    env = codec.parse_envelope(payload)
    assert "model.layers[idx].output[0][:] += v" in env["source"]
    assert len(payload) < 2048  # the tree never travels, only references
    assert "LlamaDecoderLayer" not in payload


def test_body_on_the_with_line_is_refused():
    model = VLLM("/nonexistent")
    with pytest.raises(SyntaxError, match="own line"):
        with model.trace("Hello"): model.logits.save()  # noqa: E701


def test_scan_and_unknown_modes_explain_themselves():
    with pytest.raises(NotImplementedError, match="scan"):
        VLLM("/nonexistent").scan("x")
    with pytest.raises(ValueError, match="async"):
        VLLM("/nonexistent", mode="threads")


def test_oversized_payload_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_NNSIGHT_MAX_PAYLOAD_BYTES", "1000")
    with pytest.raises(codec.PayloadError, match="over the limit"):
        codec.encode_code(codec.CodePayload("x = 1", values={"big": torch.zeros(10_000)}))
    with pytest.raises(codec.PayloadError, match="over the limit"):
        codec.parse_envelope("x" * 2000)


def test_unpicklable_variable_is_named():
    import threading

    with pytest.raises(codec.PayloadError, match="'lock'"):
        codec.encode_code(codec.CodePayload("lock", values={"lock": threading.Lock()}))


def test_cache_ops_are_checked():
    from vllm_nnsight_plugin.payload import spec

    ok = {"v": 1, "kind": "spec", "ops": [{"op": "cache", "name": "c", "modules": ["model.layers.0"],
                                           "inputs": True, "steps": "prefill", "dtype": "float16"}]}
    spec.validate(ok)
    bad = [({"op": "cache", "name": "c", "modules": []}, "modules"),
           ({"op": "cache", "name": "c", "modules": ["a b"]}, "modules[0]"),
           ({"op": "cache", "name": "c", "outputs": False}, "holds nothing"),
           ({"op": "cache", "name": "c", "steps": [0, 1]}, "from the prompt on"),
           ({"op": "cache", "name": "c", "dtype": "int8"}, "dtype"),
           ({"op": "cache", "name": "c", "module": "model"}, "unknown field")]
    for op, why in bad:
        with pytest.raises(PayloadError, match=re.escape(why)):
            spec.validate({"v": 1, "kind": "spec", "ops": [op]})


def test_a_cache_value_decodes_to_a_navigable_view():
    from vllm_nnsight_plugin.payload.cache import CacheView

    h = [torch.ones(3, 4), torch.ones(1, 4) * 2]
    body = {"$cache": {"dtype": None, "entries": [
        ["model.layers.0", "output", "tuple", [values.encode(h), values.encode([t * 10 for t in h])]],
        ["model.norm", "input", "tensor", [values.encode(torch.zeros(3, 4))]]]}}
    cache = values.decode(json.loads(json.dumps(values.to_json(body))))
    assert isinstance(cache, CacheView) and cache.keys() == ["model.model.layers.0", "model.model.norm"]
    visits = cache.model.model.layers[0].output
    assert len(visits) == 2 and torch.equal(visits[1][1], h[1] * 10)
    assert torch.equal(cache["model.model.norm"].input, torch.zeros(3, 4))
    assert cache.model.model.norm.inputs == ((cache.model.model.norm.input,), {})
    assert cache.model.model.layers[-1] is not None and "model.model.norm" in cache
    with pytest.raises(IndexError, match="out of range"):
        cache.model.model.layers[1]
    with pytest.raises(KeyError, match="was not cached"):
        cache["model.lm_head"]


def test_invokes_of_one_body_and_values_encode_once_and_edits_are_seen():
    v = torch.ones(4)
    first = codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v, "n": 2}))
    assert codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v, "n": 2})) is first
    v.add_(1)  # (an in-place change between invokes: a new payload with the new values)
    changed = codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v, "n": 2}))
    assert changed != first
    assert codec.load_code(codec.parse_envelope(changed), lambda ref: None).values["v"].tolist() == [2.0] * 4
    assert codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": torch.ones(4), "n": 2})) != changed
    assert codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v, "n": 3})) != changed
    v.data.add_(1)  # (a change the version counter does not see: the bytes do)
    seen = codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v, "n": 2}))
    assert codec.load_code(codec.parse_envelope(seen), lambda ref: None).values["v"].tolist() == [3.0] * 4
    scalar = torch.tensor(2.5)
    assert codec.encode_code(codec.CodePayload("x = s", "f.py", 3, {"s": scalar})) is \
        codec.encode_code(codec.CodePayload("x = s", "f.py", 3, {"s": scalar}))
    # a trace-level list is copied for each invoke: equal copies share one payload
    from vllm_nnsight_plugin.payload.codec import SharedList

    first_copy = codec.encode_code(codec.CodePayload("x = o", "f.py", 3, {"o": SharedList([1, 2])}))
    assert codec.encode_code(codec.CodePayload("x = o", "f.py", 3, {"o": SharedList([1, 2])})) is first_copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: a device tensor's bytes key the memo")
def test_a_small_cuda_tensor_changed_through_data_gets_a_new_payload():
    v = torch.ones(4, device="cuda")
    first = codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v}))
    assert codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v})) is first
    v.data.add_(1)  # (the version counter does not see it)
    seen = codec.encode_code(codec.CodePayload("x = v", "f.py", 3, {"v": v}))
    assert codec.load_code(codec.parse_envelope(seen), lambda ref: None).values["v"].tolist() == [2.0] * 4


def test_a_payload_is_reused_only_for_the_same_numbers():
    """Numbers key the memo by their bits and lists of numbers by their contents: a
    sweep's coefficient list repeats its payload only where every number is the same
    (``-0.0`` is not ``0.0``, ``1`` is not ``1.0``)."""
    def text(**values):
        return codec.encode_code(codec.CodePayload("x = c", "f.py", 3, values))

    coefs = [0.25 + i / 64 for i in range(256)]
    first = text(c=coefs, i=3)
    assert text(c=coefs, i=3) is first and text(c=list(coefs), i=3) == first and text(c=coefs, i=4) != first
    assert text(c=[*coefs[:-1], 9.0], i=3) != first
    assert text(c=-0.0) != text(c=0.0) and text(c=1) != text(c=1.0) and text(c=[1, 2]) != text(c=[1.0, 2])
    assert text(c=(1, "a", None, b"x")) is text(c=(1, "a", None, b"x")) != text(c=[1, "a", None, b"x"])
    loaded = codec.load_code(codec.parse_envelope(text(c=-0.0)), lambda ref: None).values["c"]
    assert str(loaded) == "-0.0"
    # one list under two names is not two equal lists (a block changing one sees the other change)
    one, other = [1.0, 2.0], [1.0, 2.0]
    same = codec.load_code(codec.parse_envelope(text(c=one, d=one)), lambda ref: None).values
    apart = codec.load_code(codec.parse_envelope(text(c=one, d=other)), lambda ref: None).values
    assert same["c"] is same["d"] and apart["c"] is not apart["d"]
    looped: list = [1]
    looped.append(looped)  # (a list that holds itself: encoded, not remembered)
    back = codec.load_code(codec.parse_envelope(text(c=looped)), lambda ref: None).values["c"]
    assert back[1] is back


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (quantized ones as their dequantized values; float8, which
    torch.equal does not take, as float32)."""
    if a.is_quantized:
        a, b = a.dequantize(), b.dequantize()
    if a.is_floating_point() and a.element_size() == 1:
        a, b = a.float(), b.float()
    return a.dtype == b.dtype and torch.equal(a.detach(), b.detach())


def test_tensors_travel_as_their_bytes_in_every_dtype_and_layout():
    """A block's tensors come back as sent: dtype (the unsigned ones torch pickles
    untyped too, float8, quantized), shape, strides and offset of a view, requires_grad,
    an empty one; one tensor under two names stays one, and a view shares its base's
    storage, sent once. Not through torch's legacy storage pickle (``_load_from_bytes``).
    A payload whose tensors went that way (an earlier client) loads as before, and what
    this client sends needs no name of the plugin's to load (an earlier engine loads it)."""
    base = torch.linspace(-1, 1, 24)
    ints = {dtype: torch.tensor([1, 2, 127], dtype=dtype) for dtype in (
        torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32, torch.int64)}
    sent = {"f32": base, "view": base.view(4, 6)[1:, ::2], "bf16": base.to(torch.bfloat16),
            "f16t": base.to(torch.float16).view(4, 6).t(), "f64": base.double(), "f8": base.to(torch.float8_e4m3fn),
            **{str(dtype): t for dtype, t in ints.items()}, "u16": torch.tensor([65535], dtype=torch.uint16),
            "bool": base > 0, "c64": torch.tensor([1 + 2j]), "q": torch.quantize_per_tensor(base, 0.1, 0, torch.qint8),
            "empty": torch.empty(0, 3), "grad": torch.ones(2, requires_grad=True), "again": base}
    text = codec.encode_code(codec.CodePayload("x = 1", "f.py", 3, sent))
    raw = base64.b64decode(json.loads(text)["values"])
    assert b"_load_from_bytes" not in raw and raw.count(base.numpy().tobytes()) == 1
    back = codec.load_code(codec.parse_envelope(text), lambda ref: None).values
    for name, value in sent.items():
        got = back[name]
        assert got.dtype == value.dtype and got.shape == value.shape and got.stride() == value.stride(), name
        assert got.storage_offset() == value.storage_offset() and got.requires_grad == value.requires_grad, name
        assert _same(got, value), name
    assert back["again"] is back["f32"]
    assert back["view"].untyped_storage().data_ptr() == back["f32"].untyped_storage().data_ptr()
    back["torch.int64"].resize_(30)  # (storages of their own, as torch's pickle gives)

    class TorchPickler(codec._RefPickler):  # (tensors as torch pickles them: what earlier clients sent)
        def reducer_override(self, obj):
            return super(codec._RefPickler, self).reducer_override(obj)

    buf = io.BytesIO()
    TorchPickler(buf, codec._nnsight_ref).dump({"v": base})
    env = {"source": "x = 1", "filename": "f.py", "lineno": 3, "values": base64.b64encode(buf.getvalue()).decode()}
    assert torch.equal(codec.load_code(env, lambda ref: None).values["v"], base)

    class TorchOnly(pickle.Unpickler):  # (what an engine of an earlier plugin version can load)
        def find_class(self, module, name):
            assert not module.startswith("vllm_nnsight_plugin"), (module, name)
            return super().find_class(module, name)

    loaded = TorchOnly(io.BytesIO(raw)).load()
    assert all(torch.equal(loaded[k].detach(), back[k].detach()) for k in ("f32", "view", "u16", "bf16"))


def test_a_code_payload_is_the_json_of_its_envelope():
    """The envelope is written out by hand (base64 needs no escaping): the text is what
    ``json.dumps`` of the envelope gives, key order too, also for a source with quotes,
    newlines and non-ASCII."""
    payload = codec.CodePayload('x = "é"\n\ty = \'\\\'', "dir/f\u00fc.py", 12, {"v": torch.ones(3)})
    text = codec._encode_code(payload)
    values = json.loads(text)["values"]
    assert text == json.dumps({"v": codec.VERSION, "kind": "code", "source": payload.source,
                               "filename": payload.filename, "lineno": 12, "values": values}, separators=(",", ":"))


def test_the_payload_memo_is_bounded_in_count_and_text(monkeypatch):
    """The client keeps recent payloads up to a count and a total of text, oldest out first."""
    monkeypatch.setattr(codec, "_ENCODED", {})
    monkeypatch.setattr(codec, "_memo_bytes", 0)
    monkeypatch.setattr(codec, "_MEMO_SIZE", 4)
    texts = [codec.encode_code(codec.CodePayload("x = n", "f.py", 3, {"n": n})) for n in range(6)]
    assert len(codec._ENCODED) == 4 and codec._memo_bytes == sum(len(t) for t in texts[2:])
    assert codec.encode_code(codec.CodePayload("x = n", "f.py", 3, {"n": 5})) is texts[5]
    monkeypatch.setattr(codec, "_MEMO_BYTES", 2 * len(texts[0]) + 1)
    codec.encode_code(codec.CodePayload("x = n", "f.py", 3, {"n": 6}))
    assert len(codec._ENCODED) == 2 and codec._memo_bytes <= codec._MEMO_BYTES


def test_operator_settings_parse_in_one_place(monkeypatch):
    """--additional-config's nnsight section, each key falling back to its environment
    variable (the section wins); a number that is not one names its key."""
    from vllm_nnsight_plugin.payload.settings import settings_of

    for env in ("VLLM_NNSIGHT_MAX_SAVED_BYTES", "VLLM_NNSIGHT_MAX_SAVES", "VLLM_NNSIGHT_CODE_TIME_LIMIT",
                "VLLM_NNSIGHT_ALLOW_CODE"):
        monkeypatch.delenv(env, raising=False)
    plain = settings_of(None)
    assert (plain.max_saved_bytes, plain.max_saves, plain.code_time_limit_s) == (1 << 30, 100_000, 30.0)
    assert plain.lanes and not plain.allow_code and not plain.taps
    got = settings_of({"max_saves": 7, "code_time_limit_s": 0, "lanes": False, "taps": "model.layers.*.output"})
    assert (got.max_saves, got.code_time_limit_s, got.lanes) == (7, 0.0, False)
    assert got.taps.patterns == ["model.layers.*.output"]
    monkeypatch.setenv("VLLM_NNSIGHT_MAX_SAVES", "9")
    monkeypatch.setenv("VLLM_NNSIGHT_ALLOW_CODE", "1")
    assert settings_of({}).max_saves == 9 and settings_of({}).allow_code  # (the cache sees the environment)
    assert settings_of({"max_saves": 3}).max_saves == 3
    monkeypatch.setenv("VLLM_NNSIGHT_ALLOW_CODE", "0")
    assert not settings_of({"allow_code": "yes"}).allow_code and settings_of({"allow_code": True}).allow_code
    with pytest.raises(ValueError, match="nnsight.max_saved_bytes: expected a number"):
        settings_of({"max_saved_bytes": "lots"})
    monkeypatch.setenv("VLLM_NNSIGHT_CODE_TIME_LIMIT", "soon")
    with pytest.raises(ValueError, match="VLLM_NNSIGHT_CODE_TIME_LIMIT: expected a number"):
        settings_of({})


def test_a_remote_error_is_a_runtime_error_and_its_builtin_type():
    """As nnsight raises it: ``RuntimeError("<TypeName>: <message>")``; and also an
    instance of the remote builtin type, for every builtin exception type."""
    import builtins

    from vllm_nnsight_plugin.client.errors import InterventionError, make_error

    for name in dir(builtins):
        base = getattr(builtins, name)
        if not (isinstance(base, type) and issubclass(base, Exception)) or base is Exception \
                or issubclass(base, getattr(builtins, "BaseExceptionGroup", ())):  # (needs its exceptions)
            continue
        err = make_error({"type": name, "message": "it failed", "filename": "b.py", "lineno": 3, "line": "x = 1"})
        assert isinstance(err, InterventionError) and isinstance(err, RuntimeError) and isinstance(err, base), name
        assert str(err).startswith(f"{name}: it failed")
    import traceback

    syntax = make_error({"type": "SyntaxError", "message": "'return' outside function", "filename": "b.py",
                         "lineno": 3, "line": "return 1"})
    shown = "".join(traceback.format_exception_only(type(syntax), syntax))  # (SyntaxError prints its own fields)
    assert "SyntaxError: 'return' outside function" in shown and 'File "b.py", line 3' in shown
    assert "return 1" in shown and "no detail" not in shown
    import copy
    import pickle

    for err in (syntax, make_error({"type": "ZeroDivisionError", "message": "m", "lineno": 2, "line": None})):
        for again in (copy.copy(err), pickle.loads(pickle.dumps(err))):
            assert type(again).__name__ == type(err).__name__ and str(again) == str(err) and "None" not in str(err)
    for info in ({"type": "CustomError", "message": "m"}, {"type": "ExceptionGroup", "message": "m"}):
        unknown = make_error(info)
        assert type(unknown) is InterventionError and str(unknown) == f"{info['type']}: m"


def test_logits_spelled_as_before_nnsight_0_7_is_no_module_access():
    """A compiled engine without taps refuses blocks that touch module values, and
    serves model.logits in every mode: model.logits.output (nnsight's spelling before
    0.7) is model.logits."""
    from vllm_nnsight_plugin.boundary.frontend import touches_modules

    assert not touches_modules({"kind": "code", "source": "x = model.logits.output\nmodel.samples.output = y"})
    assert touches_modules({"kind": "code", "source": "x = model.model.layers[0].output"})
    assert touches_modules({"kind": "code", "source": "x = model.lm_head.logits.output"})
