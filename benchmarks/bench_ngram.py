"""Lookup drafts (issue #15) vs full depth vs transformers prompt lookup, per prompt class, in one run.

Classes (all through the model's chat template; greedy, ``--tokens`` new tokens, EOS ignored):

- ``rewrite``: "repeat / rewrite this paragraph" over WikiText-2 *test* paragraphs;
- ``extract``: "copy / extract from this passage" over Gutenberg (Great Expectations) paragraphs;
- ``qa``: a question over a given WikiText-2 test passage;
- ``code``: an edit (rename a function, add a docstring) of a function from laserlm's own Python source;
- ``chat``: open-ended chat requests (nothing to copy; 16 of them);
- ``chat_heldout``: 8 more open requests, written apart from the draft head's training templates.

For every prompt the methods run back to back (full depth, each speculative spec, transformers
``generate(prompt_lookup_num_tokens=N)``), so load from other jobs hits all alike. Reported per class:
end-to-end tokens/s (``generated / total seconds``, prefill included, the only number the transformers run
gives), laserlm decode tokens/s (``(generated - 1) / sum(inter-token latencies)``), the ratios to full depth,
tokens per verify and acceptance (overall and per draft source), and whether the output equals full depth.

Usage::

    PYTHONPATH=. python benchmarks/bench_ngram.py --prompts 6 --tokens 64 --out benchmarks/out/ngram.json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import time
from pathlib import Path

import torch

from laserlm.data import find_data_root

ROOT = Path(__file__).resolve().parent.parent
CHAT = ["Write a short poem about the sea.", "Give me three tips for learning to cook.",
        "What are the benefits of regular exercise?", "Tell me a short story about a dragon.",
        "Explain why the sky is blue.", "How do I make a good cup of tea?", "What is a good name for a cat?",
        "Describe your ideal weekend.", "Why do leaves change colour in autumn?", "Suggest a plan for a rainy day.",
        "What should I pack for a beach holiday?", "Write a limerick about a cat.",
        "How can I sleep better at night?", "What makes a good friend?", "Tell me a fun fact about space.",
        "Give me ideas for a birthday party."]

# Open requests written for the draft-head benchmark (issue 39): not from the draft head's training templates.
CHAT_HELDOUT = ["What would you do with a free afternoon in Paris?", "Write a thank-you note to a teacher.",
                "Describe how a rainbow forms.", "Give advice to someone starting a new job.",
                "Invent a new holiday and describe how people celebrate it.", "What is your favourite season and why?",
                "Write a short speech for a friend's wedding.", "How do plants grow from seeds?"]


def _paragraphs(text: str, min_words: int, max_words: int) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n|\n(?= )", text):
        para = " ".join(para.split())
        if para.startswith("=") or len(para.split()) < min_words:
            continue
        words = para.split()[:max_words]
        cut = " ".join(words)
        end = cut.rfind(". ")
        out.append(cut[:end + 1] if end > len(cut) // 2 else cut)
    return out


def _functions(n: int) -> list[tuple[str, str]]:
    out = []
    for rel in ("laserlm/runtime/sampling.py", "laserlm/speculative/proposers.py", "laserlm/runtime/options.py",
                "laserlm/runtime/generate.py"):
        src = (ROOT / rel).read_text(encoding="utf-8")
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef):
                code = ast.get_source_segment(src, node)
                body = code.split('"""')
                if len(body) >= 3:  # drop the docstring: the model is to write one
                    code = body[0].rstrip() + "\n" + '"""'.join(body[2:]).lstrip("\n")
                lines = code.splitlines()
                if 6 <= len(lines) <= 30:
                    out.append((node.name, "\n".join(lines)))
    return out[:n]


