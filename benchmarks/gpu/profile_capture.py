"""Where does a workload's time go? One rep of the headline workload, profiled.

Runs the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so one profile sees
the scheduler, the runner, the plugin and the result encoding together. Prints:
the wall time of an untraced rep and of the workload's rep (same engine), cProfile's
top functions by own time, the plugin's functions by cumulative time, and every
place that made the CPU wait for the GPU during the workload's rep (CUDA sync
debug mode; a wait per step defeats vLLM's async scheduling).

    python3 benchmarks/gpu/profile_capture.py WORKLOAD [WORKLOAD ...] [--taps] [--v1]

One engine serves every WORKLOAD named (one compile). WORKLOAD:
plain, prefill, every_token, steer, prefill_spec, every_token_spec, steer_spec.
--taps: compiled + CUDA graphs with layer 8 tapped (else eager); --v1: the V1 runner.
--phases: instead, wall time per engine phase (scheduler, runner, output path),
unprofiled, plain beside the workload over alternating reps: cProfile inflates
Python-heavy code, so this is the fair split of where the extra time goes.
A workload ``NAME~PART+PART`` (phases only) runs NAME with parts of the plugin
switched back to vLLM's own code for its reps (an ablation: what each part costs;
results may then be missing): ``sched`` (the scheduler and KV-block wraps),
``results`` (the scheduler's result merge), ``guard`` (the logits check),
``inputs`` (the front end's payload check and salt), ``runner`` (every runner wrap:
nothing traced runs at all), ``guardjit`` (the guard's kernel launched through
Triton's JIT each step instead of directly), ``guardtorch`` (the guard as its torch
ops, without its kernel), ``hooks`` (every method and function the plugin wraps in vLLM:
``plain~hooks`` beside ``plain`` is what the hooks cost untraced traffic, in one engine).
A second table gives calls per rep and microseconds per call and how many objects the
garbage collector tracks each phase left behind (net, where no collection ran inside it: what makes collections come);
the collector's pauses are timed as ``gc.collect`` rows, and its older generations'
collections are listed by the phase that was running when they came.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import random
import sys
import time
import warnings

_PROMPT_RNG = random.Random(0)  # one stream per run: every call gives new prompts


def fresh_prompts() -> list[dict]:
    """New random prompts for every rep: a rep that reused an earlier rep's prompts would
    take its prefill from the prefix cache, which a traced block's request (salted) never does."""
    import headline

    return [{"prompt_token_ids": [_PROMPT_RNG.randrange(3, 32000) for _ in range(headline.PLEN)]}
            for _ in range(headline.N)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--taps", action="store_true")
    parser.add_argument("--v1", action="store_true")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--reps", type=int, default=3, help="--phases: reps per workload")
    parser.add_argument("--bare", action="store_true",
                        help="--phases without the per-phase timers (walls and the collector's pauses only): "
                             "an ablation whose wraps the timers would otherwise wrap too, timed on equal terms")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.v1:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import headline
    import torch
    from vllm import LLM

    headline.make_config()
    headline.STEER = torch.full((headline.HIDDEN,), 0.01, dtype=torch.bfloat16)
    extra = {"additional_config": {"nnsight": {"taps": headline.TAPS}}} if args.taps else {}
    llm = LLM(model=headline.MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=not args.taps,
              dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5, seed=0, **extra)
    prompts = fresh_prompts
    sps = headline.workload_params()
    for name in args.workloads:
        sps.setdefault(name, sps[name.split("~")[0]])
    for name in ["plain", *args.workloads]:  # warm-up at full batch
        llm.generate(prompts(), sps[name], use_tqdm=False)
    if args.phases:
        phases(llm, prompts, sps, args.workloads, args.reps, timers=not args.bare)
        return
    for workload in args.workloads:
        print(f"===== {workload} =====", flush=True)
        profile_one(llm, prompts, sps, workload, args)


_PHASES = [  # (module, class, method): each timed on its own (nested calls count in both)
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
    ("vllm_nnsight_plugin.engine.interleave", "Interleaver", "begin_step"),
    ("vllm_nnsight_plugin.engine.interleave", "Interleaver", "end_step"),
    ("vllm_nnsight_plugin.engine.interleave", "Interleaver", "_ship"),
    ("vllm_nnsight_plugin.engine.logits_serving", "LogitsServing", "keep_logits"),
    ("vllm_nnsight_plugin.engine.batched", "BatchedEdits", "fill_lanes"),
    ("vllm_nnsight_plugin.engine.batched", "BatchedEdits", "finish_lanes"),
    ("vllm_nnsight_plugin.engine.interleave", "Interleaver", "between_steps"),
    ("vllm_nnsight_plugin.boundary.runners", None, "v2_batch"),  # module functions: None
    ("vllm_nnsight_plugin.boundary.runners", None, "v2_will_finish"),
    ("vllm_nnsight_plugin.boundary.runner_v2", None, "close_step"),
    ("vllm_nnsight_plugin.boundary.runner_v2", None, "admit_step"),
    ("vllm_nnsight_plugin.boundary.tap_setup", None, "step_graph_mode"),
    ("vllm_nnsight_plugin.engine.logits_serving", "LogitsServing", "guard_logits"),
    ("vllm_nnsight_plugin.engine.logits_serving", "LogitsServing", "late_checks"),
    ("vllm_nnsight_plugin.engine.admission", "Admission", "admit"),
    ("vllm_nnsight_plugin.engine.serving", "ValueServing", "needs_python"),
    ("vllm_nnsight_plugin.engine.lanes", "PartLane", "set_table"),
    ("vllm_nnsight_plugin.engine.lanes", "PartLane", "done"),
    ("vllm_nnsight_plugin.engine.finite_logits", "FiniteLogits", "check"),
    ("vllm_nnsight_plugin.engine.finite_logits", "FiniteLogits", "detach"),
    ("vllm_nnsight_plugin.engine.finite_logits", "FiniteLogits", "_buffer"),
    ("vllm_nnsight_plugin.engine.guard_kernel", None, "launch"),
    ("triton.runtime.jit", "JITFunction", "run"),
    ("vllm_nnsight_plugin.boundary.kv_blocks", None, "zero_reused_blocks"),
    ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs"),
    ("vllm_nnsight_plugin.boundary.frontend", None, "_check_payload"),
    ("vllm_nnsight_plugin.boundary.frontend", None, "cache_salt"),
    ("vllm_nnsight_plugin.engine.admission", "Admission", "_session"),
    ("vllm_nnsight_plugin.engine.admission", "Admission", "_admit_spec"),
    ("vllm_nnsight_plugin.engine.batched", "BatchedEdits", "add"),
    ("vllm_nnsight_plugin.payload.request_args", None, "parse"),
    ("vllm_nnsight_plugin.payload.codec", None, "parse_envelope"),
    ("vllm_nnsight_plugin.boundary.results", None, "_stamp_outputs"),
    ("vllm_nnsight_plugin.boundary.results", None, "merge"),
]


_ABLATE = {  # part -> (module, class, method) whose plugin wrap a rep swaps for vLLM's own
    "sched": [("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
              ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "free"),
              ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "pop_blocks_for_free"),
              ("vllm.v1.core.block_pool", "BlockPool", "get_new_blocks")],
    "results": [("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output")],
    "guard": [("vllm_nnsight_plugin.engine.logits_serving", "LogitsServing", "guard_logits")],
    "inputs": [("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs")],
    "runner": [("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", m)
               for m in ("execute_model", "prepare_inputs", "sample", "sample_tokens")],
    "hooks": [],  # (every method and function the plugin wraps in vLLM: see _Ablated)
    "guardjit": [],  # (the guard's kernel launched through Triton's JIT every step: see _Ablated)
    "guardtorch": [],  # (the guard as its torch ops, no kernel: see _Ablated)
}


