"""Capture the body of a ``with`` block instead of running it.

The body of ``with model.trace(...):`` must run inside vLLM's worker, beside the
forward pass, not in the caller. On ``__enter__`` we find the ``with`` statement in
the caller's source (``linecache`` also holds notebook cells), cut out its body
with its original line numbers, and make the body's first line raise
:class:`SkipBlock` through a line event (:class:`BodySkipper`); ``__exit__`` swallows it.
After the engine ran the block, :func:`push_locals` writes the saved values into
the caller's variables.
"""

from __future__ import annotations

import ast
import ctypes
import linecache
import sys
import textwrap
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..engine.block_source import saved_expr


class SkipBlock(Exception):
    """Raised on the first line of a captured body so it never runs locally."""


@dataclass(frozen=True)
class BlockSource:
    """The source of a captured body and the names it reads."""

    source: str
    filename: str
    lineno: int
    names: tuple[str, ...]
    statements: tuple[ast.stmt, ...]
    as_name: str | None = None  # ``with ... as NAME``: bound only after __enter__

    @property
    def empty(self) -> bool:
        """A body of only ``pass`` and ``...``: nothing to run (a plain request)."""
        return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                   for s in self.statements)


_CACHE: dict[tuple, BlockSource] = {}
_TREES: dict[tuple, ast.Module] = {}


def _parse(filename: str, lines: list[str]) -> ast.Module:
    key = (filename, len(lines), hash("".join(lines)))
    tree = _TREES.get(key)
    if tree is None:
        tree = ast.parse("".join(lines), filename)
        _TREES[key] = tree
    return tree


def _names_read(nodes: list[ast.stmt]) -> tuple[str, ...]:
    """The names a block reads, but ``nnsight`` of ``nnsight.save(x)`` (a save, not a value)."""
    seen: dict[str, None] = {}
    for node in nodes:
        saves = {id(sub.func.value) for sub in ast.walk(node)
                 if isinstance(sub, ast.Call) and sub.args and saved_expr(sub) is not None}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and not sub.id.startswith("__") and id(sub) not in saves:
                seen.setdefault(sub.id)
    return tuple(seen)


def find_block(frame: FrameType) -> BlockSource:
    """The body of the ``with`` statement the frame is entering."""
    filename = frame.f_code.co_filename
    lineno = frame.f_lineno
    lines = linecache.getlines(filename, frame.f_globals)
    if not lines:
        raise RuntimeError(
            f"cannot read the source of {filename}: a traced block must live in a file "
            "or notebook cell (not an interactive prompt without source)"
        )
    key = (filename, lineno, len(lines), lines[lineno - 1] if lineno <= len(lines) else "")
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    tree = _parse(filename, lines)
    best: ast.With | None = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and (
            node.lineno <= lineno < node.body[0].lineno or node.lineno == lineno
        ):
            if best is None or node.lineno >= best.lineno:
                best = node
    if best is None:
        raise RuntimeError(f"no with-block found at {filename}:{lineno}")
    first = best.body[0]
    if first.lineno == best.lineno:
        raise SyntaxError(
            "the body of a traced with-block must start on its own line",
            (filename, first.lineno, first.col_offset + 1, lines[first.lineno - 1]),
        )
    start = first.lineno
    end = best.body[-1].end_lineno or start
    source = textwrap.dedent("".join(lines[start - 1 : end]))
    target = best.items[0].optional_vars
    if isinstance(target, ast.Tuple) and target.elts:  # ``as (tracer, edit)``
        target = target.elts[0]
    as_name = target.id if isinstance(target, ast.Name) else None
    block = BlockSource(source, filename, start, _names_read(best.body), tuple(best.body), as_name)
    _CACHE[key] = block
    return block


def gather_values(frame: FrameType, names: tuple[str, ...]) -> dict[str, Any]:
    """The caller's current values of the names a block reads (locals win)."""
    local, glob = frame.f_locals, frame.f_globals
    out: dict[str, Any] = {}
    for name in names:
        if name in local:
            out[name] = local[name]
        elif name in glob:
            out[name] = glob[name]
    return out


def skipper_for(frame: FrameType, block: BlockSource) -> BodySkipper:
    """A skipper of the block's body (not armed yet). A body that starts with ``try:``
    cannot be skipped: Python runs that line outside the with-statement's handler, so
    the skip would escape the ``with``, and one line later the body's own ``except``
    would catch it. (``global`` and ``nonlocal`` run no code: the line after them is the
    first.)"""
    first = next((s for s in block.statements if not isinstance(s, (ast.Global, ast.Nonlocal))),
                 block.statements[0])
    if isinstance(first, (ast.Try, getattr(ast, "TryStar", ast.Try))):
        line = linecache.getline(block.filename, first.lineno)
        raise SyntaxError("the body of a traced with-block cannot start with `try:`: put another statement "
                          "before it (`pass` will do)", (block.filename, first.lineno, first.col_offset + 1, line))
    return BodySkipper(frame, block.lineno)


