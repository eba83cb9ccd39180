"""Untraced traffic on each engine kind, counted rather than timed.

The user's-way runs put untraced traffic on the taps engine 4-8% below stock, but the
lent machine drifts by tens of percent over seconds, so their intervals cannot say
where a few percent go. This counts what does not drift: for one untraced batch of the
headline workload (256 fresh prompts x 128 tokens -> 128 tokens) on each engine kind,
the GPU's kernels (how many, and their summed device time, from torch's profiler),
the host's CUDA graph replays and kernel launches, the Python calls (all of them, and
those in the plugin's files, from cProfile's call counts), the engine steps and the
garbage collector's collections, plus the wall time of unprofiled batches. Engine kinds:

    stock    vLLM alone (the plugin switched off)
    loaded   the plugin loaded, no taps: its hooks alone
    taps     the plugin's taps engine (``taps=["model.layers.8.output"]``, lanes on)
    nolanes  the same with its lanes off

Each kind runs in a child process of its own with its engine in-process (one profile
sees the scheduler and the runner), one after another, with vLLM's defaults (CUDA
graphs, chunked prefill, prefix caching). Prints a markdown table.

    python3 benchmarks/gpu/untraced_compare.py [--kinds stock,loaded,taps,nolanes] [--reps 5]
    (on the lent machine: bash benchmarks/gpu/remote.sh untraced)

``HEADLINE_SMOKE=1`` runs it on the CPU with a tiny model (engines eager, no taps
installed): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import headline  # noqa: E402  (the model's config and size)

KINDS = {  # kind -> (plugin loaded, nnsight settings or None)
    "stock": (False, None),
    "loaded": (True, None),
    "taps": (True, {"taps": headline.TAPS}),
    "nolanes": (True, {"taps": headline.TAPS, "lanes": False}),
}
_PLUGIN_FILES = os.sep + "vllm_nnsight_plugin" + os.sep


def _engine(kind: str, memory: float) -> Any:
    import torch
    from vllm import LLM

    settings = KINDS[kind][1]
    extra = {"additional_config": {"nnsight": settings}} if settings else {}
    return LLM(model=headline.MODEL, load_format="dummy", skip_tokenizer_init=True,
               enforce_eager=not torch.cuda.is_available(), dtype="bfloat16", max_model_len=1024,
               gpu_memory_utilization=memory, seed=0, **extra)


def _python_calls(run: Any) -> dict[str, Any]:
    """Calls made during ``run()`` (cProfile's counts: the profiler slows the calls,
    it does not change how many there are)."""
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    total = plugin = steps = 0
    by_function: dict[str, int] = collections.Counter()
    every: dict[str, int] = collections.Counter()  # (the parent prints where kinds differ most)
    for (filename, line, name), (_, calls, _, _, _) in pstats.Stats(prof).stats.items():
        total += calls
        if name == "schedule" and filename.endswith(os.path.join("sched", "scheduler.py")):
            steps = calls
        where = filename.split(_PLUGIN_FILES)[-1].split("site-packages" + os.sep)[-1]
        every[f"{where}:{line}:{re.sub(' at 0x[0-9a-f]+', '', name)}"] += calls  # (no addresses)
        if _PLUGIN_FILES in filename:
            plugin += calls
            by_function[f"{where}:{line}:{name}"] += calls
    return {"calls": total, "plugin_calls": plugin, "steps": steps,
            "top_plugin": by_function.most_common(12),
            "functions": {k: n for k, n in every.items() if n >= 32}}


def _device_work(run: Any) -> dict[str, Any]:
    """Kernels and their summed device time, graph replays and launches during ``run()``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
    kernels = kernel_us = 0.0
    host: dict[str, int] = collections.Counter()
    for event in prof.events():
        kind = str(event.device_type).rsplit(".", 1)[-1]
        if kind == "CUDA":
            kernels += 1
            kernel_us += event.device_time
        elif event.name in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync",
                            "cudaStreamSynchronize", "cudaEventSynchronize", "cudaEventRecord"):
            host[event.name] += 1
    return {"kernels": int(kernels), "kernel_ms": kernel_us / 1000, "host_cuda": dict(host)}


