"""Per-check cost of a state-feature exit gate, and per-token cost of measuring the ATS (adaptive policy=never vs
policy=ats that never exits), interleaved. usage: python benchmarks/bench_gate_check.py LASER_FILE (default /tmp/cf/smol99.safetensors)"""
import time, torch, laserlm, statistics as st
from laserlm.mode_table import make_mode
from laserlm.depth.policies import BatchPoint
torch.set_num_threads(2)
import sys
LASER = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cf/smol99.safetensors"
lm = laserlm.load("smollm2-135m"); eng = lm.engine
m = make_mode("adaptive:laser=" + LASER + ",gate_threshold=1.0", eng)
gate = m.policy.gates[20]
from laserlm.depth.policies import GatePolicy
pol = GatePolicy({20: gate}, 0.5)
h, hin = torch.randn(2, 1, 576).unbind(0)
p = BatchPoint(3, 20, 30, h, hin, head=eng.head, ats=torch.tensor([0.5]))
for _ in range(100): pol.decide_batch(p)
t0 = time.perf_counter()
for _ in range(1000): pol.decide_batch(p)
print("gate check us", (time.perf_counter()-t0)*1e3)
ats = make_mode("adaptive:policy=ats,ats_threshold=1.0,patience=0", eng)
nev = make_mode("adaptive:policy=never,patience=0", eng)
ids = torch.tensor(lm.tokenizer(open("/work/shared/data/wikitext-2/test.txt").read()[:3000])["input_ids"][:97])
res = {"never": [], "ats": []}
for rep in range(4):
    for k, mm in (("never", nev), ("ats", ats)):
        t0 = time.perf_counter(); mm.score(eng, ids)  # token-by-token decode (score=decode for these policies)
        res[k].append((time.perf_counter() - t0) / 96)
print({k: round(st.median(v)*1e3, 2) for k, v in res.items()})
