"""A real OpenAI server process (stock vLLM api_server module + the plugin) on
loopback: the GPU-less VLLM client, the openai client, raw HTTP with JSON specs,
streams, concurrency and bad input."""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import HFRun, assert_close

from vllm_nnsight_plugin import VLLM, InterventionError, make_payload, results
from vllm_nnsight_plugin.payload import values as tagged

KEY = "test-key"
# extra server flags for other machines (the GPU run sets a memory share)
SERVER_ARGS = json.loads(os.environ.get("NNSIGHT_TEST_SERVER_ARGS", "[]"))
TAPS_COMPILATION = os.environ.get("NNSIGHT_TEST_TAPS_COMPILATION", '{"mode": 3, "backend": "eager"}')


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: str

    def post(self, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def stream(self, path: str, body: dict) -> list[dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode())
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {KEY}")
        chunks = []
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return chunks

    def health(self) -> int:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:
            return resp.status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(path: str, allow_code: bool, tmp_path_factory, extra: list[str] = (), eager: bool = True,
           env: dict[str, str] | None = None, cli: bool = False) -> Server:
    """A server process; ``cli``: started as ``vllm serve`` (tests/serve_cli.py), else
    through vLLM's api_server module (the same server, one API server process)."""
    port = _free_port()
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    env = dict(os.environ, VLLM_NNSIGHT_ALLOW_CODE="1" if allow_code else "0", VLLM_LOGGING_LEVEL="WARNING",
               **(env or {}))
    launch = [str(Path(__file__).with_name("serve_cli.py")), "serve", path] if cli else \
        ["-m", "vllm.entrypoints.openai.api_server", "--model", path]
    cmd = [sys.executable, *launch, "--host", "127.0.0.1",
           "--port", str(port), "--api-key", KEY, *(["--enforce-eager"] if eager else []), "--dtype", "float32",
           "--max-model-len", "512", "--max-num-seqs", "32", "--served-model-name", "tiny", *extra, *SERVER_ARGS]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.time() + 400
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(open(log).read()[-3000:])
        try:
            if server.health() == 200:
                return server
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not start: " + open(log).read()[-3000:])


def _stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()


CODE_TIME_LIMIT_S = 15


@pytest.fixture(scope="module")
def code_server(llama_path, tmp_path_factory):
    limit = {"nnsight": {"code_time_limit_s": CODE_TIME_LIMIT_S, "max_saved_bytes": 200_000_000}}
    server = _start(llama_path, True, tmp_path_factory, ["--additional-config", json.dumps(limit)])
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def spec_server(llama_path, tmp_path_factory):
    limits = {"nnsight": {"max_saved_bytes": 150_000, "max_saves": 300}}
    server = _start(llama_path, False, tmp_path_factory, ["--additional-config", json.dumps(limits)])
    yield server
    _stop(server)


def _ids(llama_path: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------- GPU-less client


def test_gpu_less_client_traces_a_served_engine(code_server, llama_path, hf_llama):
    model = VLLM(llama_path)  # no engine, no weights
    with model.trace("Hello world", serve=code_server.url, api_key=KEY, temperature=0.0, max_tokens=3,
                     ignore_eos=True) as tracer:
        h = model.model.layers[1].output.save()
        steps = [].save()
        for _ in tracer.iter[:3]:
            steps.append(model.logits)
        result = tracer.result.save()
    assert not model.dispatched
    ids = result.prompt_token_ids
    generated = result.outputs[0].token_ids
    assert len(generated) == 3 and ids == _ids(llama_path, "Hello world")
    rec = HFRun(hf_llama, ids).record("l1", hf_llama.model.layers[1])
    rec.logits()
    assert_close(h[0] + h[1], rec.records["l1"])
    for k in range(3):
        ref = HFRun(hf_llama, ids + generated[:k]).logits()
        assert_close(steps[k][0], ref[-1])


def test_n_sequences_over_http_each_bring_their_saves_and_streams_are_refused(code_server, llama_path, hf_llama):
    """A served trace with n=2 (sampled): each sequence's saves come back on its choice,
    and in the frame as a list in sequence order, each equal to HF on that sequence's
    tokens; a stream, or per-step saves, with n>1 is a 400 naming the reason."""
    model = VLLM(llama_path)
    with model.trace(serve=code_server.url, api_key=KEY, temperature=1.0, seed=3, max_tokens=2,
                     ignore_eos=True) as tracer:
        with tracer.invoke("One two three", n=2):
            steps = list().save()
            for _ in tracer.all():
                steps.append(model.logits)
    out = tracer.outputs[0]
    assert len(out.outputs) == 2 and isinstance(steps, list) and len(steps) == 2
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for completion, mine in zip(out.outputs, steps):
        assert len(mine) == 2 and all(torch.equal(a, b) for a, b in zip(completion.saves["steps"], mine))
        ids = list(out.prompt_token_ids)
        for k in range(2):
            assert_close(mine[k][0], HFRun(hf_llama, ids + list(completion.token_ids[:k])).logits()[-1])

    def block(model, tracer):
        logits = model.logits.save()  # noqa: F841

    body = {"model": "tiny", "prompt": "One two", "n": 2, "max_tokens": 2,
            "vllm_xargs": {"nnsight": make_payload(block)}}
    status, resp = code_server.post("/v1/completions", {**body, "temperature": 1.0})
    assert status == 200 and len(resp["choices"]) == 2
    each = resp["kv_transfer_params"]["nnsight"]["sequences"]
    assert len(each) == 2 and all("logits" in json.dumps(one) for one in each)
    for extra in ({"stream": True}, {"vllm_xargs": {**body["vllm_xargs"], "nnsight_stream": True}}):
        status, err = code_server.post("/v1/completions", {**body, **extra})
        assert status == 400 and "n>1" in json.dumps(err)


def test_non_blocking_served_traces_are_collected_later(code_server, llama_path, hf_llama):
    """nnsight's way to fire many served traces and gather them later: blocking=False
    sends the request at the block's end; tracer.collect() waits, binds the saves and
    returns the outputs."""
    model = VLLM(llama_path)
    tracers = []
    for text in ("Hello world", "The capital of Japan is"):
        with model.trace(text, serve=code_server.url, api_key=KEY, blocking=False, temperature=0.0,
                         max_tokens=2) as tracer:
            h = model.model.layers[1].output[0].save()
        tracers.append(tracer)
    for tracer, text in zip(tracers, ("Hello world", "The capital of Japan is")):
        out = tracer.collect(timeout=300)[0]
        ids = out.prompt_token_ids
        assert ids == _ids(llama_path, text) and len(out.outputs[0].token_ids) == 2
        rec = HFRun(hf_llama, ids).record("mlp1", hf_llama.model.layers[1].mlp)
        rec.logits()
        assert_close(h, rec.records["mlp1"])  # (bound by collect)
    assert tracers[0].collect() is tracers[0].outputs  # collected once; later calls return the outputs


def test_a_served_trace_returns_a_cache(code_server, llama_path, hf_llama):
    model = VLLM(llama_path)
    with model.trace("Hello world", serve=code_server.url, api_key=KEY, temperature=0.0, max_tokens=2,
                     ignore_eos=True) as tracer:
        cache = tracer.cache(modules=[model.model.layers[1], model.model.layers[2].mlp])
        result = tracer.result.save()
    assert sorted(cache.keys()) == ["model.model.layers.1", "model.model.layers.2.mlp"]
    rec = HFRun(hf_llama, result.prompt_token_ids).record("l1", hf_llama.model.layers[1])
    rec.record("mlp2", hf_llama.model.layers[2].mlp).logits()
    prompt, generated = cache.model.model.layers[1].output
    assert_close(prompt[0] + prompt[1], rec.records["l1"])
    assert generated[0].shape == (1, 128)
    assert_close(cache["model.model.layers.2.mlp"].output[0], rec.records["mlp2"])


def test_gpu_less_client_checks_paths_against_the_server(code_server, llama_path):
    model = VLLM(llama_path)
    with pytest.raises(AttributeError, match="submodules: .*mlp"):
        with model.trace("Hello", serve=code_server.url, api_key=KEY):
            model.model.layers[1].mlpp.output.save()


def test_gpu_less_client_raises_the_servers_error(code_server, llama_path):
    model = VLLM(llama_path)
    with pytest.raises(InterventionError, match="division by zero"):
        with model.trace("Hello", serve=code_server.url, api_key=KEY):
            x = 1 / 0  # noqa: F841
    with pytest.raises(TypeError, match="temprature"):
        with model.trace("Hello", serve=code_server.url, api_key=KEY, temprature=0.0):
            model.logits.save()


# ----------------------------------------------------------------- openai client


def _block(model, tracer):
    model.model.layers[1].mlp.output[:] *= 0.5
    logits = model.logits.save()  # noqa: F841


def test_openai_client_with_code_payload(code_server, llama_path, hf_llama):
    import openai

    client = openai.OpenAI(base_url=code_server.url + "/v1", api_key=KEY)
    resp = client.completions.create(
        model="tiny", prompt="The capital of Japan is", max_tokens=1, temperature=0.0,
        extra_body={"vllm_xargs": {"nnsight": make_payload(_block)}},
    )
    saves = results(resp.model_dump())
    ids = _ids(llama_path, "The capital of Japan is")
    ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1].mlp, lambda x: x * 0.5).logits()
    assert_close(saves["logits"][0], ref[-1])


