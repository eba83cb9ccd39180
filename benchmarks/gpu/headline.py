"""The headline GPU benchmark (run on the lent H200; see benchmarks/gpu/README.md).

Workload (the anchor harness's): a ~1.1B dummy-weight Llama (hidden 2048, 16 layers,
32/8 heads, vocab 32000) in bf16, 256 prompts x 128 random token ids -> 128 output
tokens (ignore_eos, temperature 0.8, top_p 0.95), warm-up at full batch, then
REPS timed reps. Each variant runs in its own process, one after another; only
ratios to stock-with-graphs from the same run count.

    python3 benchmarks/gpu/headline.py --variants stock_graphs,stock_eager,idle_graphs,v1_eager
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

MODEL = "/tmp/models/l1b"
N, PLEN, OLEN = 256, 128, 128
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 2048, 16, 32, 8, 8192
if os.environ.get("HEADLINE_SMOKE"):  # a CPU smoke test of these scripts (not a measurement)
    MODEL, (N, PLEN, OLEN) = "/tmp/models/l1b-smoke", (8, 16, 4)
    HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 10, 4, 2, 256


def make_config() -> None:
    if os.path.exists(f"{MODEL}/config.json"):
        return
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                torch_dtype="bfloat16").save_pretrained(MODEL)


def prefill_capture(model, tracer):
    out = model.model.layers[8].output
    stream = (out[0] + out[1]).save()  # noqa: F841 - the residual stream over the whole prefill


def every_token_capture(model, tracer):
    rows = []
    for _ in tracer.all():
        out = model.model.layers[8].output
        rows.append(out[0] + out[1])  # a new tensor: safe to keep past the step
    stream = rows.save()  # noqa: F841


STEER = None  # set in the child: a bf16 vector on the model's hidden size


def steer(model, tracer):
    for _ in tracer.all():
        model.model.layers[8].output[0][:] += STEER


TAPS = ["model.layers.8.output"]
STEER_SPEC = json.dumps({"v": 1, "kind": "spec", "ops": [
    {"op": "add", "module": "model.layers.8", "index": 0, "value": [0.01] * HIDDEN, "steps": "all"}]})


def read_spec(steps: str) -> str:
    """Rows 3/4 as a declarative spec (runs batched): the residual stream, output[0] +
    output[1], as the code blocks save it. (Runs up to 12 read both halves: twice the bytes.)"""
    return json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "stream", "module": "model.layers.8", "sum": True, "steps": steps}]})
# "prefill"/"every_token"/"steer" are nnsight-style code blocks: the engine runs them as
# the batched spec they are (engine/lower.py); "*_code" sends the same blocks with
# extra_args nnsight_lower=False, so they run as code (one greenlet per request)
CODE = ["prefill_code", "every_token_code", "steer_code"]
CAPTURES = ["plain", "prefill", "every_token", "prefill_spec", "every_token_spec"]
VARIANTS = {
    # name: (plugin on, V1 runner, enforce_eager, workloads, taps)
    "stock_graphs": (False, False, False, ["plain"], False),
    "stock_eager": (False, False, True, ["plain"], False),
    "idle_graphs": (True, False, False, ["plain"], False),
    "taps": (True, False, False, CAPTURES + ["steer", "steer_spec"] + CODE, True),  # compiled + CUDA graphs (V2)
    "v2_eager": (True, False, True, CAPTURES + CODE[:2], False),
    "stock_v1_eager": (False, True, True, ["plain"], False),
    "v1_eager": (True, True, True, CAPTURES + CODE[:2], False),
    "taps_v1": (True, True, False, CAPTURES + ["steer", "steer_spec"], True),
    # taps without lanes (batched specs then run piecewise): A/B for the lanes' cost and gain
    "taps_nolanes": (True, False, False, ["plain", "every_token_spec", "steer_spec"], True),
    # the taps engine in-process (no engine-core process): A/B for the cost of moving
    # results between processes (vLLM's msgpack over ZMQ), which in-process runs skip
    "taps_inproc": (True, False, False, ["plain", "every_token_spec", "steer_spec"], True),
    # the taps engine with glibc keeping freed heap memory (no trim, no per-chunk mmap):
    # A/B for the page faults of the result buffers built at the end of each request
    "taps_malloc": (True, False, False, ["plain", "prefill_spec", "every_token_spec"], True),
}
IN_PROCESS = {"taps_inproc"}
ALL_WORKLOADS = CAPTURES + ["steer", "steer_spec"] + CODE
MALLOC_ENV = {"taps_malloc": {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}}


def workload_params() -> dict:
    """SamplingParams per workload: code blocks, and the same reads/steering as JSON specs
    (which run batched: one operation for all requests, no block per request)."""
    from vllm import SamplingParams

    from vllm_nnsight_plugin import make_payload

    def params(payload: str | None = None, lower: bool = True):
        extra = {"nnsight": payload} if payload else None
        if extra and not lower:
            extra["nnsight_lower"] = False
        return SamplingParams(max_tokens=OLEN, ignore_eos=True, temperature=0.8, top_p=0.95,
                              detokenize=False, extra_args=extra)

    blocks = {"prefill": prefill_capture, "every_token": every_token_capture, "steer": steer}
    return {"plain": params(), **{name: params(make_payload(fn)) for name, fn in blocks.items()},
            **{f"{name}_code": params(make_payload(fn), lower=False) for name, fn in blocks.items()},
            "steer_spec": params(STEER_SPEC), "prefill_spec": params(read_spec("prefill")),
            "every_token_spec": params(read_spec("all"))}


def make_prompts(seed: int) -> list[dict]:
    """N prompts of PLEN random token ids. The default workload repeats seed 0's every
    rep (as the anchor harness does), so untraced reps find their prompts in vLLM's
    prefix cache while traced reads (salted) compute theirs; ``--fresh-prompts`` gives
    each round and workload prompts of their own, the same for every variant."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(PLEN)]} for _ in range(N)]


