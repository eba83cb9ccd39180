"""Print a headline run (headline.jsonl lines) as a table of ratios.

    python3 benchmarks/gpu/table.py benchmarks/gpu/results/headline-2026-11-30-run3-taps.jsonl

Ratios are to stock-with-graphs of the same file (one remote run; the mean when the
run measured it more than once, e.g. first and last to bracket drift) and to the
variant's own untraced workload; absolute tok/s differ up to 2x between machines.
"""

from __future__ import annotations

import json
import sys


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    stocks = [r["tok_s"]["plain"] for r in rows if r["variant"] == "stock_graphs"]
    stock = sum(stocks) / len(stocks) if stocks else None
    note = f"stock graphs: {', '.join(f'{s:,.0f}' for s in stocks)} tok/s" + (
        f" (mean {stock:,.0f})" if len(stocks) > 1 else "")
    out = [f"{path}", note, "| variant | workload | out tok/s | ratio to stock graphs | ratio to own untraced |",
           "|---|---|---:|---:|---:|"]
    for r in rows:
        own = r["tok_s"].get("plain")
        for workload, tok_s in r["tok_s"].items():
            to_stock = f"{tok_s / stock:.3f}" if stock else ""
            to_own = f"{tok_s / own:.3f}" if own else ""
            out.append(f"| {r['variant']} | {workload} | {tok_s:,.0f} | {to_stock} | {to_own} |")
    return "\n".join(out)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(table(arg))
        print()
