"""Text and plot of a profile (the dict of :func:`laserlm.profiling.run.profile`)."""

from __future__ import annotations


def _f(v, spec=".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v == float("inf"):
        return "never"
    return format(v, spec)


def markdown(doc: dict) -> str:
    """The profile as markdown tables: per layer, then per technique, then measured vs predicted."""
    t, ly, tech = doc["timing"], doc["layers"], doc["techniques"]
    L = doc["num_layers"]
    out = [f"## Per layer ({doc['weights']} weights, {doc['threads']} threads, decode step after {t['context']} tokens)",
           "", "| layer | time ms | raw agree | lens agree | BI | skip attn agree | skip attn dNLL | skip MLP agree | skip MLP dNLL |",
           "|---|---|---|---|---|---|---|---|---|"]
    for i in range(L):
        sa = ly["skip_attention"][i] if ly["skip_attention"] else {}
        sm = ly["skip_mlp"][i] if ly["skip_mlp"] else {}
        out.append(f"| {i} | {ly['time_s'][i] * 1e3:.3f} | {ly['raw_agreement'][i]:.3f} | {ly['lens_agreement'][i]:.3f} | "
                   f"{ly['block_influence'][i]:.4f} | {_f(sa.get('agreement'))} | {_f(sa.get('nll_increase'))} | "
                   f"{_f(sm.get('agreement'))} | {_f(sm.get('nll_increase'))} |")
    out += ["", f"Step: begin {t['begin_s'] * 1e3:.2f} ms + layers {sum(ly['time_s']) * 1e3:.2f} ms + entering a run of "
            f"layers {t.get('call_s', 0.0) * 1e3:.2f} ms + head "
            f"{t['head_s'] * 1e3:.2f} ms = {t['step_s'] * 1e3:.2f} ms ({t['predicted_tokens_per_s']:.1f} tok/s predicted); "
            f"state-gate check {t['state_gate_s'] * 1e6:.0f} us, head check {t['head_check_s'] * 1e3:.2f} ms; "
            f"verify of {t['verify_tokens']} tokens {t['verify_step_s'] * 1e3:.2f} ms.", ""]
    out += ["## Techniques (predicted from the measured costs; quality on held-out calibration positions)", "",
            "| technique | setting | predicted speedup | quality cost |", "|---|---|---|---|"]
    for r in tech["static_pruning"]:
        out.append(f"| static pruning | drop {len(r['drop'])} ({'/'.join(map(str, r['drop']))}) | {r['speedup']:.3f}x | "
                   f"agreement {r['agreement']:.3f}, ppl x{r['ppl_ratio']:.2f} |")
    for r in tech["adaptive_confidence"]:
        s = r["simulation"]
        if s is None:
            out.append(f"| adaptive (lens confidence) | agreement >= {r['target']} | - | no threshold reaches it |")
            continue
        out.append(f"| adaptive (lens confidence, exact states) | agreement >= {r['target']}: threshold {s['threshold']}, "
                   f"{s['layers_per_token']:.2f} layers/token | {r['speedup_state_gate']:.3f}x state gate, "
                   f"{r['speedup_head_check']:.3f}x head checks | agreement {s['agreement']:.3f} (optimistic: no bridge) |")
    sp = tech["speculative"]
    out.append(f"| self-speculative | draft {sp['draft_layers']} layers, k={sp['k']} | {sp['speedup_raw']:.3f}x raw head "
               f"(acceptance {sp['acceptance_raw']:.2f}), {sp['speedup_lens']:.3f}x lens ({sp['acceptance_lens']:.2f}); "
               f"{sp['speedup_if_all_accepted']:.3f}x at acceptance 1 | lossless |")
    for part, r in tech["skip"].items():
        out.append(f"| skip {part} (best layer) | layer {r['layer']} | {r['speedup']:.3f}x | agreement "
                   f"{r['agreement']:.3f}, dNLL {r['nll_increase']:.3f} |")
    out += ["", "Break-even: exit gates (propagate bridge, checks at every exit point from min depth "
            f"{tech['min_depth']}); a rate above 1 cannot pay.", "",
            "| exit after layer | saving ms/exiting token | break-even rate, state gate | break-even rate, head check |",
            "|---|---|---|---|"]
    for r in tech["exit_break_even"]:
        out.append(f"| {r['exit_layer']} | {r['saving_s'] * 1e3:.2f} | {_f(r['rate_state_gate'])} | {_f(r['rate_head_check'])} |")
    out += ["", f"Self-speculative break-even acceptance (draft {sp['draft_layers']}, k={sp['k']}): "
            f"{_f(sp['break_even_acceptance'])}.", ""]
    if doc["sparse"]:
        out += ["## Block-sparse attention (threshold rule, defaults)", "",
                "| context | density | prefill speedup predicted (FLOPs) | measured | top-1 agree (last 256) |",
                "|---|---|---|---|---|"]
        for r in doc["sparse"]:
            out.append(f"| {r['context']} | {r['density']:.3f} | {r['predicted_prefill_speedup']:.3f}x | "
                       f"{r['measured_prefill_speedup']:.3f}x | {r['top1_agree']:.3f} |")
        out.append("")
    if doc["measured"]:
        rounds = doc["measured"][0].get("rounds", 1)
        out += ["## Measured decode vs predicted", "", f"Medians of {rounds} interleaved rounds (time the parts, decode "
                "64 tokens full and 64 pruned, alternating order); error = predicted / measured step time - 1.", "",
                "| config | predicted tok/s | measured tok/s | error |",
                "|---|---|---|---|"]
        for m in doc["measured"]:
            out.append(f"| {m['spec']} | {m['predicted_tokens_per_s']:.1f} | {m['tokens_per_s']:.1f} | "
                       f"{m['prediction_error'] * 100:+.1f}% |")
        if len(doc["measured"]) > 1 and "measured_speedup" in doc["measured"][1]:
            m = doc["measured"][1]
            out.append(f"\nStatic pruning speedup: predicted {m['predicted_speedup']:.3f}x, measured {m['measured_speedup']:.3f}x.")
    return "\n".join(out)


def plot(doc: dict, path: str, title: str) -> None:
    """Four panels: per-layer time, agreement + Block Influence, skip sensitivity, sparse density."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ly = doc["layers"]
    L = doc["num_layers"]
    xs = list(range(L))
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    ax[0][0].bar(xs, [t * 1e3 for t in ly["time_s"]])
    ax[0][0].set(xlabel="decoder layer", ylabel="ms per decode step", title="per-layer time")
    ax[0][1].plot(xs, ly["raw_agreement"], label="raw exit head")
    ax[0][1].plot(xs, ly["lens_agreement"], label="quick lens")
    ax[0][1].set(xlabel="exit after layer", ylabel="top-1 agreement with full", title="agreement, Block Influence")
    bi = ax[0][1].twinx()
    bi.plot(xs, ly["block_influence"], color="gray", linestyle=":", label="BI")
    bi.set_ylabel("Block Influence")
    ax[0][1].legend(loc="upper left")
    if ly["skip_attention"]:
        ax[1][0].plot(xs, [r["nll_increase"] for r in ly["skip_attention"]], marker="o", label="skip attention")
        ax[1][0].plot(xs, [r["nll_increase"] for r in ly["skip_mlp"]], marker="s", label="skip MLP")
        ax[1][0].set_yscale("symlog", linthresh=0.01)
        ax[1][0].legend()
    ax[1][0].set(xlabel="decoder layer", ylabel="mean NLL increase (nats)", title="skip sensitivity")
    if doc["sparse"]:
        ctx = [r["context"] for r in doc["sparse"]]
        ax[1][1].plot(ctx, [r["density"] for r in doc["sparse"]], marker="o")
        ax[1][1].set_xscale("log", base=2)
    ax[1][1].set(xlabel="context tokens", ylabel="density", title="block-sparse attention density")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
