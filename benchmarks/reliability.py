"""Long reliability run of a served engine with the plugin, against one without it.

    .venv/bin/python benchmarks/reliability.py [--model PATH] [--payloads 3000] [--rss-requests 5000]

Starts two stock OpenAI servers (``python -m vllm.entrypoints.openai.api_server``)
on loopback with the same flags: one with the plugin (no code opt-in), one with
``VLLM_NNSIGHT_DISABLE=1``. Then:

1. reference: greedy completions with logprobs on both; equal, exactly;
2. fuzz: ``fuzz_payloads.payloads`` sent one at a time to the plugin server
   (completions, chat, streams, the edits route); no 5xx, no connection error,
   ``/health`` and the process tree checked every 200 payloads;
3. after the fuzz and after non-finite steering specs, the reference again
   (nothing poisoned);
4. a 1M-number spec (about 4 MB) while ``/health`` is polled every 20 ms and plain
   1-token requests run;
5. 200 concurrent mixed requests (plain equal to the plugin-less server's, traced
   saves equal to the same request sent alone);
6. 50 traced streams, 25 closed after their first chunk; then no request left in
   the engine (vLLM's ``/metrics``) and 20 traced requests work;
7. RSS of the process trees over many requests, side by side: the same requests sent
   plain to the plugin-less server, traced to the plugin server, then plain to the
   plugin server; per process (API server, EngineCore, worker) too. The plugin
   server's growth may exceed the plugin-less server's by a margin only.

Prints markdown tables and a summary; exits 1 if any check fails. Nothing is
restarted: a server that dies is a failure and the checks after it do not run.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_payloads import big_value_text, payloads  # noqa: E402

KEY = "reliability-key"
HOST = "127.0.0.1"
MODEL_NAME = "tiny"
HEALTH_EVERY = 200
TIMEOUT = 60.0  # seconds, one HTTP call
BIG_TIMEOUT = 180.0  # seconds, one call carrying megabytes
START_TIMEOUT = 400.0
RSS_EVERY = 500
RSS_BATCH = 50
RSS_GROWTH = 0.20  # the absolute guard: the traced run's tree may grow this much from RSS_FROM on
RSS_FROM = 1000  # growth is compared from this many requests on (the first ones warm allocators and caches up)
# How much more the plugin server's tree may grow (traced, RSS_FROM to the last sample) than the
# plugin-less one's (plain, same requests). Observed on this benchmark's tiny model, 5000 requests,
# 2 CPU cores: the plugin-less server's own growth over that interval, for the very same requests,
# was 122, 127, 166, 182 and 202 MiB in five runs (a range of 80 MiB), all of it in vLLM's worker:
# oneDNN's primitive cache filling up (one entry per GEMM shape, 1024 at most; with
# ONEDNN_PRIMITIVE_CACHE_CAPACITY=1 that growth is gone) and glibc heap fragmentation. The plugin
# server's excess was 43, 43, 45, 101 and 130 MiB, with the workers' live heap equal within 1 MB
# (malloc_stats). The margin is twice that run-to-run range: a leak of 40 KiB or more per traced
# request still fails it.
RSS_MARGIN_MIB = 160
RSS_MARGIN_WHY = ("twice the 80 MiB run-to-run range of the plugin-less server's own growth over this interval "
                  "for these requests (122-202 MiB in 5 runs: vLLM's worker filling oneDNN's primitive cache, and "
                  "heap fragmentation); the plugin server's excess was 43-130 MiB in those runs, its worker's live "
                  "heap equal to the plugin-less one's within 1 MB")
BIG_ANSWER_MAX_S = 10.0  # the 1M-number spec must be answered within this
STALL_MAX_S = 1.0  # /health and plain requests beside it must stay below this
PLAIN_MAX_S = 3.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------- HTTP


@dataclass
class Reply:
    status: int | None  # None: connection error or timeout
    data: bytes = b""
    elapsed: float = 0.0
    error: str = ""
    chunks: list = field(default_factory=list)  # SSE data objects of a stream

    def json(self) -> object:
        try:
            return json.loads(self.data)
        except ValueError:
            return None


def _headers(body: bytes | None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {KEY}", "Connection": "close"}
    if body is not None:
        h["Content-Type"] = "application/json"
    return h


def call(port: int, method: str, path: str, body: bytes | None = None, timeout: float = TIMEOUT) -> Reply:
    t = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=_headers(body))
        resp = conn.getresponse()
        data = resp.read()
        return Reply(resp.status, data, time.perf_counter() - t)
    except (OSError, http.client.HTTPException) as exc:
        return Reply(None, b"", time.perf_counter() - t, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def call_stream(port: int, path: str, body: bytes, timeout: float = TIMEOUT, close_after_first: bool = False) -> Reply:
    """POST a streaming request; collect the SSE data objects (or stop after the first)."""
    t = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=_headers(body))
        resp = conn.getresponse()
        if resp.status != 200:
            return Reply(resp.status, resp.read(), time.perf_counter() - t)
        chunks: list = []
        done = False
        while True:
            if time.perf_counter() - t > timeout:
                return Reply(None, b"", time.perf_counter() - t, "stream exceeded its timeout", chunks)
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            try:
                chunks.append(json.loads(line[6:]))
            except ValueError:
                chunks.append({"unparsed": line[6:200].decode(errors="replace")})
            if close_after_first:
                break
        reply = Reply(200, b"", time.perf_counter() - t, "" if done or close_after_first else "no [DONE]", chunks)
        return reply
    except (OSError, http.client.HTTPException) as exc:
        return Reply(None, b"", time.perf_counter() - t, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def dumps(obj: object) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def with_xargs(base: dict, xargs: object) -> bytes:
    """A request body: ``base`` plus ``vllm_xargs`` (raw JSON text when bytes)."""
    if isinstance(xargs, bytes):
        return dumps(base)[:-1] + b', "vllm_xargs": ' + xargs + b"}"
    return dumps({**base, "vllm_xargs": xargs})


def completion(prompt: str, max_tokens: int, **extra: object) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}


def chat(prompt: str, max_tokens: int, **extra: object) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}


def nnsight_of(obj: object) -> dict | None:
    """The plugin's results of a response (or of a stream's chunks)."""
    if isinstance(obj, list):
        found = None
        for chunk in obj:
            got = nnsight_of(chunk)
            if got is not None:
                found = got
        return found
    if not isinstance(obj, dict):
        return None
    params = obj.get("kv_transfer_params")
    if isinstance(params, dict) and isinstance(params.get("nnsight"), dict):
        return params["nnsight"]
    return None


# ----------------------------------------------------------------- servers


def proc_children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(x) for x in fh.read().split()]
        except OSError:
            pass
    return out


def proc_tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen or not os.path.exists(f"/proc/{p}"):
            continue
        seen.append(p)
        todo += proc_children(p)
    return seen


MEM_FIELDS = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
ROLES = ("API server", "EngineCore", "worker", "other")


def mem_kib(pid: int) -> dict[str, int]:
    """VmRSS and its parts (anonymous, file-backed, shared memory) of one process, KiB."""
    out = dict.fromkeys(MEM_FIELDS.values(), 0)
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key = MEM_FIELDS.get(line.split(None, 1)[0]) if line.strip() else None
                if key:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def role_of(pid: int, root: int) -> str:
    """Which process of a server's tree: the API server (the root), vLLM's EngineCore,
    its worker (vLLM names them by process title) or another (a resource tracker)."""
    if pid == root:
        return "API server"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "EngineCore" in cmd:
        return "EngineCore"
    if "Worker" in cmd:
        return "worker"
    return "other"


def tree_mem(root: int) -> dict[str, dict[str, int]]:
    """Memory of a server's process tree per role (see :func:`role_of`), KiB; "total": all."""
    per: dict[str, dict[str, int]] = {}
    for pid in proc_tree(root):
        m = mem_kib(pid)
        for role in (role_of(pid, root), "total"):
            acc = per.setdefault(role, dict.fromkeys(MEM_FIELDS.values(), 0))
            for k, v in m.items():
                acc[k] += v
    return per


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: str
    children: set = field(default_factory=set)  # the process tree once ready
    dead_reason: str = ""

    def call(self, method: str, path: str, body: bytes | None = None, timeout: float = TIMEOUT) -> Reply:
        return call(self.port, method, path, body, timeout)

    def post(self, path: str, body: object, timeout: float = TIMEOUT) -> Reply:
        return self.call("POST", path, body if isinstance(body, bytes) else dumps(body), timeout)

    def check(self) -> str:
        """'' when the process tree is intact and /health answers 200, else why not."""
        if self.dead_reason:
            return self.dead_reason
        rc = self.proc.poll()
        if rc is not None:
            self.dead_reason = f"server process exited (rc {rc})"
            return self.dead_reason
        gone = self.children - set(proc_tree(self.proc.pid))
        if gone:
            self.dead_reason = f"server child process(es) {sorted(gone)} gone (engine died or restarted)"
            return self.dead_reason
        reply = self.call("GET", "/health", timeout=30)
        if reply.status != 200:
            return f"/health answered {reply.status} {reply.error or reply.data[:200]!r}"
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(name: str, model: str, tmp: Path, plugin: bool) -> Server:
    port = free_port()
    log_path = str(tmp / f"{name}.log")
    env = dict(os.environ)
    env.pop("VLLM_NNSIGHT_ALLOW_CODE", None)
    env.pop("VLLM_NNSIGHT_DISABLE", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = "1"
    if not plugin:
        env["VLLM_NNSIGHT_DISABLE"] = "1"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", HOST,
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
           "--max-num-seqs", "32", "--api-key", KEY, "--served-model-name", MODEL_NAME]
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Server(name, port, proc, log_path)


