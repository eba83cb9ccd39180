"""How long the worker takes to gather an every-token read's rows at the requests' last step.

The headline's every-token capture keeps each step's rows of the whole batch in shared
host blocks (``engine/host.put_rows``: pinned memory on a GPU) and, at the requests'
last step, gathers each request's rows into the buffer that leaves the worker
(``RowLog.__nnsight_encode__``). py-spy put that gather at about 100 ms per batch of
256 requests x 128 steps on the H200 host, three to four times a warm memcpy of its
134 MB on the development CPU. This times the same code alone, with the device and
sizes of the headline (rows of 2048 bf16 values), several batches in a row so the
result buffers' pool is warm after the first:

    python3 benchmarks/gpu/gather_bench.py [--requests 256] [--steps 128] [--batches 5]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    from vllm_nnsight_plugin.engine import host
    from vllm_nnsight_plugin.engine.rowlog import RowLog

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = torch.randn(args.requests, args.width, device=device).to(torch.bfloat16)
    print(f"device {device}, torch threads {torch.get_num_threads()}, {args.requests} requests x {args.steps} "
          f"steps x {args.width} bf16 = {args.requests * args.steps * args.width * 2 / 1e6:.0f} MB per batch")
    kept = None
    for batch in range(args.batches):
        logs = [RowLog() for _ in range(args.requests)]
        t = time.perf_counter()
        for _ in range(args.steps):  # (each step: the batch's rows to a host block, each request notes its row)
            block, first = host.put_rows(rows)
            for i, log in enumerate(logs):
                log.add(block, first + i, first + i + 1)
        host.wait()
        steps_s = time.perf_counter() - t
        t = time.perf_counter()
        encoded = [log.__nnsight_encode__(True) for log in logs]
        gather_s = time.perf_counter() - t
        print(f"batch {batch}: steps {steps_s * 1e3:.0f} ms, gather and encode {gather_s * 1e3:.0f} ms", flush=True)
        kept, encoded = encoded, None  # (the last batch's buffers live on, as the engine's outputs do while sent)
        host.release()
    del kept


if __name__ == "__main__":
    main()
