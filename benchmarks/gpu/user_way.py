"""The headline workload written the way a researcher writes it (run on the lent H200).

One ``model.trace()`` with N ``tracer.invoke``s, nnsight's code verbatim (a named
layer constant, ``for step in tracer.iter[:OLEN]``, ``tracer.iter[:]``), fresh
prompts every round, ``VLLM(path, taps=[...])`` with vLLM's default engine
settings (chunked prefill and prefix caching on), beside stock vLLM with CUDA
graphs on the same prompts in the same run. Each engine lives in its own process.
The lent machine's speed drifts by tens of percent over seconds, so every measurement
is a pair run back to back on the same fresh prompts: stock vLLM's untraced batch
and the workload (the plugin engine's untraced traffic, its traced workloads, a
second stock engine), in alternating order; the pair's ratio is the workload's
tokens/s over stock's. A round runs ``--pairs`` pairs of each workload, and rounds
repeat until ``--seconds`` have passed; the table gives the median over every pair
of the run, its bootstrap 95% interval, and the range. ``--batches K`` makes each
measurement K batches of fresh prompts back to back; ``--pin`` gives each engine's processes their own CPU cores,
and ``--rotate`` moves the engines to the next engine's cores every round (an engine ran fastest on the cores
it started on), and ``--both-baselines`` pairs each workload with the two stock engines in turn (the table
then gives each baseline's rows and both pooled); ``--gc`` also times the garbage
collector's pauses in each engine's front end and its engine processes (engine core
and workers, summed). A second table gives each traced workload over its own
engine's untraced batch of the same round, a ratio with no stock engine in it.
Output tokens are counted from the outputs; any request that ended in an error, or
did not run as the batched plan, fails the run.

    python3 benchmarks/gpu/user_way.py --seconds 300 --pin
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import headline  # noqa: E402  (the model's config and size)
from table import median_interval, pair_keys, pairs_for, same_engine_table  # noqa: E402

LAYER = 8
OLEN = headline.OLEN  # (a block's names travel by value: an int, not the module)
TAP = [f"model.layers.{LAYER}.output"]
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "max_tokens": OLEN, "ignore_eos": True}
NNSIGHT_MODEL = "/tmp/models/l1b_tok"  # the same config with a tokenizer (nnsight's VLLM loads one client-side)
NNSIGHT_SITE = "/tmp/site2"  # nnsight 0.8.1 and its wheels (remote.sh installs them from .whl/anchors)
STEER = None  # set in the child: a bf16 vector of the model's width
STEER_ZERO = None  # the same, zeros


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(headline.PLEN)] for _ in range(headline.N)]


def prefill(model: Any, prompts: list[list[int]]) -> list[Any]:
    with model.trace(**SAMPLING) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                out = model.model.layers[LAYER].output
                stream = (out[0] + out[1]).save()  # noqa: F841
    return tracer.outputs


def every_token(model: Any, prompts: list[list[int]]) -> list[Any]:
    with model.trace(**SAMPLING) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                stream = list().save()
                for step in tracer.iter[:OLEN]:  # noqa: B007
                    out = model.model.layers[LAYER].output
                    stream.append(out[0] + out[1])
    return tracer.outputs


def steer(model: Any, prompts: list[list[int]], vector: Any) -> list[Any]:
    """Steering every step with ``vector``: ``STEER``, or ``STEER_ZERO`` (the
    ``steer_zero`` workload: all of the plugin's work, the plan, the lanes' edit, the
    logits guard, the KV zeroing, while the activations, and so the logits vLLM's
    top-p sampler searches, stay those of untraced traffic; that Triton kernel searches
    each row's threshold for as many rounds as the row's values take). Beside ``steer``
    it tells the plugin's cost from what steered logits cost vLLM's own sampler."""
    with model.trace(**SAMPLING) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                for step in tracer.iter[:]:  # noqa: B007
                    model.model.layers[LAYER].output[0][:] += vector
    return tracer.outputs


def steer_sweep(model: Any, prompts: list[list[int]], vector: Any, shift: float = 0.0) -> list[Any]:
    """Steering every step with a strength of each invoke's own (a sweep: the value
    differs per invoke, so every invoke has a plan of its own). ``shift``, added to every
    strength: a sweep the client and the engine have not seen (no kept payload or plan)."""
    with model.trace(**SAMPLING) as tracer:
        for i, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                for step in tracer.iter[:]:  # noqa: B007
                    model.model.layers[LAYER].output[0][:] += (STRENGTHS[i % len(STRENGTHS)] + shift) * vector
    return tracer.outputs


STRENGTHS = [0.25 + i / 64 for i in range(256)]  # (one per invoke of the headline's 256)
_NEW_SWEEPS = itertools.count(1)  # (each steer_sweep_new batch: strengths never sent before)


def plugin_runs(model: Any) -> dict[str, Any]:
    """The plugin engine's workloads: untraced traffic on its taps engine, and the traces."""
    from vllm import SamplingParams

    params = SamplingParams(**SAMPLING, detokenize=False)

    def plain(prompts: list[list[int]]) -> list[Any]:
        return model.vllm_entrypoint.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return {"plain": plain, "prefill": lambda p: prefill(model, p),
            "every_token": lambda p: every_token(model, p), "steer": lambda p: steer(model, p, STEER),
            "steer_zero": lambda p: steer(model, p, STEER_ZERO),
            "steer_sweep": lambda p: steer_sweep(model, p, STEER),
            "steer_sweep_new": lambda p: steer_sweep(model, p, STEER, next(_NEW_SWEEPS) * 1e-3)}