def test_code_payload_refused_without_operator_opt_in(spec_server, tmp_path):
    import openai

    marker = tmp_path / "pwned"

    class Hostile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    hostile = json.loads(make_payload(_block))
    hostile["values"] = base64.b64encode(pickle.dumps({"x": Hostile()})).decode()
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key=KEY)
    for payload in (make_payload(_block), json.dumps(hostile)):
        with pytest.raises(openai.BadRequestError, match="VLLM_NNSIGHT_ALLOW_CODE"):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=1,
                                      extra_body={"vllm_xargs": {"nnsight": payload}})
    assert not marker.exists()  # never unpickled
    assert spec_server.health() == 200


# ----------------------------------------------------------------- JSON specs


def _spec(ops: list[dict]) -> str:
    return json.dumps({"v": 1, "kind": "spec", "ops": ops})


def test_json_spec_over_raw_http(spec_server, llama_path, hf_llama):
    v = torch.linspace(-0.5, 0.5, 128)
    spec = _spec([
        {"op": "read", "name": "h1", "module": "model.layers.1", "index": 0},
        {"op": "read", "name": "r1_last", "module": "model.layers.1", "index": 1, "positions": [-1]},
        {"op": "add", "module": "model.layers.0", "index": 0, "value": v.tolist(), "steps": "all"},
        {"op": "logits_topk", "name": "top", "k": 5, "steps": "all"},
    ])
    status, body = spec_server.post("/v1/completions", {
        "model": "tiny", "prompt": "The Eiffel Tower is in", "max_tokens": 3, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"nnsight": spec}})
    assert status == 200, body
    raw = body["kv_transfer_params"]["nnsight"]
    assert raw["error"] is None
    h1 = tagged.decode(raw["saves"]["h1"])
    r1_last = tagged.decode(raw["saves"]["r1_last"])
    top = tagged.decode(raw["saves"]["top"])
    ids = body["choices"][0]["prompt_token_ids"]
    generated = body["choices"][0]["token_ids"]

    def steered(tokens):
        hf = HFRun(hf_llama, tokens).edit(hf_llama.model.layers[0], lambda h: h + v)
        return hf.record("l1", hf_llama.model.layers[1]), hf

    rec, hf = steered(ids)
    ref = hf.logits()
    assert h1.shape == (len(ids), 128) and r1_last.shape == (1, 128)
    # the layer-1 reads see the steered stream: hidden + residual == HF layer 1 output
    assert_close(h1[-1] + r1_last[0], rec.records["l1"][-1])
    assert len(top) == 3
    for k in range(3):
        ref_k = HFRun(hf_llama, ids + generated[:k]).edit(hf_llama.model.layers[0], lambda h: h + v).logits()
        vals, tok = ref_k[-1].topk(5)
        assert_close(top[k]["values"], vals)
        assert top[k]["ids"].tolist() == tok.tolist()
        assert generated[k] == int(tok[0])
    assert_close(top[0]["values"], ref[-1].topk(5).values)


