"""CPU benchmark: the plugin's own work per step for many traced requests, no engine.

    .venv/bin/python benchmarks/step_overhead.py [--requests 256] [--steps 64]

The GPU profile of the headline benchmark (benchmarks/gpu/README.md)
found the step bound by the plugin's Python over 256 requests, not by the device.
This drives the worker's ``Interleaver`` exactly as the runner adapters do each
step (``begin_step``, the forward with the tap op at layer 8's output, logits,
``end_step``) on a small torch model with vLLM's config of a compiled, tapped
engine (lanes on), and subtracts the same forward untraced. Workloads as the headline's:
a batched steering spec, batched every-step reads of the residual stream (``"sum"``:
output[0] + output[1]), the same two as nnsight-style blocks (which the engine runs as
those specs: engine/lower.py) and as code (``nnsight_lower: false``). Prints a markdown table: plugin time per
step and per request-step, and the share of the last step (results encoded as they
leave the worker). Compare rows within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

HIDDEN = 256


class Layer(torch.nn.Module):
    """Returns ``(hidden, residual)`` as vLLM's decoder layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp(x), x


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h, r = layer(x)
            x = h + r
        return x


class Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model()


VEC = torch.full((HIDDEN,), 0.01)  # the model's dtype (float32): the block lowers


def steer(model, tracer):
    for _ in tracer.all():
        model.model.layers[8].output[0][:] += VEC


def every_token(model, tracer):
    rows = []
    for _ in tracer.all():
        out = model.model.layers[8].output
        rows.append(out[0] + out[1])
    stream = rows.save()  # noqa: F841


def _payloads() -> dict[str, dict]:
    """Each workload's ``extra_args``."""
    from vllm_nnsight_plugin import make_payload

    spec = {"v": 1, "kind": "spec"}
    code = {"nnsight_lower": False}
    return {
        "steering, batched spec": {"nnsight": json.dumps({**spec, "ops": [
            {"op": "add", "module": "model.layers.8", "index": 0, "value": [0.01] * HIDDEN, "steps": "all"}]})},
        "every-token reads of the residual stream, batched spec (`\"sum\"`)": {"nnsight": json.dumps({**spec, "ops": [
            {"op": "read", "name": "stream", "module": "model.layers.8", "sum": True, "steps": "all"}]})},
        "steering, nnsight-style block (runs as its plan)": {"nnsight": make_payload(steer)},
        "every-token capture, nnsight-style block (runs as its plan)": {"nnsight": make_payload(every_token)},
        "steering, the block as code": {"nnsight": make_payload(steer), **code},
        "every-token capture, the block as code": {"nnsight": make_payload(every_token), **code},
    }


def _config():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nnsight_plugin import tiny

    path = tiny.ensure("llama", os.path.join(tempfile.gettempdir(), "nnsight-bench-ckpt"))
    return EngineArgs(model=str(path), enforce_eager=False, dtype="float32",
                      additional_config={"nnsight": {"taps": ["model.layers.8.output"]}}).create_engine_config()


def run(config, extra: dict, n: int, steps: int) -> tuple[float, float]:
    """The plugin's seconds in a median decode step of ``n`` requests, and in the last
    step (blocks end, results are encoded), each less the median untraced forward."""
    from vllm import SamplingParams

    from vllm_nnsight_plugin.boundary.worker_setup import worker_setup
    from vllm_nnsight_plugin.engine import lanes, taps
    from vllm_nnsight_plugin.engine.interleave import Interleaver
    from vllm_nnsight_plugin.engine.rows import StepLayout

    lanes.reset()
    lanes.enable(512)
    root = Root()
    sites = taps.install(root, taps.from_settings({"taps": ["model.layers.8.output"]}))
    inter = Interleaver(root, worker_setup(root, config), sites)
    ids = [f"r{i}" for i in range(n)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    for req_id in ids:
        inter.admit(req_id, extra, params)
    spans = {r: (i, i + 1) for i, r in enumerate(ids)}
    rows = {r: i for i, r in enumerate(ids)}
    x = torch.randn(n, HIDDEN)
    bare = []
    with torch.inference_mode():
        root.model(x)  # the first tap call creates the lanes (vLLM's profile run does this)
        for _ in range(steps):
            t = time.perf_counter()
            root.model(x)
            bare.append(time.perf_counter() - t)  # the forward alone (no step open: nothing served)
    traced = []
    for step in range(steps):
        t = time.perf_counter()
        with torch.inference_mode():  # as vLLM's execute_model runs (the lanes' tables are inference tensors)
            inter.begin_step(StepLayout(spans, rows, n))
            h = root.model(x)  # the tap op: lanes, batched Python path or blocks
            inter.guard_logits(h)  # (as the runner's compute_logits wrap: h stands in for the logits)
            inter.keep_logits(h)
            inter.end_step(set(ids) if step == steps - 1 else set())
        traced.append(time.perf_counter() - t)
        failed = [s.error["message"] for blocks in inter.sessions.values() for s in blocks if s.error]
        if failed:  # a benchmark of requests that failed measures nothing
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    base = statistics.median(bare)
    return statistics.median(traced[:-1]) - base, traced[-1] - base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    config = _config()
    gc.collect()
    gc.freeze()  # as vLLM's engine core does after start-up (freeze_gc_heap): no scans of static objects
    n, steps = args.requests, args.steps
    print(f"{n} requests, {steps} decode steps; the plugin's time per step (the step's time minus the "
          "same forward untraced; the runner adapters' own loops are not included)\n")
    print("| workload | per step | per request-step (µs) | last step (results leave) |")
    print("|---|---:|---:|---:|")
    for name, extra in _payloads().items():
        run(config, extra, n, 4)  # warm-up
        runs = [run(config, extra, n, steps) for _ in range(3)]  # this machine is noisy: median of 3
        per_step, last = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"| {name} | {per_step * 1e3:.2f} ms | {per_step / n * 1e6:.1f} | {last * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
