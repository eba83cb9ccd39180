"""Benchmark only (``user_way.py --gc`` puts this folder first on ``PYTHONPATH``): the
pauses of Python's garbage collector in every process of an engine, stock or not.

Each process that starts with ``NNSIGHT_GC_PROBE`` set keeps its collections and their
seconds per generation, and writes them to ``$NNSIGHT_GC_PROBE/<pid>.json`` within
50 ms of a change, so the harness can read its engine core's totals before and after a
batch. A forked child starts from zero with a writer of its own. The next
``sitecustomize`` on ``sys.path`` (the one this shadows) still runs.
"""

from __future__ import annotations

import gc
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("NNSIGHT_GC_PROBE")
TOTALS = [[0, 0.0] for _ in range(3)]  # per generation: collections, seconds
_started = [0.0]


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        total = TOTALS[info["generation"]]
        total[0] += 1
        total[1] += time.perf_counter() - _started[0]


def _write_forever() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    written = None
    while True:
        now = [list(t) for t in TOTALS]
        if now != written:
            try:
                with open(path + ".tmp", "w") as fh:
                    json.dump(now, fh)
                os.replace(path + ".tmp", path)
                written = now
            except OSError:
                pass
        time.sleep(0.05)


def _start() -> None:
    threading.Thread(target=_write_forever, name="gc-probe", daemon=True).start()


def _after_fork() -> None:
    for total in TOTALS:
        total[0], total[1] = 0, 0.0
    _start()


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if _DIR:
    try:
        os.makedirs(_DIR, exist_ok=True)
    except OSError:
        _DIR = "/tmp"
    gc.callbacks.append(_callback)
    os.register_at_fork(after_in_child=_after_fork)
    _start()
_run_shadowed()