def test_spec_layer_read_matches_hf(spec_server, hf_llama):
    spec = _spec([{"op": "read", "name": "o", "module": "model.layers.2", "index": None}])
    status, body = spec_server.post("/v1/completions", {
        "model": "tiny", "prompt": "Hello world", "max_tokens": 1, "return_token_ids": True,
        "vllm_xargs": {"nnsight": spec}})
    assert status == 200, body
    hidden, residual = tagged.decode(body["kv_transfer_params"]["nnsight"]["saves"]["o"])
    assert body["kv_transfer_params"]["nnsight"]["ran_as"] == "batched"  # next to the saves
    rec = HFRun(hf_llama, body["choices"][0]["prompt_token_ids"]).record("l2", hf_llama.model.layers[2])
    rec.logits()
    assert_close(hidden + residual, rec.records["l2"])


def test_chat_and_streams_carry_results(spec_server, llama_path, hf_llama):
    from transformers import AutoTokenizer

    spec = _spec([{"op": "logits_topk", "name": "top", "k": 3, "steps": "all"}])
    messages = [{"role": "user", "content": "Hello"}]
    common = {"model": "tiny", "max_tokens": 3, "ignore_eos": True, "temperature": 0.0,
              "vllm_xargs": {"nnsight": spec}}
    status, body = spec_server.post("/v1/chat/completions", {**common, "messages": messages})
    assert status == 200, body
    chat_top = tagged.decode(body["kv_transfer_params"]["nnsight"]["saves"]["top"])
    assert len(chat_top) == 3
    tok = AutoTokenizer.from_pretrained(llama_path)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    assert_close(chat_top[0]["values"], HFRun(hf_llama, ids).logits()[-1].topk(3).values)

    status, body = spec_server.post("/v1/completions", {**common, "prompt": "Hello"})
    plain_top = tagged.decode(body["kv_transfer_params"]["nnsight"]["saves"]["top"])
    for path, req, expected in (
        ("/v1/completions", {"prompt": "Hello"}, plain_top),
        ("/v1/chat/completions", {"messages": messages}, chat_top),
    ):
        chunks = spec_server.stream(path, {**common, **req})
        final = [c for c in chunks if any(ch.get("finish_reason") for ch in c.get("choices", []))]
        assert len(final) == 1, chunks
        top = tagged.decode(final[0]["kv_transfer_params"]["nnsight"]["saves"]["top"])
        assert len(top) == 3
        for got, want in zip(top, expected):
            assert torch.equal(got["ids"], want["ids"])
            assert_close(got["values"], want["values"])
        assert all("kv_transfer_params" not in c for c in chunks if c is not final[0])


