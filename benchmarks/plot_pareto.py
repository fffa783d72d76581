"""Pareto plot of calibrated adaptive depth vs static pruning vs naive early exit (issue 5).

Reads ``laserlm eval --json`` documents (quality on the WikiText-2 *test* split and tasks) and optionally a
``laserlm bench --json`` document (decode tokens/s of the same configurations), and draws:

- left: top-1 agreement with the full model vs mean decoder layers per token (compute);
- middle: WikiText-2 perplexity vs mean layers per token;
- right: top-1 agreement vs tg decode tokens/s relative to full depth (wall clock), when a bench file is given.

Configurations are grouped into families by their spec: ``adaptive:laser=...`` (calibrated), ``static:`` (static
pruning), ``adaptive:policy=confidence`` (naive early exit with the untrained LM head), ``full``.

usage: python benchmarks/plot_pareto.py --eval A.json [B.json ...] [--bench BENCH.json] --out pareto.png
"""

from __future__ import annotations

import argparse
import json
import re

# families by spec; calibrated artifacts are named as run_calibration_pareto.sh names them: smolNN = propagate,
# smolNNd = deferred thresholds, NN = the agreement target
FAMILIES = [("calibrated, propagate bridge", r"adaptive:laser=.*smol\d+\.safetensors", "o-", "C0"),
            ("calibrated, deferred bridge (no FLOP saving)", r"adaptive:laser=.*smol\d+d\.safetensors", "D-", "C4"),
            ("static pruning (ShortGPT BI)", r"static:", "s--", "C1"),
            ("naive early exit (confidence, untrained head)", r"adaptive:policy=confidence", "^:", "C2"),
            ("full depth", r"full$", "*", "k")]


def family(config: str):
    for name, pattern, style, color in FAMILIES:
        if re.match(pattern, config):
            return name, style, color
    return None


def short_label(config: str) -> str:
    if config.startswith("static:"):
        return config.split("layers=")[-1].split(",")[0] + "L"
    m = re.search(r"smol(\d{2,3})d?\.safetensors", config)
    if m:
        return f".{m.group(1)}"
    m = re.search(r"threshold=([0-9.]+)", config)
    return f"conf>{m.group(1)}" if m else ""


def load_points(eval_paths, bench_path):
    points = {}
    for path in eval_paths:
        doc = json.load(open(path))
        res = doc["results"]
        wt, ag = res.get("wikitext", {}), res.get("agreement", {})
        for cfg, m in wt.items():
            p = points.setdefault(cfg, {})
            p["layers"] = m["mean_layers"]
            p["ppl"] = m["perplexity"]
            p["agree"] = m.get("top1_agreement", ag.get(cfg, {}).get("top1_agreement"))  # all 20k scored positions
    if bench_path:
        rows = json.load(open(bench_path))
        rows = rows["rows"] if isinstance(rows, dict) else rows
        full = next(r for r in rows if r["config"] == "full")
        for r in rows:
            if r["config"] in points:
                points[r["config"]]["speed"] = r["tg_tokens_per_s"] / full["tg_tokens_per_s"]
    return points


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval", nargs="+", required=True)
    ap.add_argument("--bench", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = load_points(args.eval, args.bench)
    panels = [("layers", "agree", "mean exit layer per token (= layers run, except deferred)", "top-1 agreement with full depth"),
              ("layers", "ppl", "mean exit layer per token (= layers run, except deferred)", "WikiText-2 test perplexity")]
    if args.bench:
        panels.append(("speed", "agree", "tg128 tokens/s relative to full depth", "top-1 agreement with full depth"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4))
    for ax, (xk, yk, xl, yl) in zip(axes, panels):
        for name, _, style, color in FAMILIES:
            pts = sorted((p[xk], p[yk], c) for c, p in points.items()
                         if family(c) and family(c)[0] == name and p.get(xk) is not None and p.get(yk) is not None)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style if xk != "speed" else style[0], color=color,
                    label=name, markersize=6)
            for x, y, c in pts:
                ax.annotate(short_label(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        if yk == "ppl":  # the naive early exit (perplexity 10^4..10^7) is far above this range
            ax.set_ylim(20, 50)
            ax.set_title("naive early exit: perplexity > 10^4, off the chart", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("SmolLM2-135M: calibrated adaptive depth vs static pruning vs naive early exit (WikiText-2 test)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
