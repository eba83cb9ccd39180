"""Front-end checks (the process that accepts requests: ``LLM`` or the API server).

Every payload is validated here, before it reaches the engine: structure, size,
the operator's policy (code payloads over HTTP need an opt-in), and ``n > 1`` only
where the output comes whole; so
are the request's other keys (payload.request_args: a flag that is not true or false).
A traced request also gets a prefix-cache salt, so it neither reads KV computed
without its intervention nor leaves edited KV for anyone else: its own, or, for an
edit-only batched spec, one shared by every request with that same spec.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ..engine import edits, guards
from ..engine.block_source import step_value_spelled_as_module
from ..payload import codec, request_args, spec
from . import configuration, entrypoints, parallel, patching
from .whole_prompts import SALT_PREFIX, SHARED_SPEC_SALT

logger = logging.getLogger("vllm.nnsight_plugin")

MODULE_ATTRS = ("output", "input", "inputs")


def touches_modules(env: dict[str, Any]) -> bool:
    """Whether a payload reads or edits module values (needs an eager engine)."""
    if env["kind"] == "spec":
        return any("module" in op or op["op"] == "cache" for op in env["ops"])
    tree = ast.parse(env["source"])
    return any(isinstance(n, ast.Attribute) and n.attr in MODULE_ATTRS and not step_value_spelled_as_module(n)
               for n in ast.walk(tree))  # (model.logits.output is model.logits: served in every mode)


class ModuleTable(NamedTuple):
    """What the front end knows of a served model's modules (from the workers'
    ``guards.table``; the last pipeline stage's, the one traces run in)."""

    integer_inputs: frozenset[str]  # modules whose input is an index tensor (never written)
    absent: frozenset[str]  # modules only earlier pipeline stages hold
    edits_refused: str | None = None  # why edits are refused (KV blocks not zeroed: kv_zeroing.refusal)


# Per engine (its VllmConfig, the one object its front end, its client and the server
# share), known once a server or VLLM client asked the engine (learn_module_table); until
# then the worker refuses such edits at admission. Two engines of one model differ where
# their stages or KV layouts do: keyed by the config object, which the entry refers to
# weakly (the config reaches the engine's layers: a shut-down engine's entry goes with it).
MODULE_TABLES: dict[int, tuple[weakref.ref, ModuleTable]] = {}


def learn_module_table(vllm_config: Any, tables: list[dict[str, Any]]) -> None:
    """From every worker's table (``collective_rpc``): the last one's is the last
    pipeline stage's, the one traces run in."""
    last = tables[-1]
    refused = next((t["edits_refused"] for t in tables if t.get("edits_refused")), None)  # (any worker's)
    key = id(vllm_config)
    MODULE_TABLES[key] = (weakref.ref(vllm_config, lambda _: MODULE_TABLES.pop(key, None)), ModuleTable(
        frozenset(last["integer_inputs"]), frozenset(last.get("absent", ())), refused))


def module_table(vllm_config: Any) -> ModuleTable | None:
    """The table learned for this engine (None: not asked yet, or no config)."""
    held = MODULE_TABLES.get(id(vllm_config)) if vllm_config is not None else None
    return held[1] if held is not None and held[0]() is vllm_config else None


async def ensure_module_table(engine_client: Any) -> None:
    """Ask the engine for its module table once (an API server's first traced request)."""
    config = getattr(engine_client, "vllm_config", None)
    if config is not None and module_table(config) is None:
        learn_module_table(config, await engine_client.collective_rpc("nnsight_module_table"))


def check_payload(raw: Any, params: Any, vllm_config: Any = None) -> dict[str, Any]:
    """Validate one payload; raise :class:`codec.PayloadError` with the reason (and log
    the refusal, never the payload)."""
    origin = "http" if entrypoints.serving_http() else "python"
    try:
        return _check_payload(raw, params, vllm_config, origin)
    except codec.PayloadError as exc:
        logger.warning("refused a payload from %s: %s", origin, str(exc)[:500])
        raise


def _check_payload(raw: Any, params: Any, vllm_config: Any, origin: str) -> dict[str, Any]:
    from ..hooks import refusal

    env = codec.parse_envelope(raw, configuration.model_width(vllm_config) if vllm_config is not None else None)
    refuse_untraceable(vllm_config)
    reason = refusal(env["kind"], origin, configuration.additional_config(vllm_config))
    if reason:
        raise codec.PayloadError(reason)
    check_sequences(params)
    table = module_table(vllm_config)
    if table is not None:
        guards.refuse_integer_writes(env, table.integer_inputs)
        guards.refuse_absent(env, table.absent, carried=parallel.stages_carry(vllm_config))
        if table.edits_refused and env["kind"] == "spec" and spec.edits(env):  # (code: the worker decides)
            raise codec.PayloadError(table.edits_refused)
    if vllm_config is None or configuration.runs_eager(vllm_config):
        return env
    tapped = configuration.settings(vllm_config).taps
    if tapped and env["kind"] == "spec":
        for op in env["ops"]:
            io = op.get("io", "output")
            if "module" in op and not tapped.matches(op["module"], io):
                raise codec.PayloadError(
                    f"{op['module']}.{io} is not tapped: this engine runs compiled with CUDA graphs "
                    f"and serves module values only at its taps ({tapped.describe()})"
                )
    elif not tapped and touches_modules(env):
        raise codec.PayloadError(
            "this engine runs compiled code / CUDA graphs, which skip Python hooks, so module "
            "reads and edits cannot apply: start it with enforce_eager=True (--enforce-eager) or "
            "declare taps. model.logits and model.samples work in every mode."
        )
    return env


