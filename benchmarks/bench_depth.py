"""Adaptive depth on a real model: quality vs average layers per token for each exit policy and bridge,
against static pruning (ShortGPT Block Influence) and naive early exit, plus decode tokens/s vs full depth.

Quality (WikiText-2 test slice, chunks scored independently through each mode's ``score``):
- top-1 agreement: argmax of the mode's logits == argmax of the full model's, per position;
- perplexity of the next token.
Depth: ``exit`` = mean decoder layers before the token's prediction; ``cost`` = layer-equivalents actually
spent per token: exit layers + exit-head evaluations x (LM-head params / layer params) + the bridge's work
(propagate: K/V projections of the skipped layers; deferred: the skipped layers themselves, run later).

Usage:
    python benchmarks/bench_depth.py --model smollm2-135m --tokens 512 --decode-tokens 128
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

import laserlm
from laserlm.mode_table import make_mode

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def chunks_of(lm, path: Path, n_tokens: int, chunk: int) -> list[torch.Tensor]:
    text = path.read_text(encoding="utf-8")[: n_tokens * 8]
    ids = torch.tensor(lm.tokenizer(text)["input_ids"][:n_tokens])
    return [ids[i:i + chunk] for i in range(0, ids.shape[0] - chunk + 1, chunk)]


def layer_costs(engine) -> tuple[float, float]:
    """(LM head, propagate K/V of one skipped layer) in units of one decoder layer's parameters."""
    layer = engine.adapter.layers[0]
    per_layer = sum(p.numel() for p in layer.parameters())
    head = engine.adapter.lm_head.weight.numel()
    attn = layer.self_attn
    kv = attn.k_proj.weight.numel() + attn.v_proj.weight.numel()
    return head / per_layer, kv / per_layer


def evaluate(lm, spec: str, chunks, ref_logits, head_cost: float, kv_cost: float) -> dict:
    eng = lm.engine
    L = eng.num_layers
    mode = make_mode(spec, eng)
    agree = nll = n = 0
    exits, costs = [], []
    t0 = time.perf_counter()
    for ids, ref in zip(chunks, ref_logits):
        out = mode.score(eng, ids)
        lg = out.logits[:-1]
        tgt = ids[1:]
        agree += int((lg.argmax(-1) == ref[:-1].argmax(-1)).sum())
        nll += float(torch.nn.functional.cross_entropy(lg, tgt, reduction="sum"))
        n += tgt.shape[0]
        exits += out.layers[1:].tolist()
        infos = out.infos
        if infos:  # adaptive: exit layers + head evaluations + bridge work
            bridge = getattr(mode, "bridge", None)
            for info in infos:
                e = info["exit_layer"]
                c = e + info.get("head_evals", 0) * head_cost
                if bridge is not None and bridge.name == "propagate":
                    c += (L - e) * kv_cost
                elif bridge is not None and bridge.name == "deferred":
                    c += L - e
                costs.append(c)
        else:
            costs += out.layers[1:].tolist()
    return {"spec": spec, "exit_layers": sum(exits) / len(exits), "cost_layers": sum(costs) / len(costs),
            "agreement": agree / n, "ppl": math.exp(nll / n), "tokens": n, "seconds": time.perf_counter() - t0}


