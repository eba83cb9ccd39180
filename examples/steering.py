"""Steering: a vector from two sets of contrasting prompts, applied to every request.

1. One trace reads one layer's residual stream at the last token of every prompt of
   both sets (one invoke each, all batched); the steering vector is the difference of
   the two means.
2. An installed edit (``model.edit()``) adds ``alpha`` times it to that layer at every
   step of every request the engine admits from then on, including plain requests from
   a client that never heard of nnsight: here ``vllm.LLM.generate``, or the OpenAI API
   when ``--serve`` is given.
3. The same prompts are generated without and with it; ``steering.json`` keeps the
   vector, the texts and the first token's log-probabilities.

    python examples/steering.py [--model PATH] [--layer N] [--alpha A] [--serve URL]
"""

from __future__ import annotations

import json

import torch
from _common import architecture, open_model, out_dir, parser, walk

POSITIVE = ["I love this, it is wonderful", "What a great and happy day", "This is excellent and kind",
            "Such a beautiful, joyful song"]
NEGATIVE = ["I hate this, it is terrible", "What an awful and sad day", "This is horrible and cruel",
            "Such an ugly, miserable song"]
TEST = ["The movie was", "My neighbour is", "Today I feel"]


def steering_vector(model, layer, residual: bool, serve: dict) -> torch.Tensor:
    """Mean last-token residual stream of POSITIVE minus that of NEGATIVE."""
    with model.trace(temperature=0.0, max_tokens=1, **serve) as tracer:
        acts = list().save()  # (filled by the invokes, in invoke order)
        for prompt in POSITIVE + NEGATIVE:
            with tracer.invoke(prompt):
                out = layer.output
                acts.append((out[0] + out[1])[-1] if residual else out[-1])
    acts = torch.stack([a.float().cpu() for a in acts])
    return acts[: len(POSITIVE)].mean(0) - acts[len(POSITIVE):].mean(0)


def generate(model, args, prompts: list[str]) -> list[tuple[str, float]]:
    """Plain requests, as a client without nnsight sends them: (text, first token's logprob)."""
    if args.serve:
        from openai import OpenAI

        client = OpenAI(base_url=args.serve.rstrip("/") + "/v1", api_key=args.api_key or "none")
        name = client.models.list().data[0].id
        outs = [client.completions.create(model=name, prompt=p, max_tokens=args.tokens, temperature=0.0,
                                          logprobs=1).choices[0] for p in prompts]
        return [(o.text, float(o.logprobs.token_logprobs[0])) for o in outs]
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=1)
    outs = model.vllm_entrypoint.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].text, max(x.logprob for x in o.outputs[0].logprobs[0].values())) for o in outs]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--alpha", type=float, default=2.0)
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args()
    from vllm_nnsight_plugin.hooks import arch_adapter

    model, serve = open_model(args)
    adapter = arch_adapter(architecture(model))
    layer = walk(model, adapter.layers_path)[args.layer]
    v = steering_vector(model, layer, adapter.layer_returns_residual, serve)
    shift = args.alpha * v
    print(f"steering vector: layer {args.layer}, norm {v.norm():.3f}; adding {args.alpha} x it")
    before = generate(model, args, TEST)
    with model.edit(**serve) as (tracer, steer):  # every request from here on: this engine-wide edit
        for _ in tracer.all():
            layer.output[0][:] += shift
    try:
        after = generate(model, args, TEST)
    finally:
        steer.clear()
    for prompt, (a, _), (b, _) in zip(TEST, before, after):
        print(f"\n{prompt!r}\n  without: {a!r}\n  with:    {b!r}")
    path = out_dir(args) / "steering.json"
    path.write_text(json.dumps({"layer": args.layer, "alpha": args.alpha, "vector": v.tolist(), "prompts": TEST,
                                "without": before, "with": after}))
    print(f"\nwrote {path}")
    if not args.serve:
        model.shutdown()


if __name__ == "__main__":
    main()
