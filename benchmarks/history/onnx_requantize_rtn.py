"""onnxruntime's own MatMulNBitsQuantizer on a float32 export (what `laserlm export onnx --weights` does NOT do).

Re-quantizes the group, bridge and head graphs of a float32 export (round to nearest, 4 bits, block 32) into a copy,
for the comparison in RESULTS.md ("ONNX Runtime with the model's own blocks"). Usage:

    python benchmarks/onnx_requantize_rtn.py FP32_EXPORT_DIR OUT_DIR [ACCURACY_LEVEL=4] [BLOCK=32] [sym]

then `laserlm eval --backend onnxruntime --model OUT_DIR --tasks wikitext --ppl-windows 4`.
"""
import sys, time, shutil
from pathlib import Path
import onnx, numpy as np, torch
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
acc = int(sys.argv[3]) if len(sys.argv) > 3 else 4
bs = int(sys.argv[4]) if len(sys.argv) > 4 else 32
if dst.exists(): shutil.rmtree(dst)
shutil.copytree(src, dst)
t0 = time.perf_counter()
for f in sorted(dst.glob("*.onnx")):
    if not (f.name.startswith("group_") or f.name.startswith("head") or f.name.startswith("bridge_")): continue
    m = onnx.load(str(f))
    ops = {}
    for n in m.graph.node: ops[n.op_type] = ops.get(n.op_type, 0) + 1
    q = MatMulNBitsQuantizer(m, bits=4, block_size=bs, is_symmetric=(len(sys.argv)>5), accuracy_level=acc)
    q.process()
    q.model.save_model_to_file(str(f), use_external_data_format=False)
    ops2 = {}
    for n in onnx.load(str(f)).graph.node: ops2[n.op_type] = ops2.get(n.op_type, 0) + 1
    print(f.name, ops.get("MatMul"), "->", ops2.get("MatMul"), ops2.get("MatMulNBits"), f.stat().st_size >> 20, "MiB", flush=True)
print("quantize s", time.perf_counter() - t0)
