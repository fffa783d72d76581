"""Bench output: a markdown table, a JSON document and a PNG plot (matplotlib).

The plot is quality-vs-speed (decode tokens/s against a quality metric from a ``laserlm eval
--json`` file) when quality results are given, throughput bars (pp and tg with ± std) otherwise.
"""

from __future__ import annotations

import math

from ..errors import InvalidArgumentError, LaserLMError


def _f(v, fmt=".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def markdown(rows: list[dict], n_prompt: int, n_gen: int, reference: str = "full") -> str:
    """One row per configuration; speed-ups are relative to the full-depth engine row."""
    ref = next((r for r in rows if r["config"] == reference), None)
    head = (f"| config | pp{n_prompt} t/s | tg{n_gen} t/s | tg vs full | TTFT ms | TPOT ms | ITL P50 ms | "
            "ITL P99 ms | layers/tok | KV alloc / used MiB | peak RSS MiB | MiB read/tok | util |")
    out = [head, "|---|" + "---:|" * 12]
    for r in rows:
        speed = (f"{r['tg_tokens_per_s'] / ref['tg_tokens_per_s']:.2f}x"
                 if ref and ref["tg_tokens_per_s"] and not math.isnan(r["tg_tokens_per_s"]) else "n/a")
        out.append(
            f"| {r['config']} | {_f(r['pp_tokens_per_s'])} ± {_f(r['pp_std'])} | "
            f"{_f(r['tg_tokens_per_s'], '.2f')} ± {_f(r['tg_std'], '.2f')} | {speed} | {_f(r['ttft_ms'])} | "
            f"{_f(r['tpot_ms'])} | {_f(r['itl_p50_ms'])} | {_f(r['itl_p99_ms'])} | {_f(r['layers_per_token'], '.2f')} | "
            f"{_f(r['kv_alloc_mib'])} / {_f(r['kv_used_mib'])} | {_f(r['peak_rss_mib'], '.0f')} | "
            f"{_f(r.get('bytes_per_token', float('nan')) / 2**20, '.1f')} | {_f(r.get('utilization', float('nan')), '.2f')} |"
            + (f" {r['note']}" if r.get("note") else ""))
    return "\n".join(out)


QUALITY_METRICS = [("wikitext", "perplexity", "WikiText-2 perplexity (lower is better)"),
                   ("hellaswag", "acc_norm", "HellaSwag acc_norm"), ("arc_easy", "acc_norm", "ARC-Easy acc_norm"),
                   ("piqa", "acc_norm", "PIQA acc_norm"), ("lambada", "acc", "LAMBADA accuracy"),
                   ("agreement", "top1_agreement", "top-1 agreement with full depth")]


def quality_metric(eval_doc: dict) -> tuple[str, dict[str, float]]:
    """The first available quality metric in a ``laserlm eval --json`` document: ``(label, {config: value})``.

    Raises:
        InvalidArgumentError: the document has no usable results.
    """
    results = eval_doc.get("results") if isinstance(eval_doc, dict) else None
    if not results:
        raise InvalidArgumentError("the --quality file is not a `laserlm eval --json` document (no 'results')")
    for task, metric, label in QUALITY_METRICS:
        if task in results:
            return label, {cfg: m[metric] for cfg, m in results[task].items() if metric in m}
    raise InvalidArgumentError("the --quality file has none of the tasks " + ", ".join(t for t, _, _ in QUALITY_METRICS))


def plot(rows: list[dict], path: str, title: str, n_prompt: int, n_gen: int, quality: dict | None = None) -> None:
    """Write a PNG: quality-vs-speed scatter if ``quality`` (``laserlm eval --json`` document) is given,
    else pp / tg throughput bars with ± std error bars.

    Raises:
        LaserLMError: matplotlib is missing or the file cannot be written.
    """
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise LaserLMError("--plot needs matplotlib: pip install 'laserlm[bench]'") from exc
    if quality is not None:
        label, values = quality_metric(quality)
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for r in rows:
            if r["config"] in values and not math.isnan(r["tg_tokens_per_s"]):
                ax.errorbar(r["tg_tokens_per_s"], values[r["config"]], xerr=r["tg_std"], fmt="o", capsize=3)
                ax.annotate(r["config"], (r["tg_tokens_per_s"], values[r["config"]]), textcoords="offset points",
                            xytext=(5, 5), fontsize=8)
        ax.set_xlabel(f"tg{n_gen} decode throughput (tokens/s)")
        ax.set_ylabel(label)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(max(6.4, 1.6 * len(rows) + 3), 4.8))
        names = [r["config"] for r in rows]
        for ax, key, std, lab in ((axes[0], "pp_tokens_per_s", "pp_std", f"pp{n_prompt}"),
                                  (axes[1], "tg_tokens_per_s", "tg_std", f"tg{n_gen}")):
            vals = [0.0 if math.isnan(r[key]) else r[key] for r in rows]
            errs = [0.0 if math.isnan(r[std]) else r[std] for r in rows]
            ax.bar(range(len(rows)), vals, yerr=errs, capsize=3, color="tab:blue")
            ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(f"{lab} tokens/s")
            ax.set_title(lab)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise LaserLMError(f"cannot write plot {path}: {exc}") from exc
    finally:
        plt.close(fig)