def wait_ready(server: Server) -> None:
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} server exited while starting; log {server.log_path}:\n"
                               + Path(server.log_path).read_text()[-3000:])
        if call(server.port, "GET", "/health", timeout=5).status == 200:
            server.children = set(proc_tree(server.proc.pid))
            return
        time.sleep(1)
    raise RuntimeError(f"{server.name} server did not start within {START_TIMEOUT} s; log {server.log_path}")


def stop_server(server: Server) -> None:
    pids = proc_tree(server.proc.pid) if server.proc.poll() is None else sorted(server.children)
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=30)
    time.sleep(1)
    for pid in pids:  # children that outlived their parent (all started by this run)
        if pid != server.proc.pid and os.path.exists(f"/proc/{pid}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# ----------------------------------------------------------------- checks


@dataclass
class Report:
    checks: list = field(default_factory=list)  # (name, ok | None (not run), detail)

    def add(self, name: str, ok: bool | None, detail: str) -> bool:
        self.checks.append((name, ok, detail))
        log(f"{'PASS' if ok else 'FAIL' if ok is False else 'NOT RUN'}: {name}: {detail}")
        return bool(ok)

    def failed(self) -> bool:
        return any(ok is not True for _, ok, _ in self.checks)


def md_escape(text: str, limit: int = 300) -> str:
    text = text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
    return text.replace("|", "\\|").replace("\n", "\\n").replace("\r", "\\r")


def spec(*ops: dict) -> str:
    return json.dumps({"v": 1, "kind": "spec", "ops": list(ops)})


READ_L1 = {"op": "read", "name": "h1", "module": "model.layers.1", "index": 0, "positions": [-1]}
TOPK = {"op": "logits_topk", "name": "top", "k": 5}


def reference(server: Server, prompts: list[str]) -> tuple[list | None, str]:
    """Greedy completions with logprobs: [(text, logprobs, prompt_tokens)], or None and why."""
    out = []
    for prompt in prompts:
        reply = server.post("/v1/completions", completion(prompt, 16, logprobs=1, ignore_eos=True))
        body = reply.json()
        if reply.status != 200 or not isinstance(body, dict):
            return None, f"{server.name}: status {reply.status} {reply.error or reply.data[:200]!r}"
        choice = body["choices"][0]
        out.append((choice["text"], choice["logprobs"], body["usage"]["prompt_tokens"]))
    return out, ""


def compare_refs(ref: list, got: list) -> tuple[bool, str]:
    bad = []
    for i, ((t1, lp1, _), (t2, lp2, _)) in enumerate(zip(ref, got)):
        if t1 != t2 or lp1 != lp2:
            tok1, tok2 = lp1.get("tokens", []), lp2.get("tokens", [])
            at = next((k for k, (a, b) in enumerate(zip(tok1, tok2)) if a != b), None)
            diffs = [abs(a - b) for a, b in zip(lp1.get("token_logprobs", []), lp2.get("token_logprobs", []))
                     if a is not None and b is not None]
            bad.append(f"prompt {i}: first token diff at {at}, max |dlogprob| {max(diffs, default=0):.3g}")
    if bad:
        return False, f"{len(bad)}/{len(ref)} prompts differ: " + "; ".join(bad[:3])
    return True, f"{len(ref)} prompts x 16 tokens, tokens and logprobs identical"


# ----------------------------------------------------------------- fuzz


@dataclass
class FuzzResult:
    counts: dict = field(default_factory=dict)  # category -> Counter of outcome keys
    sent: Counter = field(default_factory=Counter)
    bad: Counter = field(default_factory=Counter)  # failed outcomes per category
    slowest: dict = field(default_factory=dict)  # category -> (seconds, index, endpoint)
    failures: list = field(default_factory=list)
    health_max: float = 0.0
    died: str = ""
    killer: dict | None = None
    stopped_early: str = ""
    done: int = 0
    canary_checked: int = 0
    canary_bad: int = 0
    canary_first: dict | None = None  # the first payload after which the canary differed


def classify(reply: Reply, streamed: bool) -> tuple[str, bool]:
    """(outcome key, is a failure)."""
    if reply.status is None:
        return "conn", True
    if reply.status >= 500:
        return str(reply.status), True
    if reply.status != 200:
        return str(reply.status), False
    if streamed:
        errors = [c["error"] for c in reply.chunks if isinstance(c, dict) and isinstance(c.get("error"), dict)]
        if errors:
            code = errors[0].get("code") or 0
            code = code if isinstance(code, int) else 0
            return f"200/sse-err{code}", code >= 500
        if reply.error:
            return "200/unfinished", True
        res = nnsight_of(reply.chunks)
    else:
        body = reply.json()
        if not isinstance(body, dict):
            return "200/bad-json", True
        res = nnsight_of(body)
    if res is not None and res.get("error"):
        return "200/err", False
    return "200", False


def payload_text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else json.dumps(value, allow_nan=True)


def canary(server: Server, baseline: Server, i: int, prompts: list[str]) -> str | None:
    """A plain greedy request with logprobs on both servers, with a prompt no earlier
    request shares a prefix with: '' when equal, else how not (None: baseline down)."""
    body = dumps(completion(f"{i}: {prompts[i % len(prompts)]}", 4, logprobs=1, ignore_eos=True))
    ref = baseline.call("POST", "/v1/completions", body)
    if ref.status != 200:
        return None
    got = server.call("POST", "/v1/completions", body)
    if got.status != 200:
        return f"status {got.status}: {got.error or got.data[:200].decode(errors='replace')}"
    a, b = ref.json()["choices"][0], got.json()["choices"][0]
    if (a["text"], a["logprobs"]) != (b["text"], b["logprobs"]):
        return f"plain output differs: {b['text']!r} vs {a['text']!r} (plugin-less), logprobs " \
               f"{b['logprobs']['token_logprobs']} vs {a['logprobs']['token_logprobs']}"
    return ""


def run_fuzz(server: Server, baseline: Server, items: list, seed: int, deadline: float, tmp: Path,
             canary_every: int) -> FuzzResult:
    res = FuzzResult()
    rng = random.Random(seed + 1)
    from vllm_nnsight_plugin.tiny import CORPUS

    t0 = time.time()
    with open(tmp / "fuzz_failures.jsonl", "w") as fail_log, open(tmp / "fuzz_outcomes.jsonl", "w") as all_log:
        for i, (cat, value) in enumerate(items):
            if time.time() > deadline:
                res.stopped_early = f"time budget: stopped after {i}/{len(items)} payloads"
                break
            prompt = rng.choice(CORPUS)
            max_tokens = rng.randint(1, 4)
            big = isinstance(value, bytes) and len(value) > 1_000_000 or len(payload_text(value)) > 1_000_000
            timeout = BIG_TIMEOUT if big else TIMEOUT
            outcomes: list[tuple[str, bool, Reply, str]] = []  # (key, failed, reply, what)
            if cat.startswith("edits:"):
                endpoint = "POST /v1/nnsight/edits"
                reply = server.post("/v1/nnsight/edits", value, timeout)
                key, failed = classify(reply, False)
                outcomes.append((key, failed, reply, "install"))
                if reply.status == 200:  # run one plain request under the edit, then remove it
                    probe = server.post("/v1/completions", completion(prompt, 2))
                    pkey, pfailed = classify(probe, False)
                    outcomes.append(("probe" + pkey, pfailed, probe, "plain request under the installed edit"))
                    delete = server.call("DELETE", "/v1/nnsight/edits")
                    listed = server.call("GET", "/v1/nnsight/edits").json()
                    left = listed.get("edits") if isinstance(listed, dict) else None
                    ok = delete.status == 200 and left == []
                    outcomes.append(("deleted" if ok else f"delete{delete.status}", not ok, delete,
                                     f"DELETE /v1/nnsight/edits; still installed: {left}"))
            else:
                r = rng.random()
                streamed = r >= 0.85
                use_chat = 0.7 <= r < 0.85 or (streamed and r >= 0.925)
                path = "/v1/chat/completions" if use_chat else "/v1/completions"
                base = (chat if use_chat else completion)(prompt, max_tokens, **({"stream": True} if streamed else {}))
                body = with_xargs(base, value)
                endpoint = ("stream " if streamed else "") + ("chat" if use_chat else "completions")
                reply = call_stream(server.port, path, body, timeout) if streamed else \
                    server.call("POST", path, body, timeout)
                key, failed = classify(reply, streamed)
                outcomes.append((key, failed, reply, "request"))
            counts = res.counts.setdefault(cat, Counter())
            res.sent[cat] += 1
            elapsed = outcomes[0][2].elapsed
            if elapsed > res.slowest.get(cat, (-1.0,))[0]:
                res.slowest[cat] = (elapsed, i, endpoint)
            any_failed = False
            for key, failed, reply, what in outcomes:
                counts[key] += 1
                if not failed:
                    continue
                res.bad[cat] += 1
                any_failed = True
                record = {"index": i, "category": cat, "endpoint": endpoint, "what": what, "outcome": key,
                          "elapsed": round(reply.elapsed, 3), "error": reply.error,
                          "response": (reply.data[:500].decode(errors="replace")
                                       or json.dumps(reply.chunks[-2:])[:500]),
                          "payload": payload_text(value)}
                if not cat.startswith("edits:") and not baseline.check():
                    again = call_stream(baseline.port, path, body, timeout) if streamed else \
                        baseline.call("POST", path, body, timeout)
                    record["plugin_less"] = classify(again, streamed)[0]
                res.failures.append(record)
                fail_log.write(json.dumps({**record, "payload": record["payload"][:1_000_000]}) + "\n")
                fail_log.flush()
            res.done = i + 1
            all_log.write(json.dumps({"index": i, "category": cat, "endpoint": endpoint,
                                      "outcomes": [o[0] for o in outcomes], "elapsed": round(elapsed, 4),
                                      "payload": payload_text(value)[:2000]}) + "\n")
            killed = ""
            if any_failed or (i + 1) % HEALTH_EVERY == 0:
                if any_failed:
                    time.sleep(1.0)  # let an engine death reach the server process
                th = time.perf_counter()
                killed = server.check()
                res.health_max = max(res.health_max, time.perf_counter() - th)
            if not killed and canary_every and (i + 1) % canary_every == 0:
                why = canary(server, baseline, i, CORPUS)
                if why is not None:
                    res.canary_checked += 1
                if why and why.startswith(("status None", "status 5")):
                    killed = server.check()  # a canary that cannot connect: is the server gone?
                if why and not killed:
                    res.canary_bad += 1
                    if res.canary_first is None:
                        res.canary_first = {"index": i, "category": cat, "endpoint": endpoint, "detail": why,
                                            "payload": payload_text(value), "outcomes": [o[0] for o in outcomes]}
                        log(f"canary differs after payload #{i} ({cat}): {why[:200]}")
            for _ in range(6):  # unhealthy but not gone: give it half a minute
                if not killed or server.dead_reason:
                    break
                time.sleep(5.0)
                killed = server.check()
            if killed:
                res.died = f"after payload #{i} ({cat}, {endpoint}): {killed}"
                res.killer = {"index": i, "category": cat, "endpoint": endpoint,
                              "payload": payload_text(value), "outcomes": [o[0] for o in outcomes]}
                log(f"plugin server down {res.died}")
                break
            if (i + 1) % 100 == 0:
                log(f"fuzz {i + 1}/{len(items)} ({time.time() - t0:.0f} s, {len(res.failures)} failures)")
    return res


def print_fuzz(res: FuzzResult, tmp: Path) -> None:
    print("\n### Fuzz: outcomes per category\n")
    print("`200/err`: answered with a per-request error in the results; `probe…`: a plain request while the "
          "installed edit was active; `conn`: connection error or timeout.\n")
    print("| category | sent | outcomes | 5xx / conn | slowest s (payload #, endpoint) |")
    print("|---|---:|---|---:|---|")
    for cat in sorted(res.sent):
        counts = res.counts[cat]
        bad = res.bad[cat]
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        s, idx, ep = res.slowest[cat]
        print(f"| {cat} | {res.sent[cat]} | {outcomes} | {bad} | {s:.3f} (#{idx}, {ep}) |")
    if res.failures:
        print(f"\n### Fuzz failures ({len(res.failures)}; all of them in {tmp / 'fuzz_failures.jsonl'}, every "
              f"payload's outcome in {tmp / 'fuzz_outcomes.jsonl'})\n")
        print("| # | category | endpoint | what | outcome | plugin-less server | s | payload | response |")
        print("|---:|---|---|---|---|---|---:|---|---|")
        for f in res.failures[:25]:
            print(f"| {f['index']} | {f['category']} | {f['endpoint']} | {f['what']} | {f['outcome']} | "
                  f"{f.get('plugin_less', '-')} | {f['elapsed']} | `{md_escape(f['payload'], 200)}` | "
                  f"{md_escape(f['error'] or f['response'], 160)} |")
    if res.canary_first:
        c = res.canary_first
        text = c["payload"]
        print(f"\n**A plain request changed** (the canary: a plain greedy request with logprobs, compared with the "
              f"plugin-less server's, after every payload) first after payload #{c['index']} ({c['category']}, "
              f"{c['endpoint']}, outcomes {c['outcomes']}): {md_escape(c['detail'], 400)}. "
              f"It differed after {res.canary_bad} of {res.canary_checked} payloads. Payload ({len(text)} chars):\n")
        print("```json")
        print(text if len(text) <= 4000 else text[:4000] + f"... ({len(text)} chars)")
        print("```")
    if res.killer:
        text = res.killer["payload"]
        print(f"\n**The plugin server died** {res.died}. Payload ({len(text)} chars, outcomes "
              f"{res.killer['outcomes']}):\n")
        print("```json")
        print(text if len(text) <= 4000 else text[:4000] + f"... ({len(text)} chars)")
        print("```")


# ----------------------------------------------------------------- the other stages


def stage_big_spec(server: Server, hidden: int, report: Report) -> None:
    rng = random.Random(7)
    text = spec({"op": "add", "module": "model.layers.0", "index": 0, "steps": "all", "value": "@V@"})
    text = text.replace('"@V@"', big_value_text(rng))
    body = with_xargs(completion("Hello world", 1), {"nnsight": text})
    health: list[float] = []
    plain: list[tuple[int | None, float]] = []
    stop = threading.Event()
    big_reply: list[Reply] = []

    def poll_health() -> None:
        while not stop.is_set():
            r = server.call("GET", "/health", timeout=BIG_TIMEOUT)
            health.append(r.elapsed if r.status == 200 else float("inf"))
            time.sleep(0.02)

    def send_big() -> None:
        big_reply.append(server.call("POST", "/v1/completions", body, BIG_TIMEOUT))

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    time.sleep(0.3)
    sender = threading.Thread(target=send_big, daemon=True)
    sender.start()
    time.sleep(0.05)
    while sender.is_alive():  # plain 1-token requests while the big one is pending
        r = server.post("/v1/completions", completion("The capital of Japan is", 1))
        plain.append((r.status, r.elapsed))
        sender.join(timeout=0.05)
    if not plain:
        r = server.post("/v1/completions", completion("The capital of Japan is", 1))
        plain.append((r.status, r.elapsed))
    stop.set()
    poller.join(timeout=BIG_TIMEOUT)
    reply = big_reply[0]
    key, failed = classify(reply, False)
    res = nnsight_of(reply.json())
    err = (res or {}).get("error") or {}
    msg = err.get("message", "") if isinstance(err, dict) else str(err)
    if reply.status != 200:
        body_json = reply.json()
        msg = json.dumps(body_json)[:160] if body_json is not None else reply.error
    hmax = max(health, default=float("inf"))
    pmax = max(e for _, e in plain)
    plain_ok = all(s == 200 for s, _ in plain)
    report.add("big spec: 1M-number add answered in time", not failed and reply.elapsed <= BIG_ANSWER_MAX_S,
               f"{len(text) / 1e6:.1f} MB payload, answer {key} in {reply.elapsed:.2f} s "
               f"(limit {BIG_ANSWER_MAX_S} s): {md_escape(msg, 120)}")
    report.add("big spec: /health stays responsive (20 ms poll)", hmax <= STALL_MAX_S,
               f"max /health latency {hmax:.3f} s over {len(health)} polls (limit {STALL_MAX_S} s)")
    report.add("big spec: concurrent plain 1-token requests", plain_ok and pmax <= PLAIN_MAX_S,
               f"{len(plain)} plain requests, max latency {pmax:.3f} s (limit {PLAIN_MAX_S} s), "
               f"statuses {sorted(Counter(s for s, _ in plain).items(), key=str)}")


def stage_concurrent(server: Server, baseline: Server, prompts: list[str], report: Report) -> None:
    traced_spec = spec(READ_L1, TOPK)
    uniq = prompts[:8]

    def plain_body(p: str) -> bytes:
        return dumps(completion(p, 8, logprobs=1, ignore_eos=True))

    def traced_body(p: str) -> bytes:
        return with_xargs(completion(p, 8, logprobs=1, ignore_eos=True), {"nnsight": traced_spec})

    def parse(reply: Reply) -> tuple | None:
        body = reply.json()
        if reply.status != 200 or not isinstance(body, dict):
            return None
        ch = body["choices"][0]
        res = nnsight_of(body)
        return ch["text"], ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"], res

    plain_ref = {p: parse(baseline.call("POST", "/v1/completions", plain_body(p))) for p in uniq}
    traced_replies = {p: server.call("POST", "/v1/completions", traced_body(p)) for p in uniq}
    traced_ref = {p: parse(r) for p, r in traced_replies.items()}
    failed = [p for p, v in traced_ref.items() if v is None or not v[3] or v[3].get("error")]
    if any(v is None for v in plain_ref.values()) or failed:
        example = ""
        if failed:
            v, r = traced_ref[failed[0]], traced_replies[failed[0]]
            example = json.dumps(v[3].get("error"))[:300] if v and v[3] else \
                f"HTTP {r.status} {r.error or r.data[:200].decode(errors='replace')}"
        report.add("200 concurrent mixed requests", False,
                   "not run: a reference request sent alone failed (plain on the plugin-less server: "
                   f"{sum(v is None for v in plain_ref.values())}/8 failed; traced on the plugin server: "
                   f"{len(failed)}/8 failed{', e.g. ' + example if example else ''})")
        return
    jobs = [(i, uniq[i % len(uniq)], i % 2 == 1) for i in range(200)]

    def send(job: tuple) -> tuple:
        i, p, traced = job
        reply = server.call("POST", "/v1/completions", traced_body(p) if traced else plain_body(p), timeout=180)
        return job, reply

    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=200) as pool:
        results = list(pool.map(send, jobs))
    wall = time.perf_counter() - t
    statuses = Counter(r.status for _, r in results)
    plain_bad = traced_bad = trace_err = 0
    max_dlp = 0.0
    for (_, p, traced), reply in results:
        got = parse(reply)
        if got is None:
            continue
        ref = traced_ref[p] if traced else plain_ref[p]
        max_dlp = max([max_dlp] + [abs(a - b) for a, b in zip(got[2], ref[2])])
        if traced:
            if got[3] is None or got[3].get("error"):
                trace_err += 1
            elif json.dumps(got[3].get("saves"), sort_keys=True) != json.dumps(ref[3].get("saves"), sort_keys=True) \
                    or got[:2] != ref[:2]:
                traced_bad += 1
        elif got[:2] != ref[:2] or got[3] is not None:
            plain_bad += 1
    ok = statuses == Counter({200: 200}) and not plain_bad and not traced_bad and not trace_err
    report.add("200 concurrent mixed requests", ok,
               f"statuses {dict(statuses)}, {wall:.1f} s; plain != plugin-less alone: {plain_bad}/100; "
               f"traced saves/tokens != traced alone: {traced_bad}/100; traced with error: {trace_err}; "
               f"max |dlogprob| vs alone {max_dlp:.2g} (not checked)")


