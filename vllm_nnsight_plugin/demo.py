"""The main job: trace a stock vLLM engine, read a layer, ablate it, force a token.

    python -m vllm_nnsight_plugin.demo                 # builds a tiny random Llama locally
    python -m vllm_nnsight_plugin.demo --model PATH    # any local or hub checkpoint
"""

from __future__ import annotations

import argparse
import os


def _top(tokenizer, logits, k: int = 3) -> str:  # noqa: ANN001
    vals, ids = logits[0].float().topk(k)
    return ", ".join(f"{tokenizer.decode([int(i)])!r} {v:.2f}" for v, i in zip(vals.tolist(), ids.tolist()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local path or hub id (default: a tiny random Llama built here)")
    parser.add_argument("--prompt", default="The Eiffel Tower is in")
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--force-token", type=int, default=0, help="token id to force at every step")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.hooks import arch_adapter

    path = args.model
    if path is None:
        from vllm_nnsight_plugin import tiny

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        path = str(tiny.ensure("llama"))
        print(f"built a tiny random-weight Llama at {path}")

    model = VLLM(path, dispatch=True, dtype="float32", max_model_len=512)
    tok = model.tokenizer
    arch = next(iter(model._tree.values()))
    adapter = arch_adapter(arch)
    layers = model.model.layers if adapter and adapter.layers_path == "model.layers" else model.transformer.h
    layer = layers[args.layer]

    with model.trace(args.prompt, temperature=0.0):
        out = layer.output.save()
        clean = model.logits.save()
    stream = adapter.residual_stream(out) if adapter else out
    print(f"\n[read]    layer {args.layer} residual stream: shape {tuple(stream.shape)}, "
          f"norm of last token {stream[-1].norm():.3f}")
    print(f"          next-token top-3: {_top(tok, clean)}")

    with model.trace(args.prompt, temperature=0.0):
        layer.mlp.output[:] = 0
        ablated = model.logits.save()
    print(f"[ablate]  layer {args.layer} MLP zeroed -> top-3: {_top(tok, ablated)}")
    print(f"          max |logit change| {(ablated - clean).abs().max():.3f}, "
          f"argmax {tok.decode([int(clean.argmax())])!r} -> {tok.decode([int(ablated.argmax())])!r}")

    force = args.force_token
    with model.trace(temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
        with tracer.invoke(args.prompt):
            free = tracer.result.save()
        with tracer.invoke(args.prompt):
            for _ in tracer.iter[:4]:
                model.samples = torch.full_like(model.samples, force)
            forced = tracer.result.save()
    print(f"[force]   free:   {args.prompt!r} + {free.outputs[0].text!r}")
    print(f"          forced: {args.prompt!r} + {forced.outputs[0].text!r} (token {force} at every step)")
    print("          (two requests in one batch: only the second was forced)")
    model.shutdown()


if __name__ == "__main__":
    main()
