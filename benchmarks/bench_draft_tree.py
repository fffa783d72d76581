"""Chain against tree drafts for a draft head (issue 39), measured offline: acceptance from the head itself, cost from
timed calls of the head and of the target's T-row step.

laserlm's ``draft=head`` drafts a chain. EAGLE-2 drafts a tree (a beam of the ``width`` most probable paths, each
frontier node expanded by its ``branch`` most probable tokens) and verifies every node in one step with a tree mask.
Before building the tree verify, this script answers whether a tree would pay on this CPU:

1. For each chat prompt of ``bench_ngram.py``, the full model's greedy answer (``--tokens`` tokens) and its
   last-layer features are computed once, teacher-forced.
2. At every answer position the head drafts exactly as in decoding (its K/V hold the true pairs so far; deeper levels
   read the head's own predicted features), as a chain (width 1, branch 1) and as trees; *accepted* is the longest
   prefix of the true continuation present as a path of the tree (the greedy verify's rule).
3. Cost, in plain decode steps: drafting is timed here (one call per level over the frontier's rows, with the logits
   and top-k), plus the pending pairs' call; the verify is a timed target forward of ``nodes + 1`` rows (the tree mask
   changes no arithmetic, so a plain T-row step prices it).
4. Predicted speed = (mean accepted + 1) / (draft + verify) in plain steps. For the chain the same figure can be
   checked against ``bench_ngram.py``'s measured decode speed.

What it does not include: the tree mask in the target's kernels (not built), and a per-step stop on the draft's
confidence (depths are fixed; the best depth per shape is reported).

Usage::

    PYTHONPATH=. python benchmarks/bench_draft_tree.py --threads 1 --out benchmarks/out/draft_head/tree_sim.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x1,2x2,4x2"`` -> ``[(width, branch), ...]``."""
    out = []
    for part in text.split(","):
        w, b = part.lower().split("x")
        out.append((int(w), int(b)))
    return out


def sequences(lm, prompts: list[str], tokens: int) -> list[tuple[torch.Tensor, int]]:
    """The full model's greedy answers: ``[(ids [P + tokens], P), ...]``."""
    from laserlm.runtime.generate import encode_prompt  # noqa: PLC0415

    out = []
    for p in prompts:
        ids = encode_prompt(lm.tokenizer, [{"role": "user", "content": p}], True, lm.engine.config.max_position_embeddings)
        ans = lm.generate([{"role": "user", "content": p}], chat=True, mode="full", max_new_tokens=tokens,
                          ignore_eos=True)
        full = torch.cat([ids, torch.tensor(ans.token_ids[:tokens])])
        out.append((full, ids.numel()))
    return out


@torch.inference_mode()
def features(eng, ids: torch.Tensor) -> torch.Tensor:
    """Last-layer features ``[N, d]`` float32 of ``ids [N]`` (teacher-forced, before the final norm)."""
    cache = eng.new_cache(max_len=ids.numel() + 1)
    h, st = eng.begin(ids[None], cache=cache)
    return eng.run_layers(0, eng.num_layers, h, st).float()[0]