def metrics_requests(server: Server) -> tuple[float, float] | None:
    reply = server.call("GET", "/metrics", timeout=30)
    if reply.status != 200:
        return None
    running = waiting = 0.0
    for line in reply.data.decode(errors="replace").splitlines():
        if line.startswith("vllm:num_requests_running"):
            running += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_waiting"):
            waiting += float(line.rsplit(" ", 1)[1])
    return running, waiting


def stage_streams(server: Server, prompts: list[str], report: Report) -> None:
    stream_spec = spec({"op": "read", "name": "h1", "module": "model.layers.1", "index": 0, "positions": [-1],
                        "steps": "all"}, {"op": "logits_topk", "name": "top", "k": 5, "steps": "all"})

    def one(i: int) -> tuple[int, Reply]:
        body = with_xargs(completion(prompts[i % len(prompts)], 32, ignore_eos=True, stream=True),
                          {"nnsight": stream_spec})
        return i, call_stream(server.port, "/v1/completions", body, timeout=180, close_after_first=i % 2 == 0)

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(one, range(50)))
    closed_ok = sum(1 for i, r in results if i % 2 == 0 and r.status == 200 and r.chunks)
    full_ok = 0
    for i, r in results:
        if i % 2 == 1 and r.status == 200 and not r.error:
            res = nnsight_of(r.chunks)
            if res and not res.get("error") and len((res.get("saves") or {}).get("top") or []) >= 1:
                full_ok += 1
    report.add("50 streams (25 closed after the first chunk)", closed_ok == 25 and full_ok == 25,
               f"closed early with a first chunk: {closed_ok}/25; full streams with results: {full_ok}/25")
    t = time.time()
    counts = None
    while time.time() - t < 60:
        counts = metrics_requests(server)
        if counts == (0.0, 0.0):
            break
        time.sleep(0.5)
    report.add("after the streams: no request left in the engine", counts == (0.0, 0.0),
               f"vllm:num_requests_running/waiting = {counts} after {time.time() - t:.1f} s (vLLM's /metrics; "
               "the plugin has no engine-stats HTTP route)")
    why = server.check()
    oks = 0
    if not why:
        for i in range(20):
            body = with_xargs(completion(prompts[i % len(prompts)], 4, ignore_eos=True), {"nnsight": stream_spec})
            reply = server.call("POST", "/v1/completions", body)
            res = nnsight_of(reply.json()) if reply.status == 200 else None
            oks += bool(res and not res.get("error"))
    edits_left = server.call("GET", "/v1/nnsight/edits").json()
    report.add("after the streams: /health and 20 traced requests", not why and oks == 20,
               f"health: {why or 'ok'}; traced requests with results: {oks}/20; installed edits: {edits_left}")


