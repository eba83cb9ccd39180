"""The edit arithmetic is defined once (engine/arith.py): the batched Python path,
the per-request spec runner and the CUDA-graph lanes' kernels (run here on CPU
tensors) all equal eager PyTorch's in-place statement, NaN and inf rows included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_nnsight_plugin.engine import arith, lanes

NASTY = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e30, -3.5]


def _rows(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    x[0, :] = float("nan")
    x[1, 0], x[1, 1], x[2, 2], x[3, 3] = float("inf"), float("-inf"), -0.0, 1e30
    return x.to(dtype)


def _eager(kind: str, x: torch.Tensor, value, factor: float) -> torch.Tensor:
    """The statement a block would write."""
    x = x.clone()
    if kind == "add":
        x[:] += value
    elif kind == "scale":
        x[:] *= factor
    elif kind == "zero":
        x[:] = 0
    else:
        x[:] = value
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", arith.EDITS)
@pytest.mark.parametrize("operand", ["vector", "number"])
def test_every_path_equals_eager_torch_on_non_finite_rows(dtype, kind, operand):
    x = _rows(dtype)
    vec = torch.linspace(-2, 2, 8)
    raw = vec.tolist() if operand == "vector" else 0.1
    factor = 0.3 if kind == "scale" else 1.0
    value = arith.operand(raw, x)
    eager_value = vec if operand == "vector" else 0.1
    want = _eager(kind, x, eager_value, factor)

    python = arith.apply(kind, x.clone(), value if kind in ("add", "set") else None, factor)
    lane = lanes.PartLane(x, rows=8)
    lane.set_slots([lane.coefficients(kind, value if kind in ("add", "set") else None, factor)])
    lane.set_rows([(0, 6, 1)])
    laned = x.clone()
    lane.kernels(laned)
    # (with a Python number, eager CPU kernels of half types round the number to the
    # tensor's type first; CUDA's, where lanes run, compute in float32 as the lanes do)
    lane_want = want if operand == "vector" else _eager(kind, x.float(), eager_value, factor).to(dtype)
    for got, ref in ((python, want), (laned, lane_want)):
        assert got.dtype == ref.dtype
        assert torch.equal(got.isnan(), ref.isnan())
        same = ref.isnan() | (got == ref)
        assert bool(same.all()), (kind, got, ref)
        assert torch.equal(torch.signbit(got[~ref.isnan()]), torch.signbit(ref[~ref.isnan()]))


def test_rows_a_lane_does_not_pick_are_left_bit_for_bit():
    x = _rows(torch.float32)
    lane = lanes.PartLane(x, rows=8)
    lane.set_slots([lane.coefficients("zero", None, 1.0)])
    lane.set_rows([(1, 2, 1)])
    out = x.clone()
    lane.kernels(out)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[1] = False
    a, b = out[untouched], x[untouched]
    assert torch.equal(a.isnan(), b.isnan()) and bool(((a == b) | a.isnan()).all())
    assert bool((out[1] == 0).all())


def test_a_lane_gives_every_row_an_edit_of_its_own():
    """A lane has a slot per row: 40 rows, 40 distinct edits (a sweep's per-row vectors,
    numbers, scales, zeros) set at once, each row equal to its own edit in eager torch;
    more edits than rows are refused."""
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    kinds = [("add", torch.linspace(-1, 1, 8) * (i + 1) / 7, 1.0) if i % 4 == 0 else
             ("set", 0.25 * i, 1.0) if i % 4 == 1 else ("scale", None, 0.5 + i / 10) if i % 4 == 2 else
             ("zero", None, 1.0) for i in range(40)]
    lane = lanes.PartLane(x, rows=40)
    lane.set_slots([lane.coefficients(kind, arith.operand(v.tolist(), x) if isinstance(v, torch.Tensor) else
                                      (arith.operand(v, x) if v is not None else None), f) for kind, v, f in kinds])
    lane.set_rows([(i, i + 1, i + 1) for i in range(40)])
    out = x.clone()
    lane.kernels(out)
    for i, (kind, v, f) in enumerate(kinds):
        want = _eager(kind, x[i : i + 1].float(), v, f).to(x.dtype)
        assert torch.equal(out[i : i + 1].view(torch.int16), want.view(torch.int16)), (i, kind)
    with pytest.raises(ValueError, match="41 distinct edits for a lane of 40 slots"):
        lane.set_slots([lane.coefficients("zero", None, 1.0)] * 41)
    assert lanes.PartLane(x, rows=40, slots=8).offset.shape == (9, 8)  # (a step's requests bound them)


def test_a_lane_broadcasts_a_value_as_eager_torch_does():
    """A value broadcast over a row as eager PyTorch broadcasts it (one number in a
    list, a row of a 3 x 500 tensor, a leading 1), and refused where eager refuses
    (another width), instead of cut to its first row."""
    x = torch.randn(4, 3, 500, generator=torch.Generator().manual_seed(2))
    lane = lanes.PartLane(x, rows=4)
    for value in ([0.5], torch.linspace(-1, 1, 500).tolist(), torch.ones(1, 3, 500).tolist()):
        operand = arith.operand(value, x)
        lane.set_slots([lane.coefficients("add", operand, 1.0)])
        lane.set_rows([(0, 4, 1)])
        out = x.clone()
        lane.kernels(out)
        assert torch.equal(out, x + torch.tensor(value).reshape(torch.tensor(value).shape))
    with pytest.raises(RuntimeError):
        lane.coefficients("add", arith.operand(torch.ones(1000).tolist(), x), 1.0)


def test_operands_refuse_non_finite_values():
    x = torch.zeros(2, 3)
    for bad in (float("nan"), [1.0, float("inf"), 0.0]):
        with pytest.raises(ValueError, match="NaN or inf"):
            arith.operand(bad, x)


def _fused_against_torch_ops(dtype: torch.dtype, device: str) -> None:
    """The fused lane kernel and the lanes' torch ops give the same bits: every edit
    (a slot each), rows no slot picks, NaN and inf rows, the read buffer; on rows of
    3 x 500 values (two blocks of columns, the second partly outside the row)."""
    from vllm_nnsight_plugin.engine import lane_kernel

    x = torch.randn(12, 3, 500, generator=torch.Generator().manual_seed(1))
    x[0], x[1, 2, 7], x[2, 0, 499], x[5, 1, 0], x[9, 2, 3] = float("nan"), float("inf"), float("-inf"), -0.0, 1e30
    x = x.to(dtype=dtype, device=device)
    lane = lanes.PartLane(x, rows=16)
    vec = arith.operand(torch.linspace(-2, 2, 1500).reshape(3, 500).tolist(), x)
    lane.set_slots([lane.coefficients(*edit) for edit in [("add", vec, 1.0), ("scale", None, 0.3), ("zero", None, 1.0),
                                                          ("set", vec, 1.0), ("set", 0.1, 1.0), ("add", 0.1, 1.0)]])
    lane.set_rows([(0, 2, 1), (2, 3, 2), (4, 5, 3), (5, 7, 4), (8, 9, 5), (9, 11, 6)])  # rows 3, 7, 11: none
    by_ops, fused = x.clone(), x.clone()
    lane.kernels(by_ops)
    read_by_ops = lane.read.clone()
    lane.read.fill_(7)
    assert lane_kernel.takes(fused)
    lane_kernel.launch(lane, fused)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert not torch.equal(by_ops.view(bits), x.view(bits))  # (the edits changed something)
    assert torch.equal(fused.view(bits), by_ops.view(bits))
    assert torch.equal(lane.read[:12].view(bits), read_by_ops[:12].view(bits))
    assert bool((lane.read[12:] == 7).all())  # (rows past the batch: not written)
    assert torch.equal(fused[[3, 7, 11]].view(bits), x[[3, 7, 11]].view(bits))  # untouched: bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_lane_kernel_equals_the_torch_ops(dtype, monkeypatch):
    # Triton's interpreter runs the kernel on CPU tensors (it casts to bfloat16 by
    # truncation, not as the GPU rounds: bfloat16 is checked on CUDA below)
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _fused_against_torch_ops(dtype, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the kernel compiled for the GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_lane_kernel_equals_the_torch_ops_on_cuda(dtype):
    _fused_against_torch_ops(dtype, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: where lanes take the fused kernel")
def test_a_gpu_lane_runs_the_fused_kernel_inside_a_cuda_graph():
    """As vLLM uses lanes: made at the tap op's first call (outside capture), captured
    into a full graph, then the tables of a later step set before a replay; the
    replay equals the torch ops on the same tables, and captured no build."""
    from vllm_nnsight_plugin.engine import lane_kernel

    site = "model.layers.0|output|(TT"
    xs = [torch.randn(8, 3, 500, device="cuda").to(torch.bfloat16) for _ in range(2)]
    lanes.enable(16)
    try:
        lanes.run(site, xs)
        lane = lanes.lanes_at(site)[0]
        assert lane.fused is lane_kernel
        builds = sum(len(cache[0]) for cache in lane_kernel.kernel().device_caches.values())
        static = [x.clone() for x in xs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lanes.run(site, static)
        assert sum(len(cache[0]) for cache in lane_kernel.kernel().device_caches.values()) == builds
        lane.set_slots([lane.coefficients("add", arith.operand(torch.linspace(-2, 2, 1500).reshape(3, 500).tolist(),
                                                               xs[0]), 1.0)])
        lane.set_rows([(2, 5, 1)])
        for x, y in zip(static, xs):
            x.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        want = xs[0].clone()
        lane.fused = None  # (the torch ops, on the same tables)
        lane.kernels(want)
        assert torch.equal(static[0].view(torch.int16), want.view(torch.int16))
        assert torch.equal(static[1].view(torch.int16), xs[1].view(torch.int16))  # (no slots: untouched)
    finally:
        lanes.reset()


def _guard_against_torch_ops(dtype: torch.dtype, device: str) -> None:
    """The logits guard's kernel makes rows finite as ``torch.nan_to_num(x,
    neginf=-inf)`` does, bit for bit (NaN, +inf, -inf kept as a mask, large finite
    values), over rows of 9000 values (three blocks of columns, the last partly outside
    the row), for every row or for a subset (rows outside it untouched), and flags the
    rows that held NaN or +inf."""
    from vllm_nnsight_plugin.engine import guard_kernel

    inf, nan = float("inf"), float("nan")
    padded = torch.randn(6, 9064, generator=torch.Generator().manual_seed(2))
    padded[:, 9000:] = nan  # (past the vocabulary: never read, never written)
    x = padded[:, :9000]
    x[1, 7], x[2, 8999], x[3, 4096], x[4, 0], x[4, 8200], x[5, 100] = nan, inf, -inf, nan, inf, 6e4
    x[1, 8], x[1, 9], x[1, 10] = -0.0, -nan, 1e-40  # (kept bit for bit in a block that is fixed)
    x[0, :5] = -inf
    padded = padded.to(dtype=dtype, device=device)
    x = padded[:, :9000]  # (rows of a padded vocabulary, as vLLM slices them: strided)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    pinned = device == "cuda"
    assert guard_kernel.takes(x) and not guard_kernel.takes(x[:, ::2]) and not guard_kernel.takes(x.int())

    def guarded(index: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        out = padded.clone()
        flags = torch.full((6,), 9, dtype=torch.uint8, pin_memory=pinned)
        guard_kernel.launch(out[:, :9000], index, flags)
        if pinned:
            torch.cuda.synchronize()
        assert torch.isnan(out[:, 9000:]).all()  # (the padding: untouched)
        return out[:, :9000], flags.tolist()

    whole, flags = guarded(None)
    assert torch.equal(whole.view(bits), torch.nan_to_num(x, neginf=-inf).view(bits))
    assert flags == [0, 1, 1, 0, 1, 0]
    part, flags = guarded(torch.tensor([4, 0, 2], device=device))
    expected = x.clone()
    expected[[4, 0, 2]] = torch.nan_to_num(x[[4, 0, 2]], neginf=-inf)
    assert torch.equal(part.view(bits), expected.view(bits))
    assert torch.equal(part[[1, 3, 5]].view(bits), x[[1, 3, 5]].view(bits))  # (not guarded: as they were)
    assert flags == [1, 0, 1, 9, 9, 9]  # (flags past the guarded rows: not written)
    with pytest.raises(ValueError, match="need as many uint8 flags"):
        guard_kernel.launch(x.clone(), None, torch.zeros(5, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_guard_kernel_equals_nan_to_num(dtype):
    # Triton's interpreter, in a process of its own: the kernel's reductions are
    # Triton's own jitted functions, which run interpreted only when TRITON_INTERPRET
    # is set before Triton is imported
    pytest.importorskip("triton")
    code = ("import sys, torch; sys.path.insert(0, 'tests'); import test_arith; "
            f"test_arith._guard_against_torch_ops(torch.{dtype}, 'cpu'); print('OK')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the kernel compiled for the GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_guard_kernel_equals_nan_to_num_on_cuda(dtype):
    _guard_against_torch_ops(dtype, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the guard's fused path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_guard_on_a_gpu_takes_its_kernel_and_names_the_same_rows(dtype):
    """On a GPU the guard runs its one kernel, its flags land in pinned memory the
    device wrote, and it names the rows the torch ops name."""
    from vllm_nnsight_plugin.engine import finite_logits, guard_kernel

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, nan, 0.0], [-inf, 0.5, -inf], [inf, 0.0, 1.0]], dtype=dtype)
    logits = torch.cat([logits, torch.zeros(4, 29)], dim=1).to(dtype).cuda()
    assert guard_kernel.usable(logits.device, dtype, logits.shape[1])
    guard = finite_logits.FiniteLogits()
    whole = logits.clone()
    assert guard.check(whole, None, ["a", "b", "c", "d"]) == []
    assert guard._pending[0][1].host.dtype == torch.uint8  # (the kernel's flags, not maxima)
    assert guard.detach()() == ["b", "d"]
    assert torch.equal(whole, torch.nan_to_num(logits, neginf=-inf))
    part = logits.clone()
    guard.check(part, torch.tensor([1, 2], device="cuda"), ["b", "c"])
    assert guard.detach()() == ["b"] and torch.isinf(part[3, 0]) and torch.isfinite(part[1]).all()


def test_the_guard_kernel_is_not_built_per_row_stride(monkeypatch):
    """vLLM guards ``logits[:, :vocab]`` of a padded vocabulary: the row stride differs
    from the width :func:`usable` tries, and Triton would build a new variant for a
    stride of another divisibility inside a live step (GPT-2: 50257 wide, 50304 apart)."""
    pytest.importorskip("triton")
    from vllm_nnsight_plugin.engine import guard_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the compiled kernel's options)
    params = {p.name: p for p in guard_kernel.kernel().params}
    assert params["row_stride"].do_not_specialize and not params["VOCAB"].do_not_specialize


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the kernel's builds")
def test_a_padded_vocabulary_launches_the_build_usable_made(monkeypatch):
    from vllm_nnsight_plugin.engine import finite_logits, guard_kernel

    monkeypatch.setattr(guard_kernel, "DIRECT", False)  # (through the JIT, which would build for a new stride)

    padded = torch.zeros(4, 50304, dtype=torch.bfloat16, device="cuda")
    logits = padded[:, :50257]
    assert guard_kernel.usable(logits.device, logits.dtype, 50257)
    builds = sum(len(cache[0]) for cache in guard_kernel.kernel().device_caches.values())
    logits[2, 7] = float("nan")
    guard = finite_logits.FiniteLogits()
    guard.check(logits, None, ["a", "b", "c", "d"])
    assert guard._pending[0][1].host.dtype == torch.uint8  # (the kernel ran)
    assert guard.detach()() == ["c"]
    assert sum(len(cache[0]) for cache in guard_kernel.kernel().device_caches.values()) == builds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the kernel's builds")
@pytest.mark.parametrize("indexed", [False, True])
def test_the_guard_kernel_is_launched_directly_only_where_its_build_fits(monkeypatch, indexed):
    """After the JIT's first launch the build is launched without the JIT; logits or
    flags whose pointer is not 16-byte aligned (Triton built for aligned ones) go
    through the JIT, and every way comes out as the torch ops make it."""
    from vllm_nnsight_plugin.engine import guard_kernel

    width = 40
    device = torch.cuda.current_device()
    assert guard_kernel.usable(torch.device("cuda", device), torch.bfloat16, width)
    key = (device, torch.bfloat16, width, torch.long if indexed else None)
    jit, build = guard_kernel._built[key]
    direct = []

    class Counted:  # (the build, its direct launches counted)
        def __getitem__(self, grid):
            direct.append(grid)
            return build[grid]

    monkeypatch.setitem(guard_kernel._built, key, (jit, Counted()))
    padded = torch.randn(3, width + 1, device="cuda").to(torch.bfloat16)
    padded[1, 5], padded[2, 7] = float("nan"), float("inf")
    for offset, flag_offset, launched_directly in ((0, 0, 1), (1, 0, 0), (0, 1, 0)):  # (1: not aligned)
        direct.clear()
        logits = padded.clone()[:, offset : offset + width]
        index = torch.tensor([2, 1, 0], device="cuda") if indexed else None
        flags = torch.full((4,), 9, dtype=torch.uint8, pin_memory=True)[flag_offset : flag_offset + 3]
        guard_kernel.launch(logits, index, flags)
        torch.cuda.synchronize()
        expected = torch.nan_to_num(padded[:, offset : offset + width], neginf=float("-inf"))
        assert len(direct) == launched_directly
        assert torch.equal(logits, expected)
        assert flags.tolist() == ([1, 1, 0] if indexed else [0, 1, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the guard's fused path")
def test_a_failing_launch_leaves_the_guard_on_its_torch_ops(monkeypatch):
    from vllm_nnsight_plugin.engine import finite_logits, guard_kernel

    logits = torch.zeros(3, 40, dtype=torch.bfloat16, device="cuda")
    logits[1, 3] = float("inf")
    assert guard_kernel.usable(logits.device, logits.dtype, 40)

    def broken(*args, **kwargs):
        raise RuntimeError("a build that fails")

    monkeypatch.setattr(guard_kernel, "launch", broken)
    monkeypatch.setattr(guard_kernel, "_given_up", set())
    guard = finite_logits.FiniteLogits()
    guard.check(logits, None, ["a", "b", "c"])
    assert guard._pending[0][1].host.dtype == torch.bfloat16  # (the torch ops' maxima)
    assert guard.detach()() == ["b"] and torch.isfinite(logits).all()
    assert not guard_kernel.usable(logits.device, logits.dtype, 40)
