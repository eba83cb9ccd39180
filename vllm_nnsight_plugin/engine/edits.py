"""The front end's view of the engine-wide edits installed through it.

Requests pass through the front end before the engine, so this is where a
request naming an unknown edit is refused, and where every request gets a unique
prefix-cache salt while any edit is installed: KV computed under an edit must
never be reused by another request (an edit such as ``output[-1] += v`` makes
even "the same edit" produce different KV for a shared prefix).
"""

from __future__ import annotations

from ..payload.codec import PayloadError

INSTALLED: dict[str, str | None] = {}  # edit id -> name (None: unnamed)


def add(edit_id: str, name: str | None) -> None:
    INSTALLED[edit_id] = name


def remove(edit_ids: list[str] | None = None) -> None:
    for edit_id in list(INSTALLED) if edit_ids is None else edit_ids:
        INSTALLED.pop(edit_id, None)


def check_selection(names: tuple[str, ...] | None) -> None:
    """A request may only name installed edits (``names``: its parsed ``nnsight_edits``,
    payload.request_args)."""
    if names is None:
        return
    known = {n for n in INSTALLED.values() if n is not None}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PayloadError(f"unknown edit name(s) {unknown}; installed: {sorted(known) or 'none'}")
