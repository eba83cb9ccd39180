"""A linear probe on a served engine's traffic.

An engine-wide named edit saves one layer's last-token residual stream for every
request the engine admits. Plain requests (``vllm.LLM.generate``, or the OpenAI
client with ``--serve``: clients that never heard of nnsight) then carry it on their
outputs. A logistic-regression probe (scikit-learn) learns from those states which of
two kinds of prompt each request was; its accuracy on held-out prompts is printed.
``probe.json`` keeps the states, labels and accuracy.

    python examples/probe.py [--model PATH] [--serve URL] [--layer N]
"""

from __future__ import annotations

import json
import random

import torch
from _common import architecture, open_model, out_dir, parser, walk

ANIMALS = ["cat", "dog", "horse", "bird", "fox", "lion", "mouse", "bear"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
TEMPLATES = ["The {}", "I saw a {}", "Here is a {}", "My favourite is the {}", "Look, a {}"]


def dataset(seed: int = 0) -> list[tuple[str, int]]:
    """Prompts about animals (label 0) and about numbers (label 1), shuffled."""
    rows = [(t.format(w), label) for label, words in enumerate((ANIMALS, NUMBERS)) for w in words for t in TEMPLATES]
    random.Random(seed).shuffle(rows)
    return rows


def states(model, args, prompts: list[str]) -> list[torch.Tensor]:
    """The probe's save from each plain request's output."""
    from vllm_nnsight_plugin import results

    if args.serve:
        from openai import OpenAI

        client = OpenAI(base_url=args.serve.rstrip("/") + "/v1", api_key=args.api_key or "none")
        name = client.models.list().data[0].id
        outs = [client.completions.create(model=name, prompt=p, max_tokens=1) for p in prompts]
        return [results(o.model_dump())["state"] for o in outs]
    from vllm import SamplingParams

    outs = model.vllm_entrypoint.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    return [o.saves["state"] for o in outs]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--layer", type=int, default=2)
    args = p.parse_args()
    from sklearn.linear_model import LogisticRegression

    from vllm_nnsight_plugin.hooks import arch_adapter

    model, serve = open_model(args)
    adapter = arch_adapter(architecture(model))
    layer = walk(model, adapter.layers_path)[args.layer]
    residual = adapter.layer_returns_residual
    with model.edit(name="probe", **serve) as (tracer, probe):  # every request from here on
        out = layer.output
        state = ((out[0] + out[1])[-1] if residual else out[-1]).save()  # noqa: F841 - (returned by name)
    try:
        rows = dataset()
        found = states(model, args, [text for text, _ in rows])
    finally:
        probe.clear()
    x = torch.stack([s.float() for s in found]).numpy()
    y = [label for _, label in rows]
    split = len(rows) * 3 // 4
    clf = LogisticRegression(max_iter=2000).fit(x[:split], y[:split])
    accuracy = float(clf.score(x[split:], y[split:]))
    print(f"{len(rows)} plain requests carried layer {args.layer}'s last-token state ({x.shape[1]} wide)")
    print(f"probe (animals vs numbers): train {clf.score(x[:split], y[:split]):.2f}, "
          f"held-out accuracy {accuracy:.2f} on {len(rows) - split} prompts")
    path = out_dir(args) / "probe.json"
    path.write_text(json.dumps({"layer": args.layer, "prompts": [t for t, _ in rows], "labels": y,
                                "states": x.tolist(), "accuracy": accuracy}))
    print(f"wrote {path}")
    if not args.serve:
        model.shutdown()


if __name__ == "__main__":
    main()
