"""Deterministic fuzz payloads for a served vllm-nnsight-plugin engine.

    from fuzz_payloads import payloads
    items = payloads(seed=0, n=3000, hidden=128, layers=4)   # [(category, value), ...]

Each item is ``(category, value)``:

- a category that does not start with ``"edits:"``: ``value`` is what goes into the
  request's ``vllm_xargs`` field (usually a dict whose ``"nnsight"`` entry is the
  payload string, but any JSON value is possible);
- a category that starts with ``"edits:"``: ``value`` is the body of
  ``POST /v1/nnsight/edits``.

A ``bytes`` value is raw JSON text to splice into the request body as is (nesting
too deep for ``json.dumps``, invalid JSON); any other value is sent as
``json.dumps(value)`` (which writes ``NaN``/``Infinity`` literals for non-finite
floats). The list is the same for the same arguments (``random.Random(seed)``).

Groups, in roughly equal shares: random JSON and non-string payloads; mutated
valid specs (with integer-tensor targets, valid controls and a few 1M-number
values); non-finite and huge numbers; deep nesting; wrong-type values of every
``vllm_xargs`` key the plugin reads; bodies for the edits route.

Imports only the standard library's json/random/math/base64/struct (a CI test
imports this module through ``sys.path``).
"""

from __future__ import annotations

import base64
import json
import math
import random
import struct

__all__ = ["payloads", "big_value_text", "GROUPS"]

OPS = ("read", "add", "set", "scale", "zero", "logits_topk", "result")
EDIT_OPS = ("add", "set", "scale", "zero")
STEP_WORDS = ("prefill", "generated", "all")
NESTING = (100, 1000, 100000)

# (group, [(category, weight), ...]): one group per item in turn, then a category by weight
GROUPS = (
    ("random", (("random-json", 1), ("non-string", 1))),
    ("mutated", (("mutated", 3), ("int-tensor", 1), ("valid", 1))),
    ("non-finite", (("non-finite", 1),)),
    ("deep", (("deep", 4), ("deep-body", 1))),
    ("xargs", (("xargs-types", 1),)),
    ("edits", (("edits:spec", 3), ("edits:int-tensor", 1), ("edits:body", 2))),
)


# ----------------------------------------------------------------- building blocks


def _modules(layers: int) -> list[str]:
    """Module paths of vLLM's Llama whose output is (or holds) float hidden states."""
    out = ["model.norm"]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [p, p + ".mlp", p + ".self_attn", p + ".mlp.down_proj", p + ".self_attn.o_proj",
                p + ".input_layernorm", p + ".post_attention_layernorm", p + ".mlp.act_fn"]
    return out


def _safe_modules(layers: int) -> list[tuple[str, int | None]]:
    """(module, index) pairs whose output element is a [tokens, hidden] float tensor."""
    out: list[tuple[str, int | None]] = []
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(p, 0), (p, 1), (p + ".mlp", None), (p + ".self_attn", None)]
    return out


def _vec(rng: random.Random, width: int, scale: float = 0.1) -> list[float]:
    return [round(rng.uniform(-scale, scale), 4) for _ in range(width)]


def _name(rng: random.Random, i: int) -> str:
    return rng.choice(("h", "x", "act", "probe", "top", "res")) + str(i)


def _steps(rng: random.Random) -> object:
    r = rng.random()
    if r < 0.7:
        return rng.choice(STEP_WORDS)
    return sorted(rng.sample(range(0, 6), rng.randint(1, 3)))


