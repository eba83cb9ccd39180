"""What the lanes' kernels cost a full CUDA graph's replay.

Every full-graph decode step of a tapped engine replays each tapped tensor's lane
kernels (``engine/lanes.PartLane.kernels``), whether or not a request uses them.
This captures them alone in a CUDA graph, ``--copies`` passes over the headline's
shapes (a decoder layer's output: two tensors of rows x 2048 bf16), as torch ops and
as the one fused Triton kernel (``engine/lane_kernel.py``, what lanes on a GPU run),
and gives a replay's time per pass; the kernels per tensor are counted in an eager
pass. The last column replays the same graph with a slot in use (a steering step's
tables): the kernels do the same work either way.

    python3 benchmarks/gpu/lane_bench.py [--rows 64,256,512] [--width 2048] [--tensors 2]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch


def _time_graph(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--tensors", type=int, default=2)
    parser.add_argument("--copies", type=int, default=20, help="lane passes per graph (amortizes the launch)")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    from vllm_nnsight_plugin.engine import lane_kernel, lanes

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| rows | lanes as | kernels per tensor | µs per step (all tensors) | µs per step, a slot in use |")
    print("|---:|---|---:|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        for fused in (False, True):
            _one(lanes, lane_kernel if fused else None, rows, args)


def _one(lanes: Any, fused: Any, rows: int, args: argparse.Namespace) -> None:
    xs = [torch.randn(rows, args.width, device="cuda").to(torch.bfloat16) for _ in range(args.tensors)]
    parts = [lanes.PartLane(x, rows) for x in xs]
    for lane in parts:
        lane.fused = fused if fused is not None and fused.warm(lane) else None
    if fused is not None and any(lane.fused is None for lane in parts):
        raise RuntimeError("the fused kernel did not build")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # (warm up outside capture: the allocator's pools)
        for lane, x in zip(parts, xs):
            lane.kernels(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.copies):
            for lane, x in zip(parts, xs):
                lane.kernels(x)
    per_pass = _time_graph(graph, args.reps) / args.copies
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for lane, x in zip(parts, xs):
            lane.kernels(x)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) // args.tensors
    # the same with a slot in use (a steering step): the tables differ, the graph is the same
    parts[0].set_slots([parts[0].coefficients("add", torch.ones(args.width, device="cuda"), 1.0)])
    parts[0].set_rows([(0, rows, 1)])
    torch.cuda.synchronize()
    used = _time_graph(graph, args.reps) / args.copies
    print(f"| {rows} | {'fused' if fused else 'torch ops'} | {kernels} | {per_pass * 1e6:.1f} | {used * 1e6:.1f} |",
          flush=True)
    lanes.reset()


if __name__ == "__main__":
    main()
