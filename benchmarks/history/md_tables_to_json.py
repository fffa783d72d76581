import json, re, sys
src, dst = sys.argv[1], sys.argv[2]
cols = {"wikitext": {"PPL": "perplexity", "top-1 agree": "top1_agreement", "layers/tok": "mean_layers"},
        "agreement": {"top-1 agree": "top1_agreement", "gen exact": "gen_exact_match", "gen LCP tok": "gen_mean_lcp_tokens"},
        "lambada": {"acc": "acc", "target PPL": "perplexity", "pred agree": "prediction_agreement", "layers/tok": "mean_layers"},
        "hellaswag": {"acc": "acc", "acc_norm": "acc_norm", "layers/tok": "mean_layers"},
        "arc_easy": {"acc": "acc", "acc_norm": "acc_norm", "layers/tok": "mean_layers"},
        "piqa": {"acc": "acc", "acc_norm": "acc_norm", "layers/tok": "mean_layers"}}
res, task, header = {}, None, None
for line in open(src):
    line = line.rstrip("\n")
    if line.startswith("### "):
        task, header = line[4:].strip(), None
        continue
    if task and line.startswith("| config"):
        header = [h.strip() for h in line.strip("|").split("|")]
        continue
    if task and header and line.startswith("| ") and not line.startswith("|---"):
        cells = [c.strip() for c in line.strip("|").split("|")]
        cfg = cells[0]
        for h, c in zip(header[1:], cells[1:]):
            key = cols.get(task, {}).get(h)
            if key:
                res.setdefault(task, {}).setdefault(cfg, {})[key] = float(c.split()[0])
json.dump({"source": src, "note": "parsed from the printed tables of an eval run that was stopped during hellaswag",
           "results": res}, open(dst, "w"), indent=1)
print({t: len(v) for t, v in res.items()})