class BodySkipper:
    """Makes the first line of a with-body raise :class:`SkipBlock`.

    On Python 3.12+ through ``sys.monitoring`` line events local to the caller's code
    object: ``sys.settrace`` there re-instruments every code object run after each
    switch, twice per invoke (a trace of 256 invokes paid for it in every function
    the client ran). Older Pythons, or no free monitoring tool id: ``sys.settrace``."""

    def __init__(self, frame: FrameType, body_line: int):
        self.frame = frame
        self.body_line = body_line  # a multi-line with-header has line events before the body
        self._previous: Any = None  # the thread's trace function when armed (restored on disarm)
        self._armed = False
        self._monitored = _LineSkips.get()

    def arm(self) -> None:
        self._armed = True
        if self._monitored is not None:
            self._monitored.add(self)
            return
        self._previous = sys.gettrace()
        sys.settrace(lambda *args: None)
        self.frame.f_trace_lines = True
        self.frame.f_trace = self._trace

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno >= self.body_line:
            # (Python unsets the thread's trace function when a trace function raises:
            # the with-statement's exit disarms, which puts the earlier one back)
            self.frame.f_trace = None
            raise SkipBlock()
        return self._trace

    def disarm(self) -> None:
        if not self._armed:
            return
        self._armed = False
        if self._monitored is not None:
            self._monitored.discard(self)
            return
        self.frame.f_trace = None
        sys.settrace(self._previous)


_SETUP = threading.Lock()


class _LineSkips:
    """The armed skippers, by code object, behind one ``sys.monitoring`` LINE callback
    (events on only the code objects that hold an armed with-body). The callback never
    returns ``DISABLE``: a line skipped past now may hold the next invoke's body. Unlike
    a trace function, the table is the process's: threads arm and disarm under a lock."""

    _instance: _LineSkips | None = None
    _tried = False

    def __init__(self, tool: int) -> None:
        self.tool = tool
        self.armed: dict[Any, list[BodySkipper]] = {}  # code object -> skippers on it
        self._lock = threading.Lock()

    @classmethod
    def get(cls) -> _LineSkips | None:
        if cls._tried:
            return cls._instance
        with _SETUP:  # (two threads' first invokes must not both take the tool id)
            if not cls._tried:
                monitoring = getattr(sys, "monitoring", None)
                for tool in (4, 3):  # (0-2 and 5 are the debugger's, coverage's, profiler's, optimizer's)
                    if monitoring is not None and monitoring.get_tool(tool) is None:
                        monitoring.use_tool_id(tool, "vllm-nnsight-plugin")
                        cls._instance = cls(tool)
                        monitoring.register_callback(tool, monitoring.events.LINE, cls._instance._line)
                        break
                cls._tried = True  # (last: a thread that sees it also sees the instance)
        return cls._instance

    def add(self, skipper: BodySkipper) -> None:
        code = skipper.frame.f_code
        with self._lock:
            on = self.armed.setdefault(code, [])
            if not on:
                sys.monitoring.set_local_events(self.tool, code, sys.monitoring.events.LINE)
            on.append(skipper)

    def discard(self, skipper: BodySkipper) -> None:
        code = skipper.frame.f_code
        with self._lock:
            on = self.armed.get(code)
            if on is None or skipper not in on:
                return
            on.remove(skipper)
            if not on:
                del self.armed[code]
                sys.monitoring.set_local_events(self.tool, code, 0)

    def _line(self, code: Any, line: int) -> None:
        on = self.armed.get(code)
        if not on:
            return
        frame = sys._getframe(1)  # (the frame running the line: the callback's caller)
        for skipper in tuple(on):  # (another thread may arm or disarm meanwhile)
            if skipper.frame is frame and line >= skipper.body_line:
                skipper.disarm()  # (so the with-statement's exit finds it disarmed)
                raise SkipBlock()


def push_locals(frame: FrameType, values: dict[str, Any]) -> None:
    """Bind names in the caller's frame (function locals or module globals)."""
    if not values:
        return
    if frame.f_locals is frame.f_globals:
        frame.f_globals.update(values)
        return
    frame.f_locals.update(values)
    if sys.version_info < (3, 13):
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


# ------------------------------------------------------------ trace-level values


def _is_invoke(node: ast.With) -> bool:
    expr = node.items[0].context_expr if node.items else None
    return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "invoke"


def saves_outside_invokes(statements: tuple[ast.stmt, ...]) -> bool:
    """Whether a trace body calls ``.save()`` outside its invokes' bodies."""
    todo: list[ast.AST] = list(statements)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.With) and _is_invoke(node):
            todo.extend(item.context_expr for item in node.items)  # (not its body: the engine's)
            continue
        if saved_expr(node) is not None:
            return True
        todo.extend(ast.iter_child_nodes(node))
    return False


class _TraceSaves(ast.NodeTransformer):
    """``x.save()`` outside invokes -> ``__nnsight_trace_save__(x)``."""

    def visit_With(self, node: ast.With) -> Any:
        if _is_invoke(node):
            return node
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        saved = saved_expr(node)
        if saved is not None:
            return ast.copy_location(ast.Call(ast.Name("__nnsight_trace_save__", ast.Load()), [saved], []), node)
        return node


def compile_trace_body(block: BlockSource) -> Any:
    """A trace body as code that runs in the caller, at its own lines."""
    tree = ast.parse(block.source, block.filename)
    ast.increment_lineno(tree, block.lineno - 1)
    tree = ast.fix_missing_locations(_TraceSaves().visit(tree))
    return compile(tree, block.filename, "exec")

