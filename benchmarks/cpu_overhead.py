"""CPU benchmark: what the plugin costs, side by side in one run (ratios only).

    bash scripts/dev.sh bench          # or: .venv/bin/python benchmarks/cpu_overhead.py

(a) throughput with the plugin installed but idle vs switched off
    (VLLM_NNSIGHT_DISABLE=1), engines in alternating child processes (A B A B);
(b) every one of 64 requests saving one layer's output at prefill, vs the same
    64 requests untraced, on one engine (and the same at every generated token);
(c) client cost per request: capture + serialization time and payload bytes,
    for a 4-layer and a 32-layer module tree;
(d) the user's way (one ``model.trace()`` with 64 invokes of nnsight's code):
    steering every step by one vector, and a strength sweep (each invoke its own
    ``s[i] * v``: a payload and a plan per invoke), against the same engine's
    untraced batch; a sweep's first batch records its plans (each rep a sweep of new
    strengths), later batches of one sweep reuse them.

Prints a markdown table. Absolute numbers vary a lot between machines; compare
the ratios of one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = 64
MAX_TOKENS = 32
REPS = 5


def _prompts() -> list[str]:
    from vllm_nnsight_plugin.tiny import CORPUS

    return [CORPUS[i % len(CORPUS)] + f" {i}" for i in range(PROMPTS)]


def _child(variant: str, path: str) -> None:
    """Run inside a child process: one engine, warm-up, timed reps; print JSON."""
    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import make_payload

    # a plain vllm.LLM, as VLLM(...) would build it: the same engine with or without the plugin
    llm = LLM(path, enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=PROMPTS)
    prompts = _prompts()
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def save_prefill(model, tracer):
        hidden = model.model.layers[1].output.save()  # noqa: F841

    def save_every_token(model, tracer):
        hs = []
        for _ in tracer.all():
            hs.append(model.model.layers[1].output[0][-1].clone())  # views are reused next step
        hidden = hs.save()  # noqa: F841

    def traced(block):  # noqa: ANN001, ANN202
        payload = make_payload(block)
        return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                               extra_args={"nnsight": payload}) for _ in prompts]

    workloads = {"plain": plain}
    if variant == "traced":
        workloads = {"plain": plain, "prefill": traced(save_prefill), "every_token": traced(save_every_token)}
    llm.generate(prompts, plain, use_tqdm=False)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in workloads}
    for _ in range(REPS):
        for name, params in workloads.items():  # interleaved, so drift hits all alike
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
            if name != "plain":
                assert all(o.saves for o in outs), "a traced request came back without saves"
    tokens = PROMPTS * MAX_TOKENS
    print("RESULT " + json.dumps({k: tokens / statistics.median(v) for k, v in times.items()}))


def _child_users_way(path: str) -> None:
    """(d), in a child process: a ``VLLM`` engine, traces written as a researcher would."""
    import torch
    from vllm import SamplingParams

    from vllm_nnsight_plugin import VLLM

    model = VLLM(path, enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=PROMPTS, dispatch=True)
    width = model.vllm_entrypoint.llm_engine.vllm_config.model_config.get_hidden_size()
    vector = torch.linspace(-1, 1, width)
    strengths = [0.25 + i / 64 for i in range(PROMPTS)]
    prompts = _prompts()
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}

    def plain() -> list:
        return model.vllm_entrypoint.generate(prompts, SamplingParams(**sampling), use_tqdm=False)

    def steer() -> list:
        with model.trace(**sampling) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    for step in tracer.iter[:]:  # noqa: B007
                        model.model.layers[1].output[0][:] += vector
        return tracer.outputs

    def sweep(coefs: list[float] = strengths) -> list:
        with model.trace(**sampling) as tracer:
            for i, prompt in enumerate(prompts):
                with tracer.invoke(prompt):
                    for step in tracer.iter[:]:  # noqa: B007
                        model.model.layers[1].output[0][:] += coefs[i] * vector
        return tracer.outputs

    sweeps = itertools.count(1)
    # (the client keeps 512 payloads, oldest out first: the reused sweep's stay while the
    # new sweeps' 64 per rep fit beside them)
    assert PROMPTS * (REPS + 1) + 1 <= 512

    def new_sweep() -> list:  # (strengths never sent before: every plan is recorded in this batch)
        shift = next(sweeps) * 1e-3
        return sweep([s + shift for s in strengths])

    def timed(fn) -> float:  # noqa: ANN001
        t = time.perf_counter()
        outs = fn()
        seconds = time.perf_counter() - t
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        assert made == PROMPTS * MAX_TOKENS, f"{made} tokens"
        assert fn is plain or all(o.ran_as == "batched" for o in outs), [o.ran_as for o in outs]
        return made / seconds

    plain()  # warm-up: an untraced batch, then traced ones (the engine's first traced work)
    steer()
    sweep()
    times: dict[str, list[float]] = {"plain": [], "steer": [], "sweep": [], "sweep_first": []}
    for _ in range(REPS):
        for name, fn in (("plain", plain), ("steer", steer), ("sweep", sweep), ("sweep_first", new_sweep)):
            times[name].append(timed(fn))
    result = {k: statistics.median(v) for k, v in times.items()}
    print("RESULT " + json.dumps(result))


def _run_child(variant: str, path: str, disable: bool) -> dict[str, float]:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("VLLM_NNSIGHT_DISABLE", None)
    if disable:
        env["VLLM_NNSIGHT_DISABLE"] = "1"
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--model", path],
                         env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def _client_cost(layers: int, n: int = 2000) -> tuple[float, int]:
    """Median µs per request for trace capture + payload encode, and payload bytes."""
    import torch

    from vllm_nnsight_plugin.client.model import VLLM
    from vllm_nnsight_plugin.payload import codec

    model = VLLM("/unused")
    tree = {"": "LlamaForCausalLM", "model": "LlamaModel", "model.layers": "ModuleList"}
    tree.update({f"model.layers.{i}": "LlamaDecoderLayer" for i in range(layers)})
    object.__setattr__(model, "_tree", tree)
    sizes: list[int] = []

    def run_invokes(invokes, sampling, serve=None):  # noqa: ANN001, ANN202 - what trace() does before vLLM
        for inv in invokes:
            payload = codec.encode_code(codec.CodePayload(inv.block.source, inv.block.filename,
                                                          inv.block.lineno, inv.values))
            sizes.append(len(payload))
        return []

    object.__setattr__(model, "_run_invokes", run_invokes)
    v = torch.randn(16)
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        with model.trace("The Eiffel Tower is in", temperature=0.0):
            model.model.layers[1].output[0][:] += v
            hidden = model.model.layers[1].output.save()  # noqa: F841
            logits = model.logits.save()  # noqa: F841
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6, sizes[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--model")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child == "users_way":
        _child_users_way(args.model)
        return
    if args.child:
        _child(args.child, args.model)
        return

    from vllm_nnsight_plugin import tiny

    path = args.model or str(tiny.ensure("llama"))
    off, on = [], []
    for _ in range(2):  # A B A B
        off.append(_run_child("plain", path, disable=True)["plain"])
        on.append(_run_child("plain", path, disable=False)["plain"])
    traced = _run_child("traced", path, disable=False)
    users = _run_child("users_way", path, disable=False)
    c4, b4 = _client_cost(4)
    c32, b32 = _client_cost(32)

    off_tps, on_tps = statistics.mean(off), statistics.mean(on)
    print(f"\nCPU benchmark, tiny 4-layer Llama (fp32, eager), {PROMPTS} prompts x {MAX_TOKENS} tokens, "
          f"median of {REPS} reps; {time.strftime('%Y-%m-%d')}\n")
    print("| measurement | value | ratio |")
    print("|---|---:|---:|")
    print(f"| (a) plugin switched off (VLLM_NNSIGHT_DISABLE=1), out tok/s | {off_tps:,.0f} | 1 |")
    print(f"| (a) plugin installed, idle, out tok/s | {on_tps:,.0f} | {on_tps / off_tps:.3f} |")
    print(f"| (b) untraced, same engine, out tok/s | {traced['plain']:,.0f} | 1 |")
    print(f"| (b) all 64 requests save layer 1 output at prefill | {traced['prefill']:,.0f} | "
          f"{traced['prefill'] / traced['plain']:.3f} |")
    print(f"| (b') all 64 requests save layer 1's last row at every token | {traced['every_token']:,.0f} | "
          f"{traced['every_token'] / traced['plain']:.3f} |")
    print(f"| (c) client cost per request, 4-layer tree | {c4:.0f} µs, {b4} B | |")
    print(f"| (c) client cost per request, 32-layer tree | {c32:.0f} µs, {b32} B | {c32 / c4:.2f} (time) |")
    print(f"| (d) the user's way: untraced, same engine, out tok/s | {users['plain']:,.0f} | 1 |")
    for key, label in (("steer", "steering every step by one vector"),
                       ("sweep", "a strength sweep, each invoke its own (plans reused)"),
                       ("sweep_first", "a new sweep's first batch (its plans recorded)")):
        print(f"| (d) {label} | {users[key]:,.0f} | {users[key] / users['plain']:.3f} |")
    print(f"\nraw (a): off {[round(x) for x in off]}, on {[round(x) for x in on]}")


if __name__ == "__main__":
    main()
