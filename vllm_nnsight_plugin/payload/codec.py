"""The wire format of one request's intervention and of its results.

Payload: a JSON string under ``SamplingParams.extra_args["nnsight"]`` (so the
very same string can ride OpenAI's ``vllm_xargs``, which takes only flat
str/int/float values)::

    {"v": 1, "kind": "code", "source": "<block source>", "filename": "...",
     "lineno": 12, "values": "<base64 cloudpickle of the names the block reads>"}

Only the names the block reads travel, never the module tree: envoys, the model
and the tracer are pickled as references (``("envoy", path)``) that the worker
resolves to its own objects, so the size is flat in model depth.

Results: a JSON-safe dict under ``RequestOutput.kv_transfer_params["nnsight"]``::

    {"saves": {name: tagged value}, "error": null | {...}, "warnings": [...],
     "ran_as": "batched" | "code: <file>:<line> (<why>)"}
"""

from __future__ import annotations

import ast
import base64
import collections
import functools
import io
import json
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch

from . import values as tagged
from .errors import PayloadError

# the keys a request carries in SamplingParams.extra_args (vllm_xargs over HTTP)
from .keys import EDITS_KEY, LOWER_KEY, PAYLOAD_KEY, STREAM_KEY, VERSION  # noqa: F401 - re-exported

DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
# JSON values one payload may hold: parsing holds the interpreter for about 0.1 us a value
# (a front end's event loop too); tensor bytes travel as base64 strings, which parse at once
MAX_JSON_ITEMS = 1 << 18


def spec_envelope(ops: list[dict[str, Any]]) -> dict[str, Any]:
    """A spec payload's envelope around ``ops``."""
    return {"v": VERSION, "kind": "spec", "ops": ops}


