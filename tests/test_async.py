"""mode="async": vLLM's AsyncLLM, streams of outputs, concurrency, early
cancellation, and saves delivered step by step."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import ENGINE_KWARGS, HFRun, assert_close
from vllm import SamplingParams

from vllm_nnsight_plugin import VLLM, InterventionError


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()  # one loop: AsyncLLM binds its output handler to it
    yield loop
    pending = asyncio.all_tasks(loop)  # (model.shutdown() has finished AsyncLLM's own)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def amodel(llama_path, loop):
    async def make():
        return VLLM(llama_path, dispatch=True, mode="async", dtype="float32", max_model_len=512,
                    max_num_seqs=64, seed=0, **ENGINE_KWARGS)

    model = loop.run_until_complete(make())
    yield model
    model.shutdown()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 300))


def test_async_trace_equals_sync_and_hf(amodel, llama, hf_llama, loop):
    async def go():
        with amodel.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=2) as tracer:
            hidden = amodel.model.layers[2].output.save()  # noqa: F841
            logits = amodel.logits.save()  # noqa: F841
        outputs = [o async for o in tracer.backend]
        return outputs

    outputs = run(loop, go())
    last = outputs[-1]
    assert last.finished and not any(o.saves for o in outputs[:-1])  # saves arrive on the finished one
    with llama.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=2):
        hidden = llama.model.layers[2].output.save()
        logits = llama.logits.save()
    assert torch.allclose(last.saves["logits"], logits, atol=1e-5)
    assert torch.allclose(last.saves["hidden"][0], hidden[0], atol=1e-5)
    ref = HFRun(hf_llama, list(last.prompt_token_ids)).logits()
    assert_close(last.saves["logits"][0], ref[-1])


def test_await_backend_returns_the_last_output(amodel, loop):
    async def go():
        with amodel.trace("Hello", temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
            s = amodel.samples.save()  # noqa: F841
        last = await tracer.backend
        with pytest.raises(RuntimeError, match="consumed once"):  # (the stream was drained)
            async for _ in tracer.backend:
                pass
        with pytest.raises(ValueError, match="an async trace takes a single prompt"):
            with amodel.trace(temperature=0.0) as several:
                with several.invoke("Hello"):
                    pass
                with several.invoke("World"):
                    pass
        return last

    last = run(loop, go())
    assert last.finished and len(last.outputs[0].token_ids) == 3
    assert int(last.saves["s"][0]) == last.outputs[0].token_ids[0]


def test_many_traces_in_flight_each_correct(amodel, hf_llama, loop):
    prompt = "The capital of Japan is"
    v = torch.linspace(-1, 1, 128)

    async def traced(k: int):
        with amodel.trace(prompt, temperature=0.0) as tracer:
            amodel.model.layers[0].output[0][:] += k * v
            logits = amodel.logits.save()  # noqa: F841
        last = await tracer.backend
        return k, last

    async def plain(i: int):
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        last = None
        async for out in amodel.vllm_entrypoint.generate(prompt, params, f"plain-{i}"):
            last = out
        return last

    async def go():
        return await asyncio.gather(*[traced(k * 0.1) for k in range(32)], *[plain(i) for i in range(32)])

    results = run(loop, go())
    traced_results, plain_results = results[:32], results[32:]
    ids = list(traced_results[0][1].prompt_token_ids)
    for k, last in traced_results:
        ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h, k=k: h + k * v).logits()[-1]
        assert_close(last.saves["logits"][0], ref)
    clean = HFRun(hf_llama, ids).logits()[-1]
    for last in plain_results:
        assert last.outputs[0].token_ids[0] == int(clean.argmax())
        assert not last.saves


def test_errors_surface_when_the_stream_ends(amodel, loop):
    async def go():
        with amodel.trace("Hello", temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
            for step in tracer.iter[:4]:
                if step == 1:
                    boom = 1 / 0  # noqa: F841
        seen = []
        with pytest.raises(ZeroDivisionError) as info:
            async for out in tracer.backend:
                seen.append(out)
        return seen, info.value

    seen, err = run(loop, go())
    assert isinstance(err, InterventionError) and "boom = 1 / 0" in str(err)
    assert len(seen) >= 1  # outputs before the failure were streamed


def test_n_sequences_on_an_async_stream_are_refused_saying_why(amodel, loop):
    """An async trace streams its outputs, and n>1 returns its sequences' saves on the
    whole output only: refused before the engine, naming n>1 (test_sequences: n>1 on a
    whole output). ``await model.generate(..., n=2)`` is not streamed: both sequences."""
    async def go():
        with amodel.trace("Hello", temperature=1.0, max_tokens=2, n=2) as tracer:
            amodel.logits.save()
        async for _ in tracer.backend:
            pass

    with pytest.raises(ValueError, match="n>1"):
        run(loop, go())
    outs = run(loop, amodel.generate(["Hello"], n=2, temperature=1.0, max_tokens=2))  # (not streamed: both)
    assert [len(o.outputs) for o in outs] == [2]


def test_early_cancellation_frees_everything(amodel, loop):
    async def one(i: int):
        with amodel.trace("Hello world", temperature=0.0, max_tokens=64, ignore_eos=True) as tracer:
            for _ in tracer.all():
                amodel.model.layers[1].output[0][:] *= 1.0
        async for _ in tracer.backend:
            break  # stop after the first output: the request is aborted

    async def go():
        for batch in range(10):
            await asyncio.gather(*[one(batch * 20 + i) for i in range(20)])
        await asyncio.sleep(0.5)
        with amodel.trace("Hello", temperature=0.0) as tracer:
            lg = amodel.logits.save()  # noqa: F841
        last = await tracer.backend  # the engine still serves
        await asyncio.sleep(0.2)
        return last, await amodel.aengine_stats()

    last, stats = run(loop, go())
    assert last.saves["lg"].shape[0] == 1
    assert stats["scheduler_results"] == 0
    assert stats["workers"] == [{"sessions": 0, "hooks": 0, "waiters": 0, "results": 0}]


def test_stream_saves_arrive_step_by_step(amodel, hf_llama, loop):
    async def go():
        with amodel.trace("Hello world", temperature=0.0, max_tokens=4, ignore_eos=True,
                          stream_saves=True) as tracer:
            for _ in tracer.all():
                top = amodel.logits.save()  # noqa: F841
        return [o async for o in tracer.backend]

    outputs = run(loop, go())
    steps = [o.kv_transfer_params["nnsight"]["step"] for o in outputs[:-1]]
    assert steps == sorted(steps) and steps == list(range(len(steps)))
    ids = list(outputs[-1].prompt_token_ids)
    generated = list(outputs[-1].outputs[0].token_ids)
    for k, out in enumerate(outputs[:-1]):
        ref = HFRun(hf_llama, ids + generated[:k]).logits()[-1]
        assert_close(out.saves["top"][0], ref)
    assert outputs[-1].kv_transfer_params["nnsight"]["final"] is True


def test_async_edits_install_apply_and_clear(amodel, hf_llama, loop):
    v = torch.linspace(0.5, -0.5, 128)

    async def go():
        async with amodel.edit(name="steer") as (tracer, steer):
            for _ in tracer.all():
                amodel.model.layers[0].output[0][:] += v
        with pytest.raises(RuntimeError, match="aclear"):
            steer.clear()  # the sync form refuses instead of half-clearing
        with amodel.trace("Hello world", temperature=0.0) as tracer:
            steered = amodel.logits.save()  # noqa: F841
        a = await tracer.backend
        plain = await amodel.generate(["Hello world", "The capital of Japan is"], temperature=0.0, max_tokens=2,
                                      logprobs=1)
        await amodel.aclear_edits()
        with amodel.trace("Hello world", temperature=0.0) as tracer:
            clean = amodel.logits.save()  # noqa: F841
        b = await tracer.backend
        return a, b, plain

    a, b, plain = run(loop, go())
    # plain generation on the async engine (nnsight's awaitable form): each prompt steered
    assert [len(o.outputs[0].token_ids) for o in plain] == [2, 2] and plain[0].prompt == "Hello world"
    for out in plain:
        ids, token = list(out.prompt_token_ids), out.outputs[0].token_ids[0]
        steered = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v).logits()[-1]
        clean = HFRun(hf_llama, ids).logits()[-1]
        got = out.outputs[0].logprobs[0][token].logprob
        assert token == int(steered.argmax())
        assert abs(got - float(torch.log_softmax(steered, -1)[token])) < 1e-4
        assert abs(got - float(torch.log_softmax(clean, -1)[token])) > 1e-3  # (the edit ran)
    ids = list(a.prompt_token_ids)
    steered_ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v).logits()[-1]
    assert_close(a.saves["steered"][0], steered_ref)
    assert_close(b.saves["clean"][0], HFRun(hf_llama, ids).logits()[-1])
    with pytest.raises(RuntimeError, match="aclear_edits"):
        amodel.clear_edits()


EXIT_SCRIPT = '''
import asyncio, gc, json, os, sys
from vllm_nnsight_plugin import VLLM

ENGINE_KWARGS = json.loads(os.environ.get("NNSIGHT_TEST_ENGINE_KWARGS", "{}"))  # (the suite's, e.g. a GPU share)

async def one_trace(path):
    model = VLLM(path, mode="async", dispatch=True, dtype="float32", max_model_len=256, **ENGINE_KWARGS)
    with model.trace("Hello", max_tokens=2, temperature=0.0) as tracer:
        h = model.model.layers[0].output[0].save()
    out = await tracer.backend
    assert out.saves["h"].shape[0] == len(out.prompt_token_ids)
    return model

async def shut_down_inside(path):
    model = await one_trace(path)
    assert gc.get_freeze_count() > 0, "the start-up heap is left to every full collection"
    model.shutdown()
    assert gc.get_freeze_count() == 0, "a shut-down engine's objects stay out of the collector's reach"

if __name__ == "__main__":
    path = sys.argv[1]
    loop = asyncio.new_event_loop()      # shutdown() on the loop, then the loop closed by hand
    loop.run_until_complete(shut_down_inside(path))
    loop.close()
    gc.collect()
    model = asyncio.run(one_trace(path))  # no shutdown(): the interpreter exits with the engine up
    print("done", flush=True)
'''


def test_async_scripts_exit_cleanly(llama_path, tmp_path):
    """model.shutdown() finishes AsyncLLM's tasks on their own loop, so closing the loop
    and collecting garbage afterwards neither hangs nor complains (a dispatched engine's
    start-up heap is frozen, out of the cyclic collector's reach, until it is shut
    down); a script that never
    shuts down exits without AsyncLLM.__del__'s traceback (the engine is shut down at
    exit, before modules are torn down)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), llama_path], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    for bad in ("Traceback", "Exception ignored", "Task was destroyed", "ERROR"):
        assert bad not in proc.stderr, proc.stderr[-3000:]
