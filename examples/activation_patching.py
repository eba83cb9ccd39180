"""Activation patching: which layer and position carry the answer.

A clean prompt and a corrupted one (the same tokens but one) give different answers.
One trace reads the clean run's residual stream at every layer and position; a second
trace holds one invoke per (layer, position), each the corrupted prompt with that one
residual-stream row replaced by the clean run's (one request per patch, all batched).
The score is how much of the clean-vs-corrupted logit difference the patch restores:
0 = none, 1 = all. Prints the table and writes ``activation_patching.png`` and
``activation_patching.json``.

    python examples/activation_patching.py [--model PATH] [--serve URL]
"""

from __future__ import annotations

import json

import torch
from _common import architecture, heatmap, open_model, out_dir, parser, walk

CLEAN = "The Eiffel Tower is in Paris, the capital of"
CORRUPT_AT = 2  # the token replaced (by the first token of --corrupt-with)


def logit_diff(logits: torch.Tensor, good: int, bad: int) -> float:
    logits = logits.reshape(-1, logits.shape[-1])[-1].float()
    return float(logits[good] - logits[bad])


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompt", default=CLEAN)
    p.add_argument("--position", type=int, default=CORRUPT_AT, help="the position corrupted")
    p.add_argument("--corrupt-with", default=" Colosseum")
    args = p.parse_args()
    from vllm_nnsight_plugin.hooks import arch_adapter

    model, serve = open_model(args)
    adapter = arch_adapter(architecture(model))
    if not adapter.layer_returns_residual:
        raise SystemExit("this example patches (hidden, residual) layer outputs: a Llama-like model")
    layers = walk(model, adapter.layers_path)
    tok = model.tokenizer
    clean_ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
    corrupt_ids = list(clean_ids)
    corrupt_ids[args.position] = tok(args.corrupt_with, add_special_tokens=False)["input_ids"][0]
    n_layers, n_pos = len(layers), len(clean_ids)

    # 1. the clean and corrupted runs: every layer's (hidden, residual) rows, and the logits
    with model.trace(temperature=0.0, max_tokens=1, **serve) as tracer:
        clean_acts = list().save()
        runs = list().save()  # (the invokes' logits, in invoke order)
        with tracer.invoke({"prompt_token_ids": clean_ids}):
            for layer in layers:
                out = layer.output
                clean_acts.append((out[0].clone(), out[1].clone()))
            runs.append(model.logits)
        with tracer.invoke({"prompt_token_ids": corrupt_ids}):
            runs.append(model.logits)
    clean_logits, corrupt_logits = runs
    good = int(clean_logits.reshape(-1, clean_logits.shape[-1])[-1].argmax())
    bad = int(corrupt_logits.reshape(-1, corrupt_logits.shape[-1])[-1].argmax())
    if good == bad:  # (the corruption did not change the answer: compare with the runner-up)
        bad = int(corrupt_logits.reshape(-1, corrupt_logits.shape[-1])[-1].topk(2).indices[1])
    clean_diff = logit_diff(clean_logits, good, bad)
    corrupt_diff = logit_diff(corrupt_logits, good, bad)

    # 2. one invoke per (layer, position): the corrupted prompt, that row patched
    with model.trace(temperature=0.0, max_tokens=1, **serve) as tracer:
        patched = list().save()
        for i in range(n_layers):
            hidden, residual = clean_acts[i]
            for pos in range(n_pos):
                with tracer.invoke({"prompt_token_ids": corrupt_ids}):
                    out = layers[i].output
                    out[0][pos] = hidden[pos]
                    out[1][pos] = residual[pos]
                    patched.append(model.logits)
    scores = torch.tensor([(logit_diff(lg, good, bad) - corrupt_diff) / (clean_diff - corrupt_diff)
                           for lg in patched]).reshape(n_layers, n_pos)
    tokens = [repr(tok.decode([t]))[1:-1] for t in clean_ids]
    print(f"answer {tok.decode([good])!r} (clean) vs {tok.decode([bad])!r} (corrupted); "
          f"logit difference {clean_diff:.3f} clean, {corrupt_diff:.3f} corrupted")
    print("layer | " + " | ".join(f"{t:>9}" for t in tokens))
    for i in range(n_layers):
        print(f"{i:>5} | " + " | ".join(f"{float(s):>9.3f}" for s in scores[i]))
    out = out_dir(args)
    bound = max(1.0, float(scores.abs().max()))
    heatmap(out / "activation_patching.png", scores, [f"[{t}]" if j == args.position else t
                                                     for j, t in enumerate(tokens)],
            "activation patching: share of the logit difference restored",
            "position patched (the corrupted token in brackets)", "restored (1 = the clean run's)",
            cmap="RdBu", limits=(-bound, bound))
    (out / "activation_patching.json").write_text(json.dumps({
        "clean_ids": clean_ids, "corrupt_ids": corrupt_ids, "good": good, "bad": bad,
        "clean_diff": clean_diff, "corrupt_diff": corrupt_diff, "scores": scores.tolist()}))
    print(f"wrote {out / 'activation_patching.png'} and {out / 'activation_patching.json'}")
    if not args.serve:
        model.shutdown()


if __name__ == "__main__":
    main()