def test_untraced_requests_are_untouched(spec_server):
    status, body = spec_server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert status == 200 and body.get("kv_transfer_params") is None
    chunks = spec_server.stream("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert all(c.get("kv_transfer_params") is None for c in chunks)


def test_sixteen_concurrent_requests_half_traced(spec_server, llama_path, hf_llama):
    prompt = "The quick brown fox"
    ids = _ids(llama_path, prompt)
    results_by_i: dict[int, tuple[int, dict]] = {}

    def run(i: int) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 1}
        if i % 2 == 0:
            factor = 0.25 * (i // 2 + 1)
            body["vllm_xargs"] = {"nnsight": _spec([
                {"op": "scale", "module": "model.layers.1.mlp", "factor": factor},
                {"op": "logits_topk", "name": "top", "k": 3}])}
        results_by_i[i] = spec_server.post("/v1/completions", body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clean = HFRun(hf_llama, ids).logits()[-1]
    for i, (status, body) in sorted(results_by_i.items()):
        assert status == 200, body
        if i % 2 == 0:
            factor = 0.25 * (i // 2 + 1)
            ref = HFRun(hf_llama, ids).edit(hf_llama.model.layers[1].mlp, lambda x, f=factor: x * f).logits()[-1]
            top = tagged.decode(body["kv_transfer_params"]["nnsight"]["saves"]["top"])
            assert_close(top["values"], ref.topk(3).values)
        else:
            assert body.get("kv_transfer_params") is None
            lp = body["choices"][0]["logprobs"]["top_logprobs"][0]
            assert abs(max(lp.values()) - float(torch.log_softmax(clean, -1).max())) < 1e-4


@pytest.mark.parametrize("payload, match", [
    ('{"v": 1, "kind": "code", "source": "x = 1", "filename": "f", "lineno": 1, "values": "!!!"}', "base64"),
    (_spec([{"op": "read", "name": "a", "module": "model.layers.1", "steps": "sometimes"}]), r"ops\[0\]\.steps"),
    (_spec([{"op": "scale", "module": "model.layers.1", "factor": "big"}]), r"ops\[0\]\.factor"),
    (_spec([{"op": "explode", "module": "x"}]), r"ops\[0\]\.op"),
    (_spec([{"op": "read", "name": "s", "module": "model.layers.1", "index": 0, "sum": True}]), r"ops\[0\]\.sum"),
    ("{not json", "not valid JSON"),
    ("x" * (9 * 1024 * 1024), "over the limit"),
    ("[" * 100_000, "nested too deeply"),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ('{"v": 1, "kind": "spec", "ops": [{"op": "scale", "module": "model.layers.0", "factor": NaN}]}', "NaN"),
    (_spec([{"op": "scale", "module": "model.layers.0", "factor": 2}]).replace('"v": 1', '"v": true'), "'v' must"),
    (_spec([{"op": "zero", "module": "model.layers.0\n"}]), r"ops\[0\]\.module"),
    (_spec([{"op": "scale", "module": "model.layers.0", "io": "input", "factor": 1e6}]), "integer tensor"),
    (_spec([{"op": "set", "module": "model.embed_tokens", "io": "input", "value": 100000}]), "integer tensor"),
    (_spec([{"op": "add", "module": "model.layers.0", "value": [0.5] * 1_000_000}]), "JSON values, over the limit"),
    (_spec([{"op": "add", "module": "model.layers.0", "value": [0.5] * 200_000}]), "wider than any|no tensor"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/nnsight/edits"])
def test_bad_payloads_get_a_400_and_the_server_stays_up(code_server, payload, match, route):
    body = {"payload": payload} if route.endswith("edits") else {
        "model": "tiny", "max_tokens": 1, "vllm_xargs": {"nnsight": payload},
        **({"prompt": "Hello"} if route.endswith("/completions") and "chat" not in route
           else {"messages": [{"role": "user", "content": "Hello"}]})}
    status, answer = code_server.post(route, body)
    assert status == 400, answer
    assert __import__("re").search(match, json.dumps(answer)), answer
    assert code_server.health() == 200


def test_refusals_are_logged_with_their_reason(code_server):
    code_server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 1,
                                         "vllm_xargs": {"nnsight": "[" * 100_000}})
    assert "refused a payload from http: payload is nested too deeply" in open(code_server.log).read()


def test_edits_route_refuses_bodies_that_are_not_objects(code_server):
    for body in ([1, 2], "text", None, {"payload": 5}, {"payload": _spec([{"op": "zero", "module": "m"}]), "name": 3}):
        status, answer = code_server.post("/v1/nnsight/edits", body)
        assert status == 400, answer
    assert code_server.health() == 200


def test_non_finite_spec_ends_its_request_visibly_and_poisons_nothing(spec_server):
    """The reproducer of a NaN that outlived its request, over HTTP: the traced
    requests end with stop_reason "nnsight_error" (besides the error in
    kv_transfer_params), and plain requests for the same prompts afterwards, which
    get the freed KV blocks, answer exactly as before, logprob for logprob."""
    prompts = ["The Eiffel Tower is in", "Hello world!", "One two three four five six seven"]
    plain = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}

    def run(extra: dict) -> list[dict]:
        out = []
        for prompt in prompts:
            status, body = spec_server.post("/v1/completions", {**plain, "prompt": prompt, **extra})
            assert status == 200, body
            out.append(body)
        return out

    before = run({})
    overflow = _spec([{"op": "add", "module": "model.layers.1", "index": i, "value": [3e38] * 128, "steps": "all"}
                      for i in (0, 1)])
    for body in run({"vllm_xargs": {"nnsight": overflow}}):
        choice = body["choices"][0]
        assert choice["stop_reason"] == "nnsight_error", choice
        assert "NaN or inf" in body["kv_transfer_params"]["nnsight"]["error"]["message"]
    after = run({})
    assert [b["choices"][0]["logprobs"] for b in after] == [b["choices"][0]["logprobs"] for b in before]
    assert [b["choices"][0]["text"] for b in after] == [b["choices"][0]["text"] for b in before]


def test_truncated_pickle_is_a_per_request_error(code_server):
    payload = json.loads(make_payload(_block))
    payload["values"] = base64.b64encode(base64.b64decode(payload["values"])[:-5]).decode()
    status, body = code_server.post("/v1/completions", {
        "model": "tiny", "prompt": "Hello", "max_tokens": 2, "vllm_xargs": {"nnsight": json.dumps(payload)}})
    assert status == 200
    err = body["kv_transfer_params"]["nnsight"]["error"]
    assert "bad payload" in err["message"]
    assert body["choices"][0]["stop_reason"] == "nnsight_error"
    assert code_server.health() == 200


def test_api_key_gates_the_nnsight_routes(code_server):
    req = urllib.request.Request(code_server.url + "/v1/nnsight/tree")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 401
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        tree = dict(json.loads(resp.read())["tree"])
    assert tree["model.layers.3.mlp"] == "LlamaMLP"


def test_operator_limits_on_saved_values(spec_server):
    long_prompt = " ".join(["One two three four five six seven eight nine ten."] * 20)
    cases = [
        ({"op": "read", "name": "big", "module": "model.layers.0"}, long_prompt, 1, "bytes"),  # ~2 x n x 512 B
        ({"op": "logits_topk", "name": "t", "k": 1, "steps": "all"}, "Hello", 200, "values"),  # 400 leaves
        ({"op": "cache", "name": "c"}, "Hello", 20, "bytes"),  # every module: ~30 kB a step
    ]
    for op, prompt, max_tokens, _ in cases:
        status, body = spec_server.post("/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "vllm_xargs": {"nnsight": _spec([op])}})
        assert status == 200, body
        err = body["kv_transfer_params"]["nnsight"]["error"]
        assert err is not None and "over this server's limits" in err["message"], body["kv_transfer_params"]
    assert spec_server.health() == 200


def test_meta_tree_is_exactly_what_the_server_loaded(code_server, llama_path):
    from vllm_nnsight_plugin.client.served import Connection

    model = VLLM(llama_path)  # GPU-less client: vLLM's model class on the meta device
    tree = model.meta_tree()
    assert not model.dispatched
    served = Connection(code_server.url, KEY).tree()
    assert (tree, None) == (served.modules, served.taps)
    record = served.record  # what the client records blocks against
    assert record["dtype"] == "float32"  # vLLM's rotary embedding: one module under every layer
    assert {f"model.layers.{i}.self_attn.rotary_emb" for i in range(4)} <= set(record["shared"])
    assert all(".rotary_emb" in path for path in record["shared"])
    assert record["structures"]["model.layers.0"] == 2  # (hidden, residual), from its forward's annotation
    assert record["structures"]["model.layers.0.self_attn.qkv_proj"] == 2  # a vLLM linear: (output, bias)
    assert tree["model.layers.0.self_attn.qkv_proj"] == "QKVParallelLinear"  # vLLM's paths, not HF's
    with pytest.raises(AttributeError, match="submodules"):
        model.model.layers[0].q_proj  # noqa: B018


@pytest.fixture(scope="module")
def compiled_server(llama_path, tmp_path_factory):
    """A server running torch.compile (dynamo with the eager backend: fast to build on
    CPU), i.e. an engine where Python hooks would not run on every step."""
    server = _start(llama_path, True, tmp_path_factory,
                    ["--compilation-config", '{"mode": 3, "backend": "eager"}'], eager=False)
    yield server
    _stop(server)


def test_compiled_engine_refuses_module_access_with_400_but_serves_logits(compiled_server, llama_path, hf_llama):
    module_spec = _spec([{"op": "read", "name": "h", "module": "model.layers.1"}])
    logits_spec = _spec([{"op": "logits_topk", "name": "t", "k": 3}])
    for payload in (module_spec, make_payload(_block)):
        status, body = compiled_server.post("/v1/completions", {
            "model": "tiny", "prompt": "Hello", "max_tokens": 1, "vllm_xargs": {"nnsight": payload}})
        assert status == 400 and "--enforce-eager" in body["error"]["message"], body
    status, body = compiled_server.post("/v1/completions", {
        "model": "tiny", "prompt": "Hello world", "max_tokens": 1, "return_token_ids": True,
        "vllm_xargs": {"nnsight": logits_spec}})
    assert status == 200, body
    top = tagged.decode(body["kv_transfer_params"]["nnsight"]["saves"]["t"])
    ref = HFRun(hf_llama, body["choices"][0]["prompt_token_ids"]).logits()[-1]
    assert_close(top["values"], ref.topk(3).values)


@pytest.fixture(scope="module")
def tapped_server(llama_path, tmp_path_factory):
    """A stock server compiled (CUDA graphs on a GPU) with taps declared by the operator."""
    taps = json.dumps({"nnsight": {"taps": ["model.layers.*.output"]}})
    extra = ["--additional-config", taps]
    if TAPS_COMPILATION != "{}":
        extra += ["--compilation-config", TAPS_COMPILATION]
    server = _start(llama_path, True, tmp_path_factory, extra, eager=False)
    yield server
    _stop(server)


def test_tapped_server_serves_its_taps_and_refuses_the_rest(tapped_server, llama_path, hf_llama):
    from vllm_nnsight_plugin.client.served import Connection

    assert Connection(tapped_server.url, KEY).tree()[1] == ["model.layers.*.output"]
    model = VLLM(llama_path)
    with model.trace("The Eiffel Tower is in", serve=tapped_server.url, api_key=KEY, temperature=0.0,
                     max_tokens=1) as tracer:
        model.model.layers[0].output[0][:] *= 0.5
        out = model.model.layers[2].output
        resid = (out[0] + out[1]).save()
        logits = model.logits.save()
    ids = tracer.outputs[0].prompt_token_ids
    assert tracer.outputs[0].ran_as == "batched"  # (as RequestOutput.ran_as, from the server's results)
    hf = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0].mlp, lambda h: h * 0.5)
    hf.record("resid", hf_llama.model.layers[2])
    ref = hf.logits()
    assert_close(logits[0], ref[-1])
    assert_close(resid, hf.records["resid"])
    with pytest.raises(ValueError, match="not tapped"):  # refused by the client, from the server's taps
        with model.trace("Hello", serve=tapped_server.url, api_key=KEY):
            model.model.layers[1].mlp.output.save()
    status, body = tapped_server.post("/v1/completions", {  # a spec at an untapped location: 400
        "model": "tiny", "prompt": "Hello", "max_tokens": 1,
        "vllm_xargs": {"nnsight": _spec([{"op": "read", "name": "h", "module": "model.layers.1.mlp"}])}})
    assert status == 400 and "not tapped" in body["error"]["message"], body
    assert "model.layers.*.output" in body["error"]["message"]


def test_nnsight_style_blocks_over_http_run_as_specs_with_the_blocks_results(tapped_server, llama_path, hf_llama):
    """The GPU-less client records a steering + every-step read block into its plan and
    sends the spec (client/served_plans.py); when the request says ``nnsight_lower:
    false`` it sends the block as code, which this server (code on) runs as code. Both
    give the same results, and HF's."""
    model = VLLM(llama_path)
    v = torch.linspace(-1, 1, 128)
    runs = []
    for extra in ({}, {"nnsight_lower": False}):
        with model.trace("The Eiffel Tower is in", serve=tapped_server.url, api_key=KEY, temperature=0.0,
                         max_tokens=3, ignore_eos=True, extra_args=extra) as tracer:
            rows = []
            for _ in tracer.all():
                model.model.layers[0].output[0][:] += v
                out = model.model.layers[2].output
                rows.append(out[0] + out[1])
            stream = rows.save()
        runs.append((list(tracer.outputs[0].outputs[0].token_ids), stream, tracer.outputs[0].ran_as))
    (tokens, stream, ran_as), (code_tokens, code_stream, code_ran_as) = runs
    assert ran_as == "batched" and code_ran_as.startswith("code:")  # (the spec; the code the request asked for)
    assert tokens == code_tokens and len(stream) == len(code_stream) == 3
    for a, b in zip(stream, code_stream):
        assert_close(a, b, 1e-5)
    ids = tracer.outputs[0].prompt_token_ids
    hf = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v)
    hf.record("resid", hf_llama.model.layers[2])
    ref = hf.logits()
    assert_close(stream[0], hf.records["resid"])
    assert tokens[0] == int(ref[-1].argmax())


def test_nnsight_style_blocks_run_on_a_server_that_runs_no_code(spec_server, llama_path, hf_llama):
    """A served trace records its blocks here and sends their plans as JSON specs, so a
    server that runs no code (the default) runs nnsight's spellings: steering every
    step with a named layer constant, a prompt read, a saved list of reads, every-step
    reads, the finished output (``tracer.result``); batched, equal to HF. Steering changes
    the tokens (clean != steered)."""
    from vllm_nnsight_plugin.client.served import ServeError

    model = VLLM(llama_path)
    v = torch.linspace(-2, 2, 128)
    LAYER = 0

    def run(steer: bool):
        with model.trace("The Eiffel Tower is in", serve=spec_server.url, api_key=KEY, temperature=0.0,
                         max_tokens=3, ignore_eos=True) as tracer:
            first = model.model.layers[1].output
            prompt = (first[0] + first[1]).save()
            pair = [model.model.layers[1].output[1], model.model.layers[2].output[1]].save()
            rows = list().save()
            for step in tracer.iter[:3]:  # noqa: B007
                if steer:
                    model.model.layers[LAYER].output[0][:] += v
                out = model.model.layers[2].output
                rows.append(out[0] + out[1])
            result = tracer.result.save()  # (the finished output: a plan's op too)
        assert result is tracer.outputs[0]
        return tracer.outputs[0], prompt, pair, rows

    output, prompt, pair, rows = run(True)
    assert output.ran_as == "batched"
    tokens, ids = list(output.outputs[0].token_ids), output.prompt_token_ids
    hf = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v)
    for name, module in (("l0", hf_llama.model.layers[0]), ("l1", hf_llama.model.layers[1]),
                         ("l2", hf_llama.model.layers[2]), ("a1", hf_llama.model.layers[1].self_attn),
                         ("a2", hf_llama.model.layers[2].self_attn)):
        hf.record(name, module)
    ref = hf.logits()
    assert_close(prompt, hf.records["l1"])
    assert_close(rows[0], hf.records["l2"])
    assert len(rows) == 3 and isinstance(pair, list) and len(pair) == 2
    # a layer's output[1] is vLLM's residual after its attention: the stream in plus the attention's output
    assert_close(pair[0], hf.records["l0"] + hf.records["a1"])
    assert_close(pair[1], hf.records["l1"] + hf.records["a2"])
    assert tokens[0] == int(ref[-1].argmax())
    for k in (1, 2):  # each step's rows: the steered forward over the tokens so far
        hf = HFRun(hf_llama, ids + tokens[:k]).edit(hf_llama.model.layers[0], lambda h: h + v)
        hf.record("l2", hf_llama.model.layers[2])
        hf.logits()
        assert_close(rows[k], hf.records["l2"][-1])
    clean = run(False)[0]
    assert clean.ran_as == "batched" and list(clean.outputs[0].token_ids) != tokens

    line = sys._getframe().f_lineno + 3  # (the block's line that keeps it code: a tensor's value in Python)
    with pytest.raises(ServeError, match=rf"VLLM_NNSIGHT_ALLOW_CODE.*not as a plan: line {line}: uses \.norm"):
        with model.trace("Hello", serve=spec_server.url, api_key=KEY, max_tokens=1):
            if model.model.layers[1].output[0].norm().item() > 0:
                h = model.model.layers[1].output[0].save()  # noqa: F841


