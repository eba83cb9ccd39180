"""Per-request isolation inside the real engine: untraced neighbours are
bit-identical, the prefix cache never mixes edited and clean KV, and a failing
block ends only its own request."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import HFRun, assert_close, generate_together
from vllm import SamplingParams

from vllm_nnsight_plugin import InterventionError, make_payload, results

LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 20)


def _plain(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


def _traced(block, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True,
                          extra_args={"nnsight": make_payload(block)})


def _tokens_and_logprobs(output):
    comp = output.outputs[0]
    return list(comp.token_ids), [
        {tok: (lp.logprob, lp.rank) for tok, lp in step.items()} for step in comp.logprobs
    ]


def steer_block(model, tracer):
    for _ in tracer.all():
        model.model.layers[0].output[0][:] += 3.0


def test_plugin_is_live_in_the_worker_process(llama):
    probes = llama.vllm_entrypoint.collective_rpc("nnsight_probe")
    assert probes and all(p["patched"] for p in probes)
    assert all(p["pid"] != os.getpid() for p in probes)  # a real separate worker process
    expect = os.environ.get("NNSIGHT_TEST_EXPECT_RUNNER")  # the GPU run names the runner it selected
    if expect:
        assert all(p["v2"] == (expect == "v2") for p in probes), probes


def test_the_logits_guard_is_prepared_at_load_for_the_logits_the_engine_makes(llama):
    # the guard's kernel is built when the model loads, for the logits compute_logits
    # returns (a build in the first traced step stalls it); the guess must be those logits
    with llama.trace("The capital of Japan is", temperature=0.0, max_tokens=3) as tracer:
        steer_block(llama, tracer)  # (an edit: the guard checks this request's logits)
    with llama.trace("The capital of Japan is", temperature=0.0):
        logits = llama.logits.save()
    probes = llama.vllm_entrypoint.collective_rpc("nnsight_probe")
    # one build on CUDA, at load: no traced step built another (none at all elsewhere)
    assert [p["guard_builds"] for p in probes] == [int(torch.cuda.is_available())]
    for probe in probes:
        dtype, width, kernel = probe["logits"]
        assert (dtype, width) == (str(logits.dtype), logits.shape[-1])
        assert kernel == torch.cuda.is_available()  # (Triton on CUDA; the torch ops elsewhere)


def test_the_kv_blocks_a_traced_request_frees_are_zeroed_in_every_layer(llama, llama_path):
    # found when the KV cache was allocated: one tensor per attention layer, whose blocks
    # dimension holds the pool's blocks as vLLM's block tables address them (found at all:
    # kv_zeroing checks that against the kernel block size; the fills: test_kv_zeroing.py)
    layers = json.loads((Path(llama_path) / "config.json").read_text())["num_hidden_layers"]
    blocks = llama.vllm_entrypoint.llm_engine.vllm_config.cache_config.num_gpu_blocks
    for probe in llama.vllm_entrypoint.collective_rpc("nnsight_probe"):
        found = probe["kv_layers"]
        assert found is not None and len(found) == layers, found
        for shape, dim, ratio in found:
            assert shape[dim] == blocks * ratio, (shape, dim, ratio, blocks)


def test_untraced_neighbours_are_bit_identical(llama):
    llm = llama.vllm_entrypoint
    prompts = ["The capital of Japan is", "Hello world!", "One two three four"]
    # (the same batches, step for step: see generate_together)
    base = generate_together(llm, prompts, [_plain(), _plain(), _plain()])
    mixed = generate_together(llm, prompts, [_traced(steer_block), _plain(), _traced(steer_block)])
    assert _tokens_and_logprobs(mixed[1]) == _tokens_and_logprobs(base[1])
    # ...while the traced ones really changed
    assert _tokens_and_logprobs(mixed[0]) != _tokens_and_logprobs(base[0])


def test_prefix_cache_never_mixes_edited_and_clean_kv(llama, hf_llama):
    llm = llama.vllm_entrypoint
    clean_before = llm.generate([LONG], _plain(3), use_tqdm=False)[0]
    prompt_len = len(clean_before.prompt_token_ids)
    assert prompt_len > 200  # spans full KV blocks, so the prefix cache takes it

    with llama.trace(LONG, temperature=0.0) as tracer:
        llama.model.layers[1].mlp.output[:] *= 0.5
        h = llama.model.layers[3].output.save()
        logits = llama.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    # the traced request computed every position itself, under its edit
    assert h[0].shape[0] == prompt_len
    hf = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1].mlp, lambda x: x * 0.5)
    ref = hf.record("l3", hf_llama.model.layers[3]).logits()
    assert_close(h[0] + h[1], hf.records["l3"])
    assert_close(logits[0], ref[-1])

    clean_after = llm.generate([LONG], _plain(3), use_tqdm=False)[0]
    assert clean_after.num_cached_tokens and clean_after.num_cached_tokens > 0  # cache was used...
    # ...and clean: same tokens, same logprobs (a cache hit takes another kernel path, so on
    # GPU the last bits may differ; KV written under the edit would move them by ~1e-1)
    tokens_before, lps_before = _tokens_and_logprobs(clean_before)
    tokens_after, lps_after = _tokens_and_logprobs(clean_after)
    assert tokens_after == tokens_before
    for before, after in zip(lps_before, lps_after):
        assert before.keys() == after.keys()
        assert all(abs(before[t][0] - after[t][0]) < 1e-4 for t in before)
    clean_ref = HFRun(hf_llama, ids).logits()
    first_token = clean_after.outputs[0].token_ids[0]
    assert int(clean_ref[-1].argmax()) == first_token


def test_identical_edit_specs_share_prompt_kv_and_nothing_else_does(llama):
    """Requests carrying the same edit-only batched spec share prompt KV among
    themselves (computed under that same edit, as stock prefix caching shares clean
    KV); a request that reads, and a clean one, never take it."""
    import json

    llm = llama.vllm_entrypoint
    steer = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "model.layers.0", "index": 0, "value": [0.5] * 128, "steps": "all"}]})
    other = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "model.layers.0", "index": 0, "value": [-0.5] * 128, "steps": "all"}]})
    read = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "read", "name": "h", "module": "model.layers.0", "index": 0, "steps": "all"}]})

    def params(payload: str | None) -> SamplingParams:
        p = _plain(3)
        if payload:
            p.extra_args = {"nnsight": payload}
        return p

    clean = llm.generate([LONG], params(None), use_tqdm=False)[0]
    first = llm.generate([LONG], params(steer), use_tqdm=False)[0]
    again = llm.generate([LONG], params(steer), use_tqdm=False)[0]
    results(first), results(again)  # (each ran its edit: an error would raise here)
    assert len(first.outputs[0].token_ids) == len(again.outputs[0].token_ids) == 3
    assert not first.num_cached_tokens  # nothing computed under this edit yet (and not the clean KV)
    assert again.num_cached_tokens and again.num_cached_tokens > 200  # the first one's, same edit
    tokens, lps = _tokens_and_logprobs(first)
    tokens_again, lps_again = _tokens_and_logprobs(again)
    assert tokens_again == tokens and tokens != _tokens_and_logprobs(clean)[0]
    for a, b in zip(lps, lps_again):
        assert a.keys() == b.keys() and all(abs(a[t][0] - b[t][0]) < 1e-4 for t in a)
    assert not llm.generate([LONG], params(other), use_tqdm=False)[0].num_cached_tokens  # another edit
    reading = llm.generate([LONG], params(read), use_tqdm=False)[0]
    assert not reading.num_cached_tokens  # a read computes its prompt
    assert results(reading)["h"][0].shape[0] == len(reading.prompt_token_ids)
    clean_after = llm.generate([LONG], params(None), use_tqdm=False)[0]
    assert _tokens_and_logprobs(clean_after)[0] == _tokens_and_logprobs(clean)[0]


def test_finished_traced_requests_blocks_are_zeroed_at_once_and_a_shared_specs_stay_cached(llama):
    """Blocks of finished traced requests whose salt is their own are zeroed in the next
    step, before any reuse (no prefix-cache lookup can hit them), one pass for a batch
    finishing together; an edit-only spec's blocks, which its next request takes from
    the prefix cache, wait until the pool hands them out again."""
    llm = llama.vllm_entrypoint
    block_size = llm.llm_engine.vllm_config.cache_config.block_size

    def zeroed() -> tuple[int, int]:
        stats = llm.collective_rpc("nnsight_lane_stats")[0]
        return stats["kv_zeroed_blocks"], stats["kv_zero_passes"]

    blocks, passes = zeroed()
    outs = llm.generate([LONG] * 4, _traced(steer_block), use_tqdm=False)  # (a lowered block: a salt of its own)
    llm.generate(["Hello"], _plain(1), use_tqdm=False)  # a step after they finished
    held = 4 * (len(outs[0].prompt_token_ids) // block_size)  # (fewer than the pool's free blocks: no reuse)
    assert held < llm.llm_engine.vllm_config.cache_config.num_gpu_blocks // 4
    after_blocks, after_passes = zeroed()
    assert after_blocks - blocks >= held and after_passes - passes <= 2, (after_blocks - blocks, held)

    spec = json.dumps({"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "model.layers.0", "index": 0, "value": [0.25] * 128, "steps": "all"}]})
    edit = _plain(3)
    edit.extra_args = {"nnsight": spec}
    blocks, _ = zeroed()
    results(llm.generate([LONG], edit, use_tqdm=False)[0])
    llm.generate(["Hello"], _plain(1), use_tqdm=False)
    assert zeroed()[0] - blocks < len(outs[0].prompt_token_ids) // block_size  # kept for the spec's next request
    assert llm.generate([LONG], edit, use_tqdm=False)[0].num_cached_tokens > 200


def test_a_callers_salt_like_the_plugins_is_not_taken_for_a_traced_requests(llama):
    """The engine core tells traced requests by their salt's prefix and zeroes a finished
    one's blocks at once (no lookup can hit them): an untraced caller's salt that starts
    the same way gets a prefix of its own, so its next request still takes its prompt's
    KV from the prefix cache, intact."""
    llm = llama.vllm_entrypoint
    reference = llm.generate([LONG], _plain(3), use_tqdm=False)[0]
    salted = {"prompt": LONG, "cache_salt": "nnsight-mine"}
    llm.generate([salted], _plain(3), use_tqdm=False)
    llm.generate(["Hello"], _plain(1), use_tqdm=False)  # (a step after it finished)
    again = llm.generate([salted], _plain(3), use_tqdm=False)[0]
    assert again.num_cached_tokens and again.num_cached_tokens > 200
    tokens, lps = _tokens_and_logprobs(again)
    ref_tokens, ref_lps = _tokens_and_logprobs(reference)
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps):
        assert a.keys() == b.keys() and all(abs(a[t][0] - b[t][0]) < 1e-4 for t in a)


def test_error_in_one_invoke_ends_only_that_request(llama):
    with pytest.raises(ZeroDivisionError) as info:
        with llama.trace(temperature=0.0, max_tokens=4) as tracer:
            with tracer.invoke("Hello world"):
                ok = llama.logits.save()
            with tracer.invoke("The capital of Japan is"):
                bad = 1 / 0  # noqa: F841
    err = info.value
    assert isinstance(err, InterventionError) and isinstance(err, RuntimeError)  # (nnsight raises RuntimeError)
    assert str(err).startswith("ZeroDivisionError: division by zero") and "bad = 1 / 0" in str(err)
    assert err.lineno is not None
    good, failed = tracer.outputs
    assert len(good.outputs[0].token_ids) == 4  # the healthy request ran to its end
    assert failed.outputs[0].stop_reason == "nnsight_error"
    assert ok.shape[0] == 1  # saves of the healthy invoke still landed
    # the engine keeps serving
    with llama.trace("Hello", temperature=0.0):
        after = llama.logits.save()
    assert torch.isfinite(after).all()


def test_unknown_module_path_names_the_alternatives(llama):
    with pytest.raises(AttributeError) as info:
        with llama.trace("Hello", temperature=0.0):
            llama.model.layers[0].mlpp.output.save()
    msg = str(info.value)
    assert "mlpp" in msg and "mlp" in msg and "self_attn" in msg


def test_client_side_tree_rejects_wrong_paths_at_once(llama):
    with pytest.raises(AttributeError, match="submodules: .*layers"):
        llama.model.layerz  # noqa: B018
    assert len(llama.model.layers) == 4
    assert "LlamaDecoderLayer" in repr(llama.model.layers[0])


def test_out_of_order_access_is_an_error_not_a_hang(llama):
    with pytest.raises(InterventionError, match="not reached"):
        with llama.trace("Hello", temperature=0.0):
            llama.model.layers[3].output.save()
            llama.model.layers[1].output.save()


def test_lm_head_is_never_called_and_says_so(llama):
    with pytest.raises(InterventionError, match="use model.logits"):
        with llama.trace("Hello", temperature=0.0):
            llama.lm_head.output.save()


def test_saved_values_are_copies(llama):
    with llama.trace("Hello world", temperature=0.0):
        before = llama.model.layers[1].output[0].save()
        llama.model.layers[1].output[0][:] = 0
        after = llama.model.layers[1].output[0].save()
    assert torch.count_nonzero(before) > 0
    assert torch.count_nonzero(after) == 0


def test_large_per_step_results_come_back_whole_through_reused_buffers(llama):
    """Per-step reads of a long prompt leave the worker in one result buffer per request,
    over warm_buffers.SMALL, so the worker takes them from its pool of freed blocks: each
    trace's results are its own, whatever the traces before and after it left there."""
    from vllm_nnsight_plugin.payload import warm_buffers

    def trace(prompt):
        with llama.trace(prompt, temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
            rows = list().save()
            for _ in tracer.iter[:]:
                rows.append(llama.model.layers[0].output[0])
        return rows, len(tracer.outputs[0].prompt_token_ids)

    first, prompt_len = trace(LONG)
    assert sum(r.numel() * r.element_size() for r in first) > warm_buffers.SMALL
    assert [r.shape[0] for r in first] == [prompt_len, 1, 1]
    for _ in range(2):
        other, _ = trace(LONG.replace("fox", "cat"))
        assert not torch.equal(other[0], first[0])
        again, _ = trace(LONG)
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))


