"""The logits guard's work in one Triton kernel (:mod:`.finite_logits`).

As torch ops, each step the guard takes the rows' maxima, makes the rows finite in
place and copies the maxima to the host: three launches (five for a subset of the
rows: their gather and scatter too). This kernel does it in one launch: a program per
guarded row scans the row in blocks; a block that holds NaN or +inf is made finite as
``torch.nan_to_num(x, neginf=-inf)`` makes it (NaN to 0, +inf to the dtype's largest
value, -inf kept: a mask) and written back; other blocks are never written. The row's
flag (1: it was not finite) goes straight into the step's pinned host buffer, which
the device addresses directly, so no copy follows. Measured on an H100
(``benchmarks/gpu/guard_bench.py``): less GPU time per step than the torch ops, and
less host time where only some of a step's rows are guarded.

Built per dtype, vocabulary width and variant (every row, or rows through an index),
not per row stride (``do_not_specialize``: a padded vocabulary's stride differs from
the width the first try uses). They are built and tried when the model loads, for
the logits it makes (:func:`.finite_logits.prepare`); logits of another dtype or width
are built at their first guarded step (:func:`usable`: a one-time stall). A GPU or
build where the kernel cannot run, a buffer the device cannot address, or a launch
that fails later (:func:`give_up`) leaves the guard on its torch ops. After the JIT's
first launch of a build, the build is launched directly (:func:`launch`) where it fits
(CUDA logits, 16-byte-aligned pointers as the JIT built for, the same JIT; ``DIRECT``):
the JIT binds and specializes the arguments again on every call, host time the step
loop pays.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch

from .triton_jit import jitted, tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 4096  # columns per pass (8 passes for a 32000-token vocabulary), over 8 warps
WARPS = 8
logger = logging.getLogger("vllm.nnsight_plugin")


def _guard(logits_ptr, index_ptr, flags_ptr, row_stride, VOCAB: tl.constexpr, INDEXED: tl.constexpr,
           BIG: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: row ``index[i]`` (``i`` when not INDEXED) made finite, its flag at ``flags[i]``."""
    i = tl.program_id(0)
    if INDEXED:
        row = tl.load(index_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    base = logits_ptr + row * row_stride
    bad = 0
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < VOCAB
        x = tl.load(base + cols, mask=inside, other=0.0)
        nan = x != x
        posinf = x == float("inf")
        if tl.sum((nan | posinf).to(tl.int32), axis=0) > 0:
            fixed = tl.where(nan, 0.0, tl.where(posinf, BIG, x.to(tl.float32)))
            tl.store(base + cols, fixed.to(x.dtype), mask=inside)
            bad = 1
    tl.store(flags_ptr + i, bad.to(tl.uint8))


kernel = jitted(_guard, do_not_specialize=["row_stride"])  # (the kernel for this process: see triton_jit)
_BIG = {dtype: torch.finfo(dtype).max for dtype in DTYPES}  # (+inf becomes this)
# (current device, dtype, width, the index's dtype or None) -> (the JIT, the build it launched
# for them): launched directly after that (:func:`launch`), without the JIT's binding of
# its arguments on every launch (the build's launcher calls Triton's launch hooks too)
_built: dict[tuple[int, torch.dtype, int, torch.dtype | None], tuple[Any, Any]] = {}
DIRECT = True  # (False: every launch through the JIT; benchmarks compare the two)
_given_up: set[tuple[torch.device, torch.dtype, int]] = set()  # (device, dtype, width) whose launch failed


def takes(logits: torch.Tensor) -> bool:
    """Whether the kernel can guard ``logits``: rows of a float type it knows, each row
    contiguous (rows may be strided: vLLM slices a padded vocabulary off)."""
    return logits.dim() == 2 and logits.dtype in DTYPES and logits.stride(1) == 1


def launch(logits: torch.Tensor, index: torch.Tensor | None, flags: torch.Tensor) -> None:
    """Make the rows at ``index`` (None: every row) finite in place; ``flags[i]`` = 1
    where the i-th guarded row was not, else 0 (uint8; pinned host memory or device
    memory, at least one per guarded row)."""
    rows = logits.shape[0] if index is None else index.shape[0]
    if flags.dtype != torch.uint8 or flags.numel() < rows:
        raise ValueError(f"{rows} guarded rows need as many uint8 flags (got {flags.numel()} {flags.dtype})")
    if not rows:
        return
    indexed = index is not None
    args = (logits, index if indexed else logits, flags, logits.stride(0), logits.shape[1], indexed,
            _BIG[logits.dtype], BLOCK)
    jit = kernel()
    # (Triton specializes a pointer on its 16-byte alignment: a build is reused only for
    # pointers aligned as those of the launch that made it; it keys builds by the current
    # device, whose context it loaded the build into)
    aligned = not (logits.data_ptr() % 16 or flags.data_ptr() % 16 or (indexed and index.data_ptr() % 16))
    key = (torch.cuda.current_device(), logits.dtype, logits.shape[1], index.dtype if indexed else None) \
        if aligned and logits.is_cuda else None
    built = _built.get(key) if key is not None and DIRECT else None
    if built is not None and built[0] is jit:
        built[1][(rows, 1, 1)](*args)
        return
    made = jit[(rows,)](*args, num_warps=WARPS)
    if key is not None and made is not None and not hasattr(made, "result") and hasattr(made, "__getitem__"):
        _built[key] = (jit, made)


def usable(device: torch.device, dtype: torch.dtype, vocab: int) -> bool:
    """Whether the kernel runs on this device for rows of ``vocab`` values of this dtype
    and writes its flags into pinned host memory (:func:`_tried`), and no launch of it
    there has failed since (:func:`give_up`)."""
    return (device, dtype, vocab) not in _given_up and _tried(device, dtype, vocab)


def builds() -> int:
    """How many (device, dtype, width) this process has built and tried the kernel for."""
    return _tried.cache_info().misses


def give_up(device: torch.device, dtype: torch.dtype, vocab: int) -> None:
    """A launch failed (the caller logs why): the torch ops guard these logits from now on."""
    _given_up.add((device, dtype, vocab))


@functools.cache
def _tried(device: torch.device, dtype: torch.dtype, vocab: int) -> bool:
    """Tried once on a scratch row of that width (a NaN, an inf) against the torch ops,
    every row and through an index, so the builds a step launches exist before it needs
    them (a build is per dtype, width and variant); outside any CUDA-graph capture (the
    guard runs outside graphs)."""
    try:
        if kernel() is None or dtype not in DTYPES or vocab < 4:
            return False
        cuda = device.type == "cuda"
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            ok = True
            for index in (None, torch.zeros(1, dtype=torch.long, device=device)):
                row = torch.zeros((1, vocab), dtype=dtype, device=device)
                row[0, :4] = torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])
                flags = torch.zeros(2, dtype=torch.uint8, pin_memory=cuda)
                expected = torch.nan_to_num(row, neginf=float("-inf"))
                launch(row, index, flags)
                if cuda:
                    torch.cuda.synchronize(device)
                ok = ok and bool(flags[0] == 1) and torch.equal(row, expected)
        return ok
    except Exception:  # noqa: BLE001 - a GPU or build where Triton cannot run it: the torch ops do
        logger.warning("the logits guard's Triton kernel failed; the guard runs as torch ops", exc_info=True)
        return False
