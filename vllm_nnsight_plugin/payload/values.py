"""Tagged JSON for values that cross processes and HTTP.

Saved values travel from the worker to the caller through vLLM's own output path
(msgpack inside vLLM, JSON in the OpenAI server). Pickle would make every client
execute whatever the server sends, so results use this small, closed format
instead:

- ``None``, ``bool``, ``int``, ``str`` and finite ``float`` are themselves;
  lists are lists.
- Every other value is a one-key object whose key starts with ``$``:
  ``{"$tensor": {"dtype", "shape", "data"}}`` (``data``: base64 of the raw
  little-endian bytes, C order), ``{"$tuple": [...]}``, ``{"$dict": [[k, v], ...]}``,
  ``{"$float": "nan" | "inf" | "-inf"}``, ``{"$size": [...]}``,
  ``{"$dtype": "float32"}``, ``{"$result": [[op, arg], ...]}`` (a path into the
  finished request's ``RequestOutput``, resolved by the client), ``{"$cache": ...}``
  (``tracer.cache()``'s modules, see :mod:`.cache`).
- A list of two or more tensors of one dtype (a value per step) is
  ``{"$tensors": {"dtype", "shapes", "data"}}``: one base64 of the tensors' bytes
  one after another, split by ``shapes``; it decodes to the list of tensors.

numpy decode of a tensor, for clients without torch::

    np.frombuffer(base64.b64decode(t["data"]), dtype=t["dtype"]).reshape(t["shape"])

Inside vLLM ``data`` is raw bytes (``encode(..., binary=True)``, done in the
worker): vLLM's pickle (worker -> engine core) and msgpack (engine core -> front
end) carry them as they are, so no hot loop base64-encodes. The OpenAI server
turns them into base64 (:func:`to_json`) in its own process; Python callers
decode the bytes directly.
"""

from __future__ import annotations

import base64
import math
import sys
from typing import Any

import numpy as np
import torch

from . import warm_buffers

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
        "int8", "uint8", "bool", "complex64",
    )
}


class UnsupportedValue(TypeError):
    """A saved value has a type the result format cannot carry."""


def dtype_name(dtype: torch.dtype) -> str:
    """The result format's name of ``dtype`` (UnsupportedValue for one it cannot carry)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedValue(f"tensors of dtype {dtype} cannot be returned")
    return name


def _text(raw: bytes | memoryview) -> str:
    """Tensor data as JSON carries it: base64 text."""
    return base64.b64encode(raw).decode()


def _bytes(t: torch.Tensor) -> bytes | memoryview:
    """A tensor's little-endian bytes in C order: a view of its memory where possible."""
    t = t.detach().to("cpu").contiguous()
    if not t.numel():
        return b""
    if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover
        return t.numpy().byteswap().tobytes()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _raw(t: torch.Tensor) -> np.ndarray | bytes:
    """Binary data: the tensor's bytes as a flat uint8 numpy array (a view where the
    tensor is contiguous). vLLM's msgpack sends an array as a frame of its own, without
    copying it into the message (bytes would be copied in, and again out in the front
    end), and the front end hands the frame back (:func:`resolve_frames`); pickled (a
    tensor-parallel worker's output to the engine core) it is one copy of its bytes."""
    t = t.detach().to("cpu").contiguous()
    if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover
        return t.numpy().byteswap().tobytes()
    return t.reshape(-1).view(torch.uint8).numpy()


def encode_tensor(t: torch.Tensor, binary: bool = False) -> dict[str, Any]:
    """A tensor as ``{"dtype", "shape", "data"}`` (little-endian bytes: base64 text, or
    with ``binary`` a uint8 array of them)."""
    data = _raw(t) if binary else _text(_bytes(t))
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": data}


def _owned(data: Any) -> torch.Tensor:
    """Tensor data as a flat, owned, writable uint8 tensor (one copy: the frame or text
    it came in is not kept). Large data is copied into a pooled buffer (:func:`buffer`):
    an every-token batch brings 256 frames of half a megabyte, and fresh memory for each
    costs more than the copy."""
    if isinstance(data, torch.Tensor):
        return data.detach().reshape(-1).view(torch.uint8).clone()
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    if isinstance(data, np.ndarray):
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        if isinstance(data, memoryview) and not data.c_contiguous:
            data = data.tobytes()
        src = np.frombuffer(data, dtype=np.uint8)
    else:
        raise TypeError(f"tensor data is a {type(data).__name__}")
    if not src.size:
        return torch.empty(0, dtype=torch.uint8)
    out = buffer(src.size)
    np.copyto(out, src)
    return torch.from_numpy(out)