def nnsight_runs(model: Any) -> dict[str, Any]:
    """nnsight 0.8.1's ``VLLM`` on the same workloads, in its own spelling (sampling
    settings on each invoke; the outputs of a trace kept by wrapping its ``_collect``)."""
    from nnsight.modeling.vllm import VLLM as NNSIGHT_VLLM

    last: dict[str, Any] = {}
    collect = NNSIGHT_VLLM._collect

    def keep(mediators: Any, outputs: Any) -> Any:
        last["outputs"] = outputs
        return collect(mediators, outputs)

    NNSIGHT_VLLM._collect = staticmethod(keep)
    sampling = dict(SAMPLING, detokenize=False)

    def outputs() -> list[Any]:  # (this trace's: a stale list never passes for a new one)
        if "outputs" not in last:
            raise RuntimeError("nnsight's trace returned no outputs")
        return last.pop("outputs")

    def prefill(prompts: list[list[int]]) -> list[Any]:
        last.clear()
        with model.trace() as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt, **sampling):
                    out = model.model.layers[LAYER].output
                    stream = (out[0] + out[1]).save()  # noqa: F841
        return outputs()

    def every_token(prompts: list[list[int]]) -> list[Any]:
        last.clear()
        with model.trace() as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt, **sampling):
                    stream = list().save()
                    for step in tracer.iter[:OLEN]:  # noqa: B007
                        out = model.model.layers[LAYER].output
                        stream.append(out[0] + out[1])
        return outputs()

    return {"prefill": prefill, "every_token": every_token}


def _check(name: str, outputs: list[Any], plugin: bool = True) -> int:
    """Output tokens produced; raises if any request erred or ran otherwise than batched."""
    tokens = 0
    for out in outputs:
        if getattr(out, "nnsight_error", None) or out.outputs[0].stop_reason == "nnsight_error":
            raise RuntimeError(f"{name}: request {out.request_id} ended in an error: {out.nnsight_error}")
        if name != "plain" and plugin and out.ran_as != "batched":
            raise RuntimeError(f"{name}: request {out.request_id} ran as {out.ran_as!r}")
        tokens += len(out.outputs[0].token_ids)
    if name in ("prefill", "every_token"):  # (every request's save came back, whole)
        for out in outputs:
            stream = (getattr(out, "saves", None) or {}).get("stream")
            if stream is None or len(stream) != (headline.PLEN if name == "prefill" else OLEN):
                raise RuntimeError(f"{name}: request {out.request_id} came back without its whole save")
    return tokens