def max_payload_bytes() -> int:
    return int(os.environ.get("VLLM_NNSIGHT_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES))


@dataclass
class CodePayload:
    """A block of Python to run beside one request's forward."""

    source: str
    filename: str = "<intervention>"
    lineno: int = 1
    values: dict[str, Any] = field(default_factory=dict)


class SharedList(list):
    """A list the trace saved and invokes write into (nnsight's trace-level values): the
    engine treats it as saved by the block, and the client merges what each invoke
    wrote into the caller's list, in invoke order (``client/shared.py``)."""


class SharedDict(dict):
    """A dict the trace saved and invokes write into (as :class:`SharedList`)."""


class _RefPickler(cloudpickle.CloudPickler):
    """Pickles a block's values; the client's model, envoys and tracer go as a call of
    :func:`_ref` with their reference, which the engine's unpickler resolves. Through
    ``reducer_override``, which pickle skips for numbers, strings and plain containers
    (``persistent_id`` would run for each of a sweep's 256 coefficients). A CPU tensor's
    storage goes as its bytes (:class:`_StorageBytes`), once per storage: tensors that
    share one (a view beside its base) share one on the engine, as they did here."""

    def __init__(self, file: io.BytesIO, ref_of: Callable[[Any], tuple | None]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._ref_of = ref_of
        self._storages: dict[int, tuple[torch.UntypedStorage, _StorageBytes]] = {}  # (held: ids stay theirs)

    def reducer_override(self, obj: Any) -> Any:  # noqa: D102
        kind = type(obj)
        if kind is torch.storage.TypedStorage or kind is torch.UntypedStorage:  # (a tensor's values)
            storage = obj._untyped_storage if kind is torch.storage.TypedStorage else obj
            if storage.device.type == "cpu":
                # (torch pickles a uint16/32/64 tensor's UntypedStorage, and its rebuild reads
                # ``storage._untyped_storage``: a uint8 TypedStorage, as torch.load gives it)
                dtype = obj.dtype if kind is torch.storage.TypedStorage else torch.uint8
                held = self._storages.get(storage._cdata)
                if held is None:
                    held = self._storages[storage._cdata] = (storage, _StorageBytes(storage))
                return functools.partial(torch.storage.TypedStorage, wrap_storage=held[1],
                                         dtype=dtype, _internal=True), ()
        ref = self._ref_of(obj)
        if ref is not None:
            return _ref, tuple(ref)
        return super().reducer_override(obj)


class _StorageBytes:
    """A CPU storage's values as a block's payload carries them: its bytes, unpickled by
    torch's own ``UntypedStorage.from_buffer`` into a storage of its own (any engine
    with torch loads it, an older plugin's too). Torch's own pickle of a storage is a
    legacy ``torch.save`` each way (about 50 us a tensor: most of encoding and loading a
    sweep's payload that way), and it does not load its uint16/32/64 storages again."""

    __slots__ = ("data",)

    def __init__(self, storage: torch.UntypedStorage):
        self.data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()

    def __reduce__(self) -> tuple:
        return functools.partial(torch.UntypedStorage.from_buffer, self.data, dtype=torch.uint8), ()


def _ref(*ref: Any) -> Any:
    """A reference to the client's model, an envoy or the tracer: only the engine's
    unpickler (:class:`_RefUnpickler`) resolves it."""
    raise PayloadError(f"{ref!r} refers to the client's model: it is resolved only in the engine")


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, resolve: Callable[[tuple], Any]):
        super().__init__(file)
        self._resolve = resolve

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102
        if module == __name__ and name == "_ref":
            return self._resolved
        return super().find_class(module, name)

    def _resolved(self, *ref: Any) -> Any:
        return self._resolve(ref)

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - references sent as persistent ids (older clients)
        return self._resolve(tuple(pid))


def _nnsight_ref(obj: Any) -> tuple | None:
    ref = getattr(type(obj), "__nnsight_ref__", None)
    return ref(obj) if ref is not None else None


# recent payloads, oldest first: key -> (text, the values it holds). A trace's invokes
# with a value each (a sweep) have one each: up to 512 payloads and 16 MB of text
_ENCODED: dict[tuple, tuple[str, list[Any]]] = {}
_MEMO_SIZE, _MEMO_BYTES = 512, 16 << 20
_memo_bytes = 0
_MEMO_LOCK = threading.Lock()
_CONTENT_KEYED = 64 * 1024  # a tensor of up to this many bytes is keyed by its bytes too


_SCALARS = (type(None), bool, int, float, str, bytes)


def _value_key(value: Any, held: list[Any]) -> Any:
    """What a value encodes to, as a hashable key; None when unknown (no memo). A
    tensor counts by identity and in-place version: ``held`` keeps it alive so its id
    cannot be reused while a payload made from it is remembered. Floats count by their
    bits (``-0.0`` is not ``0.0``); a list of plain scalars (a sweep's coefficients) by
    its pickle, one pass in C instead of a key per element. A list also counts by
    identity (held too): one list under two names and two equal lists pickle apart."""
    kind = type(value)
    if kind in _SCALARS:
        return (kind.__name__, value.hex() if kind is float else value)
    if isinstance(value, torch.Tensor):
        held.append(value)
        key = ("t", id(value), value._version, value.data_ptr(), tuple(value.shape), value.dtype, value.device)
        if value.numel() * value.element_size() <= _CONTENT_KEYED:
            # (its bytes too: a change through ``.data`` or a numpy view keeps the version;
            # a device tensor's cross to the host, as encoding it would on a miss)
            key += (value.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes(),)
        return key
    ref = _nnsight_ref(value)
    if ref is not None:
        return ("r", ref)
    if kind in (list, tuple, SharedList):
        # (a tuple cannot be changed through an alias; the client copies a trace-level list
        # for each invoke, so only its contents tell two apart)
        which = None if kind is not list else id(value)
        if which is not None:
            held.append(value)
        if all(type(v) in _SCALARS for v in value):
            return (kind.__name__, which, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        keys = tuple(_value_key(v, held) for v in value)
        return None if any(k is None for k in keys) else (kind.__name__, which, keys)
    return None


def encode_code(payload: CodePayload) -> str:
    """Serialize a block and the values it reads into the JSON payload string. A trace's
    invokes of one body and the same values (nnsight's loop of ``tracer.invoke``s)
    encode once."""
    held: list[Any] = []
    try:
        keys: tuple | None = tuple((name, _value_key(v, held)) for name, v in payload.values.items())
    except Exception:  # noqa: BLE001 - (a list that holds itself, a tensor without a data pointer): not remembered
        keys = None
    key = None if keys is None or any(k is None for _, k in keys) \
        else (payload.source, payload.filename, payload.lineno, keys)
    if key is not None:
        found = _ENCODED.get(key)
        if found is not None:
            return found[0]
    text = _encode_code(payload)
    if key is not None and len(text) <= _MEMO_BYTES:
        _remember(key, text, held)
    return text


def _remember(key: tuple, text: str, held: list[Any]) -> None:
    global _memo_bytes
    with _MEMO_LOCK:  # (traces with blocking=False encode on threads of their own)
        while _ENCODED and (len(_ENCODED) >= _MEMO_SIZE or _memo_bytes + len(text) > _MEMO_BYTES):
            _memo_bytes -= len(_ENCODED.pop(next(iter(_ENCODED)))[0])
        if key not in _ENCODED:
            _ENCODED[key] = (text, held)
            _memo_bytes += len(text)


def _encode_code(payload: CodePayload) -> str:
    buf = io.BytesIO()
    try:
        _RefPickler(buf, _nnsight_ref).dump(payload.values)
    except Exception as exc:  # noqa: BLE001 - name the variable that failed
        for name, value in payload.values.items():
            try:
                _RefPickler(io.BytesIO(), _nnsight_ref).dump(value)
            except Exception as inner:  # noqa: BLE001
                raise PayloadError(
                    f"variable {name!r} (type {type(value).__name__}) used in the block "
                    f"cannot be sent to the engine: {inner}"
                ) from None
        raise PayloadError(f"cannot serialize the block's values: {exc}") from None
    # json.dumps of the envelope, written out: the base64 text needs no escaping, and the
    # encoder would scan every character of it (a 2048-wide vector's 11 KB: about 25 us)
    text = (f'{{"v":{json.dumps(VERSION)},"kind":"code","source":{json.dumps(payload.source)},'
            f'"filename":{json.dumps(payload.filename)},"lineno":{json.dumps(payload.lineno)},'
            f'"values":"{base64.b64encode(buf.getvalue()).decode()}"}}')
    limit = max_payload_bytes()
    if len(text) > limit:
        raise PayloadError(f"payload is {len(text)} bytes, over the limit of {limit}")
    return text


def parse_envelope(raw: Any, max_width: int | None = None) -> dict[str, Any]:
    """Check a payload's structure without executing anything (front end and worker).

    Checked envelopes are cached by their text (the same block or spec sent for
    many requests is parsed and checked once per process); callers must not mutate
    them. ``max_width``: the served model's widest tensor, when known (a spec's
    longer value is refused before its numbers are looked at).
    """
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        raise PayloadError(f"the payload extra_args[{PAYLOAD_KEY!r}] must be a JSON string, got {type(raw).__name__}")
    limit = max_payload_bytes()
    if len(raw) > limit:
        raise PayloadError(f"payload is {len(raw)} bytes, over the limit of {limit}")
    if len(raw) <= LARGE_PAYLOAD:
        return _parse_cached(raw, max_width)
    items = raw.count(",")  # about one per JSON value: bounds what parsing costs, before it starts
    if items > MAX_JSON_ITEMS:
        raise PayloadError(f"payload has about {items} JSON values, over the limit of {MAX_JSON_ITEMS}: send "
                           'large tensors as {"$tensor": {"dtype", "shape", "data"}} (base64 bytes)')
    # A large payload is not kept by text (megabytes per entry); the same string object
    # reaching a second check in this process (the HTTP handler, then vLLM's input
    # processing) is recognised by identity and not parsed again.
    for held, width, env in _recent_large:
        if held is raw and width == max_width:
            return env
    env = _parse(raw, max_width)
    _recent_large.append((raw, max_width, env))
    return env


# a payload over this is large: not kept by text, checked off a server's event loop
LARGE_PAYLOAD = 64 * 1024
_recent_large: collections.deque = collections.deque(maxlen=4)


@functools.lru_cache(maxsize=512)
def _parse_cached(raw: str, max_width: int | None) -> dict[str, Any]:
    return _parse(raw, max_width)


def _refuse_constant(name: str) -> None:
    raise PayloadError(f"payload is not valid JSON: {name} is not a JSON number")


def _parse(raw: str, max_width: int | None) -> dict[str, Any]:
    try:
        env = json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise PayloadError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise PayloadError("payload is nested too deeply") from None
    if not isinstance(env, dict):
        raise PayloadError("payload must be a JSON object")
    version = env.get("v")
    if not (type(version) in (int, float) and version == VERSION):
        raise PayloadError(f"payload field 'v' must be {VERSION}, got {version!r:.40}")
    kind = env.get("kind")
    if kind == "spec":
        from . import spec

        return spec.validate(env, max_width)
    if kind != "code":
        raise PayloadError(f"payload field 'kind' must be 'code' or 'spec', got {kind!r:.40}")
    for key, typ in (("source", str), ("filename", str), ("lineno", int), ("values", str)):
        if type(env.get(key)) is not typ:
            raise PayloadError(f"payload field {key!r} must be a {typ.__name__}")
    try:
        base64.b64decode(env["values"], validate=True)
    except ValueError:
        raise PayloadError("payload field 'values' is not valid base64") from None
    # (kept by text where the payload is kept: a sweep's invokes send one source many times)
    check = _kept_source_problem if len(raw) <= LARGE_PAYLOAD else _source_problem
    try:
        problem = check(env["source"], env["filename"])
    except (RecursionError, MemoryError) as exc:  # (not kept: this process's state, not the text's)
        problem = f"payload source does not compile: {type(exc).__name__}: {exc}"
    if problem is not None:
        raise PayloadError(problem)
    return env


def _source_problem(source: str, filename: str) -> str | None:
    """Why a block's source does not parse, or None."""
    try:
        ast.parse(source, filename)
    except (SyntaxError, ValueError) as exc:
        return f"payload source does not compile: {type(exc).__name__}: {exc}"
    return None


_kept_source_problem = functools.lru_cache(maxsize=256)(_source_problem)


def load_code(env: dict[str, Any], resolve: Callable[[tuple], Any]) -> CodePayload:
    """Unpickle a checked envelope (worker side: this executes pickled code)."""
    data = base64.b64decode(env["values"])
    try:
        values = _RefUnpickler(io.BytesIO(data), resolve).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is the payload's
        raise PayloadError(f"cannot load the block's values: {type(exc).__name__}: {exc}") from None
    if not isinstance(values, dict):
        raise PayloadError("payload values must be a dict")
    return CodePayload(env["source"], env["filename"], env["lineno"], values)


# ----------------------------------------------------------------- results


def encode_saves(saves: dict[str, Any], binary: bool = False) -> dict[str, Any]:
    """Saved values in their result form (JSON-safe unless ``binary``: then tensor data
    is raw bytes, see :func:`.values.to_json`). Raises TypeError for a value the
    format cannot carry."""
    return {name: tagged.encode(v, binary) for name, v in saves.items()}


def encode_results(
    saves: dict[str, Any], error: dict[str, Any] | None, warnings: list[str], binary: bool = False
) -> dict[str, Any]:
    """The result dict stamped on the request's output."""
    return results_of(encode_saves(saves, binary), error, warnings)


def results_of(encoded_saves: dict[str, Any], error: dict[str, Any] | None, warnings: list[str],
               ran_as: str | None = None) -> dict[str, Any]:
    """The result dict from saves already encoded (by the worker, :func:`encode_saves`);
    ``ran_as``: how the request's blocks ran ("batched", or "code: <file>:<line> (<why>)")."""
    out = {"saves": encoded_saves, "error": error, "warnings": list(warnings)}
    if ran_as is not None:
        out["ran_as"] = ran_as
    return out


SEQUENCES = "sequences"  # n > 1: the results of each sequence (one block each), in sequence order


@dataclass
class Results:
    """Decoded results of one request."""

    saves: dict[str, Any]
    error: dict[str, Any] | None
    warnings: list[str]
    ran_as: str | None = None


def _results_dict(raw: Any) -> Any:
    """``kv_transfer_params["nnsight"]`` as a dict (the HTTP path may carry it as JSON text)."""
    return json.loads(raw) if isinstance(raw, str) else raw


def sequences_of(raw: Any) -> list[Any] | None:
    """A request with ``n > 1``: each sequence's raw results in sequence order (None for
    a sequence that carried none); None for a request of one sequence."""
    raw = _results_dict(raw)
    return raw.get(SEQUENCES) if isinstance(raw, dict) else None


def ran_as_of(raw: Any) -> str | None:
    """How the request ran, from ``kv_transfer_params["nnsight"]``, its saves left as they are."""
    each = sequences_of(raw)
    if each is not None:
        return "; ".join(dict.fromkeys(r for r in map(ran_as_of, each) if r)) or None
    raw = _results_dict(raw)
    return raw.get("ran_as") if isinstance(raw, dict) else None


def decode_results(raw: Any, resolve_result: Callable | None = None) -> Results | None:
    """Decode ``kv_transfer_params["nnsight"]`` (None when the request had none)."""
    if raw is None:
        return None
    each = sequences_of(raw)
    if each is not None:
        return merge_sequences([decode_results(r, resolve_result) for r in each])
    raw = _results_dict(raw)
    saves = {k: tagged.decode(v, resolve_result) for k, v in (raw.get("saves") or {}).items()}
    return Results(saves, raw.get("error"), list(raw.get("warnings") or []), raw.get("ran_as"))


def merge_sequences(each: list[Results | None]) -> Results:
    """The results of a request with ``n > 1`` (one block per sequence, ``each`` in
    sequence order, None for a sequence without results): every saved name is a list
    of ``n`` values in sequence order (None where that sequence saved nothing, e.g. it
    failed first); the first sequence's error; every warning."""
    names = dict.fromkeys(name for res in each if res is not None for name in res.saves)
    saves = {name: [res.saves.get(name) if res is not None else None for res in each] for name in names}
    done = [r for r in each if r is not None]
    return Results(saves, next((r.error for r in done if r.error), None), [w for r in done for w in r.warnings],
                   "; ".join(dict.fromkeys(r.ran_as for r in done if r.ran_as)) or None)
