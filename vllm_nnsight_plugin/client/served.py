"""``trace(..., serve=URL)``: run invokes on a stock ``vllm serve`` over HTTP.

Each invoke is one ``POST /v1/completions`` carrying the payload in
``vllm_xargs``; the results come back in the response's ``kv_transfer_params``.
No GPU, weights or vLLM are needed here: module paths are checked against the
tree the server loaded (``GET /v1/nnsight/tree``) before anything is sent.
Standard library HTTP only.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..payload import codec

# SamplingParams fields a completion request accepts (unknown keywords are an error
# here: vLLM's HTTP layer would silently ignore a typo).
SAMPLING_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens",
})


class ServeError(RuntimeError):
    """The server refused or failed a request (its message is included)."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        super().__init__(f"HTTP {status}: {message}")


def noted(exc: ServeError, note: str | None) -> ServeError:
    """A refusal (HTTP 400) with ``note`` added to the server's message; others as they are."""
    if note is None or exc.status != 400:
        return exc
    return ServeError(exc.status, f"{exc.message} ({note})")


class ServerUnreachable(ConnectionError):
    """No answer from the server (refused, unresolvable, timed out): a
    ``ConnectionError``, as callers catch it."""


@dataclass
class ServedCompletion:
    """The parts of vLLM's ``CompletionOutput`` an HTTP response carries."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: Any
    saves: dict[str, Any] = field(default_factory=dict)  # (n > 1: this sequence's)
    nnsight_error: dict[str, Any] | None = None


@dataclass
class ServedOutput:
    """A served request's result, shaped like vLLM's ``RequestOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[ServedCompletion]
    kv_transfer_params: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    finished: bool = True
    saves: dict[str, Any] = field(default_factory=dict)
    nnsight_error: dict[str, Any] | None = None
    nnsight_warnings: list[str] = field(default_factory=list)

    @property
    def ran_as(self) -> str | None:
        """How the request's blocks ran, as ``RequestOutput.ran_as`` (``"batched"``, or
        ``"code: <file>:<line> (<why>)"``; ``;``-joined), from the server's results."""
        return codec.ran_as_of((self.kv_transfer_params or {}).get(codec.PAYLOAD_KEY))


class Connection:
    """A server URL and API key."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 - user's URL
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                text = json.loads(text).get("error", {}).get("message", text)
            except (ValueError, AttributeError):
                pass
            raise ServeError(exc.code, text) from None
        except (urllib.error.URLError, OSError) as exc:  # (HTTPError, a URLError, is answered above)
            reason = getattr(exc, "reason", exc)
            raise ServerUnreachable(f"cannot reach the vLLM server at {self.url}: {reason}") from None

    def model_name(self) -> str:
        return self.request("GET", "/v1/models")["data"][0]["id"]

    def tree(self) -> ServedTree:
        """The server's module tree, its taps and its record table."""
        body = self.request("GET", "/v1/nnsight/tree")
        return ServedTree({path: cls for path, cls in body["tree"]}, body.get("taps"), body.get("record"))


class ServedTree(NamedTuple):
    """What ``GET /v1/nnsight/tree`` tells of the served model."""

    modules: dict[str, str]  # path -> class name
    taps: list[str] | None  # the tapped globs of a compiled engine; None: an eager one serves every module
    record: dict[str, Any] | None  # what blocks are recorded against (:func:`..engine.lower.record_table`)


def completion_body(model_name: str, prompt: Any, sampling: dict[str, Any], payload: str | None) -> dict[str, Any]:
    if "lora_request" in sampling:
        raise ValueError("lora_request= is for a local engine: a served engine picks a LoRA adapter by the "
                         "request's model name (vllm serve --enable-lora --lora-modules NAME=PATH)")
    unknown = sorted(set(sampling) - SAMPLING_FIELDS - {"extra_args"})
    if unknown:
        raise TypeError(f"unknown sampling keyword(s) for a served trace: {', '.join(unknown)}")
    xargs = dict(sampling.pop("extra_args", None) or {})
    if payload is not None:  # (None: an empty body, a plain request)
        xargs[codec.PAYLOAD_KEY] = payload
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    return {"model": model_name, "prompt": prompt, "return_token_ids": True,
            **({"vllm_xargs": xargs} if xargs else {}), **sampling}


def to_output(resp: dict[str, Any]) -> ServedOutput:
    choice = resp["choices"][0]
    return ServedOutput(
        request_id=resp.get("id", ""),
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
        outputs=[ServedCompletion(c.get("index", 0), c.get("text", ""), list(c.get("token_ids") or []),
                                  c.get("finish_reason"), c.get("stop_reason")) for c in resp["choices"]],
        kv_transfer_params=resp.get("kv_transfer_params"),
        raw=resp,
    )


def post_all(conn: Connection, bodies: list[dict[str, Any]],
             notes: list[str | None] | None = None) -> list[ServedOutput]:
    """Send the invokes concurrently (the server batches them), in order. ``notes``:
    per body, what a refusal of it (HTTP 400) should add to the server's message."""
    notes = notes or [None] * len(bodies)

    def post(body: dict[str, Any], note: str | None) -> dict[str, Any]:
        try:
            return conn.request("POST", "/v1/completions", body)
        except ServeError as exc:
            raise noted(exc, note) from None

    with ThreadPoolExecutor(max_workers=min(len(bodies), 32)) as pool:
        responses = list(pool.map(post, bodies, notes))
    return [to_output(r) for r in responses]
