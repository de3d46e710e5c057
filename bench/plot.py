#!/usr/bin/env python3
"""PNG chart of bench/run_bench.py results: tok/s against length (log-log), prefill and decode panels, one
line per engine (lily, transformers, and mlx-lm when the JSON has it) with the min-max range over the rounds as
error bars; lengths an engine did not reach are listed under the panel.

  python3 bench/plot.py bench/results/bench.json --out bench/results/bench.png
  python3 bench/plot.py a.json b.json --out chart.png     # several runs: merged per length (most reps wins)
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

STYLE = {"lily": ("#d62728", "o"), "transformers": ("#1f77b4", "s"), "mlx_lm": ("#2ca02c", "^")}
LABEL = {"lily": "lily (4-bit)", "transformers": "transformers (bf16, dequantized)", "mlx_lm": "MLX-LM (4-bit)"}
KEY = {"prefill": "length", "decode": "context"}


def load(paths):
    """Engines -> mode -> {length: row}, merged over files (the row with the most reps wins); plus stamps."""
    engines, stamps = {}, []
    for p in paths:
        r = json.loads(Path(p).read_text())
        stamps.append(r.get("stamp", {}))
        for e, modes in r.get("engines", {}).items():
            for m in KEY:
                for row in modes.get(m, []) or []:
                    n = row[KEY[m]]
                    cur = engines.setdefault(e, {}).setdefault(m, {}).get(n)
                    if cur is None or len(row.get("reps", [])) > len(cur.get("reps", [])):
                        engines[e][m][n] = row
    return engines, stamps


def human(n, _pos=None):
    n = int(n)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(engines, stamps, out, title):
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, mode in zip(axes, ("prefill", "decode")):
        missing = []
        all_n = set()
        for e in sorted(engines, key=lambda x: list(STYLE).index(x) if x in STYLE else 99):
            rows = engines[e].get(mode, {})
            pts = [(n, r) for n, r in sorted(rows.items()) if r.get("tok_per_s")]
            for n, r in sorted(rows.items()):
                all_n.add(n)
                if not r.get("tok_per_s"):
                    missing.append(f"{LABEL.get(e, e)} at {human(n)}: {r.get('status', 'not run')}")
            if not pts:
                continue
            color, marker = STYLE.get(e, ("#7f7f7f", "d"))
            x = [n for n, _ in pts]
            y = [r["tok_per_s"] for _, r in pts]
            lo = [r["tok_per_s"] - r.get("tok_per_s_min", r["tok_per_s"]) for _, r in pts]
            hi = [r.get("tok_per_s_max", r["tok_per_s"]) - r["tok_per_s"] for _, r in pts]
            reps = max(len(r.get("reps", [])) for _, r in pts)
            ax.errorbar(x, y, yerr=[lo, hi], color=color, marker=marker, capsize=3, lw=1.8,
                        label=f"{LABEL.get(e, e)} (median of {reps})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if all_n:
            ax.set_xticks(sorted(all_n))
        ax.xaxis.set_major_formatter(FuncFormatter(human))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(_tps))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
        ax.set_xlabel("prompt length (tokens)" if mode == "prefill" else "context length (tokens)")
        ax.set_ylabel("tokens / s")
        ax.set_title("prefill" if mode == "prefill" else "decode (batch 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        if missing:
            text = "\n".join(_compress(missing))
            ax.text(0.0, -0.17, text, transform=ax.transAxes, fontsize=7, va="top", color="#555555")
    s = stamps[0] if stamps else {}
    gpu = (s.get("gpu") or {}).get("name", "CPU")
    sub = f"{gpu}, driver {(s.get('gpu') or {}).get('driver', '-')}; commit {str(s.get('git_sha', '?'))[:12]}; " \
          f"{s.get('date_utc', '')}; transformers {s.get('transformers', '?')}, torch {s.get('torch', '?')}"
    m = next((x for x in stamps if x.get("mlx_lm")), None)
    if m:
        sub += f"; mlx {m.get('mlx')}, mlx-lm {m.get('mlx_lm')} on {m.get('mlx_device')}"
    fig.suptitle(f"{title}\n{sub}", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=130, bbox_inches="tight")
    print(f"wrote {out}")


def _tps(v, _pos=None):
    return f"{v / 1000:g}K" if v >= 1000 else f"{v:g}"


def _compress(lines, limit=6):
    """The list of missing points, with runs of the same reason folded ("... at 64K, 128K: not reached")."""
    by_reason = {}
    for line in lines:
        who, _, reason = line.partition(": ")
        engine, _, n = who.rpartition(" at ")
        by_reason.setdefault((engine, reason), []).append(n)
    out = [f"{engine} at {', '.join(ns)}: {reason}" for (engine, reason), ns in by_reason.items()]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="run_bench.py result files")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--title", default="Qwen3.6-35B-A3B geometry (synthetic weights), same weights for every engine")
    args = ap.parse_args()
    engines, stamps = load(args.json)
    if not engines:
        sys.exit("no results in the given files")
    plot(engines, stamps, args.out, args.title)


if __name__ == "__main__":
    main()