def test_trace_level_slots_and_keys_run_as_plans_on_a_server_without_code(spec_server, llama_path, hf_llama):
    """nnsight's shared state across invokes written by slot and by key (each invoke its
    own ``slots[i]``, ``rows[prompt]`` and inner list, a number beside them) goes to a default server
    as plans (no code), and each invoke's writes come back merged, equal to HF."""
    model = VLLM(llama_path)
    prompts = ["Hello", "The capital of Japan is"]
    with model.trace(serve=spec_server.url, api_key=KEY, temperature=0.0, max_tokens=1) as tracer:
        slots = [None for _ in prompts].save()
        counts = [0 for _ in prompts].save()
        rows = dict().save()
        appended = list().save()
        nested = [list() for _ in prompts].save()
        for i, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                nested[i].append(model.model.layers[0].output[0])
                slots[i] = model.logits
                counts[i] = i + 1
                rows[prompt] = model.model.layers[1].output[0][-1]
                appended.append(model.model.layers[0].output[0])
    assert [o.ran_as for o in tracer.outputs] == ["batched", "batched"]
    assert counts == [1, 2] and list(rows) == prompts and len(appended) == 2
    assert [len(inner) for inner in nested] == [1, 1] and all(torch.equal(a, b[0]) for a, b in zip(appended, nested))
    for out, prompt, logits, first in zip(tracer.outputs, prompts, slots, appended):
        run = HFRun(hf_llama, list(out.prompt_token_ids)).record("mlp1", hf_llama.model.layers[1].mlp)
        run.record("mlp0", hf_llama.model.layers[0].mlp)  # (a vLLM layer's output[0]: its MLP's output)
        assert_close(logits[0], run.logits()[-1])
        assert_close(rows[prompt], run.records["mlp1"][-1])
        assert_close(first, run.records["mlp0"])


