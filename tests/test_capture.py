"""The skip of a captured with-body, on every interpreter found here: ``sys.settrace``
before Python 3.12, ``sys.monitoring`` line events from 3.12 on (the GPU machines run
3.12). Each interpreter runs the same script; capture.py needs only the standard
library."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import sys, threading
from vllm_nnsight_plugin.client.capture import BodySkipper, SkipBlock, _LineSkips


class Block:
    """A with-block whose body is skipped, as Invoker's is."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        frame = sys._getframe(1)
        line = frame.f_lineno
        while not sys.modules["linecache"].getline(frame.f_code.co_filename, line).rstrip().endswith(":"):
            line += 1  # (a with-header over several lines)
        self.skipper = BodySkipper(frame, line + 1)
        self.skipper.arm()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.skipper.disarm()
        return exc_type is not None and issubclass(exc_type, SkipBlock)


def loop(n, log):
    for i in range(n):
        with Block(log):
            log.append(("body ran", i))
        log.append(i)
    with Block(
        log,
    ):
        log.append("multi-line header body ran")
    log.append("after")


def recursive(depth, log):
    if depth:
        with Block(log):
            recursive(depth - 1, log)  # (this frame's body: skipped, the inner call never made)
            log.append(("body ran", depth))
        log.append(("after", depth))


log = []
loop(256, log)
assert log == list(range(256)) + ["after"], log[:4]

log = []
recursive(2, log)
assert log == [("after", 2)], log

# threads running the same function at once, switching as often as they can: each
# frame skips its own body, and nothing is left armed
sys.setswitchinterval(1e-6)
logs = [[] for _ in range(8)]
threads = [threading.Thread(target=loop, args=(4000, logs[k])) for k in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
sys.setswitchinterval(0.005)
bad = [k for k in range(8) if logs[k] != list(range(4000)) + ["after"]]
assert not bad, [[x for x in logs[k] if not isinstance(x, int)][:3] for k in bad]

# a debugger's trace function is kept
seen = []
def tracer(frame, event, arg):
    seen.append(event)
    return None
sys.settrace(tracer)
log = []
loop(3, log)
kept = sys.gettrace() is tracer
sys.settrace(None)
assert kept and log == [0, 1, 2, "after"] and seen

# a body that starts with try: (after global/nonlocal, which run no code) is refused;
# one statement before it and the skip works
from vllm_nnsight_plugin.client.capture import find_block, skipper_for


class Checked(Block):
    def __enter__(self):
        frame = sys._getframe(1)
        self.skipper = skipper_for(frame, find_block(frame))
        self.skipper.arm()
        return self


G = 0


def try_first(log):
    with Checked(log):
        try:
            log.append("body ran")
        except Exception:
            log.append("caught")


def global_then_try(log):
    with Checked(log):
        global G
        try:
            G = 1
        except Exception:
            log.append("caught")


def pass_then_try(log):
    with Checked(log):
        pass
        try:
            log.append("body ran")
        except Exception:
            log.append("caught")
    log.append("after")


for refused in (try_first, global_then_try):
    log = []
    try:
        refused(log)
    except SyntaxError as exc:
        assert "cannot start with `try:`" in str(exc), exc
    else:
        raise AssertionError(f"{refused.__name__} was not refused")
    assert log == [], log
log = []
pass_then_try(log)
assert log == ["after"], log

skips = _LineSkips.get()
if sys.version_info >= (3, 12):
    assert skips is not None and not skips.armed
    assert sys.monitoring.get_local_events(skips.tool, loop.__code__) == 0  # (nothing left on)
else:
    assert skips is None
print("ok", sys.version_info[:2], "monitoring" if skips else "settrace")
'''


def _interpreters() -> list[str]:
    found = {sys.executable}
    for name in ("python3.12", "python3.13", "python3.14"):
        if (path := shutil.which(name)) and "/shims/" not in path:  # (pyenv's shims need a pyenv setting)
            found.add(path)
    found.update(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")))
    return sorted(found)


@pytest.mark.parametrize("python", _interpreters())
def test_a_captured_body_never_runs(python, tmp_path):
    script = tmp_path / "skip.py"  # (a file: the skipper reads the with-header's lines)
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([python, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")