def decode_tensor(obj: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor` (data as base64, raw bytes or a uint8 array);
    validates dtype, shape and byte count."""
    try:
        dtype = _DTYPES[obj["dtype"]]
        shape = [int(s) for s in obj["shape"]]
        data = _owned(obj["data"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed tensor: {exc}") from None
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if data.numel() != numel * itemsize:
        raise ValueError(f"tensor data has {data.numel()} bytes, shape {shape} needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return data.view(dtype).reshape(shape)


def resolve_frames(obj: Any, frames: Any) -> None:
    """Front end, right after vLLM's msgpack decoded a message: tensor data sent as a
    frame of its own arrives as vLLM's ``[dtype, shape, frame index]`` (the inline
    form: ``[dtype, shape, bytes]``); put the frame's bytes there."""
    if isinstance(obj, dict):
        data = obj.get("data")
        if isinstance(data, list) and len(data) == 3 and isinstance(data[0], str):
            ref = data[2]
            obj["data"] = memoryview(frames[ref]) if isinstance(ref, int) else ref
            return
        for v in obj.values():
            if isinstance(v, (dict, list)):
                resolve_frames(v, frames)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, (dict, list)):
                resolve_frames(v, frames)


def buffer(size: int) -> np.ndarray:
    """Binary data of ``size`` bytes, contents undefined, for a caller that overwrites
    every byte through ``torch.from_numpy`` (result buffers of every-token reads: 134 MB
    per batch of 256, in the worker that encodes them and in the client that decodes
    them); large ones reuse memory already faulted in (:mod:`.warm_buffers`)."""
    return warm_buffers.take(size)


def tensors_tag(dtype: torch.dtype, shapes: list[list[int]], data: Any) -> dict[str, Any]:
    """The ``{"$tensors"}`` value of same-dtype tensors given as one buffer of bytes."""
    return {"$tensors": {"dtype": dtype_name(dtype), "shapes": shapes, "data": data}}


def encode_tensors(ts: list[torch.Tensor], binary: bool = False) -> dict[str, Any]:
    """Same-dtype tensors as one buffer: per-step rows cost one encode, not one each.
    Binary host tensors are concatenated straight into the returned data (one copy of
    the bytes, not a concatenation and then a copy)."""
    name = dtype_name(ts[0].dtype)
    shapes = [list(t.shape) for t in ts]
    parts = [t.detach().reshape(-1) for t in ts]
    total = sum(p.numel() for p in parts)
    if binary and total and sys.byteorder == "little" and all(p.device.type == "cpu" for p in parts):
        data = buffer(total * ts[0].element_size())  # (every byte written by the cat)
        torch.cat(parts, out=torch.from_numpy(data).view(ts[0].dtype))
        return {"dtype": name, "shapes": shapes, "data": data}
    whole = torch.cat(parts)
    return {"dtype": name, "shapes": shapes, "data": _raw(whole) if binary else _text(_bytes(whole))}


def decode_tensors(obj: dict[str, Any]) -> list[torch.Tensor]:
    """Inverse of :func:`encode_tensors`. A run of same-shape tensors (the rows of an
    every-token read: 128 per request) becomes views in one ``unbind``, not one slice
    each (a third of the time for a batch of 256 such requests), and its shape is
    converted once, not once per tensor."""
    try:
        runs: list[list[Any]] = []  # [shape, how many in a row]
        last = None
        for raw in obj["shapes"]:
            if raw != last:
                last = raw
                runs.append([tuple(map(int, raw)), 0])
            runs[-1][1] += 1
        whole = decode_tensor({"dtype": obj["dtype"], "shape": [sum(math.prod(s) * k for s, k in runs)],
                               "data": obj["data"]})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed tensor list: {exc}") from None
    out: list[torch.Tensor] = []
    offset = 0
    for shape, k in runs:
        n = math.prod(shape)
        part = whole[offset : offset + n * k]
        if k == 1:
            out.append(part.reshape(shape))
        else:
            out.extend(part.view(k, *shape).unbind(0))
        offset += n * k
    return out


def encode(value: Any, binary: bool = False) -> Any:
    """A JSON-safe form of ``value`` (see module docstring); ``binary``: tensor data as
    raw bytes (for msgpack inside vLLM; :func:`to_json` makes it JSON-safe)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.Tensor):
        return {"$tensor": encode_tensor(value, binary)}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, list):
        if len(value) > 1 and all(isinstance(v, torch.Tensor) for v in value) \
                and len({v.dtype for v in value}) == 1:
            return {"$tensors": encode_tensors(value, binary)}
        return [encode(v, binary) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, binary) for v in value]}
    if isinstance(value, dict):
        return {"$dict": [[encode(k, binary), encode(v, binary)] for k, v in value.items()]}
    own = getattr(value, "__nnsight_encode__", None)  # a worker-side value that encodes itself
    if own is not None:
        return own(binary)
    ref = getattr(value, "__nnsight_result_path__", None)
    if ref is not None:
        return {"$result": [list(step) for step in ref]}
    raise UnsupportedValue(
        f"a saved value of type {type(value).__name__} cannot leave the engine; "
        "save tensors, numbers, strings, or lists/tuples/dicts of them"
    )


def to_json(obj: Any) -> Any:
    """A binary-encoded value (raw bytes in tensor data) in its JSON-safe form (base64)."""
    if isinstance(obj, (bytes, bytearray, memoryview, np.ndarray)):
        return base64.b64encode(obj).decode()
    if isinstance(obj, torch.Tensor):
        return base64.b64encode(memoryview(obj.reshape(-1).view(torch.uint8).numpy())).decode()
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    return obj


def decode(obj: Any, resolve_result: Any = None) -> Any:
    """Inverse of :func:`encode`. ``resolve_result(path)`` handles ``$result`` refs."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode(v, resolve_result) for v in obj]
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError(f"malformed result value: {str(obj)[:80]}")
    (tag, body), = obj.items()
    if tag == "$tensor":
        return decode_tensor(body)
    if tag == "$tensors":
        return decode_tensors(body)
    if tag == "$tuple":
        return tuple(decode(v, resolve_result) for v in body)
    if tag == "$dict":
        return {decode(k, resolve_result): decode(v, resolve_result) for k, v in body}
    if tag == "$float":
        return float(body)
    if tag == "$size":
        return torch.Size(body)
    if tag == "$dtype":
        return _DTYPES[body]
    if tag == "$result":
        return resolve_result(body) if resolve_result else {"$result": body}
    if tag == "$cache":
        from .cache import decode as decode_cache

        return decode_cache(body, lambda v: decode(v, resolve_result), _DTYPES)
    raise ValueError(f"unknown result tag {tag!r}")
