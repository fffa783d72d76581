import sys, time
t0 = time.perf_counter()
import torch
from laserlm.api import load
t1 = time.perf_counter()
lm = load(sys.argv[1])
t2 = time.perf_counter()
print(f"import {t1-t0:.2f} load {t2-t1:.2f} total {t2-t0:.2f}")
