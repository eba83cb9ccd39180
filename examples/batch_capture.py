"""Capture one layer's activations for a dataset of prompts into a file on disk.

The everyday job of building a probe or SAE dataset: every prompt's residual stream at
one layer, every token, written into a memory-mapped ``.npy`` file (rows: tokens, in
prompt order) with ``captures.json`` giving each prompt's first row and length. Each
batch is one trace with one invoke per prompt (vLLM batches them); a progress bar
follows the prompts, and the throughput is printed at the end.

    python examples/batch_capture.py [--model PATH] [--prompts FILE] [--n 2048] [--batch 256] [--serve URL]
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
from _common import architecture, open_model, out_dir, parser, walk

WORDS = ("the a of to and in is it that was for on with as his they at be this from have or by one had not "
         "but what all were when we there can an your which their said if do will each about how up out them "
         "then she many some so these would other into has more her two like him see time could no make than "
         "first been its who now people my made over did down only way find use may water long little very "
         "after words called just where most know").split()


def synthetic(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(6, 24))).capitalize() for _ in range(n)]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompts", help="a text file, one prompt per line (default: --n synthetic prompts)")
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256, help="prompts per trace")
    p.add_argument("--layer", type=int, default=1)
    args = p.parse_args()
    from tqdm import tqdm

    from vllm_nnsight_plugin.hooks import arch_adapter

    prompts = [line.rstrip("\n") for line in open(args.prompts)] if args.prompts else synthetic(args.n)
    prompts = [text for text in prompts if text]
    model, serve = open_model(args, max_num_seqs=min(args.batch, 256))
    adapter = arch_adapter(architecture(model))
    layer = walk(model, adapter.layers_path)[args.layer]
    residual = adapter.layer_returns_residual
    tok = model.tokenizer
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text in prompts]
    starts = np.cumsum([0] + [len(i) for i in ids]).tolist()
    out = out_dir(args)
    store = None
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), unit="prompt") as bar:
        for first in range(0, len(prompts), args.batch):
            batch = ids[first : first + args.batch]
            with model.trace(temperature=0.0, max_tokens=1, **serve) as tracer:
                for prompt in batch:
                    with tracer.invoke({"prompt_token_ids": prompt}):
                        o = layer.output
                        h = ((o[0] + o[1]) if residual else o).save()  # noqa: F841 - (on each output)
            for k, output in enumerate(tracer.outputs):
                rows = output.saves["h"].float().cpu().numpy()
                if store is None:  # (the width is known from the first capture)
                    store = np.lib.format.open_memmap(out / "captures.npy", mode="w+", dtype=np.float32,
                                                      shape=(starts[-1], rows.shape[-1]))
                store[starts[first + k] : starts[first + k + 1]] = rows
            bar.update(len(batch))
    seconds = time.perf_counter() - t0
    store.flush()
    (out / "captures.json").write_text(json.dumps({"layer": args.layer, "prompts": prompts, "starts": starts}))
    mb = store.nbytes / 1e6
    print(f"captured {len(prompts)} prompts, {starts[-1]} tokens x {store.shape[1]} of layer {args.layer} "
          f"in {seconds:.1f} s: {len(prompts) / seconds:.0f} prompts/s, {starts[-1] / seconds:.0f} tokens/s, "
          f"{mb / seconds:.1f} MB/s -> {out / 'captures.npy'} ({mb:.1f} MB)")
    if not args.serve:
        model.shutdown()


if __name__ == "__main__":
    main()
