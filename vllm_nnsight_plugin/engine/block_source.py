"""A block's source made runnable: nnsight's ``with tracer.iter[...]:`` /
``with tracer.all():`` step loops rewritten as ``for`` loops, compiled with the
user's file name and line numbers (so tracebacks and ``ran_as`` name the user's lines)."""

from __future__ import annotations

import ast
from typing import Any


def saved_expr(node: ast.AST) -> ast.expr | None:
    """What a save call saves: ``x`` of ``x.save()`` or of nnsight's ``nnsight.save(x)``;
    None for any other node."""
    if not isinstance(node, ast.Call) or node.keywords or not isinstance(node.func, ast.Attribute) \
            or node.func.attr != "save":
        return None
    if not node.args:
        return node.func.value
    if len(node.args) == 1 and is_nnsight_module(node.func.value):
        return node.args[0]
    return None


def step_value_spelled_as_module(node: ast.AST) -> bool:
    """``model.logits.output`` / ``model.samples.output``: nnsight's spelling before 0.7
    (they were wrapper modules) of ``model.logits`` / ``model.samples``."""
    return isinstance(node, ast.Attribute) and node.attr == "output" and isinstance(node.value, ast.Attribute) \
        and node.value.attr in ("logits", "samples") and isinstance(node.value.value, ast.Name)


def is_nnsight_module(node: ast.AST) -> bool:
    """The name ``nnsight`` (as in ``nnsight.save(x)``: nothing of it travels)."""
    return isinstance(node, ast.Name) and node.id == "nnsight"


class _BlockRewriter(ast.NodeTransformer):
    """``x.save()`` and ``nnsight.save(x)`` -> ``__nnsight_save__(x)``: save works on any object;
    ``model.logits.output`` (and ``.samples.output``, nnsight's spelling before 0.7) ->
    ``model.logits``. And
    nnsight's ``with`` spelling of a step loop (``with tracer.iter[0:3]:``, ``with
    tracer.iter[:] as it:``, ``with tracer.all():``) -> the ``for`` loop it means:
    the body runs at each of those steps, ``it`` the step number."""

    def visit_With(self, node: ast.With) -> Any:
        self.generic_visit(node)
        if len(node.items) != 1 or not _is_step_loop(node.items[0].context_expr):
            return node
        target = node.items[0].optional_vars or ast.Name("__nnsight_step__", ast.Store())
        if not isinstance(target, (ast.Name, ast.Tuple, ast.List, ast.Attribute, ast.Subscript)):
            return node
        return ast.copy_location(ast.For(target=target, iter=node.items[0].context_expr, body=node.body,
                                         orelse=[]), node)

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        self.generic_visit(node)
        if step_value_spelled_as_module(node):
            inner = node.value
            return ast.copy_location(ast.Attribute(inner.value, inner.attr, node.ctx), node)
        return node

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        saved = saved_expr(node)
        if saved is not None:
            return ast.copy_location(ast.Call(ast.Name("__nnsight_save__", ast.Load()), [saved], []), node)
        return node


def _is_step_loop(node: ast.expr) -> bool:
    """``<name>.iter[...]`` or ``<name>.all()``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Attribute) and node.value.attr == "iter" \
            and isinstance(node.value.value, ast.Name)
    return isinstance(node, ast.Call) and not node.args and not node.keywords \
        and isinstance(node.func, ast.Attribute) and node.func.attr == "all" and isinstance(node.func.value, ast.Name)


_CODE_CACHE: dict[tuple, Any] = {}


def compile_block(source: str, filename: str, lineno: int) -> Any:
    key = (source, filename, lineno)
    code = _CODE_CACHE.get(key)
    if code is None:
        tree = ast.parse(source, filename)
        ast.increment_lineno(tree, lineno - 1)
        tree = ast.fix_missing_locations(_BlockRewriter().visit(tree))
        code = compile(tree, filename, "exec")
        if len(_CODE_CACHE) > 256:
            _CODE_CACHE.clear()
        _CODE_CACHE[key] = code
    return code
