"""Untraced traffic on each engine kind, counted rather than timed.

The user's-way runs put untraced traffic on the taps engine 4-8% below stock, but the
lent machine drifts by tens of percent over seconds, so their intervals cannot say
where a few percent go. This counts what does not drift: for one untraced batch of the
headline workload (256 fresh prompts x 128 tokens -> 128 tokens) on each engine kind,
the GPU's kernels (how many, and their summed device time, from torch's profiler;
copies and memsets apart), the host's CUDA graph replays, other kernel launches and
waits for the device, the Python calls (all of them, and those in the plugin's files,
from cProfile's call counts: on Python 3.12 every thread's, on 3.11 the calling
thread's), the scheduler's ``schedule()`` calls (engine steps, and under asynchronous
scheduling any that schedule nothing) and the garbage collector's collections, plus the
wall time of unprofiled batches (profiled batches are a batch of their own each). Engine kinds:

    stock    vLLM alone (the plugin switched off)
    imported vLLM alone with every module of the plugin imported (none of its hooks):
             what its code's presence costs a process, apart from its calls
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
    "imported": (False, None),
    "loaded": (True, None),
    "taps": (True, {"taps": headline.TAPS}),
    "nolanes": (True, {"taps": headline.TAPS, "lanes": False}),
}
_PLUGIN_FILES = os.sep + "vllm_nnsight_plugin" + os.sep


def _engine(kind: str, memory: float) -> Any:
    import torch
    from vllm import LLM

    if kind == "imported":
        import importlib
        import pkgutil

        import vllm_nnsight_plugin

        for module in pkgutil.walk_packages(vllm_nnsight_plugin.__path__, "vllm_nnsight_plugin."):
            importlib.import_module(module.name)
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
            "functions": dict(every)}


def _device_work(run: Any) -> dict[str, Any]:
    """The device's kernels and their summed time (copies and memsets apart), and the
    host's graph replays, kernel launches (every launch API: Triton's go through
    ``cuLaunchKernelEx``) and waits for the device during ``run()``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
    device: dict[str, float] = collections.Counter()
    host: dict[str, int] = collections.Counter()
    for event in prof.events():
        name = event.name
        if str(event.device_type).rsplit(".", 1)[-1] == "CUDA":
            what = ("copies" if name.startswith("Memcpy") else "memsets" if name.startswith("Memset")
                    else None if getattr(event, "is_user_annotation", False) else "kernels")
            if what:
                device[what] += 1
                device[what + "_ms"] += event.device_time / 1000
        elif name.startswith(("cudaGraphLaunch", "cuGraphLaunch")):
            host["graph_replays"] += 1
        elif name.startswith(("cudaLaunch", "cuLaunch")):
            host["launches"] += 1
        elif name.endswith("Synchronize"):
            host["waits"] += 1
    return {"device": dict(device), "host_cuda": dict(host)}


def child(kind: str, reps: int, memory: float) -> None:
    """One engine: warm up, then the counts of one batch each and ``reps`` timed batches."""
    seeds = iter(range(1000, 10_000))
    llm = _engine(kind, memory)
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=headline.OLEN, ignore_eos=True, temperature=0.8, top_p=0.95,
                            detokenize=False)

    produced = [0]  # output tokens of the batches after the warm-up (timed and profiled)

    def batch() -> None:  # (fresh prompts each batch: no prefix-cache hits)
        outputs = llm.generate(headline.make_prompts(next(seeds)), params, use_tqdm=False)
        produced[0] += sum(len(o.outputs[0].token_ids) for o in outputs)

    for _ in range(2):  # warm-up at full batch
        batch()
    produced[0] = 0
    collections_seen = [0, 0, 0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections_seen[info["generation"]] += 1

    walls = []
    gc.callbacks.append(on_gc)
    for _ in range(reps):
        t = time.perf_counter()
        batch()
        walls.append(time.perf_counter() - t)
    gc.callbacks.remove(on_gc)
    result = {"kind": kind, "wall_s": statistics.median(walls), "walls": walls,
              "gc_per_batch": [n / reps for n in collections_seen]}
    for part in (_python_calls(batch), _device_work(batch)):
        result.update(part)
    result["tokens"] = produced[0]
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # (the counts are out: no engine shutdown to wait for, nor its output to read)


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [f"| engine | wall s per batch (median of {len(base['walls'])}) | schedule() calls | kernels "
             "| kernels' device ms | copies, memsets (device ms) | graph replays | other launches | waits "
             "| Python calls | of them the plugin's | collections gen 0/1/2 per batch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        host, device = row["host_cuda"], row["device"]
        copies = device.get("copies", 0) + device.get("memsets", 0)
        copies_ms = device.get("copies_ms", 0) + device.get("memsets_ms", 0)
        lines.append(f"| {row['kind']} | {row['wall_s']:.3f} | {row['steps']} | {device.get('kernels', 0):,.0f} "
                     f"| {device.get('kernels_ms', 0):,.1f} | {copies:,.0f} ({copies_ms:,.1f}) "
                     f"| {host.get('graph_replays', 0):,} | {host.get('launches', 0):,} | {host.get('waits', 0):,} "
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
                                 "--memory", str(args.memory)], env=env, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            rows.append(headline._reply(proc, "RESULT"))
            proc.communicate(timeout=60)  # (the child exits once it has answered)
        finally:
            if proc.poll() is None:  # (and whatever it started: an engine must not outlive it)
                os.killpg(proc.pid, 9)
        print(table(rows[-1:]).splitlines()[-1], flush=True)  # (each row as it comes: a cut run keeps it)
        expected = (args.reps + 2) * headline.N * headline.OLEN  # (the timed batches and the two profiled)
        if rows[-1]["tokens"] != expected:
            sys.exit(f"{kind}: {rows[-1]['tokens']} output tokens, expected {expected}")
    for row in rows:
        if row["top_plugin"]:
            print(f"\n{row['kind']}: the plugin's most called functions in one batch\n"
                  + "\n".join(f"  {n:8d} {name}" for name, n in row["top_plugin"]))
    base = rows[0]["functions"]
    for row in rows[1:]:
        diff = {k: row["functions"].get(k, 0) - base.get(k, 0) for k in set(base) | set(row["functions"])}
        print(f"\n{row['kind']} over {rows[0]['kind']}: the largest differences in calls per batch\n"
              + "\n".join(f"  {n:+8d} {name}" for name, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:20]
                           if n))
    for row in rows:
        row.pop("functions")
    print("\n" + json.dumps(rows))
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