def _valid_op(rng: random.Random, hidden: int, layers: int, i: int) -> dict:
    """One schema-valid op on a location that holds float hidden states."""
    kind = rng.choice(OPS)
    if kind == "result":  # (tracer.result saved, whole or a part of it)
        return {"op": kind, "name": _name(rng, i), "path": rng.choice((
            [], [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]], [["attr", "prompt_token_ids"]],
            [["attr", "outputs"], ["item", -1], ["attr", "text"]], [["attr", "finished"]]))}
    if kind == "logits_topk":
        op = {"op": kind, "name": _name(rng, i), "k": rng.randint(1, 10)}
        if rng.random() < 0.6:
            op["steps"] = _steps(rng)
        return op
    module, index = rng.choice(_safe_modules(layers))
    op: dict = {"op": kind, "module": module}
    if index is not None or rng.random() < 0.3:
        op["index"] = index
    if rng.random() < 0.3:
        op["io"] = "output"
    if rng.random() < 0.4:
        op["positions"] = rng.choice(([-1], [0], [0, -1], None, [1, 2]))
    if rng.random() < 0.7:
        op["steps"] = _steps(rng)
    if kind == "read":
        op["name"] = _name(rng, i)
        if rng.random() < 0.2 and module.count(".") == 2:
            op.pop("index", None)
            op["sum"] = True
    elif kind in ("add", "set"):
        op["value"] = _vec(rng, hidden)
    elif kind == "scale":
        op["factor"] = rng.choice((0.5, 0.0, 1.0, 2.0, -1.0, 0.9))
    return op


def _valid_spec(rng: random.Random, hidden: int, layers: int) -> dict:
    return {"v": 1, "kind": "spec", "ops": [_valid_op(rng, hidden, layers, i) for i in range(rng.randint(1, 3))]}


def _dump(obj: object) -> str:
    return json.dumps(obj, allow_nan=True)


def big_value_text(rng: random.Random, count: int = 1_000_000) -> str:
    """JSON text of a list of ``count`` short numbers (about 4 bytes each)."""
    return "[" + ",".join(rng.choice(("0.1", "0.2", "-0.1", "0.5", "1", "-1")) for _ in range(count)) + "]"


# ----------------------------------------------------------------- random JSON


def _random_string(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz._0123456789") for _ in range(rng.randint(0, 20)))
    if r < 0.5:
        return "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(1, 12)))
    if r < 0.6:
        return "".join(chr(rng.choice((0xD800, 0xDFFF, 0xFFFE, 0x0, 0x7F, 0x1F))) for _ in range(rng.randint(1, 4)))
    if r < 0.7:
        return rng.choice(("spec", "code", "nnsight", "model.layers.0", "output", "input", "all", "NaN", "null"))
    if r < 0.8:
        return "x" * rng.choice((1000, 10000, 100000))
    return rng.choice(("", " ", "\n", "\\", '"', "{}", "[]", "\u202e", "\ufeff", "${jndi}", "%s%n"))


def _random_number(rng: random.Random) -> object:
    return rng.choice((
        0, 1, -1, rng.randint(-1000, 1000), 2**31, 2**63, -(2**63) - 1, 10**rng.randint(20, 400),
        -(10**rng.randint(20, 400)), rng.uniform(-1e6, 1e6), 1e308, -1e308, 5e-324, -0.0, 1e-45,
        math.pi, 0.1,
    ))


def _random_json(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 3 or r < 0.45:
        return rng.choice((
            lambda: _random_string(rng), lambda: _random_number(rng), lambda: rng.random() < 0.5, lambda: None,
        ))()
    if r < 0.7:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys = ["v", "kind", "ops", "op", "module", "value", "source", "values", "name", "steps"]
    return {(rng.choice(keys) if rng.random() < 0.6 else _random_string(rng)): _random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 5))}


def _cat_random_json(rng: random.Random, hidden: int, layers: int) -> object:
    r = rng.random()
    if r < 0.5:
        text = _dump(_random_json(rng))
    elif r < 0.75:  # an envelope-shaped object with random fields
        env = {"v": rng.choice((1, 1, 2, "1", None)), "kind": rng.choice(("spec", "code", "x", None))}
        env.update({k: _random_json(rng, 1) for k in rng.sample(["ops", "source", "values", "lineno", "filename",
                                                                   "extra"], rng.randint(1, 3))})
        text = _dump(env)
    elif r < 0.9:  # not JSON
        text = _random_string(rng)
    else:  # truncated JSON
        full = _dump(_valid_spec(rng, hidden, layers))
        text = full[: rng.randint(0, len(full) - 1)]
    return {"nnsight": text}


