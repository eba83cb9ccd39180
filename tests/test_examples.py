"""The examples run as a researcher runs them (a script, a fresh process, the tiny
checkpoint) and their numbers equal a Hugging Face fp32 computation of the same
quantity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         timeout=900, cwd=EXAMPLES.parent)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    """A stock OpenAI server of the same checkpoint, code payloads allowed."""
    from test_serve import _start, _stop

    srv = _start(llama_path, True, tmp_path_factory)
    yield srv
    _stop(srv)


def where(request, server_fixture: str) -> tuple[str, ...]:
    """The examples' flags for a local engine, or for the served one."""
    if request.param == "local":
        return ("--dtype", "float32")
    from test_serve import KEY

    srv = request.getfixturevalue(server_fixture)
    return ("--serve", srv.url, "--api-key", KEY)


@pytest.fixture(params=["local", "served"])
def how(request) -> tuple[str, ...]:
    return where(request, "server")


def test_logit_lens(llama_path, hf_llama, tmp_path, how):
    stdout = run("logit_lens.py", "--model", llama_path, *how, "--out", str(tmp_path),
                 "--prompt", "The quick brown fox jumps")
    assert "layer |" in stdout and (tmp_path / "logit_lens.png").stat().st_size > 10_000
    got = json.loads((tmp_path / "logit_lens.json").read_text())
    ids = got["prompt_token_ids"]
    with torch.no_grad():
        hidden = hf_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states
        layers = len(hidden) - 1
        normed = [hf_llama.model.norm(hidden[i + 1]) for i in range(layers - 1)] + [hidden[layers]]
        probs = [torch.softmax(hf_llama.lm_head(h)[0], -1) for h in normed]
    final_top = probs[-1].argmax(-1)
    assert got["top_token_ids"] == [p.argmax(-1).tolist() for p in probs]
    assert_close(torch.tensor(got["p_final_top"]), torch.stack([p[range(len(ids)), final_top] for p in probs]))


def test_steering(llama_path, hf_llama, tmp_path, how):
    from transformers import AutoTokenizer

    sys.path.insert(0, str(EXAMPLES))
    import steering

    run("steering.py", "--model", llama_path, *how, "--out", str(tmp_path), "--layer", "1")
    got = json.loads((tmp_path / "steering.json").read_text())
    tok = AutoTokenizer.from_pretrained(llama_path)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    def last_hidden(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf_llama(torch.tensor([ids(text)]), output_hidden_states=True).hidden_states[2][0, -1]

    v = torch.stack([last_hidden(t) for t in steering.POSITIVE]).mean(0) - \
        torch.stack([last_hidden(t) for t in steering.NEGATIVE]).mean(0)
    assert_close(torch.tensor(got["vector"]), v)
    shift = got["alpha"] * v
    for prompt, (_, clean_lp), (_, steered_lp) in zip(got["prompts"], got["without"], got["with"]):
        layer = hf_llama.model.layers[1]
        handle = layer.register_forward_hook(lambda m, a, o: (o[0] + shift, *o[1:]) if isinstance(o, tuple)
                                             else o + shift)
        try:
            with torch.no_grad():
                steered = torch.log_softmax(hf_llama(torch.tensor([ids(prompt)])).logits[0, -1], -1)
        finally:
            handle.remove()
        with torch.no_grad():
            clean = torch.log_softmax(hf_llama(torch.tensor([ids(prompt)])).logits[0, -1], -1)
        assert abs(steered_lp - float(steered.max())) < 1e-4 and abs(clean_lp - float(clean.max())) < 1e-4
    assert any(a != b for (a, _), (b, _) in zip(got["without"], got["with"]))  # (the steering changed text)


def test_activation_patching(llama_path, hf_llama, tmp_path, how):
    run("activation_patching.py", "--model", llama_path, *how, "--out", str(tmp_path))
    got = json.loads((tmp_path / "activation_patching.json").read_text())
    assert (tmp_path / "activation_patching.png").stat().st_size > 10_000
    layers = hf_llama.model.layers
    clean_rows: dict[int, torch.Tensor] = {}

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    handles = [layer.register_forward_hook(lambda m, a, o, i=i: clean_rows.__setitem__(i, first(o)[0].clone()))
               for i, layer in enumerate(layers)]
    with torch.no_grad():
        clean = hf_llama(torch.tensor([got["clean_ids"]])).logits[0, -1]
    for h in handles:
        h.remove()
    with torch.no_grad():
        corrupt = hf_llama(torch.tensor([got["corrupt_ids"]])).logits[0, -1]
    good, bad = got["good"], got["bad"]
    assert good == int(clean.argmax())
    diff = {"clean": float(clean[good] - clean[bad]), "corrupt": float(corrupt[good] - corrupt[bad])}
    assert abs(got["clean_diff"] - diff["clean"]) < 1e-4 and abs(got["corrupt_diff"] - diff["corrupt"]) < 1e-4
    scores = torch.empty(len(layers), len(got["clean_ids"]))
    for i, layer in enumerate(layers):
        for pos in range(len(got["clean_ids"])):
            def patch(m, a, o, i=i, pos=pos):
                x = first(o).clone()
                x[0, pos] = clean_rows[i][pos]
                return (x, *o[1:]) if isinstance(o, tuple) else x
            handle = layer.register_forward_hook(patch)
            try:
                with torch.no_grad():
                    lg = hf_llama(torch.tensor([got["corrupt_ids"]])).logits[0, -1]
            finally:
                handle.remove()
            scores[i, pos] = (float(lg[good] - lg[bad]) - diff["corrupt"]) / (diff["clean"] - diff["corrupt"])
    assert_close(torch.tensor(got["scores"]), scores)


def test_probe(llama_path, hf_llama, tmp_path, how):
    from transformers import AutoTokenizer

    stdout = run("probe.py", "--model", llama_path, *how, "--out", str(tmp_path), "--layer", "2")
    assert "held-out accuracy" in stdout
    got = json.loads((tmp_path / "probe.json").read_text())
    assert 0.0 <= got["accuracy"] <= 1.0 and sorted(set(got["labels"])) == [0, 1]
    tok = AutoTokenizer.from_pretrained(llama_path)
    for prompt, state in list(zip(got["prompts"], got["states"]))[:6]:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = hf_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[3][0, -1]
        assert_close(torch.tensor(state), ref)


def test_batch_capture(llama_path, hf_llama, tmp_path, how):
    import numpy as np

    stdout = run("batch_capture.py", "--model", llama_path, *how, "--out", str(tmp_path), "--n", "300",
                 "--batch", "128", "--layer", "1")
    assert "prompts/s" in stdout and "tokens/s" in stdout
    index = json.loads((tmp_path / "captures.json").read_text())
    store = np.load(tmp_path / "captures.npy", mmap_mode="r")
    assert store.shape == (index["starts"][-1], 128) and len(index["prompts"]) == 300
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_path)
    for k in (0, 127, 128, 299):  # (first and last of a batch, the next batch, the last prompt)
        ids = tok(index["prompts"][k], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = hf_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0]
        assert_close(torch.from_numpy(np.array(store[index["starts"][k] : index["starts"][k + 1]])), ref)
