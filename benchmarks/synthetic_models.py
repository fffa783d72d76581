"""Random-weight GGUF files of the 1B–8B models users run, made with llama.cpp's own converter and quantizer (issue 34).

For each architecture (``laserlm.bench.synthetic.ARCHITECTURES``: the published configs of Llama-3.2-1B/3B,
Llama-3.1-8B, Qwen2.5-1.5B, Qwen3-1.7B, Gemma-3-1B, Mistral-7B-v0.1):

1. a Hugging Face checkpoint with random weights, written one tensor at a time in bf16
   (``laserlm.bench.synthetic.write_checkpoint``; its docstring says how the weights are scaled);
2. ``convert_hf_to_gguf.py --outtype bf16`` of the given llama.cpp source tree (``convert_to_gguf``);
3. ``llama-quantize`` to each requested type (Q4_0, Q4_K_M, ...).

laserlm and llama.cpp then read the same files. Intermediate files are deleted unless ``--keep`` (the 8B's bf16
checkpoint and GGUF are 16 GB each), so one model at a time fits the disk.

    python benchmarks/synthetic_models.py llama-3.2-1b --llama-cpp vendor/llama.cpp --types Q4_0 Q4_K_M \\
        --out ~/synthetic

``--llama-cpp`` is a llama.cpp source tree built with cmake (``build/bin/llama-quantize``; DESIGN.md says how: the
tree inside the ``llama-cpp-python`` sdist that the ``llamacpp`` extra pins).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from laserlm.bench.synthetic import ARCHITECTURES, convert_to_gguf, write_checkpoint


def run(cmd: list[str]) -> float:
    print("+", " ".join(cmd), file=sys.stderr)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", choices=list(ARCHITECTURES))
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree with build/bin")
    ap.add_argument("--out", required=True, type=Path, help="directory for <model>-<TYPE>.gguf")
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"], help="llama-quantize types")
    ap.add_argument("--layers", type=int, default=None, help="reduced depth (default: the published depth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the bf16 checkpoint and GGUF")
    args = ap.parse_args()

    lc = args.llama_cpp.resolve()
    quantize = lc / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"{quantize} not found: build llama.cpp first (DESIGN.md)")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        tag = name + (f"-{args.layers}l" if args.layers else "")
        hf = args.out / f"{tag}-hf"
        bf16 = args.out / f"{tag}-BF16.gguf"
        t0 = time.perf_counter()
        if not hf.exists():
            write_checkpoint(name, hf, layers=args.layers, seed=args.seed)
        print(f"{name}: checkpoint {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        if not bf16.exists():
            t0 = time.perf_counter()
            convert_to_gguf(lc, hf, bf16, "bf16")
            print(f"{name}: converted in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(hf)
        for qtype in args.types:
            dst = args.out / f"{tag}-{qtype}.gguf"
            if not dst.exists():
                run([str(quantize), str(bf16), str(dst), qtype, str(os.cpu_count())])
            print(f"{dst}  {dst.stat().st_size / 2**30:.2f} GiB", file=sys.stderr)
        if not args.keep:
            bf16.unlink()


if __name__ == "__main__":
    main()
