"""Result buffers whose memory is already faulted in.

An every-token read of 256 requests fills 134 MB of result buffers at the requests'
last step (the headline workload), freed once the results have left the process; the
client copies the same bytes out of the message frames into tensors of its own, freed
when the caller drops them. Both processes take those buffers from here.
Fresh memory of that size comes from the kernel page by page on first write, and
glibc hands freed large blocks back to it. So a freed buffer's memory is kept, up to
:data:`KEEP_BYTES`, and the next buffer of about its size reuses it (on the CPU, an
every-token batch of a 2048-wide model took 43-122k page faults in the engine process
with the pool and 87-260k without).

A buffer is an array over a kept block (a ``bytearray``, not an array, so that every
array numpy derives from the buffer holds the buffer itself, not the block); the block
returns to the pool when the buffer is garbage (nothing holds it: not a tensor or a
slice made from it, not a message frame still being sent), so a buffer in use is never
handed out twice.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

KEEP_BYTES = 512 << 20  # free memory kept for reuse, at most (per process, for its lifetime)
SMALL = 64 << 10  # below this the allocator's own free lists are warm (glibc hands back only blocks over 128 KB)
_free: dict[int, list[bytearray]] = {}  # size class -> free blocks of that size
_kept = 0
# (a buffer may be freed on another thread, vLLM's output sender, or by a collection that
# starts inside this module: re-entrant)
_lock = threading.RLock()


def size_class(size: int) -> int:
    """``size`` rounded up to one of eight steps per power of two (at most 12.5% over)."""
    step = max(1, (1 << (size.bit_length() - 1)) >> 3)
    return -(-size // step) * step


def take(size: int) -> np.ndarray:
    """``size`` bytes (uint8), contents undefined: every byte is the caller's to write."""
    if size < SMALL:
        return np.empty(size, dtype=np.uint8)
    global _kept
    cls = size_class(size)
    with _lock:
        blocks = _free.get(cls)
        block = blocks.pop() if blocks else None
        if block is not None:
            _kept -= cls
    if block is None:
        block = bytearray(cls)  # (zeroed by the kernel on first touch: the cost this pool saves)
    view = np.frombuffer(block, dtype=np.uint8, count=size)
    weakref.finalize(view, _give_back, block)
    return view


def _give_back(block: bytearray) -> None:
    global _kept
    with _lock:
        if _kept + len(block) <= KEEP_BYTES:
            _free.setdefault(len(block), []).append(block)
            _kept += len(block)
