"""HTTP benchmark: a traced request vs a plain one through a real OpenAI server.

    .venv/bin/python benchmarks/serve_overhead.py [--model PATH]

Starts the stock server (``python -m vllm.entrypoints.openai.api_server``, what
``vllm serve`` runs) with the plugin and code payloads allowed, then sends the
same prompt 64 times concurrently: plain, with a code payload, and with the
equivalent JSON spec (both save layer 1's output at prefill and the top-5
logits), interleaved over reps. Prints a markdown table of ratios and payload
sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REQUESTS = 64
REPS = 5
PROMPT = "The Eiffel Tower is in Paris, the capital of France."


def _block(model, tracer):
    hidden = model.model.layers[1].output.save()  # noqa: F841
    top = model.logits[0].topk(5).values.save()  # noqa: F841


SPEC = json.dumps({"v": 1, "kind": "spec", "ops": [
    {"op": "read", "name": "hidden", "module": "model.layers.1"},
    {"op": "logits_topk", "name": "top", "k": 5},
]})


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _burst(url: str, body: dict) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        outs = list(pool.map(lambda _: _post(url, body), range(REQUESTS)))
    elapsed = time.perf_counter() - t
    if "vllm_xargs" in body:
        assert all(o["kv_transfer_params"]["nnsight"]["error"] is None for o in outs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_nnsight_plugin import make_payload, tiny

    path = args.model or str(tiny.ensure("llama"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_NNSIGHT_ALLOW_CODE="1", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
         "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
         "--max-num-seqs", str(REQUESTS), "--served-model-name", "tiny"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(1)
        code = make_payload(_block)
        base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        variants = {
            "plain": base,
            "code": {**base, "vllm_xargs": {"nnsight": code}},
            "spec": {**base, "vllm_xargs": {"nnsight": SPEC}},
        }
        for body in variants.values():
            _burst(url, body)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(REPS):
            for name, body in variants.items():
                times[name].append(_burst(url, body))
        med = {k: statistics.median(v) for k, v in times.items()}
        sample = _post(url, variants["code"])
        result_bytes = len(json.dumps(sample["kv_transfer_params"]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(f"\nHTTP round trip, {REQUESTS} concurrent requests x 8 tokens, tiny 4-layer Llama (CPU), "
          f"median of {REPS}; {time.strftime('%Y-%m-%d')}\n")
    print("| request | wall s (64 req) | ratio to plain | payload bytes |")
    print("|---|---:|---:|---:|")
    print(f"| plain | {med['plain']:.3f} | 1 | 0 |")
    print(f"| code payload (saves layer 1 + top-5) | {med['code']:.3f} | {med['code'] / med['plain']:.3f} | "
          f"{len(code)} |")
    print(f"| JSON spec (same reads) | {med['spec']:.3f} | {med['spec'] / med['plain']:.3f} | {len(SPEC)} |")
    print(f"\nresults in one traced response: {result_bytes} bytes of JSON")


if __name__ == "__main__":
    main()
