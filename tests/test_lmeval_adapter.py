"""The lm-evaluation-harness adapter: generation runs with the configuration's attention kernel, and the
model is reachable by name from lm-eval's command line."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import FakeInstance
from laserlm.attention.kernel import configure

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# aggressive block-sparse attention (threshold 0 keeps only the sink and local blocks) that really runs on a
# ~60-token prompt: 8-token blocks, every layer sparse, no minimum block count
SPARSE = "sparse:threshold=0,block_size=8,dense_layers=0,min_blocks=2"
PROMPT = ("The history of the old harbour town begins with a small fishing village on the river, where boats "
          "brought salt, wool and timber from the hills. Over three centuries the village grew into a market "
          "town with a stone bridge, a guild hall and a cathedral. The most important building in the town is")


def test_generate_until_runs_with_the_configurations_sparse_kernel(smol):
    """A ``full@sparse`` harness generates with its own sparse kernel even when a dense kernel is installed
    on the engine: the text equals generation with that kernel installed by hand (the independent
    reference), the kernel's sparse paths ran, and the engine's kernel is restored afterwards."""
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    eng = smol.engine
    gen = {"until": ["\n\n"], "max_gen_toks": 12}
    n_prompt = len(smol.tokenizer(PROMPT)["input_ids"])
    assert n_prompt >= 4 * 8, "prompt too short for the sparse path"
    try:
        configure(eng, SPARSE)
        want_sparse = smol.generate(PROMPT, max_new_tokens=12, stop=["\n\n"]).text
        configure(eng, "dense")
        want_dense = smol.generate(PROMPT, max_new_tokens=12, stop=["\n\n"]).text
        assert want_sparse != want_dense, "this sparse setting no longer changes the output; pick a harsher one"

        h = LaserLMHarness(smol, mode=f"full@{SPARSE}")
        kernel = h.scorer.kernel
        assert eng.kernel is None  # a dense kernel is installed before generating
        got = h.generate_until([FakeInstance(PROMPT, gen)])[0]
        assert eng.kernel is None  # the engine is left as it was
        sparse_layers = [v for k, v in kernel.totals.items() if v.get("prefill_calls", 0) > 0]
        assert len(sparse_layers) == eng.num_layers  # every layer ran the sparse prefill path
        assert kernel.summary()["density"] < 1.0
        assert got == want_sparse
    finally:
        configure(eng, "dense")
        eng.reset()


# -- lm-eval's command line: the model by name ----------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _declared_entry_points() -> dict[str, dict[str, str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return {"console_scripts": project["scripts"], **project.get("entry-points", {})}


def test_entry_points_are_declared_and_resolve():
    """pyproject declares the lm-eval model in the ``lm_eval.models`` group and the ``laserlm-lm-eval``
    command; both resolve to the adapter (and, when the installed metadata is current, it agrees)."""
    from laserlm.evaluation import lmeval_adapter

    eps = _declared_entry_points()
    model = md.EntryPoint("laserlm", eps[lmeval_adapter.ENTRY_POINT_GROUP]["laserlm"], lmeval_adapter.ENTRY_POINT_GROUP)
    assert model.load() is lmeval_adapter.LaserLMHarness
    script = md.EntryPoint("laserlm-lm-eval", eps["console_scripts"]["laserlm-lm-eval"], "console_scripts")
    assert script.load() is lmeval_adapter.main
    installed = {e.name: e.value for e in md.entry_points(group=lmeval_adapter.ENTRY_POINT_GROUP)}
    if "laserlm" in installed:
        assert installed["laserlm"] == model.value


def _lm_eval_command() -> tuple[list[str], dict]:
    """The installed ``laserlm-lm-eval`` script; where the installed metadata predates it (an editable install
    made before the entry point was added: reinstall with ``pip install -e .``), the same entry point run the
    way a console script runs it."""
    env = dict(os.environ)
    script = Path(sys.executable).parent / "laserlm-lm-eval"
    if script.is_file() and md.entry_points(group="console_scripts", name="laserlm-lm-eval"):
        return [str(script)], env
    value = _declared_entry_points()["console_scripts"]["laserlm-lm-eval"]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = ("import sys; from importlib.metadata import EntryPoint; "
            f"sys.exit(EntryPoint('laserlm-lm-eval', {value!r}, 'console_scripts').load()())")
    return [sys.executable, "-c", code], env


def test_lm_eval_command_line_runs_laserlm_by_name(tmp_path):
    """``laserlm-lm-eval --model laserlm --model_args model=smollm2-135m,mode=full`` on a local two-item
    multiple-choice task (lm-eval's own CLI, task YAML and JSON data in tmp_path, no network): the obvious
    answers are picked (acc 1), and the results name the laserlm model."""
    pytest.importorskip("lm_eval")
    items = [{"question": "What is the capital of France?", "choices": ["Paris", "a purple refrigerator"], "label": 0},
             {"question": "How many legs does a dog have?", "choices": ["xq zvb wpl", "four"], "label": 1}]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(
        "task: laserlm_cli_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'items.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    cmd, env = _lm_eval_command()
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "out"
    proc = subprocess.run(cmd + ["--model", "laserlm", "--model_args", "model=smollm2-135m,mode=full",
                                 "--tasks", "laserlm_cli_mc", "--include_path", str(tmp_path / "tasks"),
                                 "--output_path", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    res = json.loads(path.read_text())
    assert res["config"]["model"] == "laserlm"
    assert res["results"]["laserlm_cli_mc"]["acc,none"] == 1.0
