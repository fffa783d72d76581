"""Where propagate-decoding disagreements fall: at exited tokens or at later full-depth tokens.
Reads the per-threshold decodings cached by `laserlm calibrate` (bridge propagate) in its work directory.
usage: python benchmarks/analyze_propagate_losses.py WORK_DIR   (default /tmp/cf/smol99.safetensors.work)"""
import torch
from laserlm.training.collect import ExitStates
import sys
w = (sys.argv[1] if len(sys.argv) > 1 else "/tmp/cf/smol99.safetensors.work").rstrip("/") + "/"
st = ExitStates.from_state_dict(torch.load(w + "states.pt"))
cache = torch.load(w + "propagate_calib.pt")
# calibration split = 3rd of 4 splits by chunk: train 32, gate 16, calib 32, held 16 chunks
calib = st.select((st.chunk >= 48) & (st.chunk < 80))
print("calib positions", len(calib))
print("threshold  exit%   risk   wrong@exited  wrong@full-depth  wrong per exit")
for k in sorted(cache, key=lambda x: -float(x)):
    am, nll, lay = cache[k]
    ex = lay < 30
    wrong = am != calib.full_top1
    print(f"{float(k):.4f}  {ex.float().mean():6.1%}  {wrong.float().mean():.4f}  {(wrong & ex).float().mean():.4f}  {(wrong & ~ex).float().mean():.4f}  {wrong.sum().item() / max(ex.sum().item(),1):.2f}")
