"""lm-evaluation-harness wall time on 100 ARC-Easy items (dev split, lm-eval's arc_easy prompt): through a real
``laserlm serve`` with lm-eval's ``local-completions`` model (log-likelihoods by ``echo`` + ``logprobs``) against
lm-eval's in-process ``laserlm`` adapter, on the same weights and threads (issue 38). Also checks that both give the
same accuracy.

    python benchmarks/bench_lmeval_server.py --data ../shared/data/arc/ARC-Easy-Dev.jsonl [--limit 100] [--threads 1]

Writes ``benchmarks/out/lmeval_server.json``. Run alone (the server and lm-eval each use ``--threads``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the ServerProcess helper


def task_dir(data: Path, limit: int, tmp: Path) -> Path:
    rows = []
    for line in data.read_text().splitlines()[:limit]:
        r = json.loads(line)
        labels = [c["label"] for c in r["question"]["choices"]]
        rows.append({"question": r["question"]["stem"], "choices": [c["text"] for c in r["question"]["choices"]],
                     "label": labels.index(r["answerKey"])})
    (tmp / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = tmp / "tasks"
    d.mkdir()
    (d / "arc.yaml").write_text(
        f"task: arc_easy_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp / 'items.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return d


def run_lm_eval(model: str, model_args: str, tasks: Path, out: Path, threads: int) -> tuple[float, float]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = ([str(Path(sys.executable).with_name("laserlm-lm-eval"))] if model == "laserlm"
           else [sys.executable, "-m", "lm_eval"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + ["--model", model, "--model_args", model_args, "--tasks", "arc_easy_local",
                                 "--include_path", str(tasks), "--output_path", str(out)] + (["--log_samples"] if os.environ.get("LOG_SAMPLES") else []),
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    (res,) = out.rglob("results_*.json")
    return wall, json.loads(res.read_text())["results"]["arc_easy_local"]["acc,none"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/out/lmeval_server.json")
    args = ap.parse_args()
    from server_helpers import ServerProcess

    import laserlm
    path = laserlm.load("smollm2-135m").loaded.path  # the tokenizer directory lm-eval's client reads
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(os.environ.get("KEEP_DIR") or t)
        tasks = task_dir(args.data, args.limit, tmp)
        t0 = time.perf_counter()
        srv = ServerProcess(["--model", "smollm2-135m", "--threads", str(args.threads), "--ctx-size", "1024"])
        start_s = time.perf_counter() - t0
        try:
            http_s, http_acc = run_lm_eval(
                "local-completions", f"model=smollm2-135m,base_url={srv.url}/v1/completions,tokenizer_backend="
                f"huggingface,tokenizer={path},num_concurrent=1,max_retries=1", tasks, tmp / "http", args.threads)
        finally:
            srv.stop()
        local_s, local_acc = run_lm_eval("laserlm", "model=smollm2-135m,mode=full", tasks, tmp / "local", args.threads)
    out = {"date": time.strftime("%Y-%m-%d"), "items": args.limit, "threads": args.threads,
           "server_start_s": round(start_s, 1), "http_wall_s": round(http_s, 1), "http_acc": http_acc,
           "in_process_wall_s": round(local_s, 1), "in_process_acc": local_acc}
    print(json.dumps(out, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
