# Per-step decode times of laserlm bench's tg path: python tg_probe.py MODEL THREADS [REPS]
import sys, time, statistics, torch
threads = int(sys.argv[2]); torch.set_num_threads(threads)
from laserlm.api import load
from laserlm.bench.measure import EngineTarget, random_prompt
lm = load(sys.argv[1])
t = EngineTarget(lm, "full")
ids = random_prompt(lm.engine.config.vocab_size if hasattr(lm.engine,'config') else 128000, 16, 0)
t.pp(ids)
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 6):
    ev = t._events(ids[:1], 128)
    s = [e.seconds for e in ev[1:]]
    s.sort()
    print(f"rep {rep}: tok/s {127/sum(s):.1f}  p10 {s[12]*1e3:.2f} p50 {s[63]*1e3:.2f} p90 {s[114]*1e3:.2f} max {s[-1]*1e3:.2f} ms", flush=True)
