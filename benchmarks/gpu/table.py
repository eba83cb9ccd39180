"""Print a headline run (headline.jsonl lines) as a table of ratios.

    python3 benchmarks/gpu/table.py benchmarks/gpu/results/headline-2026-11-30-run3-taps.jsonl

Ratios are to stock-with-graphs of the same file (one remote run) and to the
variant's own untraced workload; absolute tok/s differ up to 2x between machines.
Sequential runs (one variant after another): to stock, ratios of medians, to the mean
of the stock-with-graphs rows when a run measured it more than once (first and last, to
bracket drift; drift between processes moves these); to the variant's own untraced
workload, the median of per-rep ratios (a variant's workloads alternate within each
rep, so drift moves both alike). Interleaved runs (``--interleave``: every engine
alive, rounds of one rep each): the median over rounds of each round's ratio, for both.

    python3 benchmarks/gpu/table.py --pool run-a.jsonl run-b.jsonl ...

pools the per-round ratios to stock of several interleaved runs of the same code (single
rounds on the lent machines range +-0.3), with a bootstrap 95% interval of the median.

    python3 benchmarks/gpu/table.py --user-way benchmarks/gpu/results/2026-12-02b-user_way.json

prints a ``user_way.py`` run's pairs the same way: per workload, the median ratio and
its bootstrap interval.
"""

from __future__ import annotations

import json
import random
import statistics
import sys


def _ratio(reps: list[float], ref: list[float] | None, per_rep: bool, ref_median: float | None) -> str:
    if per_rep and ref and len(ref) == len(reps):
        return f"{statistics.median(a / b for a, b in zip(reps, ref)):.3f}"
    return f"{statistics.median(reps) / ref_median:.3f}" if ref_median else ""


def _load(path: str) -> list[dict]:
    """A run's rows (one JSON object per variant)."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def table(path: str) -> str:
    rows = _load(path)
    interleaved = bool(rows) and all(r.get("interleaved") for r in rows)
    stock_rows = [r for r in rows if r["variant"] == "stock_graphs"]
    stocks = [r["tok_s"]["plain"] for r in stock_rows]
    stock = sum(stocks) / len(stocks) if stocks else None
    stock_reps = stock_rows[0]["reps"]["plain"] if stock_rows else None
    note = f"stock graphs: {', '.join(f'{s:,.0f}' for s in stocks)} tok/s" + (
        f" (mean {stock:,.0f})" if len(stocks) > 1 else "") + (
        "; interleaved rounds, ratios are medians of per-round ratios" if interleaved
        else "; to stock: ratios of medians; to own untraced: medians of per-rep ratios")
    out = [f"{path}", note, "| variant | workload | out tok/s | ratio to stock graphs | ratio to own untraced |",
           "|---|---|---:|---:|---:|"]
    for r in rows:
        own = r["reps"].get("plain")
        for workload, tok_s in r["tok_s"].items():
            reps = r["reps"][workload]
            to_stock = _ratio(reps, stock_reps, interleaved, stock)
            to_own = _ratio(reps, own, True, statistics.median(own) if own else None)
            out.append(f"| {r['variant']} | {workload} | {tok_s:,.0f} | {to_stock} | {to_own} |")
    return "\n".join(out)


def median_interval(ratios: list[float], rng: random.Random | None = None) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``ratios`` (4000 resamples)."""
    rng = rng or random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(4000))
    return boot[100], boot[3899]


BOTH = " vs both"  # a --both-baselines run's pooled rows: "plugin:plain vs both"


def pair_keys(rounds: list[dict]) -> list[str]:
    """A ``user_way.py`` run's workload keys in order (with ``--both-baselines`` a round
    holds one baseline's key per workload, "plugin:plain vs stock"), then a pooled key
    per workload measured against both baselines."""
    keys = list(dict.fromkeys(k for r in rounds for k in r))
    return keys + list(dict.fromkeys(k.rsplit(" vs ", 1)[0] + BOTH for k in keys if " vs " in k))