@torch.inference_mode()
def draft_tree(dm, base_k, base_v, f0, tok0: int, pos0: int, width: int, branch: int, depth: int):
    """One draft from the true state: the draft's K/V of positions ``< pos0`` (``[1, kv, pos0, hd]``), the head's
    predicted feature ``f0 [d]`` after the last true pair and the tokens it predicts. Returns the tree's levels: a list
    of ``depth`` lists of paths (tuples of token ids), and the seconds spent in the levels after the first."""
    lg = dm.logits(f0)
    lp = torch.log_softmax(lg, -1)
    top = lp.topk(min(max(width, branch), lp.numel()))
    # frontier: (path, cum logp); level 1 keeps the `width` best tokens (a chain: 1)
    frontier = [((int(dm.vocab_ids[int(i)]),), float(v)) for v, i in zip(top.values[:width], top.indices[:width])]
    levels = [[p for p, _ in frontier]]
    feats = f0.expand(len(frontier), -1)[:, None]  # [B, 1, d]: the feature each frontier node's token follows
    k_past, v_past = base_k.expand(len(frontier), -1, -1, -1), base_v.expand(len(frontier), -1, -1, -1)
    spent = 0.0
    for lvl in range(1, depth):
        t0 = time.perf_counter()
        toks = torch.tensor([[p[-1]] for p, _ in frontier])
        out, (k, v) = dm.infer(feats, dm.embed(toks), torch.tensor([pos0 + lvl - 1]), (k_past, v_past))
        lp = torch.log_softmax(dm.logits(out[:, 0]), -1)  # [B, k]
        tv, ti = lp.topk(branch, -1)
        cand = [(b, float(frontier[b][1] + tv[b, j]), int(dm.vocab_ids[int(ti[b, j])]))
                for b in range(len(frontier)) for j in range(branch)]
        cand.sort(key=lambda c: -c[1])
        keep = cand[:width]
        spent += time.perf_counter() - t0
        rows = torch.tensor([c[0] for c in keep])
        frontier = [(frontier[b][0] + (tok,), s) for b, s, tok in keep]
        feats = out[rows]
        k_past = torch.cat([k_past[rows], k[rows]], 2)
        v_past = torch.cat([v_past[rows], v[rows]], 2)
        levels.append([p for p, _ in frontier])
    return levels, spent


def accepted(levels, truth: list[int]) -> int:
    n = 0
    for lvl, paths in enumerate(levels):
        if lvl >= len(truth) or tuple(truth[:lvl + 1]) not in set(paths):
            break
        n = lvl + 1
    return n


