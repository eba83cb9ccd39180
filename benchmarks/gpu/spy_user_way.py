"""Where the user's-way workloads spend their time across vLLM's processes.

``profile_capture.py`` runs the engine in one process and the headline's payloads
straight through ``LLM.generate``: it cannot see what only the multi-process engine
pays (the engine core's output thread, the front end's receive thread, the client's
decode of the saves). This runs ``user_way.py``'s workloads on one plugin engine,
multi-process as users run it, and samples the front end and the engine core with
py-spy while each workload runs batch after batch (fresh prompts), the workloads
taking turns for ``--rounds`` rounds of ``--seconds / --rounds`` each:

    python3 benchmarks/gpu/spy_user_way.py [--workloads plain,steer,every_token] [--seconds 20] [--rounds 3] [--gil]

A workload ``steer~guard`` runs ``steer`` with the engine's logits check switched off
(an ablation: does the rest of the step slow down with it?); ``~guardcopy`` keeps the
check's device work but copies no flags to the host. The wrappers that switch them are
installed in the engine core only when a workload asks for an ablation (they cost a
file read per step). ``--gil`` also records
each process a second time with only the samples of the thread holding the GIL: a
function that is slower only in the first recording was waiting for the GIL (another
thread of its process held it). Each recording ends with the active time per thread.

Prints, per workload: seconds per batch (median) and engine outputs per batch (about
one per engine step); then per process, milliseconds per batch of each workload
beside the first for the functions whose time differs most from it (own time: where
the samples were, by line; total: anywhere on the stack, by function). Needs ``py-spy`` on PATH
(remote.sh installs it from .whl/extra).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
RATE = 200  # py-spy samples per second
_ABLATE_FLAG = os.environ.setdefault("SPY_ABLATE_FLAG", tempfile.mktemp(prefix="spy-ablate-"))


_ABLATIONS = ("guard", "guardcopy")


def _install_ablation() -> None:
    """In the engine core (a spawned process imports this file as ``__mp_main__``): while
    the front end holds the flag file, the part of the logits check it names is off."""
    import torch

    from vllm_nnsight_plugin.engine import finite_logits, logits_serving

    guard, check = logits_serving.LogitsServing.guard_logits, finite_logits.FiniteLogits.check

    def ablated() -> str:
        try:
            with open(_ABLATE_FLAG) as fh:
                return fh.read()
        except OSError:
            return ""

    def guard_logits(self: object, logits: object) -> None:
        if ablated() != "guard":
            guard(self, logits)

    def checked(self: object, logits: torch.Tensor, index: torch.Tensor | None, req_ids: list,
                report: bool = True) -> list:
        if ablated() != "guardcopy" or not req_ids:
            return check(self, logits, index, req_ids, report)
        # the check's device work, no flags copied to the host
        part = logits if index is None else logits.index_select(0, index)
        (part.amax(dim=-1) < float("inf")).all()
        if index is None:
            torch.nan_to_num(logits, neginf=float("-inf"), out=logits)
        else:
            logits.index_copy_(0, index, torch.nan_to_num(part, neginf=float("-inf")))
        return []

    logits_serving.LogitsServing.guard_logits = guard_logits
    finite_logits.FiniteLogits.check = checked


_ABLATE_ENV = "NNSIGHT_SPY_ABLATIONS"  # set by main() only when a workload ablates: else no wrapper

if __name__ != "__main__" and os.environ.get(_ABLATE_ENV):
    _install_ablation()


def _short(frame: str) -> str:
    """``func (dir/file.py:12)`` without the directories."""
    return re.sub(r"\(.*/", "(", frame)


def _spy(pid: int, raw: str, gil: bool = False) -> tuple[str, subprocess.Popen]:
    """py-spy recording ``pid`` into ``raw``, once it has attached (it says so on stdout)."""
    with open(raw + ".err", "w") as err:
        proc = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", str(RATE),
                                 "--threads", "--nonblocking", *(["--gil"] if gil else []), "--output", raw],
                                stdout=err, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while "Sampling process" not in open(raw + ".err").read():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"py-spy did not attach to {pid}: {open(raw + '.err').read()[-2000:]}")
        time.sleep(0.1)
    return raw, proc


def _counts(raw_path: str) -> tuple[collections.Counter, ...]:
    """py-spy's raw (collapsed) stacks: samples by leaf line and by leaf function (own
    time), by every function on the stack (total time, counted once per sample), and
    by thread (named by its outermost function)."""
    own: collections.Counter = collections.Counter()
    own_fn: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    with open(raw_path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")[1:]  # (the first names the thread)
            if not frames:
                continue
            entry = next((f for f in frames if not re.search(r"\((<string>|.*(threading|process|spawn)\.py)", f)),
                         frames[0])
            threads[f"{stack.split(';')[0][:30]} {re.sub(r':[0-9]+[)]$', ')', _short(entry))}"] += int(count)
            shorts = [_short(f) for f in frames]
            fns = [re.sub(r":\d+\)$", ")", f) for f in shorts]  # (any line of it)
            own[shorts[-1]] += int(count)
            own_fn[fns[-1]] += int(count)
            for f in set(fns):
                total[f] += int(count)
    return own, own_fn, total, threads


def _table(title: str, per_batch: dict[str, collections.Counter], top: int) -> str:
    """ms per batch of each workload for the functions that differ most from the first."""
    names = list(per_batch)
    base = per_batch[names[0]]
    keys = set().union(*per_batch.values())
    ranked = sorted(keys, key=lambda k: -max(abs(c.get(k, 0) - base.get(k, 0)) for c in per_batch.values()))
    lines = [f"{title} (ms per batch)", "| function | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    lines += [f"| {k} | " + " | ".join(f"{per_batch[n].get(k, 0):.0f}" for n in names) + " |"
              for k in ranked[:top]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="plain,steer,every_token")
    parser.add_argument("--seconds", type=float, default=20.0, help="sampled seconds per workload")
    parser.add_argument("--rounds", type=int, default=3, help="each workload this many times, in turn")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--n", type=int, default=0, help="prompts per batch (default: the headline's)")
    parser.add_argument("--gil", action="store_true", help="also record only the GIL holder's samples")
    args = parser.parse_args()
    print("spy_user_way.py " + " ".join(sys.argv[1:]), flush=True)
    if any("~" in name for name in args.workloads.split(",")):
        os.environ[_ABLATE_ENV] = "1"  # (the engine core, spawned below, inherits it)
    import headline
    import torch
    import user_way

    from vllm_nnsight_plugin import VLLM

    if args.n:
        headline.N = args.n
    headline.make_config()
    user_way.STEER = torch.full((headline.HIDDEN,), 0.01, dtype=torch.bfloat16)
    user_way.STEER_ZERO = torch.zeros((headline.HIDDEN,), dtype=torch.bfloat16)
    runs = user_way.plugin_runs(VLLM(
        headline.MODEL, taps=user_way.TAP, dispatch=True, load_format="dummy", skip_tokenizer_init=True,
        dtype="bfloat16", max_model_len=1024, seed=0,
        **({"gpu_memory_utilization": 0.5} if torch.cuda.is_available() else {})))
    workloads = args.workloads.split(",")
    for name in workloads:
        if "~" not in name:
            user_way._check(name, runs[name](user_way.prompts_for(7)))  # warm-up at full batch
    me = os.getpid()
    processes = [("front end", me)] + [
        (f"process {p} ({open(f'/proc/{p}/comm').read().strip()})", p)
        for p in user_way.descendants(me) if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
    raw_dir = tempfile.mkdtemp(prefix="spy-")  # (raw stacks: only the tables are kept)
    from vllm.v1.engine import core_client

    outputs_got = [0]  # front end: messages from the engine core, about one per engine step (multi-process)
    get_output = core_client.SyncMPClient.get_output

    def counted(self: object) -> object:
        outputs_got[0] += 1
        return get_output(self)

    core_client.SyncMPClient.get_output = counted
    seed = 100
    counts: dict[str, dict[str, list[collections.Counter]]] = collections.defaultdict(dict)  # label -> name -> 3
    walls: dict[str, list[float]] = collections.defaultdict(list)
    tokens: collections.Counter = collections.Counter()
    steps: collections.Counter = collections.Counter()
    # rounds, each workload in turn: a drift of the machine over the run is shared by all
    for rnd in range(args.rounds):
        for name in workloads:
            base, _, ablated = name.partition("~")
            if ablated not in ("", *_ABLATIONS):
                raise SystemExit(f"unknown ablation {ablated!r} (known: {', '.join(_ABLATIONS)})")
            if ablated:
                with open(_ABLATE_FLAG, "w") as fh:
                    fh.write(ablated)
            spies = {label: _spy(pid, os.path.join(raw_dir, f"{name}-{rnd}-{pid}.txt")) for label, pid in processes}
            if args.gil:
                spies.update({f"{label} [GIL held]": _spy(pid, os.path.join(raw_dir, f"{name}-{rnd}-{pid}-gil.txt"),
                                                          gil=True) for label, pid in processes})
            outputs_got[0] = 0
            start, batches = time.time(), 0
            while time.time() - start < args.seconds / args.rounds or not batches:
                prompts = user_way.prompts_for(seed)
                seed += 1
                t = time.perf_counter()
                outputs = runs[base](prompts)
                walls[name].append(time.perf_counter() - t)
                tokens[name] += user_way._check(base, outputs)
                batches += 1
            steps[name] += outputs_got[0]
            if ablated:
                os.remove(_ABLATE_FLAG)
            for _, proc in spies.values():
                proc.send_signal(2)  # SIGINT: py-spy writes what it has
            for label, (raw, proc) in spies.items():
                proc.wait(timeout=60)
                if not os.path.exists(raw):  # (no samples is an error, not zero milliseconds)
                    raise RuntimeError(f"py-spy wrote nothing for the {label}: {open(raw + '.err').read()[-2000:]}")
                got = _counts(raw)
                mine = counts[label].setdefault(name, [collections.Counter() for _ in got])
                for acc, c in zip(mine, got):
                    acc.update(c)
    own, own_fn, total, threads = ({label: {} for label in counts} for _ in range(4))
    for name in workloads:
        n = len(walls[name])
        # (samples also cover py-spy's attach and a batch's tail: per batch is an estimate)
        print(f"{name}: {n} batches, {statistics.median(walls[name]):.3f} s per batch (median), "
              f"{tokens[name] / sum(walls[name]):,.0f} tok/s, {steps[name] / n:.0f} engine outputs per batch",
              flush=True)
        scale = 1000 / RATE / n
        for label in counts:
            for table, c in zip((own, own_fn, total, threads), counts[label][name]):
                table[label][name] = collections.Counter({k: v * scale for k, v in c.items()})
    shutil.rmtree(raw_dir, ignore_errors=True)
    # (active: every thread's samples added up, so it may exceed the wall time)
    for label in own:
        print(f"\n===== {label}: active {', '.join(f'{n} {sum(c.values()):.0f}' for n, c in own[label].items())} "
              "ms per batch")
        print(_table("own time by line", own[label], args.top))
        print(_table("own time by function", own_fn[label], args.top))
        print(_table("total time", total[label], args.top))
        print(_table("active time by thread", threads[label], args.top), flush=True)


if __name__ == "__main__":
    main()