def child(kind: str, memory: float, tp: int) -> None:
    """Start the engine, warm each workload up at full batch, then answer one timed
    measurement per line on stdin ("workload seed batches"); stdin's end stops it.
    Under tensor parallel a plugin engine's reply also gives the bytes of split values
    its ranks put together during the measurement (``tp_whole_bytes``, rank 0's)."""
    global STEER, STEER_ZERO
    import torch
    from vllm import LLM, SamplingParams

    STEER = torch.full((headline.HIDDEN,), 0.01, dtype=torch.bfloat16)
    STEER_ZERO = torch.zeros((headline.HIDDEN,), dtype=torch.bfloat16)
    engine = {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 1024,
              "gpu_memory_utilization": memory, "seed": 0}
    if tp > 1:
        engine["tensor_parallel_size"] = tp
    whole_bytes = None  # () -> rank 0's count of bytes put together so far (plugin engines under TP)
    t0 = time.time()
    if kind.startswith("stock") or kind == "loaded":  # (loaded: the same, with the plugin in its processes)
        llm = LLM(model=headline.MODEL, **engine)
        params = SamplingParams(**SAMPLING, detokenize=False)

        def plain(prompts: list[list[int]]) -> list[Any]:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        runs = {"plain": plain}
    elif kind == "nnsight":
        from nnsight.modeling.vllm import VLLM as NNSIGHT_VLLM

        engine.pop("skip_tokenizer_init")
        model = NNSIGHT_VLLM(NNSIGHT_MODEL, dispatch=True, taps=tuple(TAP), **engine)
        params = SamplingParams(**SAMPLING, detokenize=False)

        def plain(prompts: list[list[int]]) -> list[Any]:  # untraced traffic on nnsight's taps engine
            return model.vllm_entrypoint.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                  use_tqdm=False)

        runs = {"plain": plain, **nnsight_runs(model)}
    elif kind == "idle":  # the plugin loaded, no taps: what untraced traffic pays for the plugin's hooks alone
        from vllm_nnsight_plugin import VLLM

        model = VLLM(headline.MODEL, dispatch=True, **engine)
        runs = {"plain": plugin_runs(model)["plain"]}
    elif kind == "nolanes":  # the taps engine with lanes off: its untraced traffic without the lanes' kernels
        from vllm_nnsight_plugin import VLLM

        model = VLLM(headline.MODEL, taps=TAP, dispatch=True, additional_config={"nnsight": {"lanes": False}},
                     **engine)
        runs = {"plain": plugin_runs(model)["plain"]}
    else:
        from vllm_nnsight_plugin import VLLM

        model = VLLM(headline.MODEL, taps=TAP, dispatch=True, **engine)
        runs = plugin_runs(model)
    if tp > 1 and kind in ("plugin", "idle"):
        def whole_bytes() -> int:
            return model.vllm_entrypoint.collective_rpc("nnsight_lane_stats")[0]["tp_whole_bytes"]
    init = time.time() - t0
    plugin = kind == "plugin"
    for name, run in runs.items():
        _check(name, run(prompts_for(7)), plugin)  # warm-up at full batch
    print("READY " + json.dumps({"init_s": init, "workloads": list(runs)}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        name, seed, batches = (line.split() + ["1"])[:3]
        prompt_sets = [prompts_for(int(seed) * 100 + b) for b in range(int(batches))]
        before = whole_bytes() if whole_bytes else 0  # (an RPC: outside the timed part)
        outputs = None  # (the last batch's outputs are freed here, not in the timed part)
        gc_before = gc_totals()
        t = time.time()
        outputs = [runs[name](prompts) for prompts in prompt_sets]
        took = time.time() - t
        gc_front = gc_totals()
        reply = {"s": took, "tokens": sum(_check(name, o, plugin) for o in outputs)}
        if gc_before is not None:
            time.sleep(0.1)  # (the engine processes' next writes, outside the timed part)
            reply["gc"] = gc_delta(gc_before, gc_front, gc_totals())
        if whole_bytes:
            reply["tp_whole_bytes"] = whole_bytes() - before
        print("TIME " + json.dumps(reply), flush=True)


def gc_totals() -> dict[int, list[float]] | None:
    """With ``--gc``: the collector's totals per process, this one (the front end) and
    its descendants (the engine core and any workers), each [gen-0, gen-1, gen-2
    collections, ms paused] (``gc_probe/sitecustomize.py``); None without."""
    probe = os.environ.get("NNSIGHT_GC_PROBE")
    if not probe:
        return None
    import sitecustomize  # (the probe: first on PYTHONPATH)

    def flat(totals: list) -> list[float]:
        return [totals[0][0], totals[1][0], totals[2][0], 1000 * sum(t[1] for t in totals)]

    out = {os.getpid(): flat(sitecustomize.TOTALS)}
    for pid in descendants(os.getpid()):
        try:
            with open(os.path.join(probe, f"{pid}.json")) as fh:
                out[pid] = flat(json.load(fh))
        except (OSError, ValueError):
            continue
    return out


def gc_delta(before: dict, front: dict, after: dict) -> dict[str, list[float]]:
    """One batch's collections: the front end's up to the end of the timed part, the
    engine processes' (summed) up to their writes after it; a process that came or went
    in between does not count."""
    me = os.getpid()
    core = [0.0] * 4
    for pid, totals in after.items():
        if pid != me and pid in before:
            core = [c + a - b for c, a, b in zip(core, totals, before[pid])]
    return {"front": [a - b for a, b in zip(front[me], before[me])], "core": core}


def gc_table(rounds: list[dict[str, list[dict]]], batches: int) -> str:
    """Medians per batch of the collector's pauses (``--gc``), each workload beside the
    stock batches it was paired with."""
    lines = ["| workload | front end: ms paused | engine processes: ms paused "
             "| engine processes: gen-0/1/2 collections | stock beside it: front end ms, engine processes ms |",
             "|---|---:|---:|---:|---:|"]
    for key in pair_keys(rounds):
        pairs = [p for p in pairs_for(rounds, key) if "gc" in p["run"] and "gc" in p["stock"]]
        if not pairs:
            continue

        def med(side: str, part: str, i: int, pairs: list[dict] = pairs) -> float:
            return statistics.median(p[side]["gc"][part][i] for p in pairs) / batches

        lines.append(f"| {key} | {med('run', 'front', 3):.1f} | {med('run', 'core', 3):.1f} | "
                     + "/".join(f"{med('run', 'core', i):.1f}" for i in range(3))
                     + f" | {med('stock', 'front', 3):.1f}, {med('stock', 'core', 3):.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (vLLM's engine core and, where the executor spawns
    them, its workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            kids = [int(p) for p in fh.read().split()]
    except OSError:
        return []
    return [d for k in kids for d in [k, *descendants(k)]]


def pin_tree(pid: int, cores: list[int]) -> None:
    """Every thread of a process tree onto ``cores``."""
    for proc in [pid, *descendants(pid)]:
        try:
            tids = os.listdir(f"/proc/{proc}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1, help="rounds at least")
    parser.add_argument("--seconds", type=float, default=0, help="more rounds until this much time has passed")
    parser.add_argument("--batches", type=int, default=1, help="batches of fresh prompts per measurement")
    parser.add_argument("--pin", action="store_true", help="each engine's processes on their own CPU cores")
    parser.add_argument("--rotate", action="store_true", help="with --pin: each round, every engine moves to the "
                                                               "next engine's cores (no engine keeps the best ones)")
    parser.add_argument("--both-baselines", action="store_true",
                        help="with stock2: every workload but the stock2 control is paired with stock and stock2 "
                             "in turn")
    parser.add_argument("--memory", type=float, default=0.3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="every engine (stock ones too) over this many GPUs")
    parser.add_argument("--engines", default="stock,stock2,plugin",
                        help="stock2: a second stock engine, to show how far two identical engines differ; "
                             "nnsight: nnsight 0.8.1's VLLM with the same taps (remote.sh installs it); "
                             "idle: the plugin loaded without taps (its untraced traffic); loaded: stock LLM "
                             "with the plugin loaded (its hooks alone, graphs on); nolanes: the taps engine "
                             "with lanes off (untraced traffic without the lanes' kernels)")
    parser.add_argument("--workloads", default="", help="only these workloads (default: every one)")
    parser.add_argument("--pairs", type=int, default=2, help="pairs of each workload per round (fresh prompts each)")
    parser.add_argument("--gc", action="store_true",
                        help="time the garbage collector's pauses in each engine's front end and engine core "
                             "(gc_probe/sitecustomize.py in every engine process)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if not (1 <= args.pairs < 10 and 1 <= args.batches <= 100):
        parser.error("--pairs 1-9 and --batches 1-100 (each measurement's seeds must be its own)")
    if args.child:
        child(args.child, args.memory, args.tensor_parallel_size)
        return
    if args.rotate and not args.pin:
        parser.error("--rotate moves pinned engines: add --pin")
    if args.both_baselines and "stock2" not in args.engines.split(","):
        parser.error("--both-baselines needs a second stock engine: add stock2 to --engines")
    headline.make_config()
    out_dir = os.environ.get("OUT", ".")
    procs = {}
    kinds = args.engines.split(",")
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // len(kinds)
    core_sets = [cores[n * share:(n + 1) * share] for n in range(len(kinds))]
    for n, kind in enumerate(kinds):
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING",
                   VLLM_NNSIGHT_DISABLE="0" if kind in ("plugin", "idle", "loaded", "nolanes") else "1")
        if kind == "nnsight":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [NNSIGHT_SITE, env.get("PYTHONPATH")]))
        if args.gc:
            probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gc_probe")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [probe, env.get("PYTHONPATH")]))
            env["NNSIGHT_GC_PROBE"] = f"/dev/shm/nnsight-gc-{os.getpid()}"
        err = open(os.path.join(out_dir, f"user_way-{kind}.stderr"), "w")
        pin = []
        if args.pin:  # (children inherit the affinity: the engine core and its worker too)
            pin = ["taskset", "-c", ",".join(map(str, core_sets[n]))]
        proc = subprocess.Popen([*pin, sys.executable, __file__, "--child", kind, "--memory", str(args.memory),
                                 "--tensor-parallel-size", str(args.tensor_parallel_size)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                bufsize=1)
        try:
            ready = headline._reply(proc, "READY")
        except RuntimeError as exc:  # (an engine beside the plugin may fail: the run goes on without it)
            if kind in ("stock", "plugin"):
                raise
            err.flush()
            print(f"{kind} FAILED to start: {exc}\n{open(err.name).read()[-3000:]}", flush=True)
            continue
        print(f"{kind} ready in {ready['init_s']:.0f}s", flush=True)
        procs[kind] = (proc, ready["workloads"])
    rounds: list[dict[str, dict]] = []
    wanted = set(args.workloads.split(",")) if args.workloads else None
    measured = [(kind, name) for kind, (_, workloads) in procs.items() for name in workloads
                if kind != "stock" and (wanted is None or name in wanted)]
    bases = ["stock", "stock2"] if args.both_baselines and "stock2" in procs else ["stock"]

    def timed(proc: Any, name: str, seed: int) -> dict:
        proc.stdin.write(f"{name} {seed} {args.batches}\n")
        proc.stdin.flush()
        return headline._reply(proc, "TIME")

    start = time.time()
    rnd = 0
    while rnd < args.reps or time.time() - start < args.seconds:
        pairs: dict[str, list[dict]] = {}
        if args.pin and args.rotate:
            placed = {kind: (kinds.index(kind) + rnd) % len(kinds) for kind in procs}
            for kind, (proc, _) in procs.items():
                pin_tree(proc.pid, core_sets[placed[kind]])
        for i, (kind, name) in enumerate(measured):
            for attempt in range(args.pairs):  # (fresh prompts each pair: no prefix-cache hits)
                seed = 1000 * (rnd + 1) + 10 * i + attempt
                base_kind = "stock" if kind == "stock2" else bases[(rnd + attempt) // 2 % len(bases)]
                baseline = procs[base_kind][0]
                if (rnd + attempt) % 2:  # (alternate which runs first: no bias from the order)
                    got = timed(procs[kind][0], name, seed)
                    base = timed(baseline, "plain", seed)
                else:
                    base = timed(baseline, "plain", seed)
                    got = timed(procs[kind][0], name, seed)
                key = f"{kind}:{name}" + (f" vs {base_kind}" if len(bases) > 1 and kind != "stock2" else "")
                pairs.setdefault(key, []).append(
                    {"stock": base, "run": got, "stock_first": not (rnd + attempt) % 2, "base": base_kind,
                     "attempt": attempt,
                     **({"cores": {base_kind: placed[base_kind], kind: placed[kind]}}
                        if args.pin and args.rotate else {}),
                     "ratio": (got["tokens"] / got["s"]) / (base["tokens"] / base["s"])})
        rounds.append(pairs)
        rnd += 1
        print(f"round {rnd}: " + ", ".join(f"{k} " + "/".join(f"{p['ratio']:.2f}" for p in v)
                                                for k, v in pairs.items()), flush=True)
    report(rounds, args, out_dir)
    for proc, _ in procs.values():  # (after the report: a slow shutdown must not cost the numbers)
        proc.stdin.close()
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # (its engine core too: it must not hold the GPU for the next call)
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass


def report(rounds: list[dict[str, list[dict]]], args: Any, out_dir: str) -> None:
    """Prints the tables and writes user_way.json."""
    table = {}
    for k in pair_keys(rounds):
        pairs_k = pairs_for(rounds, k)
        ratios = [p["ratio"] for p in pairs_k]
        table[k] = {"tok_s": statistics.median(p["run"]["tokens"] / p["run"]["s"] for p in pairs_k),
                    "stock_tok_s": statistics.median(p["stock"]["tokens"] / p["stock"]["s"] for p in pairs_k),
                    "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                    "ratio_interval": list(median_interval(ratios))}
        if all("tp_whole_bytes" in p["run"] for p in pairs_k):  # (the same every pair: the median shows it)
            table[k]["tp_whole_bytes_per_batch"] = statistics.median(
                p["run"]["tp_whole_bytes"] / args.batches for p in pairs_k)
    tp = args.tensor_parallel_size
    print(f"\n{len(rounds)} rounds x {args.pairs} pairs x {args.batches} batches of {headline.N} prompts"
          f"{', engines pinned to their own cores' if args.pin else ''}"
          f"{f', tensor parallel over {tp} GPUs (stock engines too)' if tp > 1 else ''}")
    print("\n| workload (user's code) | tok/s | stock beside it, tok/s | ratio to stock graphs (median of pairs) "
          "| 95% interval of the median (bootstrap) | range |\n|---|---:|---:|---:|---:|---:|")
    for k, row in table.items():
        (low, high), (lo_ci, hi_ci) = row["ratio_range"], row["ratio_interval"]
        print(f"| {k} | {row['tok_s']:,.0f} | {row['stock_tok_s']:,.0f} | {row['ratio']:.2f} "
              f"| {lo_ci:.2f}-{hi_ci:.2f} | {low:.2f}-{high:.2f} |")
    if tp > 1:  # (a replicated value, as a decoder layer's output, is read and edited where it is)
        print(f"\n| workload | split values put together per batch (each rank) | per decode step ({OLEN} a batch) |"
              "\n|---|---:|---:|")
        for k, row in table.items():
            if "tp_whole_bytes_per_batch" in row:
                per = row["tp_whole_bytes_per_batch"]
                print(f"| {k} | {per / 2**20:,.1f} MiB | {per / OLEN / 2**10:,.1f} KiB |")
    if same := same_engine_table(rounds):
        print("\n" + same)
    if collected := gc_table(rounds, args.batches):
        print("\nPython's garbage collector, per batch (median of the pairs; --gc):\n" + collected)
    with open(os.path.join(out_dir, "user_way.json"), "w") as fh:
        json.dump({"rounds": rounds, "table": table}, fh, indent=1)


if __name__ == "__main__":
    main()
