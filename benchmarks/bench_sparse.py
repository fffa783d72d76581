"""Block-sparse attention vs dense SDPA: prefill / attention / decode time, density, quality, passkey.

One run per context size (``--tokens``), dense and each sparse setting interleaved (dense, A, B, dense,
A, B, ...), on a WikiText-2 *test* window of that many tokens:

- prefill: wall-clock of embed + all decoder layers (LM head excluded; it is the same for both) and the
  summed attention-kernel time (selection + attention) over layers, median over ``--reps``;
- quality: perplexity of the window (logits of every position), relative error and mean cosine of the
  logits vs dense, top-1 agreement;
- decode: ``--decode-steps`` greedy steps after the prefill, seconds per step (dense vs sparse kernel);
- passkey: ``--passkeys`` prompts (PASSKEY_SPEC format, essay filler) answered by dense and by sparse.

``--block-sweep`` instead times the prefill kernel alone for several block sizes at one random block
selection of about the same density, alternating with dense SDPA (bool causal mask, as the engine calls
it), on smollm2's attention shape (9 query heads, 3 KV heads, head dim 64) at 4096 tokens.

Example::

    python benchmarks/bench_sparse.py --tokens 1024 2048 4096 8150 --sparse "sparse" "sparse:threshold=1.0"
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import laserlm
from laserlm.attention.passkey import first_integer, passkey_cases, passkey_prompt

WIKI = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


def timed_prefill(lm, ids, logits):
    """(seconds for embed + layers, kernel attention seconds, logits [T, V] or last)."""
    eng = lm.engine
    eng.reset()
    k = eng.kernel
    if k is not None:
        k.reset_stats()
    with torch.inference_mode():
        t0 = time.perf_counter()
        h, st = eng.begin(ids[None])
        h = eng.run_layers(0, eng.num_layers, h, st)
        eng.commit(st)
        sec = time.perf_counter() - t0
        out = eng.head(h if logits == "all" else h[:, -1:])[0]
    summ = k.summary() if k is not None else {}
    return sec, summ.get("select_s", 0.0) + summ.get("attn_s", 0.0), summ.get("density", 1.0), out


def decode_steps(lm, first_token, n):
    eng, toks, t0 = lm.engine, [], time.perf_counter()
    tok = first_token
    with torch.inference_mode():
        for _ in range(n):
            tok = eng.decode_step(tok.view(1)).logits[0, -1].argmax()
            toks.append(int(tok))
    return (time.perf_counter() - t0) / n, toks


def set_att(lm, spec):
    """dense is timed through the same kernel wrapper (threshold=inf routes every layer to SDPA)."""
    if spec == "dense":
        return lm.set_attention("sparse", threshold=float("inf"), dense_layers=0)
    return lm.set_attention(spec)


def run_size(lm, n, specs, reps, decode_n, passkeys, wiki_ids):
    ids = wiki_ids[:n]
    row = {"tokens": n, "configs": {}}
    names = ["dense"] + specs
    res = {s: {"prefill_s": [], "attn_s": [], "density": None, "decode_s": []} for s in names}
    logits = {}
    for r in range(reps):
        for s in names:
            set_att(lm, s)
            sec, att, dens, out = timed_prefill(lm, ids, "all" if r == 0 else "last")
            res[s]["prefill_s"].append(sec)
            res[s]["attn_s"].append(att)
            res[s]["density"] = dens
            if r == 0:
                logits[s] = out
                lm.engine.kernel.reset_stats()
                step_s, toks = decode_steps(lm, out[-1].argmax(), decode_n)
                res[s]["decode_s"].append(step_s)
                res[s]["decode_density"] = lm.engine.kernel.summary()["density"]
                res[s]["decode_tokens"] = toks
    ref = logits["dense"]
    tgt = ids[1:]
    for s in names:
        lg = logits[s]
        nll = F.cross_entropy(lg[:-1], tgt)
        c = {"prefill_s": statistics.median(res[s]["prefill_s"]), "attn_s": statistics.median(res[s]["attn_s"]),
             "density": res[s]["density"], "decode_s": res[s]["decode_s"][0],
             "decode_density": res[s]["decode_density"], "ppl": math.exp(nll.item()),
             "logit_rel_err": ((lg - ref).norm() / ref.norm()).item(),
             "logit_cos": F.cosine_similarity(lg, ref, dim=-1).mean().item(),
             "top1_agree": (lg.argmax(-1) == ref.argmax(-1)).float().mean().item(),
             "decode_agree": sum(a == b for a, b in zip(res[s]["decode_tokens"], res["dense"]["decode_tokens"]))
             / max(1, decode_n)}
        row["configs"][s] = c
    # passkey
    cases = passkey_cases(passkeys, seed=n)
    for s in names:
        correct = []
        for key, depth in cases:
            set_att(lm, s)
            prompt = passkey_prompt(lm.tokenizer, n, key, depth, filler="essays")
            ans = first_integer(lm.generate(prompt, max_new_tokens=8).text)
            correct.append(ans == key)
            row["configs"][s].setdefault("passkey_answers", []).append(ans)
        row["configs"][s]["passkey_acc"] = sum(correct) / max(1, len(correct))
    return row


def block_sweep(sizes, t=4096, density=0.3, reps=3):
    """Kernel-only time of the gather-then-SDPA prefill vs dense SDPA at one random selection."""
    from laserlm.attention.prefill import block_sparse_prefill
    from laserlm.attention.selection import SparseConfig

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, t, 64, generator=g)
    k = torch.randn(1, 3, t, 64, generator=g)
    v = torch.randn(1, 3, t, 64, generator=g)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    rows = []

    def tm(fa, fb):
        """Medians of fa and fb timed alternately (A, B, A, B ...)."""
        fa(), fb()
        ta, tb = [], []
        for _ in range(reps):
            for f, acc in ((fa, ta), (fb, tb)):
                t0 = time.perf_counter()
                f()
                acc.append(time.perf_counter() - t0)
        return statistics.median(ta), statistics.median(tb)

    for bs in sizes:
        nb = t // bs
        keep = torch.rand(3, nb, nb, generator=g) < density
        keep |= torch.eye(nb, dtype=torch.bool)
        keep[:, :, 0] = True
        keep &= torch.ones(nb, nb, dtype=torch.bool).tril()
        cfg = SparseConfig(block_size=bs)
        dense, sec = tm(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                        lambda: block_sparse_prefill(q, k, v, mask, 0.125, 0, cfg, keep=keep))
        real = keep.sum().item() / (3 * nb * (nb + 1) / 2)
        rows.append({"block_size": bs, "density": real, "sparse_s": sec, "dense_s": dense,
                     "speedup": dense / sec})
        print(rows[-1], flush=True)
    return rows


def to_markdown(rows) -> str:
    """One table row per (size, config) from the JSON lines this script writes."""
    out = ["| tokens | config | prefill s (layers) | vs dense | attention s | vs dense | density | decode s/step "
           "| vs dense | decode density | ppl | logit rel. err | logit cos | top-1 agree | decode agree | passkey |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "configs" not in row:
            continue
        d = row["configs"]["dense"]
        for name, c in row["configs"].items():
            out.append(f"| {row['tokens']} | `{name}` | {c['prefill_s']:.2f} | {d['prefill_s'] / c['prefill_s']:.2f}x "
                       f"| {c['attn_s']:.2f} | {d['attn_s'] / c['attn_s']:.2f}x | {c['density']:.3f} "
                       f"| {c['decode_s']:.3f} | {d['decode_s'] / c['decode_s']:.2f}x | {c['decode_density']:.3f} "
                       f"| {c['ppl']:.3f} | {c['logit_rel_err']:.4f} | {c['logit_cos']:.5f} | {c['top1_agree']:.4f} "
                       f"| {c['decode_agree']:.2f} | {c['passkey_acc']:.2f} {c['passkey_answers']} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8150])
    ap.add_argument("--sparse", nargs="+", default=["sparse"], help="sparse attention specs to compare")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--passkeys", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-sweep", type=int, nargs="*", default=None)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--report", nargs="+", default=None, help="print a markdown table of these JSON-lines files")
    args = ap.parse_args()
    if args.report:
        rows = [json.loads(line) for f in args.report for line in open(f) if line.strip()]
        print(to_markdown(rows))
        return
    torch.set_num_threads(args.threads)
    if args.block_sweep is not None:
        rows = block_sweep(args.block_sweep or [16, 32, 64, 128, 256])
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"block_sweep": rows, "date": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
        return
    lm = laserlm.load(args.model, max_seq_len=max(args.tokens) + 16)
    words = WIKI.read_text(encoding="utf-8")
    wiki_ids = torch.tensor(lm.tokenizer(words[:max(args.tokens) * 8])["input_ids"])
    for n in args.tokens:
        row = run_size(lm, n, args.sparse, args.reps, args.decode_steps, args.passkeys, wiki_ids)
        row.update(model=args.model, date=time.strftime("%Y-%m-%d %H:%M"), threads=args.threads)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