@dataclass
class RssSeries:
    """One RSS run: the same requests (prompts, max_tokens, concurrency) sent to one server."""
    label: str
    traced: bool
    samples: list = field(default_factory=list)  # (requests sent, tree_mem(...))
    sent: int = 0
    wall: float = 0.0
    bad: Counter = field(default_factory=Counter)  # failed requests per kind
    first_error: dict = field(default_factory=dict)
    no_results: int = 0  # steering answers without a results object (not an error)
    died: bool = False

    def at(self, n: int) -> dict[str, dict[str, int]] | None:
        return next((m for k, m in self.samples if k == n), None)

    def growth(self, start: int, end: int, role: str = "total", kind: str = "rss") -> float | None:
        """MiB from the sample at ``start`` requests to the one at ``end``."""
        a, b = self.at(start), self.at(end)
        if a is None or b is None:
            return None
        return (b.get(role, {}).get(kind, 0) - a.get(role, {}).get(kind, 0)) / 1024


def rss_kinds(hidden: int) -> list[tuple[str, str, int]]:
    """The RSS runs' request kinds: (name, spec text, max_tokens); requests cycle through them."""
    rng = random.Random(11)
    vec = [round(rng.uniform(-0.05, 0.05), 4) for _ in range(hidden)]
    return [
        ("prefill read", spec({"op": "read", "name": "h", "module": "model.layers.1"}), 1),
        ("every-step read", spec({"op": "read", "name": "s", "module": "model.layers.1", "sum": True, "steps": "all"},
                                 {"op": "logits_topk", "name": "top", "k": 5, "steps": "all"}), 4),
        ("steering add", spec({"op": "add", "module": "model.layers.0", "index": 0, "value": vec, "steps": "all"}), 4),
    ]


