"""Logit lens: what each layer's residual stream would predict, at every position.

Every layer's residual stream is put through the model's final norm and
unembedding, in the engine, in one trace; what comes back is small: each layer's
top token per position, and the probability it gives the token the model finally
predicts there. Prints the table of top tokens and writes ``logit_lens.png``
(layers × positions, colour: probability of the final top token) and
``logit_lens.json``.

    python examples/logit_lens.py [--model PATH] [--prompt TEXT] [--serve URL]

The block calls modules (the norm, then the unembedding, as nnsight's logit lens
does: ``lm_head(norm(h))``), so it runs as code: a served engine needs
VLLM_NNSIGHT_ALLOW_CODE=1. Under tensor parallel the unembedding's call gives the
whole vocabulary's logits.
"""

from __future__ import annotations

import json

import torch
from _common import architecture, heatmap, open_model, out_dir, parser, walk


def lens(model, prompt: str, serve: dict) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``(prompt token ids, top token id [layers, positions], probability of the final
    top token [layers, positions])``."""
    from vllm_nnsight_plugin.hooks import arch_adapter

    adapter = arch_adapter(architecture(model))
    if adapter is None:
        raise SystemExit(f"no adapter for {architecture(model)}: register one (hookspecs.nnsight_arch_adapter)")
    layers = walk(model, adapter.layers_path)
    norm = walk(model, adapter.final_norm)
    unembed = walk(model, adapter.unembed)
    residual = adapter.layer_returns_residual
    with model.trace(prompt, max_tokens=1, temperature=0.0, **serve) as tracer:
        probs = []
        for layer in layers:
            out = layer.output
            stream = out[0] + out[1] if residual else out
            probs.append(torch.softmax(unembed(norm(stream)).float(), dim=-1))
        final_top = probs[-1].argmax(-1)
        top = torch.stack([p.argmax(-1) for p in probs]).save()
        p_final = torch.stack([p.gather(-1, final_top[:, None])[:, 0] for p in probs]).save()
        result = tracer.result.save()
    return list(result.prompt_token_ids), top.cpu(), p_final.cpu()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompt", default="The Eiffel Tower is in Paris, the capital of")
    args = p.parse_args()
    model, serve = open_model(args)
    ids, top, p_final = lens(model, args.prompt, serve)
    tok = model.tokenizer

    def text(i: int) -> str:  # (escapes for control bytes; a partial UTF-8 byte shows as \ufffd)
        return repr(tok.decode([int(i)]))[1:-1]

    tokens = [text(i) for i in ids]
    table = [[text(t) for t in row] for row in top]
    width = max(8, *(len(t) for row in table for t in row))
    print("layer | " + " | ".join(f"{t:>{width}}" for t in tokens))
    for i, row in enumerate(table):
        print(f"{i:>5} | " + " | ".join(f"{t:>{width}}" for t in row))
    out = out_dir(args)
    heatmap(out / "logit_lens.png", p_final, tokens, "logit lens: probability of the final prediction, "
            "top token per cell", "position (input token)", "p(final top token)",
            limits=(0.0, float(p_final.max())), cells=table)
    (out / "logit_lens.json").write_text(json.dumps({
        "prompt_token_ids": ids, "top_token_ids": top.tolist(), "p_final_top": p_final.tolist()}))
    print(f"wrote {out / 'logit_lens.png'} and {out / 'logit_lens.json'}")
    if not args.serve:
        model.shutdown()


if __name__ == "__main__":
    main()