def _cat_non_string(rng: random.Random, hidden: int, layers: int) -> object:
    value = rng.choice((
        lambda: rng.randint(-10, 10), lambda: 10**rng.randint(20, 400), lambda: rng.uniform(-1e9, 1e9),
        lambda: rng.choice((0.0, 1.0, 1e308, -0.0)), lambda: rng.random() < 0.5, lambda: None,
        lambda: [rng.randint(0, 9) for _ in range(rng.randint(0, 4))],
        lambda: [_dump(_valid_spec(rng, hidden, layers))],
        lambda: _valid_spec(rng, hidden, layers), lambda: _random_json(rng, 1),
        lambda: {"nnsight": "x"}, lambda: [[1, 2], [3]],
    ))()
    return {"nnsight": value}


# ----------------------------------------------------------------- mutated specs


def _bad_module(rng: random.Random, layers: int) -> str:
    base = rng.choice(_modules(layers))
    return rng.choice((
        base + "\n", " " + base, base + " ", base.replace(".", " . "), base.replace("layers", "lay\u0435rs"),
        base.replace("0", "\uff10"), "m\u00f3del.layers.0", base + "." + "a" * 300, "model." + "x." * 5000 + "y",
        f"model.layers.{layers}", f"model.layers.{10**30}", "model.layers.-1", "", ".", "model..layers", "model.",
        "__class__", "model.__class__.__init__", "model.layers.0.__dict__", "lm_head", "logits_processor",
        "model", "model.layers", "sampler", "model.layers.0.self_attn.attn", "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.rotary_emb", "model.embed_tokens",
        "model.layers.0\u0000", "model/layers/0", "MODEL.LAYERS.0",
    ))


def _wrong_type(rng: random.Random) -> object:
    return rng.choice(("x", "", 1, -1, 1.5, True, False, None, [], [1], {}, {"a": 1}, [[0]], 10**30, "0", "1.0"))