def rss_series(server: Server, label: str, traced: bool, kinds: list, prompts: list[str], total: int,
               deadline: float) -> RssSeries:
    """Send ``total`` requests, RSS_BATCH at a time (request i: prompt i % len(prompts), kind
    i % len(kinds), its max_tokens, ignore_eos; the kind's spec attached only when ``traced``),
    sampling the process tree's memory at 0 and every RSS_EVERY requests."""
    out = RssSeries(label, traced)

    def one(i: int) -> tuple[str, str, bool]:
        """(kind, '' or what went wrong, answered without a results object)."""
        name, text, max_tokens = kinds[i % len(kinds)]
        base = completion(prompts[i % len(prompts)], max_tokens, ignore_eos=True)
        body = with_xargs(base, {"nnsight": text}) if traced else dumps(base)
        reply = server.call("POST", "/v1/completions", body, timeout=120)
        if reply.status != 200:
            return name, f"HTTP {reply.status}: {reply.error or reply.data[:300].decode(errors='replace')}", False
        res = nnsight_of(reply.json())
        if not traced:
            return name, "" if res is None else "a plain request answered with nnsight results", False
        if res is None:
            if name == "steering add":  # saves nothing: an absent results object is not an error
                return name, "", True
            return name, "no nnsight results in the response", False
        err = res.get("error")
        if err:
            return name, json.dumps(err)[:300], False
        return name, "" if name == "steering add" or res.get("saves") else "results without saves", False

    out.samples.append((0, tree_mem(server.proc.pid)))
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=RSS_BATCH) as pool:
        while out.sent < total:
            if time.time() > deadline:
                break
            n = min(RSS_BATCH, total - out.sent)
            for name, error, no_results in pool.map(one, range(out.sent, out.sent + n)):
                out.no_results += no_results
                if error:
                    out.bad[name] += 1
                    out.first_error.setdefault(name, error)
            out.sent += n
            if out.sent % RSS_EVERY == 0 or out.sent == total:
                out.samples.append((out.sent, tree_mem(server.proc.pid)))
                per = out.samples[-1][1]
                log(f"rss {label} {out.sent}/{total}: {per['total']['rss'] / 1024:.0f} MiB ("
                    + ", ".join(f"{r} {per[r]['rss'] / 1024:.0f}" for r in ROLES if r in per) + ")")
            if server.proc.poll() is not None:
                out.died = True
                break
    out.wall = time.perf_counter() - t
    return out


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def _signed(mib: float | None) -> str:
    return "-" if mib is None else f"{mib:+.1f}"


