"""Errors raised in the caller for what went wrong inside the engine."""

from __future__ import annotations

import builtins
from typing import Any


class InterventionError(RuntimeError):
    """An intervention block failed inside the engine.

    Raised at the exit of the ``with`` block as nnsight raises it: a ``RuntimeError``
    whose message starts ``"<TypeName>: <message>"`` (so a ported ``except
    RuntimeError`` catches it). When the remote exception was a builtin type
    (``ZeroDivisionError``, ``IndexError``...), the raised error is also an instance
    of that type, so ``except ZeroDivisionError`` works too.
    """

    def __init__(self, info: dict[str, Any]):
        self.info = info
        self.type_name = info.get("type", "Error")
        self.remote_message = info.get("message", "")
        self.filename = info.get("filename")
        self.lineno = info.get("lineno")
        self.line = info.get("line") or ""
        where = ""
        if self.lineno:
            place = f'File "{self.filename}", line {self.lineno}' if self.filename else f"line {self.lineno}"
            where = f"\n  {place}" + (f"\n    {self.line}" if self.line else "")
        super().__init__(f"{self.type_name}: {self.remote_message}{where}")
        if isinstance(self, SyntaxError):  # (its own fields, which tracebacks print, are not set by __init__)
            self.msg, self.text, self.offset = f"{self.type_name}: {self.remote_message}", self.line or None, None

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple:  # (copy and pickle: made again from what the engine sent)
        return make_error, (self.info,)


def make_error(info: dict[str, Any]) -> InterventionError:
    base = getattr(builtins, str(info.get("type")), None)
    if isinstance(base, type) and issubclass(base, Exception) and base is not Exception:
        try:
            cls = type(f"Remote{base.__name__}", (InterventionError, base), {"__str__": InterventionError.__str__})
            return cls(info)
        except TypeError:  # (incompatible layouts: none among today's builtins, test_payload checks)
            pass
    return InterventionError(info)