def test_sse_chunks_carry_each_steps_saves(spec_server, llama_path, hf_llama):
    spec = _spec([{"op": "logits_topk", "name": "top", "k": 2, "steps": "all"}])
    chunks = spec_server.stream("/v1/completions", {
        "model": "tiny", "prompt": "Hello world", "max_tokens": 4, "ignore_eos": True, "temperature": 0.0,
        "return_token_ids": True, "vllm_xargs": {"nnsight": spec, "nnsight_stream": 1}})
    carried = [c["kv_transfer_params"]["nnsight"] for c in chunks if c.get("kv_transfer_params")]
    assert carried[-1]["final"] is True and len(tagged.decode(carried[-1]["saves"]["top"])) == 4
    partial = carried[:-1]
    # one record per chunk, steps increasing; a chunk may carry several steps' tokens when
    # the client reads slower than the engine steps (vLLM merges the deltas; seen on the
    # GPU), and its record then holds every step so far
    steps = [r["step"] for r in partial]
    assert partial and steps == sorted(set(steps))
    ids = _ids(llama_path, "Hello world")
    tokens = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    for r in [*partial, carried[-1]]:
        top = tagged.decode(r["saves"]["top"])  # the spec's list so far: one entry per step
        assert len(top) == (r["step"] + 1 if not r.get("final") else 4)
        for k, entry in enumerate(top):
            ref = HFRun(hf_llama, ids + tokens[:k]).logits()[-1]
            assert_close(entry["values"], ref.topk(2).values)


