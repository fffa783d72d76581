"""In-process A/B of two adaptive-depth overhead fixes on native weights, interleaved (5 rounds, 96 greedy tokens):
the one-row walk in Python scalars (walk.py before: commit 2b688bd, read with `git show`) and the ATS layer's
attention probabilities from the kernel (before: the ATS layer left the stack run for the PyTorch path; emulated by
ending the run at that layer). Checks that all variants emit the same tokens.

    PYTHONPATH=. python benchmarks/ab_adaptive_overhead.py --laser FILE.safetensors
"""
import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import torch

import laserlm
from laserlm.depth import scheduler
from laserlm.runtime import attention as attn
from laserlm.runtime import packed_layers

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--laser", required=True)
ap.add_argument("--tokens", type=int, default=96)
args = ap.parse_args()
old_src = subprocess.run(["git", "show", "2b688bd:laserlm/depth/walk.py"], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout
old_path = os.path.join(tempfile.mkdtemp(), "walk_old.py")
with open(old_path, "w") as f:
    f.write(old_src.replace("from .policies import BatchPoint", "from laserlm.depth.policies import BatchPoint"))
spec_ = importlib.util.spec_from_file_location("walk_old", old_path)
wo = importlib.util.module_from_spec(spec_)
sys.modules["walk_old"] = wo  # dataclasses look their module up there
spec_.loader.exec_module(wo)
new_walk = scheduler.walk_groups
real_run = packed_layers.native_stack_run
def split_run(stack, layers, start, stop, hidden, rope, types, cache, eligible):
    ctx = attn.current_context()
    w = sorted(ctx.want_probs) if ctx is not None else []
    if w and start == w[0]:
        return None, start
    if w and start < w[0] < stop:
        stop = w[0]
    return real_run(stack, layers, start, stop, hidden, rope, types, cache, eligible)
torch.set_num_threads(1)
lm = laserlm.load("smollm2-135m", weights="native")
spec = f"adaptive:laser={args.laser}"
variants = {"old walk, ATS on PyTorch": (wo.walk_groups, split_run), "new walk, ATS on PyTorch": (new_walk, split_run),
            "old walk, ATS in kernel": (wo.walk_groups, real_run), "new walk, ATS in kernel": (new_walk, real_run),
            "full": None}
res = {k: [] for k in variants}; toks = {}
prompt = "The history of the city of London begins"
for rep in range(5):
    for name, v in (list(variants.items()) if rep % 2 == 0 else list(variants.items())[::-1]):
        if v is not None:
            scheduler.walk_groups, packed_layers.native_stack_run = v
        t0 = time.perf_counter()
        r = lm.generate(prompt, max_new_tokens=args.tokens, mode="full" if v is None else spec, ignore_eos=True)
        res[name].append((time.perf_counter() - t0) / args.tokens * 1e3)
        toks[name] = r.token_ids
        scheduler.walk_groups, packed_layers.native_stack_run = new_walk, real_run
for k, v in res.items():
    print(f"{k:28s} median {sorted(v)[2]:.2f} ms/token  all {[round(x, 2) for x in v]}")
outs = [toks[k] for k in variants if k != "full"]
print("same tokens across the four adaptive variants:", all(o == outs[0] for o in outs))
