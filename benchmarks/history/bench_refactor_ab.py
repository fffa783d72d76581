"""A/B of decode speed before and after the request/loop refactor (issue 12): the same script runs in two
checkouts, alternately, one thread each. usage: python benchmarks/bench_refactor_ab.py OLD_CHECKOUT NEW_CHECKOUT"""
import json
import subprocess
import sys

CHILD = r'''
import json, time, torch, laserlm
torch.set_num_threads(1)
lm = laserlm.load("smollm2-135m")
out = {}
for spec in ("full", "adaptive:threshold=0.9", "speculative:draft_layers=15,k=3"):
    lm.generate("The weather today is", max_new_tokens=8, mode=spec, ignore_eos=True)  # warm-up
    best = 0.0
    for _ in range(3):
        r = lm.generate("The weather today is", max_new_tokens=64, mode=spec, ignore_eos=True)
        best = max(best, r.stats()["decode_tokens_per_s"])
    out[spec] = best
print(json.dumps(out))
'''


def run(checkout):
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    old, new = sys.argv[1], sys.argv[2]
    rows = {"old": [], "new": []}
    for _ in range(3):
        rows["old"].append(run(old))
        rows["new"].append(run(new))
    for spec in rows["old"][0]:
        o = max(r[spec] for r in rows["old"])
        n = max(r[spec] for r in rows["new"])
        print(f"{spec:40s} old {o:7.2f} t/s  new {n:7.2f} t/s  new/old {n / o:.3f}")


if __name__ == "__main__":
    main()
