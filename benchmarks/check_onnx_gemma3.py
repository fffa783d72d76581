"""Parity of the real gemma3-270m on onnxruntime vs the PyTorch engine (float32) past its 512-token sliding window:
a 530-token WikiText-2 test prompt, then 32 greedy steps. Usage: PYTHONPATH=. python benchmarks/check_onnx_gemma3.py OUT_DIR"""
import sys, time, torch
OUT = sys.argv[1]
torch.set_num_threads(1)
import laserlm
from laserlm.export.onnx import export_onnx
from laserlm.runtime.ort_engine import OnnxEngine, OnnxModel
lm = laserlm.load("gemma3-270m", dtype="float32", weights="fp32", max_seq_len=640)
eng = lm.engine
t = time.time(); man = export_onnx(eng, OUT, max_len=640, progress=False, tokenizer=lm.tokenizer)
print("export s", round(time.time()-t,1), "MiB", sum(g["bytes"] for g in man["graphs"].values())/2**20, man["groups_spec"], "window", man["model"]["sliding_window"])
from laserlm import data as D
text = D.read_text(D.resolve(None, "wikitext-2/test.txt"))[:6000]
ids = torch.tensor(lm.tokenizer(text)["input_ids"][:530])
dec = OnnxEngine(OnnxModel(OUT, threads=1))
eng.reset(); ref = eng.prefill(ids.unsqueeze(0)).logits[0,0]
got = dec.prefill(ids.unsqueeze(0)).logits[0,0]
worst = float((got-ref).abs().max()/ref.abs().max()); rt=[int(ref.argmax())]; gt=[int(got.argmax())]
for _ in range(31):
    ref = eng.decode_step(torch.tensor([rt[-1]])).logits[0,0]
    got = dec.decode_step(torch.tensor([gt[-1]])).logits[0,0]
    worst = max(worst, float((got-ref).abs().max()/ref.abs().max())); rt.append(int(ref.argmax())); gt.append(int(got.argmax()))
print("prompt", len(ids), "tokens equal", rt == gt, "worst rel", worst)
