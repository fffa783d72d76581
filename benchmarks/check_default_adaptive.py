"""Issue 12's check: bare `adaptive` on smollm2-135m (the cached calibrated artifact) vs its agreement target on
the shipped prompt set: teacher-forced top-1 agreement with full-depth greedy output per generated position, plus
free-running generation (exact match, mean layers). Same measurement as
tests/test_defaults.py::test_bare_adaptive_meets_its_target_on_the_shipped_prompts, on an existing cache.
usage: LASERLM_CACHE=DIR python benchmarks/check_default_adaptive.py [THREADS]"""
import json
import sys

import torch

import laserlm
from laserlm import defaults
from laserlm.evaluation.tasks import load_prompts
from laserlm.runtime.generate import encode_prompt
from laserlm.training.defaults import build_adaptive_default

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
defaults.set_adaptive_builder(build_adaptive_default)  # reuses the cached artifact (builds only if absent)
lm = laserlm.load("smollm2-135m")
mode = lm.mode("adaptive")
path = defaults.adaptive_artifact_path(lm.engine)
target = json.loads(path.with_suffix(".json").read_text())["config"]["calibration"]["settings"]["target_agreement"]
agree = total = exact = 0
layers = []
for prompt in load_prompts():
    ref = lm.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True)
    ids_p = encode_prompt(lm.tokenizer, prompt, True, lm.engine.max_seq_len).tolist()
    with torch.inference_mode():
        logits = mode.score(lm.engine, torch.tensor(ids_p + ref.token_ids)).logits
    pred = logits[len(ids_p) - 1:-1].argmax(-1)
    agree += int((pred == torch.tensor(ref.token_ids)).sum())
    total += len(ref.token_ids)
    got = lm.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True, mode="adaptive")
    exact += got.token_ids == ref.token_ids
    layers.append(got.mean_layers_per_token)
print(json.dumps({"artifact": str(path), "target_agreement": target, "teacher_forced_agreement": agree / total,
                  "positions": total, "target_met": agree / total >= target, "gen_exact_match": exact / len(layers),
                  "mean_layers_per_token": sum(layers) / len(layers), "prompts": len(layers)}, indent=1))