def _mutate_op(rng: random.Random, op: dict, hidden: int, layers: int) -> None:
    r = rng.randrange(15)
    fields = ["op", "module", "io", "index", "positions", "steps", "value", "factor", "k", "name", "sum", "path"]
    if r == 0:  # wrong type for a field
        op[rng.choice(fields)] = _wrong_type(rng)
    elif r == 1:  # out-of-range / negative ints
        field, bad = rng.choice((
            ("index", rng.choice((17, -1, 2**31, 2**63, 10**30, 3, 16))),
            ("k", rng.choice((0, -5, 1001, 10**20, 100000, 511, 512, 513))),
            ("positions", rng.choice(([10**9], [-10**9], [2**63], [0, 10**6], list(range(70000)), [-513],
                                      [511], [0] * 1000))),
            ("steps", rng.choice(([100001], [-1], [2**64], list(range(5000)), [], [0] * 4096, [100000]))),
        ))
        op[field] = bad
    elif r == 2:  # unknown field
        op[rng.choice(("extra", "Module", "op ", "values", "$tensor", "__proto__"))] = _wrong_type(rng)
    elif r == 3:  # missing required field
        required = [f for f in ("op", "module", "name", "value", "factor", "k") if f in op]
        if required:
            del op[rng.choice(required)]
    elif r in (4, 5):  # module path mutations
        op["module"] = _bad_module(rng, layers)
    elif r == 6:  # io / index combos
        op["io"] = rng.choice(("input", "output", "inputs", "Output", "", None))
        op["index"] = rng.choice((None, 0, 1, 2))
    elif r == 7:  # value of the wrong width / shape
        op["op"] = rng.choice(("add", "set"))
        for f in ("factor", "k", "name", "sum"):
            op.pop(f, None)
        op.setdefault("module", f"model.layers.{rng.randrange(layers)}")
        op["value"] = rng.choice((
            [], [0.1], _vec(rng, hidden - 1), _vec(rng, hidden + 1), _vec(rng, 2 * hidden),
            [_vec(rng, hidden), _vec(rng, hidden)], [_vec(rng, hidden), [0.1]], [[[0.1]]], 0.5, "0.1",
            [0.1, "x"], [True] * hidden, [None] * hidden, [10**30] * hidden,
            {"$tensor": {"dtype": "float32", "shape": [hidden], "data": "!!!"}},
            {"$tensor": {"dtype": "float32", "shape": [hidden], "data": base64.b64encode(b"\0" * 7).decode()}},
            {"$tensor": {"dtype": "float64", "shape": [hidden],
                         "data": base64.b64encode(struct.pack(f"<{hidden}d", *[0.1] * hidden)).decode()}},
            {"$tensor": {"dtype": "float32", "shape": [10**9, 10**9], "data": ""}},
            {"$tensor": {"dtype": "float32", "shape": [-1], "data": ""}},
            {"$tensor": {"dtype": "int64", "shape": [hidden], "data": ""}},
            {"$tensor": {"dtype": "float16", "shape": [2, hidden],
                         "data": base64.b64encode(b"\0" * (4 * hidden)).decode()}},
        ))
    elif r == 8:  # factor variants
        op["op"] = "scale"
        for f in ("value", "k", "name", "sum"):
            op.pop(f, None)
        op.setdefault("module", f"model.layers.{rng.randrange(layers)}")
        op["factor"] = rng.choice(("2", None, [2.0], 10**400, -1e30, 0, True))
    elif r == 9:  # sum variants
        op["op"], op["name"] = "read", op.get("name") or "s"
        op["sum"] = rng.choice((True, 1, "yes", None))
        op.setdefault("module", "model.layers.0")
    elif r == 10:  # name variants
        op["name"] = rng.choice(("", "1abc", "a" * 65, "a b", "a\n", "\u00e9", "saves", "$tensor", "error",
                                 "__init__", "a" * 10000, "null", "name.with.dots"))
    elif r == 11:  # op variants
        op["op"] = rng.choice(("READ", "read ", "del", "exec", "code", "logits", "", "topk", "mul", "eval"))
    elif r == 12:  # steps variants
        op["steps"] = rng.choice(("Prefill", "every", "", "0", [0.5], [True], [[0]], {"all": 1}, ["all"], [0, 0, 0]))
    elif r == 13:  # positions variants
        op["positions"] = rng.choice(([], [0.5], ["0"], [[0]], [None], [True], {"0": 1}, "all", 0, [-1, -1]))
    else:  # result paths (a path a client resolves on its output: never anything but names and keys)
        name = op.get("name", "r")
        op.clear()
        op.update({"op": "result", "name": name})
        op["path"] = rng.choice((
            [["attr", "__class__"]], [["attr", "_private"]], [["call", "x"]], [["attr"]], [["item", 0.5]],
            [["item", 2**40]], [["item", 3.0]], [["item", "k" * 65]], [["item", None]], "outputs", {"a": 1},
            [["attr", "outputs"]] * 17, [["attr", "a" * 65]], [["attr", "a b"]], [["attr", "x\n"]], [[0, 1]],
            [["item", True]], [["attr", "outputs"], ["item", 0], ["attr", "token_ids"]]))


def _mutate_envelope(rng: random.Random, env: dict, hidden: int, layers: int) -> None:
    r = rng.randrange(8)
    if r == 0:
        env["v"] = rng.choice((True, 1.0, 2, 0, "1", None, -1, 10**30, [1]))
    elif r == 1:
        env["kind"] = rng.choice(("SPEC", "Spec", "spec ", "code", "", None, 1, "specs", ["spec"]))
    elif r == 2:
        env.pop(rng.choice(("v", "kind", "ops")), None)
    elif r == 3:
        env[rng.choice(("extra", "source", "values", "lineno"))] = _wrong_type(rng)
    elif r == 4:  # duplicate names
        env["ops"] = [{"op": "read", "name": "dup", "module": "model.layers.0"},
                      {"op": "logits_topk", "name": "dup", "k": 2}]
    elif r == 5:  # too many ops
        env["ops"] = [{"op": "zero", "module": "model.layers.0.mlp", "positions": [0]}
                      for _ in range(rng.choice((256, 257, 1000)))]
    elif r == 6:
        env["ops"] = rng.choice(([], None, {}, "read", [None], [[]], [1], [{}]))
    else:  # a code payload: refused without the operator's opt-in
        env.clear()
        env.update({"v": 1, "kind": "code", "source": "import os\nos.system('true')\n", "filename": "x.py",
                    "lineno": 1, "values": base64.b64encode(b"\x80\x05N.").decode()})


