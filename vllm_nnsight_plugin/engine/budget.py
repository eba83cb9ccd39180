"""What one request's block may cost the engine: running time, and memory after it.

A block runs on the worker's main thread between pieces of the forward, so a block
that loops forever (or sleeps) holds every request in the engine. Each request has
a time budget for its blocks (``code_time_limit_s``, default 30 s of running time
summed over its steps). A watchdog thread notices a block past its budget and
signals the main thread; the signal handler raises :class:`BlockTimeout` inside the
block only if that block is still the one running (checked on the main thread, so
the exception never lands in vLLM's code), which also interrupts ``time.sleep``.
The request ends with a ``TimeoutError``; the engine goes on.

Memory: saved tensors and a block's temporaries are freed when the request ends,
but the allocator keeps the pages. When a request with a block ends and the
process has grown by more than ``TRIM_GROWTH`` since the last trim, the garbage
collector runs and glibc returns free pages to the system.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading
import time
from typing import Any

import greenlet

POLL_S = 0.05
TRIM_GROWTH = 256 << 20


class BlockTimeout(BaseException):
    """Raised inside a block past its time budget (a BaseException, so a block's own
    ``except Exception`` does not swallow it)."""


class Watchdog:
    """Times the block that is running and interrupts it past its budget."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.running: Any = None  # the session whose block runs now (its greenlet is current)
        self.since = 0.0
        self.ident = 0  # the thread the block runs on
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident
        self._signals = threading.current_thread() is threading.main_thread()
        if limit_s > 0 and self._signals:
            previous = signal.getsignal(signal.SIGALRM)
            signal.signal(signal.SIGALRM, lambda signum, frame: self._on_signal(previous, signum, frame))

    def enter(self, session: Any) -> None:
        """Control passes into ``session``'s block."""
        if self.limit_s <= 0:
            return
        self.running, self.since = session, time.perf_counter()
        self.ident = threading.get_ident()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="nnsight-watchdog", daemon=True)
            self._thread.start()

    def leave(self, session: Any) -> None:
        """Control came back from ``session``'s block."""
        if self.running is session:
            session.code_time += time.perf_counter() - self.since
            self.running = None

    def overdue(self, session: Any) -> bool:
        return session.code_time + (time.perf_counter() - self.since) > self.limit_s

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            session = self.running
            if session is None or not self.overdue(session):
                continue
            if self._signals:
                signal.pthread_kill(self._main, signal.SIGALRM)
            else:  # not on the main thread: an asynchronous exception (does not interrupt a sleep)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(BlockTimeout))

    def _on_signal(self, previous: Any, signum: int, frame: Any) -> None:
        session = self.running
        if session is not None and greenlet.getcurrent() is session._glet and self.overdue(session) \
                and _inside_block(frame, session.filename, type(session)._main.__code__):
            raise BlockTimeout(f"the block ran for more than {self.limit_s:g} s, this server's limit "
                               "(code_time_limit_s); the request ends here")
        if callable(previous):
            previous(signum, frame)


def _inside_block(frame: Any, filename: str, stop: Any) -> bool:
    """Whether ``frame`` runs the block's code or something it called, so that an
    exception raised here unwinds through the block to the session's own handler
    (and never inside that handler, which reports the first one: ``stop``, its code)."""
    while frame is not None:
        if frame.f_code is stop:
            return False
        if frame.f_code.co_filename == filename:
            return True
        frame = frame.f_back
    return False


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """Gives memory back after requests with blocks end (see the module docstring)."""

    def __init__(self) -> None:
        self.baseline = _rss()
        try:
            self._malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._malloc_trim = None

    def after_requests(self) -> None:
        rss = _rss()
        if rss - self.baseline <= TRIM_GROWTH:
            return
        gc.collect()
        if self._malloc_trim is not None:
            self._malloc_trim(0)
        self.baseline = _rss()
