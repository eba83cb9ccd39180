"""Check a block's module paths against a known module tree before sending.

Only chains that end in ``.output``/``.input``/``.inputs`` and are rooted at the
model variable with constant indices are checked (``model.model.layers[1].mlp
.output``); anything dynamic is left to the worker, which reports wrong paths
with the available names too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..engine.block_source import step_value_spelled_as_module
from ..payload.tapset import TapSet

TERMINALS = ("output", "input", "inputs")


def _chain(node: ast.AST, roots: set[str]) -> list[str] | None:
    segments: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            segments.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, (int, str)) and not isinstance(node.slice.value, bool):
            if isinstance(node.slice.value, int) and node.slice.value < 0:
                return None
            segments.append(str(node.slice.value))
            node = node.value
        elif isinstance(node, ast.Name) and node.id in roots:
            return segments[::-1]
        else:
            return None


def module_paths(statements: tuple[ast.stmt, ...], roots: set[str]) -> Iterator[tuple[str, int, str]]:
    """``(module path, line, "output"|"input"|"inputs")`` for each checkable location access."""
    for stmt in statements:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and node.attr in TERMINALS:
                segments = _chain(node.value, roots)
                if segments is not None and not step_value_spelled_as_module(node):  # (model.logits: served)
                    yield ".".join(segments), node.lineno, node.attr


def check_taps(statements: tuple[ast.stmt, ...], roots: set[str], taps: TapSet, filename: str) -> None:
    """Raise ``ValueError`` at once for an access no tap serves (compiled engines)."""
    for path, line, kind in module_paths(statements, roots):
        if not taps.matches(path, kind):
            raise ValueError(
                f"{filename}, line {line}: {path}.{kind} is not tapped. This engine runs compiled "
                f"with CUDA graphs and serves module values only at its taps: {taps.describe()}"
            )


def check_paths(statements: tuple[ast.stmt, ...], roots: set[str], tree: dict[str, str], filename: str) -> None:
    """Raise ``AttributeError`` naming the available submodules for a wrong path."""
    for path, line, _ in module_paths(statements, roots):
        if path in tree:
            continue
        parts = path.split(".")
        parent = ""
        for i in range(len(parts)):
            candidate = ".".join(parts[: i + 1])
            if candidate not in tree:
                break
            parent = candidate
        prefix = f"{parent}." if parent else ""
        children = [p[len(prefix):] for p in tree if p.startswith(prefix) and p != parent
                    and "." not in p[len(prefix):]]
        raise AttributeError(
            f'{filename}, line {line}: {path!r} is not a module of this model; '
            f"{parent or 'the model'} has submodules: {', '.join(children) or '(none)'}"
        )