def _all_hooks() -> list[tuple]:
    """(owner, name, wrap, vLLM's own) for every method and module function the plugin
    has wrapped in this process (``boundary.patching.PATCHED``; a name wrapped on a
    base class counts once, where it sits)."""
    import importlib

    from vllm_nnsight_plugin.boundary import patching

    swaps, seen = [], set()
    owners = [(mod, cls, list(methods)) for (mod, cls), methods in patching.PATCHED.items()]
    owners += [(mod, None, [name]) for (mod, name) in patching.PATCHED_FUNCTIONS]
    for mod_name, cls_name, methods in owners:
        try:
            mod = importlib.import_module(mod_name)
            owner = mod if cls_name is None else getattr(mod, cls_name)
        except (ImportError, AttributeError):
            continue
        for meth in methods:
            current = owner.__dict__.get(meth) if cls_name is not None else getattr(owner, meth, None)
            original = getattr(current, "__nnsight_original__", None)
            if original is not None and (id(owner), meth) not in seen:
                seen.add((id(owner), meth))
                swaps.append((owner, meth, current, original))
    return swaps


class _Ablated:
    """For one rep: the named parts' wraps replaced by vLLM's own methods."""

    def __init__(self, parts: list[str]):
        import importlib

        self.swaps = []
        if "guardjit" in parts:
            from vllm_nnsight_plugin.engine import guard_kernel

            self.swaps.append((guard_kernel, "DIRECT", True, False))
        if "guardtorch" in parts:
            from vllm_nnsight_plugin.engine import finite_logits

            fused = finite_logits.FiniteLogits.__dict__["_fused"]
            self.swaps.append((finite_logits.FiniteLogits, "_fused", fused, staticmethod(lambda logits: False)))
        if "hooks" in parts:
            self.swaps += _all_hooks()
        for part in parts:
            for mod_name, cls_name, meth in _ABLATE[part]:
                cls = getattr(importlib.import_module(mod_name), cls_name)
                current = cls.__dict__.get(meth)
                if current is None:
                    continue
                original = getattr(current, "__nnsight_original__", None)
                if original is None and part == "guard":
                    original = lambda self, logits: None  # noqa: E731
                self.swaps.append((cls, meth, current, original or current))

    def __enter__(self):
        for cls, meth, _, original in self.swaps:
            setattr(cls, meth, original)

    def __exit__(self, *exc):
        for cls, meth, current, _ in self.swaps:
            setattr(cls, meth, current)


