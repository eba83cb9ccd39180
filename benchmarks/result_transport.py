"""CPU benchmark: the cost of carrying saved values from the worker to the caller.

    .venv/bin/python benchmarks/result_transport.py [--requests 256]

Saved values cross vLLM's own output path: the worker's ``ModelRunnerOutput`` is
pickled to the engine core (vLLM's message queue), the engine core stamps them on
each finished request's ``EngineCoreOutput`` (msgpack, vLLM's ``MsgpackEncoder``),
the front end decodes them, and the caller turns them into tensors. The engine core
is vLLM's scheduling loop, so whatever it spends here is time no GPU step is
scheduled.

Shapes are the headline benchmark's (benchmarks/gpu): 256 requests, layer 8's
residual stream of a 2048-wide bf16 model, (a) over a 128-token prefill (one
[128, 2048] tensor each) and (b) one [1, 2048] row per generated token (128 rows,
one ``$tensors`` buffer). Two placements of the encoding are timed side by side:
``core encodes`` (the worker ships host tensors; the engine core encodes them:
the plugin before this change) and ``worker encodes`` (the worker ships encoded
bytes; the engine core only forwards them). Tensor data is raw bytes in both
(base64 only in the OpenAI server). Prints a markdown table; compare within one run.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch


def _saves(kind: str) -> dict:
    if kind == "prefill":
        return {"stream": torch.randn(128, 2048).to(torch.bfloat16)}
    return {"stream": [torch.randn(1, 2048).to(torch.bfloat16) for _ in range(128)]}


def _one_rep(kind: str, in_worker: bool, n: int) -> dict[str, float]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_nnsight_plugin.payload import codec

    saves = [_saves(kind) for _ in range(n)]
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    t0 = time.perf_counter()
    shipped = {str(i): codec.encode_saves(s, binary=True) if in_worker else s for i, s in enumerate(saves)}
    t1 = time.perf_counter()  # the worker's share
    wire = pickle.dumps(shipped, protocol=pickle.HIGHEST_PROTOCOL)
    arrived = pickle.loads(wire)
    t2 = time.perf_counter()  # worker -> engine core (vLLM pickles the runner output)
    outs = [EngineCoreOutput(request_id=i, new_token_ids=[1], finish_reason=0, kv_transfer_params={
        codec.PAYLOAD_KEY: codec.results_of(s, None, []) if in_worker else codec.encode_results(s, None, [], True)})
        for i, s in arrived.items()]
    frames = enc.encode(EngineCoreOutputs(outputs=outs))
    t3 = time.perf_counter()  # engine core done
    got = dec.decode(frames)
    t4 = time.perf_counter()  # front end has the outputs
    for o in got.outputs:
        codec.decode_results(o.kv_transfer_params[codec.PAYLOAD_KEY])
    t5 = time.perf_counter()  # the caller has tensors
    return {"worker": t1 - t0, "worker -> core": t2 - t1, "engine core": t3 - t2, "front end": t4 - t3,
            "caller": t5 - t4, "MB pickled": len(wire) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.requests} requests; median of {args.reps} reps, seconds (MB: the worker's pickle)\n")
    cols = ["worker", "worker -> core", "engine core", "front end", "caller", "MB pickled"]
    print("| saved per request | encoded in | " + " | ".join(cols) + " | engine core, ratio |")
    print("|---|---|" + "---:|" * (len(cols) + 1))
    for kind, label in (("prefill", "[128, 2048] bf16 (prefill)"), ("every", "128 x [1, 2048] bf16 (per token)")):
        medians = {}
        for in_worker in (False, True):
            runs = [_one_rep(kind, in_worker, args.requests) for _ in range(args.reps)]
            medians[in_worker] = {c: statistics.median(r[c] for r in runs) for c in cols}
        for in_worker in (False, True):
            m = medians[in_worker]
            ratio = m["engine core"] / medians[False]["engine core"]
            cells = " | ".join(f"{m[c]:.1f}" if c.startswith("MB") else f"{m[c]:.3f}" for c in cols)
            print(f"| {label} | {'worker' if in_worker else 'engine core'} | {cells} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
