"""Tap declarations: which module locations a compiled engine keeps reachable.

Shared by the client (refuses an untapped access before sending) and the engine
(installs the tap op, refuses untapped accesses). A declaration is a glob over
module paths (``*`` is exactly one path segment), optionally ending in
``.output`` or ``.input`` (both when absent): ``"model.layers.*.output"``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

KINDS = ("output", "input")


class TapSet:
    """Parsed ``taps`` declarations: which (module path, kind) pairs are tapped."""

    def __init__(self, patterns: Iterable[str] = ()):
        self.patterns: list[str] = []
        self._rules: list[tuple[re.Pattern[str], tuple[str, ...]]] = []
        for raw in patterns:
            if not isinstance(raw, str) or not raw.strip():
                raise ValueError(f"a tap is a module path glob such as 'model.layers.*.output', not {raw!r}")
            text = raw.strip()
            kinds: tuple[str, ...] = KINDS
            head, _, last = text.rpartition(".")
            if last in KINDS and head:
                text, kinds = head, (last,)
            # '*' matches exactly one dotted segment; fnmatch's '*' would cross dots
            regex = r"\.".join(
                re.escape(seg).replace(r"\*", "[^.]+" if seg == "*" else "[^.]*").replace(r"\?", "[^.]")
                for seg in text.split(".")
            )
            self.patterns.append(raw.strip())
            self._rules.append((re.compile(regex), kinds))

    def __bool__(self) -> bool:
        return bool(self._rules)

    def matches(self, path: str, kind: str) -> bool:
        return any(kind in kinds and rx.fullmatch(path) for rx, kinds in self._rules)

    def describe(self) -> str:
        return ", ".join(self.patterns) or "(none)"

    def sites(self, paths: Iterable[str]) -> list[tuple[str, str]]:
        """Every tapped ``(path, kind)`` among a model's module paths."""
        return [(p, k) for p in paths for k in KINDS if self.matches(p, k)]


def from_settings(settings: dict[str, Any]) -> TapSet:
    """The taps of ``--additional-config``'s ``nnsight`` section."""
    value = settings.get("taps") or ()
    if isinstance(value, str):
        value = [value]
    try:
        return _parsed(tuple(value))
    except TypeError:  # unhashable entries: TapSet says what is wrong with them
        return TapSet(value)


@functools.lru_cache(maxsize=16)  # the front end checks every traced request against them
def _parsed(patterns: tuple) -> TapSet:
    return TapSet(patterns)