def _engine(variant: str, only: list[str], memory: float):
    """The variant's engine, prompts, workload params and workloads (warmed up)."""
    from vllm import LLM

    global STEER
    import torch

    _, _, eager, workloads, taps = VARIANTS[variant]
    workloads = [w for w in workloads if w in only or w == "plain"] if only else workloads
    STEER = torch.full((HIDDEN,), 0.01, dtype=torch.bfloat16)
    settings = {"taps": TAPS, "lanes": variant != "taps_nolanes"}
    extra = {"additional_config": {"nnsight": settings}} if taps else {}
    t0 = time.time()
    llm = LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=eager,
              dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=memory, seed=0, **extra)
    init = time.time() - t0
    prompts = make_prompts(0)
    sps = workload_params()
    for name in workloads:  # warm-up at full batch size (first full batch compiles kernels)
        llm.generate(prompts, sps[name], use_tqdm=False)
    return llm, prompts, sps, workloads, init


def _timed(llm, prompts, sps, name: str) -> float:
    """One rep of a workload, in seconds; its results are checked to be there."""
    from vllm_nnsight_plugin import results

    t = time.time()
    outs = llm.generate(prompts, sps[name], use_tqdm=False)
    took = time.time() - t
    if name == "prefill_spec":
        assert results(outs[0])["stream"].shape[0] == PLEN
    if name == "every_token_spec":
        assert len(results(outs[0])["stream"]) == OLEN
    if name in ("prefill", "every_token", "prefill_code", "every_token_code"):
        stream = results(outs[0])["stream"]
        assert (stream.shape[0] == PLEN) if name.startswith("prefill") else (len(stream) == OLEN)
    return took


def _row(variant: str, init: float, times: dict[str, list[float]], interleaved: bool = False,
         fresh: bool = False) -> dict:
    ntok = N * OLEN
    return {"variant": variant, "init_s": round(init, 1), "interleaved": interleaved, "fresh_prompts": fresh,
            "tok_s": {w: ntok / statistics.median(v) for w, v in times.items()},
            "reps": {w: [round(ntok / x) for x in v] for w, v in times.items()}}


def child(variant: str, reps: int, only: list[str]) -> None:
    llm, prompts, sps, workloads, init = _engine(variant, only, 0.5)
    times: dict[str, list[float]] = {w: [] for w in workloads}
    for _ in range(reps):
        for name in workloads:
            times[name].append(_timed(llm, prompts, sps, name))
    print("RESULT " + json.dumps(_row(variant, init, times)), flush=True)


def served_child(variant: str, only: list[str], memory: float) -> None:
    """Interleaved mode: start the engine, then run one rep of each workload named on
    stdin (one line each) and answer its time, until stdin closes."""
    llm, prompts, sps, workloads, init = _engine(variant, only, memory)
    print("READY " + json.dumps({"init_s": init, "workloads": workloads}), flush=True)
    for line in sys.stdin:  # "workload" or "workload seed" (fresh prompts)
        name, _, seed = line.strip().partition(" ")
        if not name:
            break
        print("TIME " + json.dumps(_timed(llm, make_prompts(int(seed)) if seed else prompts, sps, name)),
              flush=True)