def test_stop_ends_the_request_without_error(llama):
    with llama.trace("Hello", temperature=0.0, max_tokens=8, ignore_eos=True) as tracer:
        for step in tracer.iter[:]:
            if step == 2:
                tracer.stop()
    assert len(tracer.outputs[0].outputs[0].token_ids) == 3
    assert tracer.outputs[0].outputs[0].stop_reason == "nnsight_stop"


def test_malformed_payloads_fail_before_the_engine(llama):
    llm = llama.vllm_entrypoint
    for bad in ["not json", '{"v": 1, "kind": "code"}', '{"v": 9}', 42]:
        with pytest.raises(ValueError, match="payload"):
            llm.generate(["Hello"], SamplingParams(extra_args={"nnsight": bad}), use_tqdm=False)


def test_unloadable_payload_ends_only_its_request(llama):
    import json

    good = json.loads(make_payload(steer_block))
    good["values"] = "gARLAS4="[:-2] + "=="  # valid base64, truncated pickle
    llm = llama.vllm_entrypoint
    outs = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(max_tokens=3, extra_args={"nnsight": json.dumps(good)}), _plain(3)],
        use_tqdm=False,
    )
    with pytest.raises(InterventionError, match="bad payload"):
        results(outs[0])
    assert len(outs[1].outputs[0].token_ids) == 3


