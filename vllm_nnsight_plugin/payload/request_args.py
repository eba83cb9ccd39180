"""A request's ``extra_args`` (the wire keys of :mod:`.keys`) read by one rule, into
one record. The front end parses every request's extra args, so a bad value is
refused (:class:`PayloadError`, naming the key) before the engine; the worker parses
them again at admission, and the scheduler reads the stream flag alone (:func:`flag`).
Torch-free, like :mod:`.keys`.

The flags (``nnsight_stream``, ``nnsight_lower``) take ``True``/``False``, ``1``/``0``
(an OpenAI request's ``vllm_xargs`` turn JSON ``false`` into ``0``) or the strings
``"true"``/``"false"``/``"1"``/``"0"`` in any case; absent (or ``None``), their default.
``nnsight_edits`` takes one edit name or a list of names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import PayloadError
from .keys import EDITS_KEY, LOWER_KEY, PAYLOAD_KEY, STREAM_KEY

KEYS = (PAYLOAD_KEY, STREAM_KEY, EDITS_KEY, LOWER_KEY)
_WORDS = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True, slots=True)
class RequestArgs:
    """What a request's ``extra_args`` ask of the plugin."""

    payload: Any = None  # the intervention, unchecked (boundary.frontend.check_payload checks it)
    stream: bool = False  # deliver saves with every step's output
    edits: tuple[str, ...] | None = None  # installed edits it selects (None: all of them)
    lower: bool = True  # False: its blocks run as code (engine/lower.py)


NONE = RequestArgs()  # (a request without extra args)


def parse(extra_args: dict[str, Any] | None) -> RequestArgs:
    """The record of a request's ``extra_args``; :class:`PayloadError` for a bad value."""
    if not extra_args:
        return NONE
    return RequestArgs(extra_args.get(PAYLOAD_KEY), flag(extra_args, STREAM_KEY, False),
                       edit_names(extra_args.get(EDITS_KEY)), flag(extra_args, LOWER_KEY, True))


def mentioned(extra_args: dict[str, Any] | None) -> bool:
    """Whether any of the plugin's keys is present (else the request is not the plugin's)."""
    return bool(extra_args) and any(key in extra_args for key in KEYS)


def flag(extra_args: dict[str, Any], key: str, default: bool) -> bool:
    value = extra_args.get(key)
    if value is None:
        return default
    if value is True or value is False:
        return value
    if type(value) in (int, float) and value in (0, 1):  # (1.0 and 0.0 too: a JSON number)
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _WORDS:
        return _WORDS[value.strip().lower()]
    raise PayloadError(f"extra_args[{key!r}] must be true or false (True/False, 1/0, or the strings "
                       f"'true'/'false'/'1'/'0'), got {_shown(value)}")


def edit_names(value: Any) -> tuple[str, ...] | None:
    """``nnsight_edits``: one name, or names (a list); None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise PayloadError(f"extra_args[{EDITS_KEY!r}] must be an edit name or a list of edit names, "
                           f"got {_shown(value)}")
    return names


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