def phases(llm, prompts, sps, workloads: list[str], reps: int = 3, timers: bool = True) -> None:
    """Seconds per phase per rep (median of ``reps``), plain and each workload alternating."""
    import importlib
    import statistics

    spent: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)

    import functools
    import gc

    def timed(name: str, fn):
        @functools.wraps(fn)  # (keeps the plugin's __nnsight_original__: ablations find vLLM's own)
        def wrapper(*args, **kwargs):
            t, young, passes = time.perf_counter(), gc.get_count()[0], collecting[1]
            running.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                running.pop()
                spent[name] += time.perf_counter() - t
                calls[name] += 1
                if passes == collecting[1]:  # (no collection in between: the young generation's growth)
                    grown[name] += gc.get_count()[0] - young
        return wrapper

    grown: dict[str, int] = collections.defaultdict(int)  # objects the collector tracks, net, per phase
    collecting = [0.0, 0]
    running: list[str] = []  # the timed phases now running, innermost last
    # (generation, innermost phase running when a collection started) -> collections, seconds
    where: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def gc_timer(phase: str, info: dict) -> None:  # (the collector's pauses, whoever allocated)
        if phase == "start":
            collecting[0] = time.perf_counter()
            collecting[1] += 1
        else:
            during = where[(info.get("generation", -1), running[-1] if running else "(no timed phase)")]
            during[0] += 1
            during[1] += time.perf_counter() - collecting[0]
            name = f"gc.collect (generation {info.get('generation')})"
            spent[name] += time.perf_counter() - collecting[0]
            calls[name] += 1

    gc.callbacks.append(gc_timer)

    names = []
    for mod_name, cls_name, meth in _PHASES if timers else ():
        try:
            mod = importlib.import_module(mod_name)
            cls = mod if cls_name is None else getattr(mod, cls_name)
        except (ImportError, AttributeError):
            continue
        if cls_name is None and hasattr(mod, meth):  # callers look it up on the module
            name = f"{mod_name.rsplit('.', 1)[-1]}.{meth}"
            setattr(mod, meth, timed(name, getattr(mod, meth)))
            names.append(name)
        elif cls_name is not None and meth in cls.__dict__:
            name = f"{mod_name.rsplit('.', 1)[-1]}.{cls_name}.{meth}"
            setattr(cls, meth, timed(name, cls.__dict__[meth]))
            names.append(name)
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)  # in-process
    if core is not None and timers:  # the engine loop's step (bound at start-up: wrap the instance's)
        core.step_fn = timed("EngineCore.step_fn", core.step_fn)
        names.append("EngineCore.step_fn")
    workloads = [w for w in workloads if w != "plain"]  # (plain runs first in every rep)
    per: dict[str, dict[str, list[float]]] = {w: collections.defaultdict(list) for w in ["plain", *workloads]}
    for _ in range(reps):
        for workload in ["plain", *workloads]:
            spent.clear()
            parts = workload.partition("~")[2]
            batch = prompts()  # (made before the clock starts)
            with _Ablated(parts.split("+") if parts else []):
                t = time.perf_counter()
                llm.generate(batch, sps[workload], use_tqdm=False)
                per[workload]["wall"].append(time.perf_counter() - t)
            for name in names + [f"gc.collect (generation {g})" for g in range(3)]:
                per[workload][name].append(spent[name])
                per[workload][f"{name} calls"].append(calls[name])
                per[workload][f"{name} grown"].append(grown[name])
            calls.clear()
            grown.clear()
    gc.callbacks.remove(gc_timer)
    print("| collections of generation 1 and 2, by the innermost timed phase running when they "
          "came (all reps, all workloads) | count | ms |\n|---|---:|---:|")
    for (generation, name), (count, seconds) in sorted(where.items(), key=lambda kv: -kv[1][1]):
        if generation > 0:
            print(f"| generation {generation}: {name} | {count:.0f} | {seconds * 1e3:.1f} |")
    cols = ["plain", *workloads]
    print(f"| phase (s per rep, median of {reps}) | {' | '.join(cols)} |")
    print("|---|" + "---:|" * len(cols))
    names += [f"gc.collect (generation {g})" for g in range(3)]
    for name in ["wall", *names]:
        print(f"| {name} | " + " | ".join(f"{statistics.median(per[w][name]):.3f}" for w in cols) + " |")
    print(f"\n| phase (calls per rep; µs per call; tracked objects it left, net per rep), median of {reps} | "
          f"{' | '.join(cols)} |")
    print("|---|" + "---:|" * len(cols))
    for name in names:
        cells = []
        for w in cols:
            n, sec = statistics.median(per[w][f"{name} calls"]), statistics.median(per[w][name])
            left = statistics.median(per[w][f"{name} grown"])
            cells.append(f"{n:.0f}; {sec / n * 1e6:.1f}; {left:.0f}" if n else "–")
        print(f"| {name} | " + " | ".join(cells) + " |")