def test_raw_llm_user_with_payload_helper(llama, hf_llama):
    def block(model, tracer):
        hidden = model.model.layers[2].output  # noqa: F841
        logits = model.logits.save()  # noqa: F841

    out = llama.vllm_entrypoint.generate(
        ["Hello world"], SamplingParams(max_tokens=1, extra_args={"nnsight": make_payload(block)}),
        use_tqdm=False,
    )[0]
    saves = results(out)
    assert set(saves) == {"logits"}
    assert out.saves.keys() == saves.keys()  # RequestOutput.saves, from the plugin
    ref = HFRun(hf_llama, list(out.prompt_token_ids)).logits()
    assert_close(saves["logits"][0], ref[-1])


def test_sampling_keywords_and_precedence(llama):
    with llama.trace(temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        with tracer.invoke("Hello"):
            a = llama.logits.save()  # noqa: F841
        with tracer.invoke("Hello", max_new_tokens=4):
            b = llama.logits.save()  # noqa: F841
    assert [len(o.outputs[0].token_ids) for o in tracer.outputs] == [2, 4]
    with pytest.raises(TypeError):
        with llama.trace("Hello", not_a_sampling_field=1):
            llama.logits.save()


def test_generate_with_and_without_a_block(llama):
    with llama.generate("Hello", max_tokens=2, temperature=0.0, ignore_eos=True) as tracer:
        out = llama.samples.save()
    assert out.shape == (1,)
    assert len(tracer.outputs[0].outputs[0].token_ids) == 2
    outputs = llama.generate(["Hello", "Hello world"], max_tokens=3, temperature=0.0)
    assert len(outputs) == 2 and all(len(o.outputs[0].token_ids) <= 3 for o in outputs)


def test_scan_is_refused_up_front(llama):
    with pytest.raises(NotImplementedError, match="scan"):
        llama.scan("Hello")


def test_open_ended_loop_unwinds_when_the_request_ends(llama):
    eos = llama.tokenizer.eos_token_id
    with llama.trace("Hello", temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
        hs = []
        for _ in tracer.all():
            hs.append(llama.model.layers[1].output[0][-1].clone())
        stacked = torch.stack(hs).save()  # after the loop: runs once the last token is out
    assert stacked.shape == (3, 128)
    with llama.trace("Hello", temperature=0.0, max_tokens=8) as tracer:
        steps = [].save()
        for step in tracer.all():
            if step == 1:
                llama.samples = torch.full_like(llama.samples, eos)  # EOS ends the request
            steps.append(step)
        done = True  # noqa: F841
        flag = done.save()
    assert steps == [0, 1] and flag is True
    assert list(tracer.outputs[0].outputs[0].token_ids)[-1] == eos


def test_bounded_loop_cut_short_warns(llama):
    with pytest.warns(RuntimeWarning, match="before tracer.iter reached"):
        with llama.trace("Hello", temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
            for _ in tracer.iter[:5]:
                last = llama.logits.save()
            result = tracer.result.save()
    assert last.shape[0] == 1 and len(result.outputs[0].token_ids) == 2


def test_inputs_gives_only_this_requests_rows_in_args_and_kwargs(llama):
    with llama.trace(temperature=0.0) as tracer:
        with tracer.invoke("Hello world"):
            args, kwargs = llama.model.layers[1].self_attn.inputs
            shapes = [tuple(v.shape) for v in list(args) + list(kwargs.values()) if hasattr(v, "shape")]
            n = shapes.save()
        with tracer.invoke("The quick brown fox jumps over the lazy dog"):
            llama.logits.save()
    rows = len(tracer.outputs[0].prompt_token_ids)
    assert n and all(shape[0] == rows for shape in n)
