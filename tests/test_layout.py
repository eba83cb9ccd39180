"""The package's import graph has no cycles: every module can be read after the ones
it imports (imports under ``if TYPE_CHECKING:`` are annotations only and not counted;
imports inside functions are)."""

from __future__ import annotations

import ast
import pathlib

import vllm_nnsight_plugin

ROOT = pathlib.Path(vllm_nnsight_plugin.__file__).parent


def _graph() -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix("__init__").rstrip("."): p
               for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("vllm_nnsight_plugin"):
                target = node.module.removeprefix("vllm_nnsight_plugin").lstrip(".")
            else:
                continue
            for alias in node.names:
                found = f"{target}.{alias.name}".lstrip(".")
                graph[name].add(found if found in modules else target)
    return {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}


def test_no_import_cycles():
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert len(graph) > 40 and graph["engine.interleave"]  # (the graph was read)
