"""Lanes: batched spec edits and reads that run inside full CUDA graphs.

A tapped step normally leaves vLLM's full CUDA graph for piecewise graphs so the
tap op's Python can run. A step whose traced requests only carry batched specs
(a steering vector, an ablation, whole-row reads) needs no Python in the
forward: the tap op's own kernels apply them from device tables the worker
fills before the step, so the step keeps the full graph.

Per tapped tensor (a *part*: ``output[0]`` of a decoder layer) a lane holds a
slot per row of the batch (``sel``; 0 leaves the row untouched) and, per slot,
a mask, a keep flag, a scale and an offset (a slot for every request a step can hold,
so each may carry an edit of its own: a strength sweep, a steering vector per prompt):

    y = where(keep[sel], x * scale[sel] + offset[sel], offset[sel])
    x[:] = where(mask[sel], y, x);  read[:n] = x

with the coefficients of :func:`.arith.lane_coefficients` (``zero`` and ``set``
do not read the old value, so a NaN row becomes what eager PyTorch makes it); the
arithmetic runs in fp32 and rounds once, as PyTorch's own in-place ops do, so
the result equals the eager path's; untouched rows are copied as they are (bit
for bit). These kernels are recorded when vLLM captures its full graphs and
replay on every step, traced or not: on a GPU one fused Triton kernel per tapped
tensor (:mod:`.lane_kernel`), elsewhere (or for a tensor it cannot take) the
torch ops of :meth:`PartLane.kernels` (the price of keeping full graphs;
``--additional-config '{"nnsight": {"lanes": false}}'`` turns lanes off). Outside
graph replay (eager or piecewise steps) they run only on steps that use them.

A step with the rows and slots of the step before (decode steps of a steady
batch) uploads nothing: ``sel`` keeps its table, and :func:`settle` zeroes, before
a forward, only the lanes that step does not use.

Lanes are per worker process, keyed by tap site (as the tap op's handler is):
one tapped engine per process, which is how vLLM runs its workers.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np
import torch

from . import arith

_cap = 0  # rows a lane holds (vLLM's largest CUDA-graph batch); 0: lanes off
_slots = 0  # distinct edits a lane holds per step (the requests a step can hold)
_sites: dict[str, list[PartLane | None]] = {}  # tap site -> a lane per tensor of its value
_not_in_graphs: set[str] = set()  # sites captured into a full graph before their lanes existed
_failed: set[str] = set()  # sites whose lane kernels raised this step
_stale: set[PartLane] = set()  # lanes whose sel may still hold an earlier step's slots
STATS = {"lane": 0, "python": 0}  # location-steps of batched specs served by lanes / by Python
logger = logging.getLogger("vllm.nnsight_plugin")


def enable(rows: int, slots: int | None = None) -> None:
    """Turn lanes on (the runner's model is tapped and compiled), ``rows`` per lane and
    ``slots`` distinct edits (at most ``rows``; None: ``rows``)."""
    global _cap, _slots
    _cap = max(int(rows), 1)
    _slots = _cap if slots is None else max(1, min(int(slots), _cap))


def enabled() -> bool:
    return _cap > 0


def capacity() -> int:
    """Rows a lane holds: a step with more tokens runs the Python path."""
    return _cap


def sites() -> list[str]:
    """Tap sites that have lanes (created at the op's first call)."""
    return list(_sites)


class PartLane:
    """Device tables and read buffer for one tapped tensor (fixed addresses: a full
    CUDA graph captured them)."""

    def __init__(self, like: torch.Tensor, rows: int, slots: int | None = None):
        device, inner = like.device, tuple(like.shape[1:])
        slots = rows if slots is None else min(slots, rows)
        ones = (1,) * len(inner)
        self.rows, self.dtype, self.inner = rows, like.dtype, inner
        self.sel = torch.zeros(rows, dtype=torch.int64, device=device)
        # (slot 0 untouched, then one per request a step can hold: a request has at most
        # one edit of a tensor, so a step has at most that many distinct edits)
        self.slots = slots
        self.mask = torch.zeros((slots + 1, *ones), dtype=torch.bool, device=device)
        self.keep = torch.zeros((slots + 1, *ones), dtype=torch.bool, device=device)
        self.scale = torch.ones((slots + 1, *ones), dtype=torch.float32, device=device)
        self.offset = torch.zeros((slots + 1, *inner), dtype=torch.float32, device=device)
        self.read = torch.zeros((rows, *inner), dtype=like.dtype, device=device)
        pin = device.type == "cuda"
        self._staging = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events: list[Any] = [None, None]
        self._turn = 0
        self.editing = False  # sel holds slots this step
        self.reading = False  # a read wants this step's rows
        self.slot_keys: tuple = ()  # what the tables hold (re-uploaded when it changes)
        self._live: Any = None  # the host table sel holds (None: zeros)
        self.fused: ModuleType | None = None  # lane_kernel, where its one Triton kernel runs this lane

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and tuple(x.shape[1:]) == self.inner and x.shape[0] <= self.rows

    def kernels(self, x: torch.Tensor) -> None:
        if self.fused is not None and x.shape[0] <= self.rows and self.fused.takes(x):
            self.fused.launch(self, x)
            return
        n = x.shape[0]
        idx = self.sel[:n]
        offset = self.offset.index_select(0, idx)
        y = torch.addcmul(offset, x.float(), self.scale.index_select(0, idx))
        y = torch.where(self.keep.index_select(0, idx), y, offset)
        x.copy_(torch.where(self.mask.index_select(0, idx), y.to(x.dtype), x))
        self.read[:n].copy_(x)

    def set_rows(self, spans_slots: list[tuple[int, int, int]]) -> Any:
        """Slot per row for this step (rows not named stay 0). Returns the host table,
        which :meth:`set_table` can upload again for a step with the same rows."""
        table = np.zeros(self.rows, dtype=np.int64)
        for start, end, slot in spans_slots:
            table[start:end] = slot
        self.set_table(table)
        return table

    def set_table(self, table: Any) -> None:
        """Upload a slot-per-row table (from :meth:`set_rows`) through a pinned staging
        buffer (two, alternating: the copy of the step before may still be in flight);
        nothing when sel already holds that very table."""
        self.editing = True
        _stale.discard(self)
        if table is self._live:
            return
        self._live = table
        i = self._turn = 1 - self._turn
        if self._events[i] is not None:
            self._events[i].synchronize()  # its copy two steps ago has long landed
        host = self._staging[i]
        host.numpy()[:] = table
        self.sel.copy_(host, non_blocking=True)
        if self.sel.device.type == "cuda":
            self._events[i] = torch.cuda.Event()
            self._events[i].record()

    def coefficients(self, kind: str, value: arith.Operand | None, factor: float) -> tuple:
        """One slot's ``(keep, scale, offset)``; a tensor offset as one row of this lane's
        shape, broadcast as eager PyTorch broadcasts a value over a row (raises where it
        would: a value of another width)."""
        keep, scale, offset = arith.lane_coefficients(kind, value, factor)
        if isinstance(offset, torch.Tensor):
            if offset.dim() == len(self.inner) + 1 and offset.shape[0] == 1:
                offset = offset[0]
            offset = torch.broadcast_to(offset.to(self.offset.device, torch.float32), self.inner)
        return keep, scale, offset

    def set_slots(self, coefficients: list[tuple]) -> None:
        """Slots 1..n take ``coefficients[i - 1]`` (from :meth:`coefficients`). A handful
        of copies whatever n (a sweep fills hundreds of slots): the flags and numbers
        from pinned host memory without a wait, the tensor offsets stacked on the device."""
        n = len(coefficients)
        if not n:
            return
        if n > self.slots:
            raise ValueError(f"{n} distinct edits for a lane of {self.slots} slots")
        ones = (1,) * len(self.inner)
        keep = torch.tensor([c[0] for c in coefficients], dtype=torch.bool)
        scale = torch.tensor([c[1] for c in coefficients], dtype=torch.float32)
        numbers = torch.tensor([c[2] if isinstance(c[2], float) else 0.0 for c in coefficients], dtype=torch.float32)
        self.mask[1 : n + 1].fill_(True)
        self.keep[1 : n + 1].copy_(self._device(keep).view(n, *ones))
        self.scale[1 : n + 1].copy_(self._device(scale).view(n, *ones))
        self.offset[1 : n + 1].copy_(self._device(numbers).view(n, *ones).expand(n, *self.inner))
        tensors = [(slot, c[2]) for slot, c in enumerate(coefficients, 1) if not isinstance(c[2], float)]
        if tensors:
            where = self._device(torch.tensor([slot for slot, _ in tensors], dtype=torch.int64))
            self.offset.index_copy_(0, where, torch.stack([offset for _, offset in tensors]))

    def _device(self, host: torch.Tensor) -> torch.Tensor:
        """A small host table on the lane's device; on a GPU through pinned memory, so the
        copy does not make the host wait for the device (torch keeps the pinned block
        until the copy is done)."""
        device = self.offset.device
        if device.type != "cuda":
            return host.to(device)
        return host.pin_memory().to(device, non_blocking=True)

    def done(self) -> None:
        """End of the step. Untraced steps replay these kernels too, so sel goes back to
        0 before the next forward (:func:`settle`) unless that step sets the same table."""
        if self.editing:
            _stale.add(self)
        self.editing = self.reading = False

    def clear(self) -> None:
        if self._live is not None:
            self.sel.zero_()
            self._live = None


def settle() -> None:
    """Before a forward: zero sel of the lanes this step does not use (a full CUDA
    graph replays every lane's kernels)."""
    while _stale:
        _stale.pop().clear()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def run(site: str, xs: list[torch.Tensor]) -> None:
    """In the tap op, before its Python handler: this site's lane kernels."""
    if not _cap:
        return
    capturing = _capturing()
    parts = _sites.get(site)
    if parts is None:
        if capturing:  # a full graph without this site's lanes: never use them
            _not_in_graphs.add(site)
            return
        parts = _sites[site] = [PartLane(x, _cap, _slots) if x.is_floating_point() and x.dim() >= 2 else None
                                for x in xs]
        for lane in parts:
            if lane is not None and lane.sel.is_cuda:
                from . import lane_kernel  # (Triton: only where a GPU's lanes use it)

                lane.fused = lane_kernel if lane_kernel.warm(lane) else None
    for lane, x in zip(parts, xs):
        if lane is not None and (capturing or lane.editing or lane.reading) and lane.fits(x):
            lane.kernels(x)


def guarded_run(site: str, xs: list[torch.Tensor]) -> None:
    """:func:`run`, never breaking vLLM's forward: a failure is reported on the
    requests the lanes served this step (:func:`take_failed`)."""
    try:
        run(site, xs)
    except Exception:  # noqa: BLE001
        logger.exception("lanes at %s failed", site)
        _failed.add(site)


def take_failed(site: str) -> bool:
    if site in _failed:
        _failed.discard(site)
        return True
    return False


def lanes_at(site: str) -> list[PartLane | None] | None:
    """The site's lanes, if every full graph holds them."""
    if not _cap or site in _not_in_graphs:
        return None
    return _sites.get(site)


def part_of(code: str, index: int | None) -> int | None:
    """Which tensor of a site's value (its code, see taps) ``index`` picks; None
    when it picks no single tensor."""
    if code == "T":
        return 0 if index is None else None
    if index is None or not 0 <= index < len(code) - 1 or code[1 + index] != "T":
        return None
    return code[1 : 1 + index].count("T")


def reset() -> None:
    """Forget every lane (tests; a new model)."""
    global _cap, _slots
    _cap = _slots = 0
    _sites.clear()
    _not_in_graphs.clear()
    _failed.clear()
    _stale.clear()