def _mutated_spec(rng: random.Random, hidden: int, layers: int) -> dict:
    env = _valid_spec(rng, hidden, layers)
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.25 or not env.get("ops") or not isinstance(env["ops"], list):
            _mutate_envelope(rng, env, hidden, layers)
        else:
            op = rng.choice(env["ops"])
            if isinstance(op, dict):
                _mutate_op(rng, op, hidden, layers)
    return env


def _cat_mutated(rng: random.Random, hidden: int, layers: int) -> object:
    return {"nnsight": _dump(_mutated_spec(rng, hidden, layers))}


def _int_tensor_op(rng: random.Random, hidden: int, layers: int, edit_only: bool = False) -> dict:
    """An op whose io/index targets an integer tensor (token ids, positions)."""
    layer = rng.randrange(layers)
    module, io, index = rng.choice((
        (f"model.layers.{layer}", "input", None),
        (f"model.layers.{layer}", "input", 0),  # LlamaDecoderLayer.forward(positions, hidden, residual)
        ("model.embed_tokens", "input", None),
        ("model.embed_tokens", "input", 0),
        (f"model.layers.{layer}.self_attn.rotary_emb", "input", None),
        (f"model.layers.{layer}.self_attn.rotary_emb", "input", 0),
        (f"model.layers.{layer}.self_attn", "input", 0),
        (f"model.layers.{layer}.self_attn", "input", None),
        ("model", "input", 0),
        ("model", "input", 1),  # positions
        (f"model.layers.{layer}.self_attn.rotary_emb", "output", None),
        (f"model.layers.{layer}", "input", 2),  # residual: None at layer 0
    ))
    kind = rng.choice(EDIT_OPS if edit_only else ("read",) + EDIT_OPS)
    op: dict = {"op": kind, "module": module, "io": io}
    if index is not None or rng.random() < 0.5:
        op["index"] = index
    if rng.random() < 0.5:
        op["steps"] = rng.choice(("all", "prefill", "generated", [0, 1]))
    if rng.random() < 0.3:
        op["positions"] = rng.choice(([0], [-1], None))
    if kind == "read":
        op["name"] = "ints"
    elif kind in ("add", "set"):
        op["value"] = rng.choice((_vec(rng, hidden), [1.0], [0.5], 1.0, [7.0] * 2, [-1e9], 100000, -5, 5,
                                  [100000.0], 1e6))
    elif kind == "scale":
        op["factor"] = rng.choice((0.5, 2.0, -1.0, 1e9, 0.0, 1e6, -1e6, 1000.0))
    return op


def _cat_int_tensor(rng: random.Random, hidden: int, layers: int) -> object:
    ops = [_int_tensor_op(rng, hidden, layers)]
    if rng.random() < 0.3:
        ops.append({"op": "logits_topk", "name": "top", "k": 3})
    return {"nnsight": _dump({"v": 1, "kind": "spec", "ops": ops})}


def _cat_valid(rng: random.Random, hidden: int, layers: int) -> object:
    return {"nnsight": _dump(_valid_spec(rng, hidden, layers))}


def _big_value(rng: random.Random, hidden: int, layers: int) -> object:
    prefix = _dump({"v": 1, "kind": "spec", "ops": [
        {"op": rng.choice(("add", "set")), "module": f"model.layers.{rng.randrange(layers)}", "index": 0,
         "steps": "all", "value": "@V@"}]})
    return {"nnsight": prefix.replace('"@V@"', big_value_text(rng))}


# ----------------------------------------------------------------- non-finite / huge


