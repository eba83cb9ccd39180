"""Non-finite logits end their request, and no one else's.

A traced request whose logits hold NaN or +inf ends with a per-request error naming
the step. Its rows are made finite before sampling (a sampler fed NaN can fail for
the whole batch). On a GPU each step's check is read where vLLM takes that step's
output: vLLM has waited for the step's sampled tokens there, which the check's copy
(or the guard kernel's write of its flags) precedes on the stream, so the CPU never
waits for it, and the error rides the very
output of the step that found it, however the request ends (a stop token too).
(KV blocks a traced request held are zeroed before reuse: ``boundary/kv_blocks.py``.)
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

logger = logging.getLogger("vllm.nnsight_plugin")


class FiniteLogits:
    """Per step: traced rows of the logits made finite, and which were not, read once
    the device has got there (a device-to-host copy read where vLLM takes the step's
    output, :meth:`detach`: it neither stalls the step nor makes the CPU wait for the
    GPU; under async scheduling the CPU prepares the next step while the GPU runs this
    one, and one wait per step would undo that).

    A row is bad when its maximum is NaN or +inf (the maximum propagates NaN): one
    reduction and one in-place pass per step, whatever the batch; the maxima cross to
    the host and are compared there. On a GPU one Triton kernel does all of it
    (:mod:`.guard_kernel`) and writes each row's flag straight into the pinned buffer.
    The engine core's step loop is CPU-bound, so each host call counts: pinned buffers
    and their events are reused (no allocation per step) and the landed maxima or flags
    are read through numpy views."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[str], _Buffer]] = []  # this step's, until detached
        self._spare: deque[_Buffer] = deque(maxlen=8)  # (the oldest size goes first)
        self._read: deque[_Buffer] = deque()  # read by a detached check (another thread): spare again
        # the flag buffers of the last launches of the guard kernel, kept alive even when a
        # detached check is dropped unread: torch's pinned allocator, which would hand a
        # freed buffer out again, does not know that a kernel still writes it
        self._written: deque[torch.Tensor] = deque(maxlen=64)

    def check(self, logits: torch.Tensor, index: torch.Tensor | None, req_ids: list[str],
              report: bool = True) -> list[str]:
        """Make the logits rows at ``index`` (those of ``req_ids``; None: every row, in
        order) finite; on the CPU return the requests whose rows were not; on a GPU
        return none and keep the check for :meth:`detach`. Not ``report``: only make
        them finite (a tensor-parallel rank whose outputs vLLM never reads)."""
        if not req_ids:
            return []
        rows = len(req_ids)
        if report and logits.device.type == "cuda" and rows == (logits.shape[0] if index is None else
                                                               index.shape[0]) and self._fused(logits):
            from . import guard_kernel

            buffer = self._buffer(rows, torch.uint8)  # (the rows' flags, written by the device)
            try:
                guard_kernel.launch(logits, index, buffer.host)
            except Exception:  # noqa: BLE001 - e.g. a build that fails: the torch ops below guard instead
                logger.warning("the logits guard's Triton kernel failed; the guard runs as torch ops",
                               exc_info=True)
                guard_kernel.give_up(logits.device, logits.dtype, logits.shape[1])
                self._written.append(buffer.host)  # (not reused: the launch may have reached the device)
            else:
                buffer.event.record()
                self._written.append(buffer.host)
                self._pending.append((req_ids, buffer))
                return []
        part = logits if index is None else logits.index_select(0, index)
        # (-inf is a mask some models' logits carry: kept, and not an error)
        maxima = part.amax(dim=-1) if report else None
        if index is None:
            torch.nan_to_num(logits, neginf=float("-inf"), out=logits)
        else:
            logits.index_copy_(0, index, torch.nan_to_num(part, neginf=float("-inf")))
        if maxima is None:
            return []
        if maxima.device.type != "cuda":
            return _bad(req_ids, maxima.float().numpy())
        buffer = self._buffer(rows, maxima.dtype)
        (buffer.host if buffer.host.shape[0] == rows else buffer.host[:rows]).copy_(maxima, non_blocking=True)
        buffer.event.record()
        self._pending.append((req_ids, buffer))
        return []

    @staticmethod
    def _fused(logits: torch.Tensor) -> bool:
        """Whether the guard's one Triton kernel (:mod:`.guard_kernel`) takes these logits
        on this device (tried once per device, dtype and width; not after a launch there failed)."""
        from . import guard_kernel

        return guard_kernel.takes(logits) and guard_kernel.usable(logits.device, logits.dtype, logits.shape[1])

    def _buffer(self, rows: int, dtype: torch.dtype) -> _Buffer:
        """A landed buffer that holds ``rows`` (one of just that size first, as a batch of
        256 finds: no slice), else a new one of at least 256 rows, a power of two (a
        batch that changes size every step allocates nothing)."""
        spare, read = self._spare, self._read
        while read:  # (deque's append and popleft are atomic: no lock with the reading thread)
            spare.append(read.popleft())
        fits = None
        for i in range(len(spare)):
            buffer = spare[i]
            if buffer.host.dtype == dtype and buffer.host.shape[0] >= rows:
                if buffer.host.shape[0] == rows:
                    fits = i
                    break
                if fits is None:
                    fits = i
        if fits is not None:
            buffer = spare[fits]
            del spare[fits]
            return buffer
        host = torch.empty(max(256, 1 << (rows - 1).bit_length()), dtype=dtype, pin_memory=True)
        return _Buffer(host, host_view(host), torch.cuda.Event())

    def detach(self) -> Callable[[], list[str]] | None:
        """The checks not read yet, handed over (this object forgets them): a function
        that returns the requests whose rows were not finite, waiting for the device if
        it must, once (its buffers are then reused). Safe to call from another thread;
        called where vLLM has already waited for the step, it does not wait."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        read = self._read

        def failed() -> list[str]:
            found: list[str] = []
            for req_ids, buffer in pending:
                buffer.event.synchronize()
                found += _bad(req_ids, buffer.read(len(req_ids)))
                read.append(buffer)
            pending.clear()
            return found

        return failed


def host_view(host: torch.Tensor) -> np.ndarray | None:
    """The numpy view a buffer's maxima (or the fused kernel's flags, uint8) are read
    through, without torch: floats as they are, bfloat16 (which numpy lacks) as its bits
    (uint16); None for other dtypes."""
    if host.dtype in (torch.float32, torch.float16, torch.float64, torch.uint8):
        return host.numpy()
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16)
    return None


class _Buffer(NamedTuple):
    """A pinned buffer of one step's row maxima (or the guard kernel's row flags), its
    numpy view (:func:`host_view`) and the event that says they have landed."""

    host: torch.Tensor
    maxima: np.ndarray | None
    event: Any

    def read(self, rows: int) -> np.ndarray:
        return self.maxima[:rows] if self.maxima is not None else self.host[:rows].float().numpy()


def prepare(device: torch.device | str, dtype: torch.dtype, width: int) -> bool:
    """Build the guard's kernel for logits rows of this dtype and width on this device
    now, at model load: the first traced step would otherwise build it while the batch
    waits (vLLM logs that as a JIT compilation during inference). True when the kernel
    will guard such rows; always False off CUDA (nothing is built)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index is None:  # (the key a step's logits give: their device has its index)
        device = torch.device("cuda", torch.cuda.current_device())
    from . import guard_kernel

    return guard_kernel.usable(device, dtype, width)


