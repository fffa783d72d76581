"""lm-evaluation-harness itself as the client of a real ``laserlm serve`` on 127.0.0.1 (issue 38): its
``local-completions`` model runs a local multiple-choice task (log-likelihoods through ``echo`` + ``logprobs``)
and a generation task, and every log-likelihood it got over HTTP equals laserlm's own in-process scorer
(``laserlm eval``'s, through the lm-eval adapter) within 1e-3."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import FakeInstance
from server_helpers import ServerProcess

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's [api] extra: laserlm[lmeval] / [dev] install it

ITEMS = [{"question": "What is the capital of France?", "choices": ["Paris", "a purple refrigerator"], "label": 0},
         {"question": "How many legs does a dog have?", "choices": ["xq zvb wpl", "four"], "label": 1},
         {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "loud"], "label": 0}]


def _tasks(tmp_path) -> str:
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    d = tmp_path / "tasks"
    d.mkdir()
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              'doc_to_text: "Question: {{question}}\\nAnswer:"\n')
    (d / "mc.yaml").write_text(
        "task: laserlm_http_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "gen.yaml").write_text(
        "task: laserlm_http_gen\n" + common + "output_type: generate_until\n"
        'doc_to_target: "{{choices[label]}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    return str(d)


def test_lm_eval_local_completions_against_the_server(tmp_path, smol):
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    srv = ServerProcess(["--model", "smollm2-135m", "--weights", "fp32", "--threads", "1", "--ctx-size", "512"])  # as smol
    try:
        out = tmp_path / "out"
        args = (f"model=smollm2-135m,base_url={srv.url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={smol.loaded.path},num_concurrent=1,max_retries=1,tokenized_requests=True")
        env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"),
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                               "--tasks", "laserlm_http_mc,laserlm_http_gen", "--include_path", _tasks(tmp_path),
                               "--output_path", str(out), "--log_samples"],
                              cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        srv.stop()
    (res_path,) = out.rglob("results_*.json")
    res = json.loads(res_path.read_text())["results"]
    assert res["laserlm_http_mc"]["acc,none"] == 1.0
    assert "exact_match,none" in res["laserlm_http_gen"]
    (mc_path,) = out.rglob("samples_laserlm_http_mc_*.jsonl")
    samples = [json.loads(line) for line in mc_path.read_text().splitlines()]
    pairs, got = [], []
    for s in samples:
        for arg, resp in zip(s["arguments"].values(), s["resps"]):
            pairs.append((arg["arg_0"], arg["arg_1"]))
            got.append(float(resp[0][0]))
    assert len(pairs) == sum(len(i["choices"]) for i in ITEMS)
    want = [ll for ll, _ in LaserLMHarness(lm=smol).loglikelihood([FakeInstance(*p) for p in pairs])]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, list(zip(got, want))
