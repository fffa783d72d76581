"""Cost of a 2-token forward vs a 1-token decode step at position 200 (what a deferred-bridge exit costs later).
usage: python benchmarks/bench_two_token_step.py   (2 threads, 30 interleaved reps, smollm2-135m fp32)"""
import time, torch, laserlm
torch.set_num_threads(2)
lm = laserlm.load("smollm2-135m"); eng = lm.engine
ids = torch.randint(100, 49000, (1, 200))
res = {1: [], 2: []}
for rep in range(30):
    for n in (1, 2):
        eng.reset(); eng.forward(ids)
        x = torch.randint(100, 49000, (1, n))
        t0 = time.perf_counter(); eng.forward(x); res[n].append(time.perf_counter() - t0)
import statistics as st
m1, m2 = st.median(res[1]), st.median(res[2])
print(f"1-token step {m1*1e3:.1f} ms, 2-token step {m2*1e3:.1f} ms, ratio {m2/m1:.2f}")
