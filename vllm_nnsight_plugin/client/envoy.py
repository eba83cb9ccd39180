"""Client-side envoys: the module tree, for inspection and references.

Blocks never run in the caller, so a client envoy only names a module (by path);
inside a block the worker resolves the same path to the real vLLM module. When
the module tree is known (after dispatch), a wrong path fails at once with the
available names.
"""

from __future__ import annotations

from typing import Any


class Envoy:
    """A module path of the vLLM model (``model.model.layers[1].mlp``)."""

    def __init__(self, path: str, tree: dict[str, str] | None):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_tree", tree)

    def __nnsight_ref__(self) -> tuple:
        return ("envoy", self._path)

    def _child_path(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def _children(self) -> list[str]:
        tree = self._tree or {}
        prefix = f"{self._path}." if self._path else ""
        return [p[len(prefix):] for p in tree if p.startswith(prefix) and p and "." not in p[len(prefix):]]

    def __getattr__(self, name: str) -> Envoy:
        if name.startswith("__"):
            raise AttributeError(name)
        path = self._child_path(name)
        if self._tree is not None and path not in self._tree:
            raise AttributeError(
                f"{self._path or 'model'!r} has no submodule {name!r}; submodules: "
                f"{', '.join(self._children()) or '(none)'}"
            )
        return Envoy(path, self._tree)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):  # model.layers[:4]: those modules' envoys
            return [self.__getattr__(c) for c in self._children()[index]]
        if self._tree is not None and isinstance(index, int):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"{self._path or 'model'} index {index} is out of range: it holds {n} modules "
                                 f"(indices 0 to {n - 1}, or -{n} to -1)")
            index %= n
        return self.__getattr__(str(index))

    def __len__(self) -> int:
        return len(self._children())

    def __iter__(self):  # noqa: ANN204
        return (self.__getattr__(c) for c in self._children())

    def _outside(self, what: str) -> Any:
        raise RuntimeError(
            f"{self._path or 'model'}.{what} is only available inside a traced block "
            "(with model.trace(...): ...)"
        )

    output = property(lambda self: self._outside("output"))
    input = property(lambda self: self._outside("input"))
    inputs = property(lambda self: self._outside("inputs"))

    def __repr__(self) -> str:
        if self._tree is None:
            return f"<Envoy {self._path or 'model'}>"
        prefix = f"{self._path}." if self._path else ""
        rows = [
            f"{'  ' * p[len(prefix):].count('.')}{p[len(prefix):].rsplit('.', 1)[-1]}: {cls}"
            for p, cls in self._tree.items()
            if p.startswith(prefix) and p != self._path
        ]
        head = f"{self._path or 'model'}: {self._tree.get(self._path, '?')}"
        return "\n".join([head, *("  " + r for r in rows)])
