"""Data parallel: ``vllm serve --data-parallel-size 2`` (two engine cores, requests
balanced between them) compiled with taps. Traced requests run on whichever rank takes
them and equal HF fp32; an edit installed over HTTP reaches both ranks; with the CLI's
default of one API server per rank, traced requests run and installing an edit is
refused with how to allow it (each front end would keep its own list)."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import HFRun, assert_close
from test_serve import KEY, TAPS_COMPILATION, _get, _start, _stop

from vllm_nnsight_plugin import VLLM

PROMPTS = [f"The number {i} is" for i in range(16)]


def _dp_server(llama_path: str, tmp_path_factory, *flags: str):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("data parallel takes a GPU per rank")
    extra = ["--data-parallel-size", "2", *flags, "--additional-config",
             json.dumps({"nnsight": {"taps": ["model.layers.*.output"]}})]
    if TAPS_COMPILATION != "{}":
        extra += ["--compilation-config", TAPS_COMPILATION]
    # (on the CPU: one core per rank, as for tensor parallel)
    return _start(llama_path, True, tmp_path_factory, extra, eager=False, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                  cli=True)


@pytest.fixture(scope="module")
def dp_server(llama_path, tmp_path_factory):
    """One API server in front of both ranks (what installed edits need)."""
    server = _dp_server(llama_path, tmp_path_factory, "--api-server-count", "1")
    yield server
    _stop(server)


def _finished_per_rank(server) -> dict[str, float]:
    """Requests each engine core (DP rank) has finished, from vLLM's Prometheus metrics."""
    req = urllib.request.Request(server.url + "/metrics")
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for engine, value in re.findall(r'^vllm:request_success_total\{engine="(\d+)"[^}]*\} (\S+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


def _ran_on_both(server, before: dict[str, float]) -> None:
    after = _finished_per_rank(server)
    assert sorted(after) == ["0", "1"], after
    assert all(after[e] > before.get(e, 0.0) for e in after), (before, after)


def test_a_traced_batch_runs_on_both_ranks_and_equals_hf(dp_server, llama_path, hf_llama):
    model = VLLM(llama_path)
    before = _finished_per_rank(dp_server)
    with model.trace(serve=dp_server.url, api_key=KEY, temperature=0.0, max_tokens=3) as tracer:
        resids, logits = list().save(), list().save()
        for i, prompt in enumerate(PROMPTS[:8]):
            with tracer.invoke(prompt):
                if i % 2:
                    model.model.layers[1].output[0][:] += 0.5
                out = model.model.layers[2].output
                resids.append(out[0] + out[1])
                logits.append(model.logits)
    _ran_on_both(dp_server, before)
    assert [o.ran_as for o in tracer.outputs] == ["batched"] * 8
    for i, output in enumerate(tracer.outputs):
        hf = HFRun(hf_llama, output.prompt_token_ids)
        if i % 2:
            hf.edit(hf_llama.model.layers[1].mlp, lambda h: h + 0.5)
        hf.record("resid", hf_llama.model.layers[2])
        ref = hf.logits()
        assert_close(resids[i], hf.records["resid"])
        assert_close(logits[i], ref[-1])


def test_an_installed_edit_reaches_every_rank(dp_server):
    def generate() -> list[list[int]]:
        def one(prompt: str) -> list[int]:
            status, body = dp_server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0.0, "return_token_ids": True})
            assert status == 200, body
            return body["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # (at once: the balancer spreads them)
            return list(pool.map(one, PROMPTS))

    clean = generate()
    spec = {"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "model.layers.1", "index": 0, "value": [3.0] * 128, "steps": "all"}]}
    status, edit = dp_server.post("/v1/nnsight/edits", {"payload": json.dumps(spec), "name": "shift"})
    assert status == 200, edit
    try:
        before = _finished_per_rank(dp_server)
        edited = generate()
        _ran_on_both(dp_server, before)
    finally:
        req = urllib.request.Request(dp_server.url + "/v1/nnsight/edits", method="DELETE")
        req.add_header("Authorization", f"Bearer {KEY}")
        urllib.request.urlopen(req, timeout=60).close()
    assert all(a != b for a, b in zip(clean, edited)), (clean, edited)  # every request, on either rank
    assert _get(dp_server, "/v1/nnsight/edits")["edits"] == []
    assert generate() == clean


@pytest.fixture(scope="module")
def dp_server_two_front_ends(llama_path, tmp_path_factory):
    """The CLI's default: one API server process per rank."""
    server = _dp_server(llama_path, tmp_path_factory)
    yield server
    _stop(server)


def test_with_an_api_server_per_rank_traces_run_and_installing_an_edit_is_refused(dp_server_two_front_ends):
    server = dp_server_two_front_ends
    read = json.dumps({"v": 1, "kind": "spec", "ops": [{"op": "read", "name": "h", "module": "model.layers.2"}]})

    def traced(prompt: str) -> tuple[int, dict]:
        return server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                               "temperature": 0.0, "vllm_xargs": {"nnsight": read}})

    before = _finished_per_rank(server)
    with ThreadPoolExecutor(8) as pool:  # (each a new connection: the kernel hands them to either front end)
        answers = list(pool.map(traced, PROMPTS[:8]))
    assert all(status == 200 and "h" in body["kv_transfer_params"]["nnsight"]["saves"] for status, body in answers)
    _ran_on_both(server, before)
    steer = {"v": 1, "kind": "spec", "ops": [
        {"op": "add", "module": "model.layers.1", "index": 0, "value": [3.0] * 128, "steps": "all"}]}
    status, body = server.post("/v1/nnsight/edits", {"payload": json.dumps(steer), "name": "shift"})
    assert status == 400 and "--api-server-count 1" in body["error"]["message"], body