def test_a_stream_flag_sent_as_a_false_string_does_not_stream(spec_server):
    """``nnsight_stream`` read as a flag (payload/request_args.py): "false" leaves the
    saves on the finish chunk only; a value that is not true or false is a 400."""
    spec = _spec([{"op": "logits_topk", "name": "top", "k": 2, "steps": "all"}])
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    for off in ("false", "0", 0):
        chunks = spec_server.stream("/v1/completions", {**body, "vllm_xargs": {"nnsight": spec, "nnsight_stream": off}})
        carried = [c["kv_transfer_params"]["nnsight"] for c in chunks if c.get("kv_transfer_params")]
        assert len(carried) == 1 and carried[0]["final"] is True and "step" not in carried[0], (off, carried)
    bad = {**body, "vllm_xargs": {"nnsight": spec, "nnsight_stream": "yes"}}
    status, err = spec_server.post("/v1/completions", bad)
    assert status == 400 and "nnsight_stream" in err["error"]["message"], err


def test_spec_input_read_zero_and_set_at_positions(spec_server, hf_llama):
    w = torch.linspace(1, -1, 128)
    spec = _spec([
        {"op": "read", "name": "mlp_in", "module": "model.layers.1.mlp", "io": "input"},
        {"op": "zero", "module": "model.layers.2.mlp", "positions": [0]},
        {"op": "set", "module": "model.layers.3.mlp", "positions": [-1], "value": w.tolist()},
        {"op": "logits_topk", "name": "top", "k": 4},
    ])
    status, body = spec_server.post("/v1/completions", {
        "model": "tiny", "prompt": "The quick brown fox", "max_tokens": 1, "return_token_ids": True,
        "vllm_xargs": {"nnsight": spec}})
    assert status == 200, body
    saves = {k: tagged.decode(v) for k, v in body["kv_transfer_params"]["nnsight"]["saves"].items()}
    ids = body["choices"][0]["prompt_token_ids"]

    def zero_first(x):
        x = x.clone()
        x[:, 0] = 0
        return x

    def set_last(x):
        x = x.clone()
        x[:, -1] = w
        return x

    seen = {}
    hook = hf_llama.model.layers[1].mlp.register_forward_pre_hook(
        lambda mod, args: seen.setdefault("mlp_in", args[0][0].detach().clone()))
    try:
        ref = (HFRun(hf_llama, ids).edit(hf_llama.model.layers[2].mlp, zero_first)
               .edit(hf_llama.model.layers[3].mlp, set_last).logits()[-1])
    finally:
        hook.remove()
    assert_close(saves["mlp_in"], seen["mlp_in"])
    assert_close(saves["top"]["values"], ref.topk(4).values)
    assert saves["top"]["ids"].tolist() == ref.topk(4).indices.tolist()


def _get(server: Server, path: str) -> dict:
    req = urllib.request.Request(server.url + path)
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("server", ["code_server", "spec_server"])
def test_served_edit_reaches_plain_openai_requests(server, request, llama_path, hf_llama):
    """``model.edit(serve=...)`` installs its block's plan as a spec: on a server that
    runs no code too."""
    import openai

    server = request.getfixturevalue(server)
    model = VLLM(llama_path)
    v = torch.linspace(-0.3, 0.3, 128)
    with model.edit(name="steer", serve=server.url, api_key=KEY) as (tracer, steer):
        for _ in tracer.all():
            model.model.layers[0].output[0][:] += v
    ids = _ids(llama_path, "Hello world")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    try:
        assert [e["name"] for e in _get(server, "/v1/nnsight/edits")["edits"]] == ["steer"]
        resp = client.completions.create(model="tiny", prompt="Hello world", max_tokens=1, temperature=0.0,
                                          logprobs=1)  # a client that never heard of nnsight
        steered = HFRun(hf_llama, ids).edit(hf_llama.model.layers[0], lambda h: h + v).logits()[-1]
        top = max(resp.choices[0].logprobs.top_logprobs[0].values())
        assert abs(top - float(torch.log_softmax(steered, -1).max())) < 1e-4
    finally:
        steer.clear()
    assert _get(server, "/v1/nnsight/edits")["edits"] == []
    resp = client.completions.create(model="tiny", prompt="Hello world", max_tokens=1, temperature=0.0, logprobs=1)
    clean = HFRun(hf_llama, ids).logits()[-1]
    assert abs(max(resp.choices[0].logprobs.top_logprobs[0].values())
               - float(torch.log_softmax(clean, -1).max())) < 1e-4