@torch.inference_mode()
def step_costs(eng, widths: list[int], context: int, reps: int) -> dict[int, float]:
    """Median seconds of a target forward of T rows after ``context`` cached positions, per T in ``widths``."""
    eng.reset()
    eng.forward(torch.randint(0, 1000, (1, context)))
    samples = {t: [] for t in widths}
    toks = {t: torch.randint(0, 1000, (1, t)) for t in widths}
    for rep in range(reps + 2):
        for t in widths:
            eng.truncate(context)
            t0 = time.perf_counter()
            eng.forward(toks[t], logits="all")
            if rep >= 2:
                samples[t].append(time.perf_counter() - t0)
    eng.reset()
    return {t: statistics.median(v) for t, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--head", default=None, help="draft head file (default: the shipped one)")
    ap.add_argument("--classes", nargs="+", default=["chat", "chat_heldout"])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per class")
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens per prompt")
    ap.add_argument("--shapes", default="1x1,2x2,4x2,4x4,8x4", help="tree shapes WIDTHxBRANCH (1x1 = the chain)")
    ap.add_argument("--depths", default="1,2,3,4,5,6")
    ap.add_argument("--reps", type=int, default=20, help="repeats of each timed target step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import bench_ngram  # noqa: PLC0415

    import laserlm  # noqa: PLC0415
    from laserlm.speculative.draft_head import load_draft_head, shipped_head_path  # noqa: PLC0415

    lm = laserlm.load(args.model, weights=args.weights)
    eng = lm.engine
    head_path = args.head or shipped_head_path(eng)
    dm, _ = load_draft_head(head_path, eng)
    shapes, depths = parse_shapes(args.shapes), [int(d) for d in args.depths.split(",")]
    dmax = max(depths)
    prompts = bench_ngram.build_prompts(args.prompts)
    seqs = sequences(lm, [p for c in args.classes for p in prompts[c]], args.tokens)

    # per shape: accepted length at every depth, per position; drafting seconds per depth
    acc = {s: {d: [] for d in depths} for s in shapes}
    spent = {s: {d: [] for d in depths} for s in shapes}
    pend = []
    for ids, plen in seqs:
        f = features(eng, ids)  # [N, d]
        with torch.inference_mode():
            n = ids.numel()
            # the head over every true pair (feature i, token i+1): outputs predict features i+1
            out, (k, v) = dm.infer(f[None, :-1], dm.embed(ids[None, 1:]), torch.arange(n - 1))
            t0 = time.perf_counter()
            dm.infer(f[None, :2], dm.embed(ids[None, 1:3]), torch.arange(plen, plen + 2),
                     (k[:, :, :plen], v[:, :, :plen]))  # a cycle's pending pairs: two rows
            pend.append(time.perf_counter() - t0)
        # drafting after the last emitted token x[j+1] with true pairs i <= j: positions j = plen-1 .. n-3
        for j in range(plen - 1, n - 2):
            truth = ids[j + 2:j + 2 + dmax].tolist()
            for s in shapes:
                with torch.inference_mode():
                    levels, _ = draft_tree(dm, k[:, :, :j + 1], v[:, :, :j + 1], out[0, j], int(ids[j + 1]), j + 1,
                                           s[0], s[1], dmax)
                a = accepted(levels, truth)
                for d in depths:
                    acc[s][d].append(min(a, d))
    # timing of the levels, on a few positions of the first sequence (alone, not beside the acceptance loop's bookkeeping)
    ids, plen = seqs[0]
    f = features(eng, ids)
    with torch.inference_mode():
        out, (k, v) = dm.infer(f[None, :-1], dm.embed(ids[None, 1:]), torch.arange(ids.numel() - 1))
    for s in shapes:
        for d in depths:
            for j in range(plen - 1, plen + 15):
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    draft_tree(dm, k[:, :, :j + 1], v[:, :, :j + 1], out[0, j], int(ids[j + 1]), j + 1, s[0], s[1], d)
                    spent[s][d].append(time.perf_counter() - t0)
    nodes = {(s, d): s[0] * d for s in shapes for d in depths}
    widths = sorted({1} | {n + 1 for n in nodes.values()})
    steps = step_costs(eng, widths, context=160, reps=args.reps)
    plain = steps[1]
    pending = statistics.median(pend)
    rows = []
    for s in shapes:
        for d in depths:
            a = statistics.fmean(acc[s][d])
            draft = (pending + statistics.median(spent[s][d])) / plain
            verify = steps[nodes[(s, d)] + 1] / plain
            rows.append({"width": s[0], "branch": s[1], "depth": d, "nodes": nodes[(s, d)],
                         "accepted": round(a, 4), "tokens_per_verify": round(a + 1, 4),
                         "draft_steps": round(draft, 4), "verify_steps": round(verify, 4),
                         "predicted_speed": round((a + 1) / (draft + verify), 4)})
    res = {"model": args.model, "weights": args.weights, "head": str(head_path), "threads": args.threads,
           "classes": args.classes, "prompts": len(seqs), "positions": len(acc[shapes[0]][depths[0]]),
           "plain_step_ms": round(plain * 1e3, 3), "pending_ms": round(pending * 1e3, 3),
           "step_costs": {t: round(v / plain, 4) for t, v in steps.items()}, "rows": rows,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print("| shape (width x branch) | depth | nodes | accepted | draft (steps) | verify (steps) | predicted speed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['width']}x{r['branch']} | {r['depth']} | {r['nodes']} | {r['accepted']:.3f} | "
              f"{r['draft_steps']:.3f} | {r['verify_steps']:.3f} | {r['predicted_speed']:.3f}x |")
    best = {}
    for r in rows:
        key = f"{r['width']}x{r['branch']}"
        if key not in best or r["predicted_speed"] > best[key]["predicted_speed"]:
            best[key] = r
    res["best_per_shape"] = best
    print("best depth per shape:", {k: (v["depth"], v["predicted_speed"]) for k, v in best.items()})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
