"""What the logits guard costs the engine core's CPU per step, as torch ops and as its
one Triton kernel (``engine/guard_kernel.py``), launched through Triton's JIT or directly.

The engine core's step loop is bound by the CPU at the headline's size, so the
guard's host time per step is what steering pays for it. This times ``FiniteLogits
.check`` alone on the headline's logits (rows x 32000, every row guarded, or half of
them through an index), each way, many steps back to back with the device left to run
behind (as in the engine: nothing waits for the device), and the device time of one
step each way, and what each check leaves to Python's garbage collector (the engine
core's collector paused more per steering batch than per untraced one: run L of the
README): the net GC-tracked objects per check (what counts toward a young
collection) and the objects of reference cycles it left (freed only by a collection).

    python3 benchmarks/gpu/guard_bench.py [--rows 64,256,512] [--vocab 32000] [--steps 500] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch


def host_us(guard: Any, logits: torch.Tensor, index: torch.Tensor | None, req_ids: list[str], steps: int) -> float:
    """Median host time of one check, over ``steps`` checks (the flags read every 8)."""
    times = []
    for n in range(steps):
        t = time.perf_counter()
        guard.check(logits, index, req_ids)
        times.append(time.perf_counter() - t)
        if n % 8 == 7:
            guard.detach()()
    torch.cuda.synchronize()
    guard.detach()
    times.sort()
    return times[len(times) // 2] * 1e6


def garbage_per_step(guard: Any, logits: torch.Tensor, index: torch.Tensor | None, req_ids: list[str],
                     steps: int) -> tuple[float, float]:
    """Per check, with the collector off: the net GC-tracked objects allocated, and the
    objects of the reference cycles left behind (found by one collection after)."""
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        for n in range(steps):
            guard.check(logits, index, req_ids)
            if n % 8 == 7:
                guard.detach()()
        rest = guard.detach()
        if rest is not None:
            rest()
        torch.cuda.synchronize()
        net = gc.get_count()[0] - before
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return net / steps, cyclic / steps


def device_us(guard: Any, logits: torch.Tensor, index: torch.Tensor | None, req_ids: list[str]) -> float:
    """Device time of one check: 16 checks queued behind a sleeping kernel, so the
    device runs them back to back whatever the host's speed (a first pass leaves the
    pinned buffers they take in torch's cache: no allocation while timed)."""
    for _pass in range(2):  # (the first: warm)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)
        start.record()
        for _ in range(16):
            guard.check(logits, index, req_ids)
        end.record()
        end.synchronize()
        guard.detach()()
    return start.elapsed_time(end) * 1000 / 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--dtype", default="bfloat16", help="the logits' dtype (the headline's model: bfloat16)")
    args = parser.parse_args()
    from vllm_nnsight_plugin.engine import finite_logits, guard_kernel

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, logits {args.dtype}")
    print("| rows | guarded | guard as | host µs per step (median) | device µs per step | "
          "net GC-tracked objects per step | objects in cycles left per step |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda").to(getattr(torch, args.dtype))
        for guarded, index in (("all", None), ("half", torch.arange(0, rows, 2, device="cuda"))):
            req_ids = [str(i) for i in range(rows if index is None else index.shape[0])]
            for way in ("torch ops", "kernel through the JIT", "kernel"):
                guard = finite_logits.FiniteLogits()
                if way == "torch ops":
                    guard._fused = lambda _logits: False  # (this instance only)
                elif not guard_kernel.usable(logits.device, logits.dtype, logits.shape[1]):
                    print(f"| {rows} | {guarded} | kernel | not usable here | – | – | – |")
                    continue
                guard_kernel.DIRECT = way != "kernel through the JIT"  # (the JIT binds the arguments every launch)
                try:
                    host_us(guard, logits, index, req_ids, 50)  # (warm: builds, buffers)
                    host = host_us(guard, logits, index, req_ids, args.steps)
                    device = device_us(guard, logits, index, req_ids)
                    net, cyclic = garbage_per_step(guard, logits, index, req_ids, args.steps)
                finally:
                    guard_kernel.DIRECT = True
                print(f"| {rows} | {guarded} | {way} | {host:.1f} | {device:.1f} | {net:.1f} | {cyclic:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
