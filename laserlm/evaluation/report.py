"""Markdown tables of evaluation results: one table per task, one row per configuration, the
full-depth reference first; every non-reference number shows its change from the reference."""

from __future__ import annotations

import math

# task -> (metric, label, format, better) ; better: +1 higher is better, -1 lower is better, 0 neutral
COLUMNS = {
    "wikitext": [("perplexity", "PPL", ".3f", -1), ("top1_agreement", "top-1 agree", ".4f", +1),
                 ("mean_layers", "layers/tok", ".2f", 0), ("tokens_scored", "tokens", "d", 0)],
    "lambada": [("acc", "acc", ".4f", +1), ("perplexity", "target PPL", ".3f", -1),
                ("prediction_agreement", "pred agree", ".4f", +1), ("mean_layers", "layers/tok", ".2f", 0),
                ("n", "n", "d", 0)],
    "agreement": [("top1_agreement", "top-1 agree", ".4f", +1), ("gen_exact_match", "gen exact", ".3f", +1),
                  ("gen_mean_lcp_tokens", "gen LCP tok", ".1f", +1), ("gen_mean_lcp_fraction", "LCP frac", ".3f", +1),
                  ("prompts", "prompts", "d", 0)],
    "longtext": [("agreement", "top-1 agree", ".4f", +1), ("consistency", "agree past 2048", ".4f", +1),
                 ("agreement_decay_per_1k", "agree decay/1k", ".4f", -1), ("nll_gap", "NLL gap", ".4f", -1),
                 ("nll_gap_growth_per_1k", "gap growth/1k", ".4f", -1), ("perplexity", "PPL", ".3f", -1),
                 ("mean_layers", "layers/tok", ".2f", 0)],
}
CHOICE_COLUMNS = [("acc", "acc", ".4f", +1), ("acc_norm", "acc_norm", ".4f", +1),
                  ("choice_agreement", "answer agree", ".4f", +1), ("mean_layers", "layers/tok", ".2f", 0),
                  ("n", "n", "d", 0)]
GLUE_COLUMNS = [("acc", "acc", ".4f", +1), ("choice_agreement", "answer agree", ".4f", +1),
                ("mean_layers", "layers/tok", ".2f", 0), ("n", "n", "d", 0)]
COLUMNS.update({"sst2": GLUE_COLUMNS, "rte": GLUE_COLUMNS, "qnli": GLUE_COLUMNS,
                "mrpc": GLUE_COLUMNS[:1] + [("f1", "F1", ".4f", +1)] + GLUE_COLUMNS[1:]})


def _fmt(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, fmt)


def _setting_line(task: str, ref: dict) -> str:
    if task == "wikitext":
        return (f"WikiText-2 test (tokenized file as is), {ref['method']} windows of {ref['window']} tokens"
                + (f", stride {ref['stride']}" if ref["method"] == "sliding" else "")
                + (", each window prefixed with BOS" if ref.get("bos_prefix") else "")
                + f"; {ref['windows']} windows, {ref['tokens_scored']}"
                + (f" of {ref['text_tokens']}" if ref.get("text_tokens") is not None else "") + " tokens scored"
                + (f"; unscored: {ref['unscored']}" if ref.get("unscored") else ""))
    if task == "agreement":
        return (f"top-1 agreement on {ref['positions']} WikiText-2 test positions (windows of {ref['window']}); "
                f"greedy generations of {ref['gen_tokens']} tokens on {ref['prompts']} prompts"
                + (" (chat template)" if ref.get("chat") else ""))
    if task == "longtext":
        return (f"one document of {ref['tokens']} tokens (the Gutenberg novel, one sequence); agreement and NLL gap "
                f"vs full depth by position, decay = least-squares slope per 1000 positions; consistency = agreement "
                f"over positions >= {ref['long_from']}")
    n, of = ref.get("n"), ref.get("of")
    return f"{n} of {of} items" + (" (seeded random subset)" if n != of else " (full set)")


def markdown(results: dict, reference: str = "full") -> str:
    """``{task: {config: metrics}}`` -> markdown, one table per task."""
    out = []
    for task, per_cfg in results.items():
        cols = COLUMNS.get(task, CHOICE_COLUMNS)
        ref = per_cfg.get(reference, next(iter(per_cfg.values())))
        out.append(f"### {task}\n\n{_setting_line(task, ref)}\n")
        out.append("| config | " + " | ".join(c[1] for c in cols) + " |")
        out.append("|---|" + "---:|" * len(cols))
        for name, m in per_cfg.items():
            cells = []
            for key, _label, fmt, better in cols:
                v = m.get(key)
                cell = _fmt(v, fmt)
                if key in ("acc", "acc_norm") and m.get(f"{key}_stderr") is not None:
                    cell += f" ± {_fmt(m[f'{key}_stderr'], '.4f')}"
                if name != reference and better and isinstance(v, (int, float)) and isinstance(ref.get(key), (int, float)):
                    if key == "perplexity":
                        cell += f" ({v / ref[key] - 1:+.1%})" if ref[key] else ""
                    else:
                        cell += f" ({v - ref[key]:+.4f})"
                cells.append(cell)
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