def _nonfinite_number(rng: random.Random) -> str:
    return rng.choice(("NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e400", "-1e400", "1e38", "-1e38",
                       "3.5e38", "1e-400", "65504", "1e39", "nan", "inf"))


def _cat_non_finite(rng: random.Random, hidden: int, layers: int) -> object:
    r = rng.randrange(9)
    layer = rng.randrange(layers)
    if r == 0:  # factor literal, every step
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": "scale", "module": f"model.layers.{layer}.mlp", "factor": "@F@", "steps": "all"}]})
        text = text.replace('"@F@"', _nonfinite_number(rng))
    elif r == 1:  # vector of one literal
        lit = _nonfinite_number(rng)
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": rng.choice(("add", "set")), "module": f"model.layers.{layer}", "index": rng.choice((0, 1)),
             "value": "@V@", "steps": rng.choice(("all", "prefill", "generated"))}]})
        text = text.replace('"@V@"', "[" + ",".join([lit] * hidden) + "]")
    elif r == 2:  # one literal inside an otherwise fine vector
        vec = [str(x) for x in _vec(rng, hidden)]
        vec[rng.randrange(hidden)] = _nonfinite_number(rng)
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": "add", "module": f"model.layers.{layer}", "index": 0, "value": "@V@", "steps": "all"}]})
        text = text.replace('"@V@"', "[" + ",".join(vec) + "]")
    elif r == 3:  # $tensor bytes holding NaN / inf (no JSON literal needed)
        dtype, fmt, size = rng.choice((("float32", "f", 4), ("float16", "e", 2), ("float64", "d", 8)))
        bad = rng.choice((math.nan, math.inf, -math.inf, 3e38 if size >= 4 else 65504.0))
        data = struct.pack(f"<{hidden}{fmt}", *([bad] * hidden))
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": rng.choice(("add", "set")), "module": f"model.layers.{layer}", "index": 0, "steps": "all",
             "value": {"$tensor": {"dtype": dtype, "shape": [hidden], "data": base64.b64encode(data).decode()}}}]})
    elif r == 4:  # literals in integer fields
        field = rng.choice(("index", "k", "positions", "steps", "v"))
        spec = {"v": 1, "kind": "spec", "ops": [
            {"op": "read", "name": "h", "module": "model.layers.0", "index": 0, "positions": [-1]},
            {"op": "logits_topk", "name": "t", "k": 3}]}
        lit = _nonfinite_number(rng)
        if field == "v":
            spec["v"] = "@X@"
        elif field == "k":
            spec["ops"][1]["k"] = "@X@"
        elif field in ("positions", "steps"):
            spec["ops"][0][field] = ["@X@"]
        else:
            spec["ops"][0]["index"] = "@X@"
        text = _dump(spec).replace('"@X@"', lit)
    elif r == 5:  # json.dumps writes Python's nan/inf as NaN/Infinity
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": "scale", "module": f"model.layers.{layer}", "index": 0,
             "factor": rng.choice((math.nan, math.inf, -math.inf)), "steps": "all"}]})
    elif r == 6:  # 1e38 factor, every step
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": "scale", "module": f"model.layers.{layer}.mlp", "factor": rng.choice((1e38, -1e38, 3.4e38, 1e308)),
             "steps": "all"}]})
    elif r == 7:  # a huge vector, every step
        text = _dump({"v": 1, "kind": "spec", "ops": [
            {"op": "add", "module": f"model.layers.{layer}", "index": rng.choice((0, 1)),
             "value": [rng.choice((1e38, -1e38, 1e308))] * hidden, "steps": "all"}]})
    else:  # non-finite values of vllm_xargs keys themselves (the HTTP body gets NaN literals)
        return {rng.choice(("nnsight", "nnsight_stream", "nnsight_lower", "nnsight_edits")):
                rng.choice((math.nan, math.inf, -math.inf, 1e308, 10**400))}
    return {"nnsight": text}


# ----------------------------------------------------------------- deep nesting