def speed(lm, specs: list[str], prompt: str, n_new: int, reps: int) -> dict:
    """Decode tokens/s per mode, interleaved A, B, C, A, B, C ... (median over reps)."""
    res = {s: [] for s in specs}
    lm.generate(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up
    for _ in tqdm(range(reps), desc="speed"):
        for s in specs:
            r = lm.generate(prompt, mode=s, max_new_tokens=n_new, ignore_eos=True)
            res[s].append((r.decode_tokens_per_s, r.mean_layers_per_token))
    out = {}
    for s, v in res.items():
        tps = sorted(x[0] for x in v)
        out[s] = {"tokens_per_s": tps[len(tps) // 2], "all": [round(x[0], 2) for x in v],
                  "mean_exit_layers": v[0][1]}
    return out


def family(spec: str) -> str:
    """Series name of a spec for the plot and tables."""
    if spec.startswith("early-exit"):
        return "naive early exit"
    if spec.startswith("static"):
        return "static pruning (ShortGPT BI)"
    if spec == "full":
        return "full"
    opts = dict(p.split("=", 1) for p in spec.split(":", 1)[1].split(","))
    name = opts.get("policy", "confidence")
    if opts.get("measure"):
        name += f"({opts['measure']})"
    if "compensation" in opts:
        name += f"+compensation {opts['compensation']}"
    if opts.get("patience") == "0":
        name += ", no patience"
    return f"adaptive {name} [{opts.get('bridge', 'propagate')}]"


def report(path: str, png: str | None) -> str:
    """Markdown tables (and a PNG plot) from a results JSON."""
    data = json.loads(Path(path).read_text())
    rows = data["quality"]
    lines = []
    for which, title in (("main", "batched / replayed (deferred bridge exact by replay)"),
                         ("decode", "token-by-token decode (propagate / none bridges)")):
        sel = [r for r in rows if r["set"] == which]
        if not sel:
            continue
        lines += [f"\n#### {title}: {sel[0]['tokens']} predicted tokens\n",
                  "| mode | exit layers | cost (layer-eq.) | top-1 agreement | perplexity |", "|---|---|---|---|---|"]
        for r in sel:
            lines.append(f"| `{r['spec']}` | {r['exit_layers']:.1f} | {r['cost_layers']:.1f} | {r['agreement']:.3f} | "
                         f"{r['ppl']:.1f} |")
    for key in ("speed", "speed_extra"):
        if key not in data:
            continue
        sp = data[key]
        base = sp["full"]["tokens_per_s"]
        lines += [f"\n#### decode speed{' (second run)' if key == 'speed_extra' else ''} (interleaved, median of reps)\n",
                  "| mode | tokens/s | vs full | mean exit layers | all runs |", "|---|---|---|---|---|"]
        for k, v in sp.items():
            lines.append(f"| `{k}` | {v['tokens_per_s']:.2f} | {v['tokens_per_s'] / base:.2f}x | "
                         f"{v['mean_exit_layers']:.1f} | {v['all']} |")
    if png:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        series: dict = {}
        for r in rows:
            if r["set"] != "main" and "propagate" not in r["spec"] and "none" not in r["spec"]:
                continue
            series.setdefault(family(r["spec"]) + (" (decode set)" if r["set"] == "decode" else ""), []).append(r)
        for name, pts in series.items():
            pts = sorted(pts, key=lambda r: r["exit_layers"])
            xs = [r["exit_layers"] for r in pts]
            style = "-o" if name.startswith(("static", "naive")) else "--^" if "decode" in name else ":s"
            axes[0].plot(xs, [r["agreement"] for r in pts], style, label=name, markersize=4)
            axes[1].plot(xs, [r["ppl"] for r in pts], style, label=name, markersize=4)
        axes[0].set_ylabel("greedy top-1 agreement with the full model")
        axes[1].set_ylabel("perplexity (WikiText-2 test slice)")
        axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xlabel("mean layers before the prediction (exit layer)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6)
        meta = data.get("meta", {})
        fig.suptitle(f"{meta.get('model', '')}: adaptive depth (untrained exit heads) vs static baselines")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=512, help="WikiText-2 test tokens for replayed/batched modes")
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens for token-by-token (decode) modes")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode-chunk", type=int, default=128)
    ap.add_argument("--calib-tokens", type=int, default=512, help="WikiText-2 valid tokens for Block Influence")
    ap.add_argument("--speed-tokens", type=int, default=24)
    ap.add_argument("--speed-reps", type=int, default=2)
    ap.add_argument("--skip-decode", action="store_true", help="skip the slow propagate/none sweeps")
    ap.add_argument("--out", default="benchmarks/out/depth.json")
    ap.add_argument("--speed-specs", nargs="+", help="only a speed run of full + these specs (stored as speed_extra)")
    ap.add_argument("--specs", nargs="+", help="only these replay/batched specs (appended to --out), no speed run")
    ap.add_argument("--report", metavar="JSON", help="only print tables (and --plot) from a results JSON")
    ap.add_argument("--plot", default=None, help="PNG path for the quality-vs-layers plot")
    args = ap.parse_args()
    if args.report:
        print(report(args.report, args.plot))
        return
    torch.set_num_threads(2)
    lm = laserlm.load(args.model)
    eng = lm.engine
    L = eng.num_layers
    head_cost, kv_cost = layer_costs(eng)
    eng._depth_replay_memo = {}  # replayed policies share the full-depth hidden states of each chunk
    chunks = chunks_of(lm, DATA / "test.txt", args.tokens, args.chunk)
    dchunks = [c[i:i + args.decode_chunk] for c in chunks for i in range(0, c.shape[0], args.decode_chunk)]
    dchunks = [c for c in dchunks if c.shape[0] == args.decode_chunk][: max(1, args.decode_tokens // args.decode_chunk)]
    full = make_mode("full", eng)
    ref = [full.score(eng, c).logits for c in chunks]
    q = [i * L // 6 for i in range(2, 6)]  # 10, 15, 20, 25 for 30 layers
    specs = ["full"]
    specs += [f"early-exit:layer={k}" for k in q]
    specs += [f"static:layers={k},calib_tokens={args.calib_tokens}" for k in (L - 2, L - 4, L - 8, L - 12)]
    for th in (0.95, 0.9, 0.8, 0.6):
        specs.append(f"adaptive:policy=confidence,threshold={th},bridge=deferred")
    for th in (0.9, 0.7, 0.5):
        specs.append(f"adaptive:policy=confidence,measure=margin,threshold={th},bridge=deferred")
    for th in (0.9, 0.7):
        specs.append(f"adaptive:policy=confidence+ats,threshold={th},ats_threshold=0.7,bridge=deferred")
    for th in (0.99, 0.98, 0.95):
        specs.append(f"adaptive:policy=saturation,threshold={th},bridge=deferred")
    for th in (0.9, 0.7):
        specs.append(f"adaptive:policy=confidence,threshold={th},compensation=0.3,bridge=deferred")
        specs.append(f"adaptive:policy=confidence,threshold={th},patience=0,bridge=deferred")
    if args.speed_specs:
        old = json.loads(Path(args.out).read_text())
        old["speed_extra"] = speed(lm, ["full"] + args.speed_specs, "The history of the city begins in the Roman "
                                   "period, when", args.speed_tokens, args.speed_reps)
        Path(args.out).write_text(json.dumps(old, indent=1))
        print(json.dumps(old["speed_extra"], indent=1))
        return
    if args.specs:
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"quality": []}
        for s in tqdm(args.specs, desc="extra specs"):
            old["quality"].append({**evaluate(lm, s, chunks, ref, head_cost, kv_cost), "set": "main"})
            Path(args.out).write_text(json.dumps(old, indent=1))
        return
    dspecs = [] if args.skip_decode else [f"adaptive:policy=confidence,threshold={th},bridge={b}"
                                          for b in ("propagate", "none") for th in (0.95, 0.8, 0.6)]
    rows = []
    for s in tqdm(specs, desc="quality (batched/replay)"):
        rows.append({**evaluate(lm, s, chunks, ref, head_cost, kv_cost), "set": "main"})
        Path(args.out).write_text(json.dumps({"quality": rows}, indent=1))
    ref_d = [full.score(eng, c).logits for c in dchunks]
    dspecs = ["full", "early-exit:layer=20", f"static:layers={L - 8},calib_tokens={args.calib_tokens}",
              "adaptive:policy=confidence,threshold=0.8,bridge=deferred"] + dspecs
    for s in tqdm(dspecs, desc="quality (decode)"):
        spec = s
        rows.append({**evaluate(lm, spec, dchunks, ref_d, head_cost, kv_cost), "set": "decode"})
        Path(args.out).write_text(json.dumps({"quality": rows}, indent=1))
    sp = speed(lm, ["full", "adaptive:policy=confidence,threshold=0.8,bridge=propagate",
                    "adaptive:policy=confidence,threshold=0.8,bridge=deferred",
                    "adaptive:policy=confidence,threshold=0.8,bridge=none",
                    f"static:layers={L - 8},calib_tokens={args.calib_tokens}", "early-exit:layer=20"],
               "The history of the city begins in the Roman period, when", args.speed_tokens, args.speed_reps)
    meta = {"model": args.model, "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.processor() or platform.machine()}, torch threads 2",
            "tokens": sum(c.shape[0] for c in chunks), "decode_tokens": sum(c.shape[0] for c in dchunks),
            "chunk": args.chunk, "head_cost_layers": head_cost, "kv_cost_layers": kv_cost}
    Path(args.out).write_text(json.dumps({"meta": meta, "quality": rows, "speed": sp}, indent=1))
    print(json.dumps({"meta": meta, "speed": sp}, indent=1))
    for r in rows:
        print(f"{r['set']:6} {r['spec']:75} exit {r['exit_layers']:5.1f} cost {r['cost_layers']:5.1f} "
              f"agree {r['agreement']:.3f} ppl {r['ppl']:8.2f} ({r['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
