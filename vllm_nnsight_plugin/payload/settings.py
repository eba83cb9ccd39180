"""The operator's settings, parsed in one place: ``--additional-config``'s ``nnsight``
section, each key with its environment variable as the fallback (the section wins).

    vllm serve MODEL --additional-config '{"nnsight": {"taps": ["model.layers.*.output"],
        "allow_code": true, "max_saved_bytes": 1073741824, "max_saves": 100000,
        "code_time_limit_s": 30, "lanes": true}}'

Every process reads the same section from its ``VllmConfig``, so each builds the same
:class:`Settings`; they are cached by the section's text and the environment's values.
A number that is not one is an error naming the key, where the engine first needs it;
``allow_code`` allows code only when it is ``true`` (or the variable is ``1``).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from .tapset import TapSet, from_settings

ALLOW_CODE_ENV = "VLLM_NNSIGHT_ALLOW_CODE"
# key -> (environment variable, default, type)
_NUMBERS: dict[str, tuple[str, float, type]] = {
    "max_saved_bytes": ("VLLM_NNSIGHT_MAX_SAVED_BYTES", 1 << 30, int),
    "max_saves": ("VLLM_NNSIGHT_MAX_SAVES", 100_000, int),
    "code_time_limit_s": ("VLLM_NNSIGHT_CODE_TIME_LIMIT", 30.0, float),
}
_ENVS = (ALLOW_CODE_ENV, *(env for env, _, _ in _NUMBERS.values()))


@dataclass(frozen=True)
class Settings:
    taps: TapSet  # the tapped module locations of a compiled engine
    lanes: bool  # plans inside full CUDA graphs (engine/lanes.py)
    allow_code: bool  # code payloads over HTTP (remote code execution) accepted
    max_saved_bytes: int  # what one traced request may save
    max_saves: int
    code_time_limit_s: float  # a request's code blocks' time budget, over all its steps; 0: none


def settings_of(section: dict[str, Any] | None) -> Settings:
    """The :class:`Settings` of an ``nnsight`` section (None or {}: the defaults)."""
    section = section or {}
    try:
        key = json.dumps(section, sort_keys=True)
    except (TypeError, ValueError):  # (not JSON: parsed uncached, to name the bad key)
        return _parse(section, tuple(os.environ.get(env) for env in _ENVS))
    return _cached(key, tuple(os.environ.get(env) for env in _ENVS))


@functools.lru_cache(maxsize=16)
def _cached(key: str, envs: tuple) -> Settings:
    return _parse(json.loads(key), envs)


def _parse(section: dict[str, Any], envs: tuple) -> Settings:
    env = dict(zip(_ENVS, envs))
    numbers = {}
    for name, (var, default, kind) in _NUMBERS.items():
        raw = section.get(name, env[var] if env[var] is not None else default)
        try:
            if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                raise ValueError
            numbers[name] = kind(raw)
        except ValueError:
            where = f"nnsight.{name}" if name in section else var
            raise ValueError(f"{where}: expected a number, got {raw!r}") from None
    return Settings(
        taps=from_settings(section),
        lanes=bool(section.get("lanes", True)),
        allow_code=env[ALLOW_CODE_ENV] == "1" or section.get("allow_code") is True,
        **numbers,
    )