def refuse_installing(env: dict[str, Any], vllm_config: Any) -> None:
    """An engine-wide edit is installed through one front end, which keeps it apart in
    the prefix cache (every request is salted while edits are installed): refused where
    other API server processes front the engine, and where the workers cannot zero the
    KV blocks edited requests free (code is refused there too: it may change anything)."""
    servers = configuration.api_servers(vllm_config)
    if servers > 1:
        raise codec.PayloadError(
            f"engine-wide edits need one API server process, and this engine has {servers} (vllm serve "
            "--data-parallel-size N starts N by default): each would keep its own list of edits, and requests "
            "through the others would share prefix-cache blocks with edited ones. Start the server with "
            "--api-server-count 1 to install edits; traced requests work either way")
    table = module_table(vllm_config)
    if table is not None and table.edits_refused and spec.may_edit(env):
        raise codec.PayloadError(table.edits_refused)


def refuse_untraceable(vllm_config: Any) -> None:
    """Refuse every payload and edit on an engine the plugin cannot trace
    (:func:`.configuration.untraceable`: speculative decoding)."""
    reason = configuration.untraceable(vllm_config) if vllm_config is not None else None
    if reason is not None:
        raise codec.PayloadError(reason)


def check_sequences(params: Any) -> None:
    """``n > 1`` runs one block per sequence (``sequences``), and the sequences' results
    come back together on the request's whole output: refused where outputs stream
    (``stream=true``, an async engine's per-token outputs, saves streamed per step).
    ``params``: ``SamplingParams``, or an OpenAI request (``stream``, ``vllm_xargs``)."""
    if (getattr(params, "n", 1) or 1) == 1:
        return
    kind = getattr(params, "output_kind", None)
    extra = getattr(params, "extra_args", None) or getattr(params, "vllm_xargs", None)
    if getattr(params, "stream", False) or (kind is not None and kind.name != "FINAL_ONLY") \
            or request_args.parse(extra).stream:
        raise codec.PayloadError(
            "a traced request with n>1 returns its sequences' saves on its whole output, which a stream does "
            "not give: ask without streaming (LLM.generate, or stream=false), or run one invoke per sample")


def cache_salt(raw: Any, env: dict[str, Any] | None) -> str:
    """The prefix-cache salt of a traced request. Requests whose only intervention is
    one batched edit spec (steering, ablation: no reads, every step, whole rows) share
    prompt KV among themselves, keyed by the spec's text: that KV was computed under
    the very same edit, as it would be again (stock prefix caching's own assumption).
    Anything else gets a salt of its own: a read must see its prompt computed, and a
    block's edits depend on more than its text. (A spec that fails deterministically,
    e.g. a value of the wrong width, fails again for the next request with its text.)"""
    if env is not None and not edits.INSTALLED and env["kind"] == "spec" and spec.replayable(env):
        return _spec_salt(raw)
    return f"{SALT_PREFIX}{uuid.uuid4().hex}"


@functools.lru_cache(maxsize=64)  # one steering spec for a whole batch: hashed once
def _spec_salt(raw: str | bytes) -> str:
    text = raw.encode() if isinstance(raw, str) else bytes(raw)
    return f"{SHARED_SPEC_SALT}{hashlib.sha256(text).hexdigest()}"


CALLER_SALT = "caller:"  # before a caller's own salt that starts like the plugin's (or like this)


def _process_inputs(original: Callable) -> Callable:
    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        asked = request_args.parse(entrypoints.sampling_extra_args(params))  # (a bad value: refused here)
        raw = asked.payload
        env = check_payload(raw, params, getattr(self, "vllm_config", None)) if raw is not None else None
        if edits.INSTALLED:
            edits.check_selection(asked.edits)
            if raw is None:  # (installed edits trace every request; check_payload checked the others)
                check_sequences(params)
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if raw is not None or edits.INSTALLED:
            entrypoints.salt_request(request, cache_salt(raw, env))
        elif (getattr(request, "cache_salt", None) or "").startswith((SALT_PREFIX, CALLER_SALT)):  # (the engine
            request.cache_salt = f"{CALLER_SALT}{request.cache_salt}"  # core tells traced requests by the prefix)
        return request

    return process_inputs


def install(input_processor_cls: type) -> None:
    patching.patch_method(input_processor_cls, "process_inputs", _process_inputs)