def _env(variant: str) -> dict[str, str]:
    plugin, v1, *_ = VARIANTS[variant]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env["VLLM_NNSIGHT_DISABLE"] = "0" if plugin else "1"
    if variant in IN_PROCESS:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(MALLOC_ENV.get(variant, {}))
    if v1:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    else:
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    return env


def _reply(proc: subprocess.Popen, tag: str) -> Any:
    """The child's next ``tag`` line (vLLM may print other lines on stdout)."""
    for line in proc.stdout:
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise RuntimeError(f"child exited (rc {proc.wait()}) before answering {tag}")


def interleaved(variants: list[str], reps: int, workloads: str, memory: float, out_dir: str,
                fresh: bool = False) -> list[dict]:
    """Every variant's engine alive at once (started one after another, each in its
    own process), then ``reps`` rounds in which each runs each of its workloads once.
    The machines drift (stock's own median moved 30k -> 47k within one run): a round
    measures every variant within seconds of the others, and ratios are taken per round."""
    procs = {}
    logs = os.environ.get("HEADLINE_LOGS", "/tmp/headline-logs")  # (not $OUT: few files come back)
    os.makedirs(logs, exist_ok=True)
    for variant in variants:
        err = open(os.path.join(logs, f"{variant}.stderr"), "w")
        proc = subprocess.Popen([sys.executable, __file__, "--serve-child", variant, "--workloads", workloads,
                                 "--memory", str(memory)], env=_env(variant), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        try:
            ready = _reply(proc, "READY")
        except RuntimeError as exc:
            err.close()
            print(f"{variant} FAILED to start: {exc}\n{open(err.name).read()[-3000:]}", flush=True)
            continue
        print(f"{variant} ready in {ready['init_s']:.0f}s", flush=True)
        procs[variant] = (proc, ready)
    times = {v: {w: [] for w in ready["workloads"]} for v, (_, ready) in procs.items()}
    for rnd in range(reps):
        for variant, (proc, ready) in procs.items():
            for name in ready["workloads"]:
                # the same prompts for a round's workload in every variant
                seed = f" {1000 * (rnd + 1) + ALL_WORKLOADS.index(name)}" if fresh else ""
                proc.stdin.write(name + seed + "\n")
                proc.stdin.flush()
                times[variant][name].append(_reply(proc, "TIME"))
        stock = times.get("stock_graphs", {}).get("plain")
        print(f"round {rnd + 1}/{reps}" + (f": stock graphs {N * OLEN / stock[-1]:,.0f} tok/s" if stock else ""),
              flush=True)
        _save([_row(v, ready["init_s"], times[v], interleaved=True, fresh=fresh) for v, (_, ready) in procs.items()],
              out_dir)  # after every round: a run cut short keeps its complete rounds
    for proc, _ in procs.values():
        proc.stdin.close()
        proc.wait(timeout=120)
    return [_row(v, ready["init_s"], times[v], interleaved=True, fresh=fresh) for v, (_, ready) in procs.items()]


def _save(rows: list[dict], out_dir: str) -> None:
    with open(os.path.join(out_dir, "headline.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workloads", default="", help="keep only these workloads (comma-separated)")
    parser.add_argument("--interleave", action="store_true",
                        help="all engines at once, rounds of one rep each (ratios per round)")
    parser.add_argument("--memory", type=float, default=0.12, help="gpu_memory_utilization per engine (interleaved)")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="interleaved: new prompts per round and workload (no prefix-cache hits)")
    parser.add_argument("--child")
    parser.add_argument("--serve-child")
    args = parser.parse_args()
    only = [w for w in args.workloads.split(",") if w]
    if args.child:
        child(args.child, args.reps, only)
        return
    if args.serve_child:
        served_child(args.serve_child, only, args.memory)
        return
    make_config()
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    variants = args.variants.split(",")
    if args.interleave:  # all engines share the GPU: each a share of it, each once
        variants = list(dict.fromkeys(variants))
        memory = min(args.memory, 0.9 / len(variants))
        rows = interleaved(variants, args.reps, args.workloads, memory, out_dir, args.fresh_prompts)
    else:
        rows = []
        for variant in variants:
            t = time.time()
            proc = subprocess.run([sys.executable, __file__, "--child", variant, "--reps", str(args.reps),
                                   "--workloads", args.workloads],
                                  env=_env(variant), capture_output=True, text=True, timeout=1200)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{variant} FAILED after {time.time() - t:.0f}s:\n{proc.stderr[-4000:]}", flush=True)
                continue
            rows.append(json.loads(lines[-1][7:]))
            _save(rows, out_dir)
    for res in rows:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
