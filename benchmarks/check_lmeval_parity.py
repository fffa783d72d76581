"""Cross-check: `laserlm eval`'s ARC-Easy scorer vs lm-evaluation-harness itself (through the laserlm
adapter) on the first N items of ARC-Easy test, with lm-eval's own arc_easy prompt definition.

Usage: python benchmarks/check_lmeval_parity.py [N] [THREADS]
Prints both accuracies and the largest per-choice log-likelihood difference.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import laserlm  # noqa: E402
from laserlm.evaluation.data import default_data_dir  # noqa: E402
from laserlm.evaluation.lmeval_adapter import LaserLMHarness  # noqa: E402
from laserlm.evaluation.tasks import EvalSettings, Evaluator  # noqa: E402

rows = [json.loads(x) for x in (default_data_dir() / "arc/ARC-Easy-Test.jsonl").read_text().splitlines()[:N]]
tmp = Path(tempfile.mkdtemp())
(tmp / "arc").mkdir()
(tmp / "arc/ARC-Easy-Test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
hf_rows = [{"id": r["id"], "question": r["question"]["stem"],
            "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                        "label": [c["label"] for c in r["question"]["choices"]]}, "answerKey": r["answerKey"]}
           for r in rows]
(tmp / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hf_rows))
# lm-eval's arc_easy.yaml prompt (lm_eval/tasks/arc/arc_easy.yaml), over the local file
(tmp / "task.yaml").write_text(
    "task: local_arc_easy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    f"    test: {tmp / 'hf.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
    'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{choices.label.index(answerKey)}}"\n'
    'doc_to_choice: "{{choices.text}}"\nmetric_list:\n  - metric: acc\n    aggregation: mean\n'
    "    higher_is_better: true\n  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")

lm = laserlm.load("smollm2-135m")
res = lm_eval.simple_evaluate(model=LaserLMHarness(lm), tasks=["local_arc_easy"],
                              task_manager=TaskManager(include_path=str(tmp)), log_samples=True)
ours = Evaluator(lm, [], EvalSettings(data_dir=str(tmp), progress=False)).run("arc_easy")["full"]
r = res["results"]["local_arc_easy"]
print(f"N={N}  lm-eval harness: acc={r['acc,none']:.4f} acc_norm={r['acc_norm,none']:.4f}")
print(f"N={N}  laserlm eval:    acc={ours['acc']:.4f} acc_norm={ours['acc_norm']:.4f}")