def stage_rss(plug: Server, base: Server, prompts: list[str], hidden: int, total: int, deadline: float,
              report: Report, plain_on_plugin: bool = True) -> None:
    """The same RSS_BATCH-concurrent requests as plain requests to the plugin-less server,
    traced requests to the plugin server, then (``plain_on_plugin``) plain requests to the
    plugin server; memory of each process tree sampled every RSS_EVERY requests."""
    kinds = rss_kinds(hidden)
    runs = [rss_series(base, "plugin-less, plain", False, kinds, prompts, total, deadline)]
    runs.append(rss_series(plug, "plugin, traced", True, kinds, prompts, total, deadline))
    if plain_on_plugin and plug.proc.poll() is None and time.time() < deadline:
        runs.append(rss_series(plug, "plugin, plain (after its traced run)", False, kinds, prompts, total, deadline))
    ref, traced = runs[0], runs[1]
    # the interval compared: from RSS_FROM requests (or the first sample after 0) to the last
    # sample every run reached
    last = min(r.samples[-1][0] for r in runs[:2])
    start = RSS_FROM if RSS_FROM < last else min((n for n, _ in traced.samples if n > 0), default=0)
    g_ref, g_tr = ref.growth(start, last), traced.growth(start, last)
    excess = None if g_ref is None or g_tr is None else g_tr - g_ref
    margin = RSS_MARGIN_MIB

    print(f"\n### RSS of the servers' process trees (MiB), {total} requests per column\n")
    print(f"Each column: the same requests ({', '.join(f'{k[0]} (max_tokens {k[2]})' for k in kinds)}, "
          f"cycled; {len(prompts)} prompts; ignore_eos; {RSS_BATCH} at a time), plain (no `vllm_xargs`) or "
          f"traced (the kind's spec attached); RSS (VmRSS) summed over the server's process tree, sampled "
          f"after every {RSS_EVERY}. Runs in column order. Pass: the plugin server's traced growth from "
          f"{start} to {last} requests exceeds the plugin-less server's plain growth over the same interval "
          f"by at most {margin:.0f} MiB ({RSS_MARGIN_WHY}); and the traced growth stays within "
          f"+{RSS_GROWTH:.0%} (the absolute guard).\n")
    print("| requests | " + " | ".join(r.label for r in runs) + " |")
    print("|---:|" + "---:|" * len(runs))
    for n in sorted({n for r in runs for n, _ in r.samples}):
        cells = [_mib(m["total"]["rss"]) if (m := r.at(n)) else "-" for r in runs]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(f"| growth {start} → {last} | " + " | ".join(_signed(r.growth(start, last)) for r in runs) + " |")
    print(f"| growth 0 → {last} | " + " | ".join(_signed(r.growth(0, last)) for r in runs) + " |")

    print("\n### RSS per process (MiB)\n")
    print("VmRSS of each process of the tree (API server: the root; EngineCore and worker: vLLM's process "
          f"titles), and the growth from {start} to {last} requests split into anonymous memory (heap), "
          "shared memory (vLLM's message queues between EngineCore and worker) and file-backed pages.\n")
    print(f"| series | process | at 0 | at {start} | at {last} | growth 0 → {last} | growth {start} → {last} | "
          "of it anon | of it shmem | of it file |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        for role in (*ROLES, "total"):
            if not any(role in m for _, m in r.samples):
                continue
            cells = [_mib(m.get(role, {}).get("rss", 0)) if (m := r.at(n)) else "-" for n in (0, start, last)]
            parts = [_signed(r.growth(start, last, role, k)) for k in ("anon", "shmem", "file")]
            print(f"| {r.label} | {role} | " + " | ".join(cells) + f" | {_signed(r.growth(0, last, role))} | "
                  f"{_signed(r.growth(start, last, role))} | " + " | ".join(parts) + " |")

    def per_role(r: RssSeries) -> str:
        return ", ".join(f"{role} {_signed(r.growth(start, last, role))}" for role in ROLES
                         if r.at(start) and role in r.at(start))

    first, base_at, end_at = traced.samples[0][1], traced.at(start), traced.samples[-1]
    grew = (end_at[1]["total"]["rss"] - base_at["total"]["rss"]) / base_at["total"]["rss"] if base_at else 0.0
    peak = max(m["total"]["rss"] for _, m in traced.samples)
    stopped = "".join(f"; {r.label} stopped at {r.sent}/{total} (time budget)" for r in runs if r.sent < total)
    report.add("RSS: no growth over traced requests", grew <= RSS_GROWTH and plug.proc.poll() is None,
               f"first {first['total']['rss'] / 1024:.0f} MiB, at {start} "
               f"{(base_at or first)['total']['rss'] / 1024:.0f} MiB, last (at {end_at[0]}) "
               f"{end_at[1]['total']['rss'] / 1024:.0f} MiB ({grew:+.1%}, limit +{RSS_GROWTH:.0%}), max "
               f"{peak / 1024:.0f} MiB; {traced.sent} requests in {traced.wall:.0f} s{stopped}")
    report.add("RSS: plugin server's growth vs the plugin-less server's", excess is not None and excess <= margin,
               f"growth {start} → {last} requests: plugin server traced {_signed(g_tr)} MiB ({per_role(traced)}), "
               f"plugin-less server plain {_signed(g_ref)} MiB ({per_role(ref)}); excess {_signed(excess)} MiB "
               f"(limit {margin:.0f} MiB)"
               + (f"; plugin server plain after its traced run {_signed(runs[2].growth(start, last))} MiB "
                  f"({per_role(runs[2])})" if len(runs) > 2 else ""))
    report.add("RSS runs: every request answered", all(not r.bad and r.sent > 0 and not r.died for r in runs),
               "; ".join(f"{r.label}: failed {dict(r.bad) or 'none'} of {r.sent}"
                         + (" (server died)" if r.died else "")
                         + "".join(f", first {k} error: {v}" for k, v in r.first_error.items())
                         + (f", steering answers without a results object: {r.no_results}" if r.no_results else "")
                         for r in runs))


# ----------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the tiny Llama, built in a temp dir)")
    parser.add_argument("--payloads", type=int, default=3000)
    parser.add_argument("--rss-requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma-separated fuzz categories (or prefixes) to leave out")
    parser.add_argument("--budget-min", type=float, default=28.0, help="stop the long stages after this")
    parser.add_argument("--canary-every", type=int, default=1,
                        help="a plain request compared with the plugin-less server after every N payloads (0: off)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    t_start = time.time()
    budget_end = t_start + args.budget_min * 60

    from vllm_nnsight_plugin import tiny

    tmp = Path(tempfile.mkdtemp(prefix="nnsight-reliability-"))
    model = args.model or str(tiny.ensure("llama", tmp / "ckpt"))
    config = json.loads((Path(model) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    long_prompt = " ".join(tiny.CORPUS) * 3
    prompts = list(tiny.CORPUS[:7]) + [long_prompt]
    skip = [s for s in args.skip.split(",") if s]
    items = [it for it in payloads(args.seed, args.payloads, hidden, layers)  # before any server starts
             if not any(it[0].startswith(s) for s in skip)]
    report = Report()
    servers: list[Server] = []
    fuzz: FuzzResult | None = None
    try:
        log("starting both servers")
        plug = start_server("plugin", model, tmp, plugin=True)
        servers.append(plug)
        base = start_server("plugin-less", model, tmp, plugin=False)
        servers.append(base)
        print(f"\n## Reliability run, {time.strftime('%Y-%m-%d %H:%M')}\n")
        print(f"model {model} (hidden {hidden}, {layers} layers); logs: plugin server `{plug.log_path}`, "
              f"plugin-less server `{base.log_path}`; temp dir `{tmp}`\n", flush=True)
        for s in servers:
            wait_ready(s)
        log(f"servers ready after {time.time() - t_start:.0f} s")
        tree_plug = plug.call("GET", "/v1/nnsight/tree").status
        tree_base = base.call("GET", "/v1/nnsight/tree").status
        report.add("setup: plugin live on one server only", tree_plug == 200 and tree_base == 404,
                   f"GET /v1/nnsight/tree: plugin server {tree_plug}, plugin-less server {tree_base}")

        # 2. reference
        ref_base, why_b = reference(base, prompts)
        ref_plug, why_p = reference(plug, prompts)
        if ref_base is None or ref_plug is None:
            report.add("reference: plugin == plugin-less (greedy, logprobs)", False, why_b or why_p)
        else:
            ok, detail = compare_refs(ref_base, ref_plug)
            report.add("reference: plugin == plugin-less (greedy, logprobs)", ok,
                       f"{detail}; long prompt {ref_base[-1][2]} tokens")
            report.add("reference: long prompt has 200+ tokens", ref_base[-1][2] >= 200,
                       f"{ref_base[-1][2]} prompt tokens")

        # 3. fuzz
        log(f"fuzz: {len(items)} payloads")
        t = time.time()
        fuzz = run_fuzz(plug, base, items, args.seed, budget_end - 10 * 60, tmp, args.canary_every)
        fuzz_s = time.time() - t
        print_fuzz(fuzz, tmp)
        n5 = [f for f in fuzz.failures if f.get("plugin_less", "").startswith(("5", "conn"))]
        report.add("fuzz: no 5xx / connection error caused by the plugin", not (len(fuzz.failures) - len(n5)),
                   f"{fuzz.done}/{len(items)} payloads in {fuzz_s:.0f} s; {len(fuzz.failures) - len(n5)} failures "
                   f"(5xx, conn, timeouts; plugin-less server fine or not asked)"
                   + (f"; {fuzz.stopped_early}" if fuzz.stopped_early else "")
                   + (f"; skipped categories {skip}" if skip else ""))
        report.add("fuzz: no 5xx that the plugin-less server also gives", not n5,
                   f"{len(n5)} (vLLM's own answer to that body)")
        if args.canary_every:
            c = fuzz.canary_first
            report.add("fuzz: a plain canary request unchanged after every payload", c is None and
                       fuzz.canary_checked > 0,
                       f"{fuzz.canary_checked} canaries, {fuzz.canary_bad} differed"
                       + (f"; first after payload #{c['index']} ({c['category']}): {c['detail']}" if c else ""))
        report.add("fuzz: server alive and healthy throughout", not fuzz.died,
                   fuzz.died or f"/health every {HEALTH_EVERY} payloads, max {fuzz.health_max:.3f} s")

        def alive(name: str) -> bool:
            why = plug.check()
            if why:
                report.add(name, None, f"not run: plugin server down ({why})")
            return not why

        # 4. nothing poisoned
        if alive("after fuzz: plugin == plugin-less reference"):
            got, why = reference(plug, prompts)
            ok, detail = compare_refs(ref_base, got) if got and ref_base else (False, why)
            report.add("after fuzz: plugin == plugin-less reference", ok, detail)
        if alive("after non-finite specs: plugin == plugin-less reference"):
            nan_b64 = base64.b64encode(struct.pack(f"<{hidden}f", *[math.nan] * hidden))
            poison = {
                "scale NaN literal": spec({"op": "scale", "module": "model.layers.0.mlp", "factor": math.nan,
                                           "steps": "all"}),
                "scale 1e38": spec({"op": "scale", "module": "model.layers.0.mlp", "factor": 1e38, "steps": "all"}),
                "add [1e38]*hidden": spec({"op": "add", "module": "model.layers.0", "index": 0,
                                           "value": [1e38] * hidden, "steps": "all"}),
                "add $tensor NaN": spec({"op": "add", "module": "model.layers.0", "index": 0, "steps": "all",
                                         "value": {"$tensor": {"dtype": "float32", "shape": [hidden],
                                                               "data": nan_b64.decode()}}}),
            }
            seen: dict[str, Counter] = {k: Counter() for k in poison}
            for p in prompts:
                for name, text in poison.items():
                    reply = plug.post("/v1/completions", with_xargs(completion(p, 4, ignore_eos=True),
                                                                    {"nnsight": text}))
                    seen[name][classify(reply, False)[0]] += 1
            crashed = [n for n, c in seen.items() if any(k[:1] == "5" or k == "conn" for k in c)]
            report.add("non-finite specs answered without 5xx", not crashed,
                       "; ".join(f"{n}: {dict(c)}" for n, c in seen.items()))
            if alive("after non-finite specs: plugin == plugin-less reference"):
                got, why = reference(plug, prompts)
                ok, detail = compare_refs(ref_base, got) if got and ref_base else (False, why)
                report.add("after non-finite specs: plugin == plugin-less reference", ok, detail)

        # 5. big spec
        if alive("big spec"):
            stage_big_spec(plug, hidden, report)
        # 6. concurrency
        if alive("200 concurrent mixed requests"):
            stage_concurrent(plug, base, prompts, report)
        # 7. streams
        if alive("50 streams (25 closed after the first chunk)"):
            stage_streams(plug, prompts, report)
        # 8. RSS
        if alive("RSS: no growth over traced requests"):
            stage_rss(plug, base, prompts, hidden, args.rss_requests, budget_end - 60, report)
        why = plug.check()
        report.add("end: plugin server alive and healthy", not why, why or "ok")
    except Exception as exc:  # noqa: BLE001 - the table is printed anyway
        report.add("harness", False, f"{type(exc).__name__}: {exc}")
        import traceback

        traceback.print_exc()
    finally:
        for s in servers:
            stop_server(s)
    print(f"\n### Summary ({time.time() - t_start:.0f} s)\n")
    print("| check | result | numbers |")
    print("|---|---|---|")
    for name, ok, detail in report.checks:
        result = "pass" if ok else "FAIL" if ok is False else "FAIL (not run)"
        print(f"| {name} | {result} | {md_escape(detail, 600)} |")
    print(f"\nlogs: {', '.join(s.log_path for s in servers)}", flush=True)
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
