"""One fused Triton kernel for a lane's work on one tapped tensor.

Every full-graph decode step of a tapped engine replays each lane's kernels, traced
or not (:mod:`.lanes`). As torch ops they are eleven small kernels per tensor,
about 50 µs per step for a decoder layer's two tensors on an H100
(``benchmarks/gpu/lane_bench.py``). This kernel does the same in one launch: each
program loads its row's slot and the row's values; only a row whose slot edits
(``mask``) is computed and written back, and every row is copied to the read
buffer. Untouched rows are never written, so they stay bit for bit.

The arithmetic is the lanes' (:func:`.arith.lane_coefficients`): in float32,
``x * scale + offset`` where ``keep``, else ``offset``, rounded once to the
tensor's type (Triton rounds a float downcast to nearest even, as torch's casts
do). For each edit one of ``scale == 1`` and ``offset == ±0`` holds, so a fused
multiply-add gives the same bits as a multiply and then an add.

Triton compiles the kernel when a lane is created, outside CUDA-graph capture
(:func:`warm`), for the lane's dtype and width; a launch during capture then finds
that build (its tables are fixed allocations, and :func:`takes` admits only
contiguous, 16-byte aligned tensors). Without Triton, or for a tensor it does not
take, the lane runs its torch ops.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from .triton_jit import jitted, tl, triton

if TYPE_CHECKING:
    from .lanes import PartLane


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
logger = logging.getLogger("vllm.nnsight_plugin")


def _lane(x_ptr, read_ptr, sel_ptr, mask_ptr, keep_ptr, scale_ptr, offset_ptr,
          WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block of columns): the row's edit, if its slot has one, then the
    row's copy into the read buffer."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < WIDTH
    at = row * WIDTH + cols
    x = tl.load(x_ptr + at, mask=inside)
    slot = tl.load(sel_ptr + row)
    if tl.load(mask_ptr + slot):
        keep = tl.load(keep_ptr + slot)
        scale = tl.load(scale_ptr + slot)
        offset = tl.load(offset_ptr + slot * WIDTH + cols, mask=inside)
        y = tl.where(keep, x.to(tl.float32) * scale + offset, offset)
        x = y.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + at, x, mask=inside)
    tl.store(read_ptr + at, x, mask=inside)


kernel = jitted(_lane)  # (the kernel for this process: see triton_jit)


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel can run on ``x`` (row-major, 16-byte aligned, a float type
    it was compiled for)."""
    return x.dtype in DTYPES and x.is_contiguous() and x.data_ptr() % 16 == 0


def launch(lane: PartLane, x: torch.Tensor) -> None:
    """The lane's edits of ``x``'s rows and their copy into its read buffer (from the
    lane's tables; ``x`` has at most ``lane.rows`` rows)."""
    if not x.shape[0]:
        return
    width = math.prod(lane.inner)
    block = min(1024, triton.next_power_of_2(width))
    grid = (x.shape[0], triton.cdiv(width, block))
    kernel()[grid](x, lane.read, lane.sel, lane.mask, lane.keep, lane.scale, lane.offset, WIDTH=width, BLOCK=block)


def warm(lane: PartLane) -> bool:
    """Compile the kernel for the lane's tensors on a scratch row (outside capture: a
    full graph records a launch, not a compile). False when the lane cannot use it."""
    try:
        if kernel() is None:
            return False
        scratch = torch.zeros((1, *lane.inner), dtype=lane.dtype, device=lane.sel.device)
        if not takes(scratch):
            return False
        launch(lane, scratch)  # (sel is all 0 at creation: only read's first row is written)
    except Exception:  # noqa: BLE001 - a GPU or build where Triton cannot run it: the torch ops do
        logger.warning("lanes: the fused Triton kernel failed to build; the lanes run as torch ops", exc_info=True)
        return False
    return True