def child(kind: str, reps: int, memory: float) -> None:
    """One engine: warm up, then the counts of one batch each and ``reps`` timed batches."""
    seeds = iter(range(1000, 10_000))
    llm = _engine(kind, memory)
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=headline.OLEN, ignore_eos=True, temperature=0.8, top_p=0.95,
                            detokenize=False)

    def batch() -> int:  # (fresh prompts each batch: no prefix-cache hits)
        outputs = llm.generate(headline.make_prompts(next(seeds)), params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    for _ in range(2):  # warm-up at full batch
        batch()
    collections_seen = [0, 0, 0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections_seen[info["generation"]] += 1

    walls, tokens = [], 0
    gc.callbacks.append(on_gc)
    for _ in range(reps):
        t = time.perf_counter()
        tokens += batch()
        walls.append(time.perf_counter() - t)
    gc.callbacks.remove(on_gc)
    result = {"kind": kind, "wall_s": statistics.median(walls), "walls": walls, "tokens": tokens,
              "gc_per_batch": [n / reps for n in collections_seen]}
    result.update(_python_calls(batch))
    result.update(_device_work(batch))
    print("RESULT " + json.dumps(result), flush=True)


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [f"| engine | wall s per batch (median of {len(base['walls'])}) | engine steps | kernels "
             "| kernels' device ms | graph replays | kernel launches | Python calls | of them the plugin's "
             "| collections gen 0/1/2 per batch |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        host = row["host_cuda"]
        launches = host.get("cudaLaunchKernel", 0) + host.get("cuLaunchKernel", 0)
        lines.append(f"| {row['kind']} | {row['wall_s']:.3f} | {row['steps']} | {row['kernels']:,} "
                     f"| {row['kernel_ms']:,.1f} | {host.get('cudaGraphLaunch', 0):,} | {launches:,} "
                     f"| {row['calls']:,} | {row['plugin_calls']:,} "
                     f"| {'/'.join(f'{n:.1f}' for n in row['gc_per_batch'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default="stock,loaded,taps,nolanes")
    parser.add_argument("--reps", type=int, default=5, help="timed batches per engine")
    parser.add_argument("--memory", type=float, default=0.3)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.reps, args.memory)
        return
    headline.make_config()
    rows = []
    for kind in args.kinds.split(","):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING",
                   VLLM_NNSIGHT_DISABLE="0" if KINDS[kind][0] else "1")
        proc = subprocess.Popen([sys.executable, __file__, "--child", kind, "--reps", str(args.reps),
                                 "--memory", str(args.memory)], env=env, stdout=subprocess.PIPE, text=True)
        rows.append(headline._reply(proc, "RESULT"))
        proc.wait()
        print(table(rows[-1:]).splitlines()[-1], flush=True)  # (each row as it comes: a cut run keeps it)
        if rows[-1]["tokens"] != args.reps * headline.N * headline.OLEN:
            sys.exit(f"{kind}: {rows[-1]['tokens']} tokens, expected {args.reps * headline.N * headline.OLEN}")
    print(table(rows))
    for row in rows:
        if row["top_plugin"]:
            print(f"\n{row['kind']}: the plugin's most called functions in one batch\n"
                  + "\n".join(f"  {n:8d} {name}" for name, n in row["top_plugin"]))
    base = rows[0]["functions"]
    for row in rows[1:]:
        diff = {k: row["functions"].get(k, 0) - base.get(k, 0) for k in set(base) | set(row["functions"])}
        print(f"\n{row['kind']} over {rows[0]['kind']}: the largest differences in calls per batch "
              "(functions called 32 times or more in either)\n"
              + "\n".join(f"  {n:+8d} {name}" for name, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:20]
                           if n))
    for row in rows:
        row.pop("functions")
    print("\n" + json.dumps(rows))


if __name__ == "__main__":
    main()
