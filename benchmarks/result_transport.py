"""CPU benchmark: the cost of carrying saved values from the engine core to the caller.

    .venv/bin/python benchmarks/result_transport.py [--requests 256]

Saved values cross vLLM's own output path: the engine core encodes them onto each
finished request's ``EngineCoreOutput`` (msgpack, vLLM's ``MsgpackEncoder``), the
front end decodes them, and the caller turns them into tensors. The engine core is
vLLM's scheduling loop, so whatever it spends here is time no GPU step is scheduled.

Shapes are the headline benchmark's (benchmarks/gpu): 256 requests, layer 8's
residual stream of a 2048-wide bf16 model, (a) over a 128-token prefill (one
[128, 2048] tensor each) and (b) one [1, 2048] row per generated token (128 rows,
one ``$tensors`` buffer). Both result encodings are timed side by side:
``base64`` (tensor data as base64 text end to end: what the plugin did before) and
``binary`` (raw bytes inside vLLM; base64 only in the OpenAI server's process).
Prints a markdown table; compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _saves(kind: str) -> dict:
    if kind == "prefill":
        return {"stream": torch.randn(128, 2048).to(torch.bfloat16)}
    return {"stream": [torch.randn(1, 2048).to(torch.bfloat16) for _ in range(128)]}


def _one_rep(kind: str, binary: bool, n: int) -> dict[str, float]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_nnsight_plugin.payload import codec
    from vllm_nnsight_plugin.payload import values as tagged

    saves = [_saves(kind) for _ in range(n)]
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    t0 = time.perf_counter()
    outs = [EngineCoreOutput(request_id=str(i), new_token_ids=[1], finish_reason=0,
                             kv_transfer_params={codec.PAYLOAD_KEY: codec.encode_results(s, None, [], binary=binary)})
            for i, s in enumerate(saves)]
    frames = enc.encode(EngineCoreOutputs(outputs=outs))
    t1 = time.perf_counter()  # engine core done
    got = dec.decode(frames)
    t2 = time.perf_counter()  # front end has the outputs
    http = [tagged.to_json(o.kv_transfer_params[codec.PAYLOAD_KEY]) for o in got.outputs] if binary else None
    t3 = time.perf_counter()  # (OpenAI server only) JSON-safe form
    for o in got.outputs:
        codec.decode_results(o.kv_transfer_params[codec.PAYLOAD_KEY])
    t4 = time.perf_counter()  # the caller has tensors
    del http
    return {"engine core": t1 - t0, "front end": t2 - t1, "to JSON (server)": t3 - t2, "caller": t4 - t3,
            "MB on the wire": sum(len(bytes(f)) for f in frames) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.requests} requests; median of {args.reps} reps, seconds (MB: the msgpack frames)\n")
    cols = ["engine core", "front end", "to JSON (server)", "caller", "MB on the wire"]
    print("| saved per request | encoding | " + " | ".join(cols) + " | engine core, ratio to base64 |")
    print("|---|---|" + "---:|" * (len(cols) + 1))
    for kind, label in (("prefill", "[128, 2048] bf16 (prefill)"), ("every", "128 x [1, 2048] bf16 (per token)")):
        medians = {}
        for binary in (False, True):
            runs = [_one_rep(kind, binary, args.requests) for _ in range(args.reps)]
            medians[binary] = {c: statistics.median(r[c] for r in runs) for c in cols}
        for binary in (False, True):
            m = medians[binary]
            ratio = m["engine core"] / medians[False]["engine core"]
            cells = " | ".join(f"{m[c]:.1f}" if c.startswith("MB") else f"{m[c]:.3f}" for c in cols)
            print(f"| {label} | {'binary' if binary else 'base64'} | {cells} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