def _deep_text(rng: random.Random, k: int) -> str:
    return rng.choice((
        "[" * k, "[" * k + "]" * k, '{"a":' * k + "0" + "}" * k, '{"a":' * k, "[" * k + "1" + "]" * k,
        '{"v":1,"kind":"spec","ops":' + "[" * k + "]" * k + "}",
    ))


def _cat_deep(rng: random.Random, hidden: int, layers: int) -> object:
    k = rng.choice(NESTING)
    r = rng.randrange(4)
    if r == 0:  # the whole payload
        text = _deep_text(rng, k)
    else:  # nested inside a field of an otherwise valid spec
        field = ("value", "positions", "steps")[r - 1]
        spec = {"v": 1, "kind": "spec", "ops": [
            {"op": "add", "module": "model.layers.0", "index": 0, "value": "@D@", "steps": "all"}]}
        if field != "value":
            spec["ops"][0]["value"] = _vec(rng, hidden)
            spec["ops"][0][field] = "@D@"
        text = _dump(spec).replace('"@D@"', _deep_text(rng, k))
    return {"nnsight": text}


def _cat_deep_body(rng: random.Random, hidden: int, layers: int) -> object:
    """Deep nesting in the HTTP body itself (vllm_xargs or one of its values): raw text."""
    k = rng.choice(NESTING)
    key = rng.choice(("nnsight", "nnsight_edits", "nnsight_stream", "nnsight_lower"))
    inner = rng.choice(("[" * k + "]" * k, '{"a":' * k + "0" + "}" * k, "[" * k + '"x"' + "]" * k))
    if rng.random() < 0.2:
        return inner.encode()  # vllm_xargs itself
    return ('{"' + key + '":' + inner + "}").encode()


# ----------------------------------------------------------------- vllm_xargs keys


def _cat_xargs(rng: random.Random, hidden: int, layers: int) -> object:
    xargs: dict = {}
    if rng.random() < 0.6:
        xargs["nnsight"] = _dump(_valid_spec(rng, hidden, layers))
    for key in rng.sample(["nnsight_edits", "nnsight_stream", "nnsight_lower"], rng.randint(1, 3)):
        if key == "nnsight_edits":
            xargs[key] = rng.choice((
                "probe", "", "none", ["probe"], [], ["a", "b"], [1, 2], [1.5], 0, 1, -1, 1.5, 10**30, "x" * 10000,
                ["x"] * 1000, "\n", ["", ""],
            ))
        elif key == "nnsight_stream":
            xargs[key] = rng.choice((0, 1, 2, -1, 1.5, "1", "yes", "", [1], [], 10**30, "true", "false"))
        else:
            xargs[key] = rng.choice((0, 1, "false", "False ", "0", "no", "off", "true", "", 0.0, [0], [], 10**30,
                                     "x" * 1000))
    if rng.random() < 0.1:  # vllm_xargs itself of the wrong type
        return rng.choice(("nnsight", 1, 1.5, [xargs], None, True, [], {"": 1}, {"nnsight": None}))
    return xargs


# ----------------------------------------------------------------- the edits route


def _edit_name(rng: random.Random) -> object:
    return rng.choice((None, None, "probe", "steer", "", "a" * 10000, 1, 1.5, True, [], {}, ["probe"], "\n",
                       "x y", "\u00e9"))


def _edit_spec(rng: random.Random, hidden: int, layers: int) -> dict:
    return {"v": 1, "kind": "spec", "ops": [_valid_op(rng, hidden, layers, i) for i in range(rng.randint(1, 2))]}


def _cat_edits_spec(rng: random.Random, hidden: int, layers: int) -> object:
    r = rng.random()
    if r < 0.3:
        payload = _dump(_edit_spec(rng, hidden, layers))
    elif r < 0.7:
        spec = _edit_spec(rng, hidden, layers)
        for _ in range(rng.randint(1, 2)):
            if rng.random() < 0.25:
                _mutate_envelope(rng, spec, hidden, layers)
            elif isinstance(spec.get("ops"), list) and spec["ops"] and isinstance(spec["ops"][0], dict):
                _mutate_op(rng, rng.choice(spec["ops"]), hidden, layers)
        payload = _dump(spec)
    else:
        payload = _cat_non_finite(rng, hidden, layers).get("nnsight")
        if not isinstance(payload, str):
            payload = _dump(_mutated_spec(rng, hidden, layers))
    body = {"payload": payload, "name": _edit_name(rng)}
    if rng.random() < 0.1:
        body[rng.choice(("extra", "id", "names"))] = _wrong_type(rng)
    return body