def pairs_for(rounds: list[dict], key: str) -> list[dict]:
    """The pairs of a key of :func:`pair_keys` (a pooled key: both baselines' pairs)."""
    if key.endswith(BOTH):
        return [p for r in rounds for k, v in r.items() if k.rsplit(" vs ", 1)[0] == key[: -len(BOTH)] for p in v]
    return [p for r in rounds for p in r.get(key, ())]


def same_engine(rounds: list[dict]) -> dict[str, list[float]]:
    """Each traced workload's tokens/s over its own engine's untraced batch of the same
    round and attempt ("plugin:steer / plugin:plain"): the plugin's cost on one engine,
    with no stock engine in the ratio (drift between engines and their placement drop
    out). With ``--both-baselines`` an attempt's baseline is the same for every
    workload, so runs pair within one baseline's key ("... vs stock")."""
    out: dict[str, list[float]] = {}
    for r in rounds:
        for key, pairs in r.items():
            name, _, base = key.partition(" vs ")
            engine, workload = name.split(":", 1)
            plain = r.get(f"{engine}:plain" + (f" vs {base}" if base else ""))
            if workload != "plain" and plain:
                out.setdefault(f"{name} / {engine}:plain", []).extend(
                    (a["run"]["tokens"] / a["run"]["s"]) / (b["run"]["tokens"] / b["run"]["s"])
                    for a, b in zip(pairs, plain))
    return out


def same_engine_table(rounds: list[dict]) -> str:
    rows = ["| same engine, same round | pairs | median ratio | 95% interval (bootstrap) |", "|---|---:|---:|---|"]
    for key, ratios in same_engine(rounds).items():
        low, high = median_interval(ratios)
        rows.append(f"| {key} | {len(ratios)} | {statistics.median(ratios):.2f} | {low:.2f}-{high:.2f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def user_way(path: str) -> str:
    """A ``user_way.py`` run's pairs as a table: median ratio and its bootstrap interval."""
    with open(path) as fh:
        rounds = json.load(fh)["rounds"]
    out = [f"{path}: ratio to stock graphs per pair",
           "| workload | pairs | median ratio | 95% interval (bootstrap) |", "|---|---:|---:|---|"]
    for key in pair_keys(rounds):
        ratios = [p["ratio"] for p in pairs_for(rounds, key)]
        low, high = median_interval(ratios)
        out.append(f"| {key} | {len(ratios)} | {statistics.median(ratios):.2f} | {low:.2f}-{high:.2f} |")
    if same := same_engine_table(rounds):
        out += ["", same]
    return "\n".join(out)


def pooled(paths: list[str]) -> str:
    """Per-round ratios to stock with graphs, pooled over interleaved runs."""
    pools: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        rows = _load(path)
        stock = next(r["reps"]["plain"] for r in rows if r["variant"] == "stock_graphs")
        for r in rows:
            if not r.get("interleaved"):
                raise SystemExit(f"{path}: --pool takes interleaved runs only")
            for workload, reps in r["reps"].items():
                pools.setdefault((r["variant"], workload), []).extend(a / b for a, b in zip(reps, stock))
    rng = random.Random(0)
    out = [f"pooled per-round ratios to stock graphs over {len(paths)} runs",
           "| variant | workload | rounds | median ratio | 95% interval (bootstrap) |", "|---|---|---:|---:|---|"]
    for (variant, workload), ratios in pools.items():
        low, high = median_interval(ratios, rng)
        out.append(f"| {variant} | {workload} | {len(ratios)} | {statistics.median(ratios):.3f} | "
                   f"{low:.3f}-{high:.3f} |")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pool"]:
        print(pooled(sys.argv[2:]))
    elif sys.argv[1:2] == ["--user-way"]:
        for arg in sys.argv[2:]:
            print(user_way(arg))
            print()
    else:
        for arg in sys.argv[1:]:
            print(table(arg))
            print()