def profile_one(llm, prompts, sps, workload: str, args) -> None:
    import headline
    import torch

    walls = {}
    for name in ("plain", workload):
        batch = prompts()
        t = time.perf_counter()
        llm.generate(batch, sps[name], use_tqdm=False)
        walls[name] = time.perf_counter() - t
    print(f"wall: plain {walls['plain']:.3f}s, {workload} {walls[workload]:.3f}s "
          f"(ratio {walls['plain'] / walls[workload]:.3f}); taps={args.taps} v1={args.v1}")

    batch = prompts()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(batch, sps[workload], use_tqdm=False)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("nnsight", 30)
    stats.sort_stats("tottime").print_stats("nnsight", 30)
    print(out.getvalue()[:20000])

    if not torch.cuda.is_available():
        return
    # device time per kernel over one rep: is the step GPU-bound or waiting on the CPU?
    from torch.profiler import ProfilerActivity, profile

    batch = prompts()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as kprof:
        llm.generate(batch, sps[workload], use_tqdm=False)
    wall = time.perf_counter() - t
    events = kprof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(f"kernels: {busy:.3f}s of device time in a {wall:.3f}s rep (profiled); top kernels:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"{e.self_device_time_total / 1e3:10.1f} ms {e.count:8d}x  {e.key[:100]}")
    # where the CPU waited for the GPU (one rep): call sites, most frequent first
    sites: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts(), sps[workload], use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{w.filename}:{w.lineno}"] += 1
    print(f"CUDA syncs during one {workload} rep ({headline.OLEN} steps): {sum(sites.values())}")
    for site, n in sites.most_common(25):
        print(f"{n:8d}  {site}")


if __name__ == "__main__":
    main()