def _cat_edits_int_tensor(rng: random.Random, hidden: int, layers: int) -> object:
    spec = {"v": 1, "kind": "spec", "ops": [_int_tensor_op(rng, hidden, layers)]}
    return {"payload": _dump(spec), "name": rng.choice((None, "ints"))}


def _cat_edits_body(rng: random.Random, hidden: int, layers: int) -> object:
    spec = _dump(_valid_spec(rng, hidden, layers))
    r = rng.randrange(8)
    if r == 0:  # non-object bodies
        return rng.choice(([], [spec], spec, 1, 1.5, None, True, "", {"": spec}))
    if r == 1:  # payload of the wrong type
        return {"payload": rng.choice((None, 1, 1.5, True, [spec], json.loads(spec), {}, [], 10**400)),
                "name": _edit_name(rng)}
    if r == 2:  # missing payload
        return rng.choice(({}, {"name": "probe"}, {"Payload": spec}))
    if r == 3:  # not JSON
        return rng.choice((b"", b"{", b"{'payload': 1}", b"\xff\xfe", b"null", b'{"payload": "x"', b"NaN",
                           b'{"payload": NaN}', b"[" * 10))
    if r == 4:  # deep nesting: the body, or inside it
        k = rng.choice(NESTING)
        return rng.choice((
            ("[" * k + "]" * k).encode(), ('{"a":' * k + "0" + "}" * k).encode(),
            ('{"payload":' + "[" * k + "]" * k + "}").encode(),
            ('{"payload":"x","name":' + '{"a":' * k + "0" + "}" * k + "}").encode(),
        ))
    if r == 5:  # deep nesting inside the payload string
        return {"payload": _deep_text(rng, rng.choice(NESTING)), "name": None}
    if r == 6:  # random payload strings
        return {"payload": _cat_random_json(rng, hidden, layers)["nnsight"], "name": _edit_name(rng)}
    return {"payload": _dump({"v": 1, "kind": "code", "source": "x = 1\n", "filename": "e.py", "lineno": 1,
                              "values": base64.b64encode(b"\x80\x05}\x94.").decode()}), "name": "code"}


MAKERS = {
    "random-json": _cat_random_json, "non-string": _cat_non_string, "mutated": _cat_mutated,
    "int-tensor": _cat_int_tensor, "valid": _cat_valid, "non-finite": _cat_non_finite, "deep": _cat_deep,
    "deep-body": _cat_deep_body, "xargs-types": _cat_xargs, "edits:spec": _cat_edits_spec,
    "edits:int-tensor": _cat_edits_int_tensor, "edits:body": _cat_edits_body,
}


def payloads(seed: int, n: int, hidden: int, layers: int) -> list[tuple[str, object]]:
    """``n`` fuzz items ``(category, value)``, the same for the same arguments.

    The six groups take turns (equal shares); within a group a category is drawn
    by weight. ``max(1, n // 1000)`` items (none below 50) are 1M-number values
    (about 4 MB each, category ``big-value``). The order is shuffled."""
    rng = random.Random(seed)
    items: list[tuple[str, object]] = []
    for i in range(n):
        _, cats = GROUPS[i % len(GROUPS)]
        cat = rng.choices([c for c, _ in cats], weights=[w for _, w in cats])[0]
        items.append((cat, MAKERS[cat](rng, hidden, layers)))
    big = max(1, n // 1000) if n >= 50 else 0
    mutated = [i for i, (cat, _) in enumerate(items) if cat == "mutated"]
    for i in rng.sample(mutated, min(big, len(mutated))):
        items[i] = ("big-value", _big_value(rng, hidden, layers))
    rng.shuffle(items)
    return items