def test_spec_edit_without_code_opt_in_and_its_saves_in_plain_responses(spec_server, hf_llama):
    probe = _spec([{"op": "read", "name": "h", "module": "model.layers.1", "index": 0, "positions": [-1]}])
    status, body = spec_server.post("/v1/nnsight/edits", {"payload": probe, "name": "probe"})
    assert status == 200, body
    try:
        status, refused = spec_server.post("/v1/nnsight/edits", {"payload": make_payload(_block)})
        assert status == 400 and "VLLM_NNSIGHT_ALLOW_CODE" in json.dumps(refused)
        status, out = spec_server.post("/v1/completions", {"model": "tiny", "prompt": "Hello world",
                                                           "max_tokens": 1, "return_token_ids": True})
        assert status == 200
        h = tagged.decode(out["kv_transfer_params"]["nnsight"]["saves"]["h"])
        assert h.shape == (1, 128)
        status, err = spec_server.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                                                           "vllm_xargs": {"nnsight_edits": "nope"}})
        assert status == 400 and "unknown edit" in json.dumps(err)
        # the installed edit traces every request: n>1 cannot stream its sequences' saves
        status, err = spec_server.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                                                           "n": 2, "temperature": 1.0, "stream": True})
        assert status == 400 and "n>1" in json.dumps(err), (status, err)
    finally:
        req = urllib.request.Request(spec_server.url + "/v1/nnsight/edits", method="DELETE")
        req.add_header("Authorization", f"Bearer {KEY}")
        urllib.request.urlopen(req, timeout=60)
    status, out = spec_server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 1})
    assert out.get("kv_transfer_params") is None


def _forever(model, tracer):
    while True:
        pass


def _sleeps(model, tracer):
    import time

    time.sleep(600)


def _swallows(model, tracer):
    while True:
        try:
            while True:
                pass
        except Exception:  # noqa: BLE001 - a block that tries to catch the limit's exception
            pass


@pytest.mark.parametrize("block", [_forever, _sleeps, _swallows], ids=["loop", "sleep", "except-Exception"])
def test_a_runaway_code_block_ends_with_a_timeout_and_the_engine_serves_on(code_server, block):
    """A block past the server's time limit (15 s here) ends its request with a
    TimeoutError at its line; a plain request sent while it runs is answered."""
    answers: dict[str, tuple[int, dict]] = {}

    def traced() -> None:
        answers["traced"] = code_server.post("/v1/completions", {
            "model": "tiny", "prompt": "Hello", "max_tokens": 2,
            "vllm_xargs": {"nnsight": make_payload(block)}})

    thread = threading.Thread(target=traced)
    thread.start()
    time.sleep(1.0)
    status, plain = code_server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    thread.join(timeout=120)
    assert status == 200 and plain["choices"][0]["text"] is not None
    status, body = answers["traced"]
    assert status == 200, body
    error = body["kv_transfer_params"]["nnsight"]["error"]
    assert error["type"] == "TimeoutError" and "code_time_limit_s" in error["message"], error
    assert body["choices"][0]["stop_reason"] == "nnsight_error"
    assert code_server.health() == 200


def _tree_rss(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _big_save(model, tracer):
    import torch

    big = torch.ones(62_500_000).save()  # noqa: F841 - 250 MB, over the server's 200 MB limit
    for _ in range(2):
        tmp = torch.ones(50_000_000)  # noqa: F841 - 200 MB temporaries
    hidden = model.model.layers[0].output[0].save()  # noqa: F841


def test_memory_comes_back_after_large_saves_and_temporaries(code_server):
    before = _tree_rss(code_server.proc.pid)
    for _ in range(3):
        status, body = code_server.post("/v1/completions", {
            "model": "tiny", "prompt": "Hello", "max_tokens": 1, "vllm_xargs": {"nnsight": make_payload(_big_save)}})
        assert status == 200, body
        assert "over this server's limits" in body["kv_transfer_params"]["nnsight"]["error"]["message"]
    assert _tree_rss(code_server.proc.pid) - before < 300 << 20


def _raw_post(server: Server, path: str, body: bytes) -> int:
    req = urllib.request.Request(server.url + path, data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def test_fuzzed_payloads_get_no_5xx_and_poison_nothing(spec_server):
    """The CI share of benchmarks/reliability.py: 400 generated hostile payloads
    (random JSON, mutated specs, index-tensor edits, non-finite numbers, deep nesting,
    wrong types in every vllm_xargs key, edits-route bodies) against the spec server:
    no 5xx, the server healthy, and plain requests answer as before."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from fuzz_payloads import payloads

    plain = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
    prompts = ["The Eiffel Tower is in", "Hello world!", "One two three four five six seven"]
    before = [spec_server.post("/v1/completions", {**plain, "prompt": p})[1]["choices"][0] for p in prompts]
    statuses: dict[int, int] = {}
    for i, (category, value) in enumerate(payloads(seed=11, n=400, hidden=128, layers=4)):
        text = value if isinstance(value, bytes) else json.dumps(value, allow_nan=True).encode()
        if category.startswith("edits:"):
            status = _raw_post(spec_server, "/v1/nnsight/edits", text)
            if status == 200:
                req = urllib.request.Request(spec_server.url + "/v1/nnsight/edits", method="DELETE")
                req.add_header("Authorization", f"Bearer {KEY}")
                urllib.request.urlopen(req, timeout=60).read()
        else:
            base = json.dumps({"model": "tiny", "prompt": f"{i} Hello", "max_tokens": 2}).encode()
            status = _raw_post(spec_server, "/v1/completions", base[:-1] + b', "vllm_xargs": ' + text + b"}")
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (category, text[:300])
    assert spec_server.health() == 200
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 100, statuses
    after = [spec_server.post("/v1/completions", {**plain, "prompt": p})[1]["choices"][0] for p in prompts]
    assert [(c["text"], c["logprobs"]) for c in after] == [(c["text"], c["logprobs"]) for c in before]
