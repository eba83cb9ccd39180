"""CPU benchmark: the cost of carrying saved values from the worker to the caller.

    .venv/bin/python benchmarks/result_transport.py [--requests 256]

Saved values cross vLLM's own output path: the worker encodes them
(``codec.encode_saves(..., binary=True)``), its ``ModelRunnerOutput`` is pickled to
the engine core when the worker is a process of its own (tensor parallel; on one GPU
it runs inside the engine core), the engine core stamps them on each finished
request's ``EngineCoreOutput`` and msgpacks it (vLLM's ``MsgpackEncoder``), the front
end decodes it, and the caller turns the results into tensors. The engine core is
vLLM's scheduling loop, so whatever it spends here is time no GPU step is scheduled.

Shapes are the headline benchmark's (benchmarks/gpu): 256 requests, layer 8's
residual stream of a 2048-wide bf16 model, (a) over a 128-token prefill (one
[128, 2048] tensor each) and (b) one [1, 2048] row per generated token (128 rows,
one ``$tensors`` buffer). Two forms of the tensor data are timed side by side:
``frames`` (a uint8 numpy array: msgpack sends it as a frame of its own and the front
end puts the frame back, as the plugin does) and ``bytes`` (the same data as bytes
inside the message). Prints a markdown table; compare within one run.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
import torch


def _as_bytes(obj: object) -> object:
    """The encoded saves with tensor data as bytes inside the message."""
    if isinstance(obj, dict):
        return {k: bytes(v) if k == "data" and isinstance(v, np.ndarray) else _as_bytes(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_bytes(v) for v in obj]
    return obj


def _saves(kind: str) -> dict:
    if kind == "prefill":
        return {"stream": torch.randn(128, 2048).to(torch.bfloat16)}
    return {"stream": [torch.randn(1, 2048).to(torch.bfloat16) for _ in range(128)]}


def _one_rep(kind: str, frames_form: bool, n: int, tp: bool) -> dict[str, float]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_nnsight_plugin.payload import codec
    from vllm_nnsight_plugin.payload.values import resolve_frames

    saves = [_saves(kind) for _ in range(n)]
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    t0 = time.perf_counter()
    shipped = {str(i): codec.encode_saves(s, binary=True) for i, s in enumerate(saves)}
    if not frames_form:
        shipped = _as_bytes(shipped)
    t1 = time.perf_counter()  # the worker's share
    wire = pickle.dumps(shipped, protocol=pickle.HIGHEST_PROTOCOL) if tp else b""
    arrived = pickle.loads(wire) if tp else shipped
    t2 = time.perf_counter()  # worker -> engine core (pickled when the worker is its own process)
    outs = [EngineCoreOutput(request_id=i, new_token_ids=[1], finish_reason=0,
                             kv_transfer_params={codec.PAYLOAD_KEY: codec.results_of(s, None, [])})
            for i, s in arrived.items()]
    frames = enc.encode(EngineCoreOutputs(outputs=outs))
    t3 = time.perf_counter()  # engine core done
    got = dec.decode(frames)
    for o in got.outputs:  # (what the plugin's hook on the decoder does)
        resolve_frames(o.kv_transfer_params[codec.PAYLOAD_KEY], frames)
    t4 = time.perf_counter()  # front end has the outputs
    for o in got.outputs:
        codec.decode_results(o.kv_transfer_params[codec.PAYLOAD_KEY])
    t5 = time.perf_counter()  # the caller has tensors
    return {"worker": t1 - t0, "worker -> core": t2 - t1, "engine core": t3 - t2, "front end": t4 - t3,
            "caller": t5 - t4, "frames": len(frames)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tp", action="store_true", help="also pickle worker -> engine core (own process)")
    args = parser.parse_args()
    print(f"{args.requests} requests; median of {args.reps} reps, seconds\n")
    cols = ["worker", "worker -> core", "engine core", "front end", "caller"]
    print("| saved per request | tensor data | " + " | ".join(cols) + " | total | msgpack frames |")
    print("|---|---|" + "---:|" * (len(cols) + 2))
    for kind, label in (("prefill", "[128, 2048] bf16 (prefill)"), ("every", "128 x [1, 2048] bf16 (per token)")):
        for frames_form in (False, True):
            runs = [_one_rep(kind, frames_form, args.requests, args.tp) for _ in range(args.reps)]
            m = {c: statistics.median(r[c] for r in runs) for c in [*cols, "frames"]}
            cells = " | ".join(f"{m[c]:.3f}" for c in cols)
            total = sum(m[c] for c in cols)
            print(f"| {label} | {'frames' if frames_form else 'bytes'} | {cells} | {total:.3f} | {m['frames']:.0f} |")


if __name__ == "__main__":
    main()