def _bad(req_ids: list[str], maxima: np.ndarray) -> list[str]:
    """The requests whose row maximum is NaN or +inf (bfloat16 bits: an all-ones
    exponent is NaN or an infinity; -inf, a mask, is finite here), or whose flag is set
    (uint8: the fused kernel's)."""
    if maxima.dtype == np.uint8:
        finite = maxima == 0
    elif maxima.dtype == np.uint16:
        finite = ((maxima & 0x7F80) != 0x7F80) | (maxima == 0xFF80)
    else:
        finite = maxima < np.inf  # (NaN compares false)
    if finite.all():
        return []
    return [req_ids[i] for i in np.flatnonzero(~finite)]


@dataclass
class GuardedRows:
    """The logits rows the non-finite check covers, kept while the batch's rows and
    requests stay the same (``epoch``, ``rows``): the traced requests that may edit,
    their rows' index (None: every row, in order) and each one's first block (whose
    step names when an error was found, also once the block has ended)."""

    epoch: int
    rows: dict[str, int]
    req_ids: list[str]
    index: torch.Tensor | None
    blocks: dict[str, Any]


def non_finite_message(step: int | str) -> str:
    # (by: on a GPU the step is read where the step's output is taken, when the request
    # may have moved on to the next one)
    return (f"the logits held NaN or inf by step {step}: an edit made this request's activations overflow or "
            "become NaN, so it ends here (its KV cache blocks are zeroed before any other request gets them)")
