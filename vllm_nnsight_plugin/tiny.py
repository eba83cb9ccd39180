"""Tiny random-weight checkpoints built locally (no model hub needed).

Used by the demo, the tests and the CPU benchmarks. Head size 64 (vLLM's CPU
attention needs >= 32); a byte-level BPE tokenizer trained on a few sentences
with ``tokenizers``. Building needs ``transformers`` and ``tokenizers``.
"""

from __future__ import annotations

import os
from pathlib import Path

CORPUS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "The capital of Japan is Tokyo, a very large city.",
    "Hello world! This is a tiny model built for tests.",
    "Researchers trace and edit the internals of language models.",
    "Production inference runs on vLLM with continuous batching.",
    "One two three four five six seven eight nine ten.",
    "Activations, logits and edits are checked against a reference.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
]

KINDS = ("llama", "llama_tied", "gpt2", "llama_gqa", "llama_mqa", "mixtral", "qwen2_moe", "falcon",
         "mistral_sliding")  # mistral_sliding: sliding-window attention (16 tokens) in every layer; llama_gqa:
# 4 query heads, 2 KV heads; llama_mqa: 2 query heads, 1 KV head (replicated on both ranks of
# tensor_parallel_size=2); llama_tied: the unembedding shares the input embedding's weight; falcon:
# linears with biases that vLLM returns beside their output (skip_bias_add), parallel attention
VERSION = 2  # bump when the checkpoint recipe changes (cached builds are keyed by it)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _tokenizer(vocab_size: int):  # noqa: ANN202 - transformers type
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens(["<|endoftext|>"])  # last id, as in GPT-2: id 0 is an ordinary byte
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE  # so /v1/chat/completions works on the tiny models
    return fast


def build(kind: str, path: str | os.PathLike, layers: int = 4, hidden: int = 128, seed: int = 0) -> Path:
    """Write a tiny ``kind`` ("llama" or "gpt2") checkpoint + tokenizer to ``path``."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab_size=512)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    heads = hidden // 64
    torch.manual_seed(seed)
    if kind in ("llama", "llama_tied"):
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
            bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=kind == "llama_tied", torch_dtype="float32",
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama_gqa":  # grouped-query attention, heads divisible by a tensor-parallel size of 2
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden * 2, intermediate_size=hidden * 4,
            num_hidden_layers=layers, num_attention_heads=heads * 2, num_key_value_heads=heads,
            head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
            bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False, torch_dtype="float32",
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama_mqa":  # one KV head: tensor_parallel_size=2 replicates it on both ranks
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
            head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
            bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False, torch_dtype="float32",
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            head_dim=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False,
            torch_dtype="float32",
        )
        model = transformers.MixtralForCausalLM(config)
    elif kind == "mistral_sliding":
        config = transformers.MistralConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            head_dim=64, sliding_window=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
            bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False, torch_dtype="float32",
        )
        model = transformers.MistralForCausalLM(config)
    elif kind == "qwen2_moe":  # routed experts plus a shared expert
        config = transformers.Qwen2MoeConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden * 2, num_experts=4, num_experts_per_tok=2,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=eos, eos_token_id=eos,
            tie_word_embeddings=False, torch_dtype="float32",
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    elif kind == "falcon":  # biases returned beside the output (skip_bias_add), row-parallel partial sums
        config = transformers.FalconConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_kv_heads=heads, new_decoder_architecture=False, multi_query=False, parallel_attn=True,
            bias=True, alibi=False, max_position_embeddings=1024, bos_token_id=eos, eos_token_id=eos,
            torch_dtype="float32",
        )
        model = transformers.FalconForCausalLM(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024,
            bos_token_id=eos, eos_token_id=eos, torch_dtype="float32",
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(f"kind must be one of {KINDS}")
    with torch.no_grad():  # larger weights than the default init: logits that differ visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        if kind == "falcon":  # (biases start at zero: nonzero ones show where they are added)
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.08)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / ".complete").write_text("ok\n")
    return path


def ensure(kind: str, root: str | os.PathLike | None = None, layers: int = 4) -> Path:
    """The checkpoint directory, built on first use (cached under ``root``)."""
    root = Path(root or os.environ.get("VLLM_NNSIGHT_CACHE", Path.home() / ".cache" / "vllm-nnsight-plugin"))
    path = root / f"tiny-{kind}-{layers}l-v{VERSION}"
    if not (path / ".complete").exists():
        build(kind, path, layers=layers)
    return path