def build_prompts(n: int) -> dict[str, list[str]]:
    data = find_data_root()
    wiki = _paragraphs((data / "wikitext-2" / "test.txt").read_text(encoding="utf-8"), 80, 110)
    gut = (data / "gutenberg" / "1400-0.txt").read_text(encoding="utf-8")
    gut = gut[gut.find("Chapter I"):] if "Chapter I" in gut else gut
    gut = _paragraphs(gut.replace("\r", ""), 70, 110)
    step_w, step_g = max(1, len(wiki) // (2 * n + 1)), max(1, len(gut) // (n + 1))
    rewrite_tasks = ["Repeat the following paragraph exactly.", "Rewrite the following paragraph, keeping all facts."]
    extract_tasks = ["Copy the first three sentences of this passage exactly.",
                     "Quote every sentence of this passage that mentions a person."]
    code_tasks = ["Rename the function `{f}` to `{f}_v2` and output the complete code.",
                  "Add a docstring to the function `{f}` and output the complete code."]
    out = {
        "rewrite": [f"{rewrite_tasks[i % 2]}\n\n{wiki[i * step_w]}" for i in range(n)],
        "extract": [f"{extract_tasks[i % 2]}\n\n{gut[(i + 1) * step_g]}" for i in range(n)],
        "qa": [f"Read the passage and answer the question.\n\nPassage: {wiki[(n + i) * step_w + 1]}\n\n"
               "Question: What does the passage say about its main subject? Answer with details from the passage."
               for i in range(n)],
        "code": [f"{code_tasks[i % 2].format(f=name)}\n\n```python\n{code}\n```" for i, (name, code) in
                 enumerate(_functions(n))],
        "chat": CHAT[:n],
        "chat_heldout": CHAT_HELDOUT[:n],
    }
    return out


def gmean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per class")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="fp32", help="fp32 (dense float32, as transformers) or native (packed GGUF)")
    ap.add_argument("--specs", nargs="+", default=["speculative:draft=ngram", "speculative:draft=ngram+suffix"])
    ap.add_argument("--hf-lookup", type=int, default=10, help="transformers prompt_lookup_num_tokens (0: skip)")
    ap.add_argument("--classes", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every method this many times per prompt, interleaved (full, spec..., full, spec...); "
                         "a method's figures are those of its run with the median decode time")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm  # noqa: PLC0415
    from laserlm.runtime.generate import encode_prompt  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    lm = (laserlm.load(args.model, dtype="float32") if args.weights == "fp32"
          else laserlm.load(args.model, weights=args.weights))
    hf = None
    if args.hf_lookup:
        hf = AutoModelForCausalLM.from_pretrained(lm.loaded.path, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = lm.tokenizer.pad_token_id or 0
    prompts = build_prompts(args.prompts)
    classes = args.classes or list(prompts)
    specs = ["full", *args.specs]
    for s in specs:
        lm.mode(s)
    lm.generate("Hello", mode="full", max_new_tokens=4)  # warm-up
    rows = []
    for cls in classes:
        for i, prompt in enumerate(prompts[cls]):
            msgs = [{"role": "user", "content": prompt}]
            row = {"class": cls, "prompt": i, "prompt_tokens": None, "runs": {}}
            full_ids = None
            results: dict = {s: [] for s in specs}
            for _ in range(args.repeats):
                for s in specs:
                    results[s].append(lm.generate(msgs, chat=True, mode=s, max_new_tokens=args.tokens,
                                                  ignore_eos=True))
            for s in specs:
                res = sorted(results[s], key=lambda x: sum(x.itl_s))[len(results[s]) // 2]
                row["prompt_tokens"] = res.prompt_tokens
                dec = sum(res.itl_s)
                r = {"e2e_tok_s": res.generated_tokens / res.total_s,
                     "decode_tok_s": (res.generated_tokens - 1) / dec if dec > 0 else float("nan"),
                     "total_s": res.total_s}
                if s == "full":
                    full_ids = res.token_ids
                else:
                    sp = res.extra.get("speculative", {})
                    r.update(same_as_full=all(x.token_ids == full_ids for x in results[s]),
                             tokens_per_verify=sp.get("mean_accepted_length"),
                             acceptance=sp.get("acceptance_rate"), drafted=sp.get("drafted"),
                             accepted=sp.get("accepted"), cycles=sp.get("cycles"),
                             cost_steps=sp.get("cost_steps"), predicted_steps=sp.get("predicted_steps"),
                             budget_refused=sp.get("budget_refused"), budget_shortened=sp.get("budget_shortened"),
                             by_source={k: {kk: v[kk] for kk in ("cycles", "drafted", "accepted", "emitted")}
                                        for k, v in sp.get("by_source", {}).items()})
                row["runs"][s] = r
            if hf is not None:
                ids = encode_prompt(lm.tokenizer, msgs, True, lm.engine.max_seq_len).unsqueeze(0)
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                      min_new_tokens=args.tokens, do_sample=False,
                                      prompt_lookup_num_tokens=args.hf_lookup)
                    dt = time.perf_counter() - t0
                gen = out[0, ids.shape[1]:].tolist()
                row["runs"]["hf_prompt_lookup"] = {"e2e_tok_s": len(gen) / dt, "total_s": dt,
                                                   "same_as_full": gen == full_ids}
            rows.append(row)
            print(json.dumps({"class": cls, "prompt": i, "tokens": row["prompt_tokens"],
                              **{k: round(v["e2e_tok_s"], 2) for k, v in row["runs"].items()}}), flush=True)

    methods = list(rows[0]["runs"])
    summary = {}
    for cls in classes:
        rs = [r for r in rows if r["class"] == cls]
        c = {}
        for m in methods:
            e2e = [r["runs"][m]["e2e_tok_s"] for r in rs]
            entry = {"e2e_tok_s": statistics.mean(e2e),
                     "e2e_vs_full": gmean([r["runs"][m]["e2e_tok_s"] / r["runs"]["full"]["e2e_tok_s"] for r in rs])}
            if "decode_tok_s" in rs[0]["runs"][m]:
                entry["decode_tok_s"] = statistics.mean(r["runs"][m]["decode_tok_s"] for r in rs)
                entry["decode_vs_full"] = gmean([r["runs"][m]["decode_tok_s"] / r["runs"]["full"]["decode_tok_s"]
                                                 for r in rs])
            if m != "full":
                entry["same_as_full"] = sum(bool(r["runs"][m]["same_as_full"]) for r in rs)
            if "cycles" in rs[0]["runs"][m]:
                cyc = sum(r["runs"][m]["cycles"] for r in rs)
                dr = sum(r["runs"][m]["drafted"] for r in rs)
                ac = sum(r["runs"][m]["accepted"] for r in rs)
                entry.update(tokens_per_verify=(ac + cyc) / cyc, acceptance=ac / dr if dr else float("nan"))
                src: dict = {}
                for r in rs:
                    for k, v in r["runs"][m]["by_source"].items():
                        agg = src.setdefault(k, {"cycles": 0, "drafted": 0, "accepted": 0, "emitted": 0})
                        for kk in agg:
                            agg[kk] += v[kk]
                entry["by_source"] = {k: {"cycles": v["cycles"], "tokens_per_verify": v["emitted"] / v["cycles"],
                                          "acceptance": v["accepted"] / v["drafted"] if v["drafted"] else None}
                                      for k, v in src.items()}
            c[m] = entry
        summary[cls] = {"prompts": len(rs), "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rs),
                        **c}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
