"""One entry point for the maintained benchmark scenarios: ``python benchmarks/run.py SCENARIO [-- EXTRA ARGS]``.

Each scenario runs one maintained script with the arguments of the current figure in RESULTS.md's "Where laserlm
stands" table (from the repository root) and, where the script writes JSON, to ``benchmarks/out/<scenario>.json``
(its own ``--out``/``--json`` after ``--`` overrides; ``paged-batch`` and ``draft-head`` only print).
Extra arguments after ``--`` go to the script unchanged (e.g. ``-- --threads 2``). ``python benchmarks/run.py``
alone lists the scenarios. Scenarios that need something this repository cannot install (a llama.cpp build, the
shared data directory ``../shared/data`` beside the repository, which the scripts read) say so before they start.

Run a benchmark alone on the machine (record ``uptime`` before and after): a figure taken beside other work is not
comparable. Scripts not listed here are kept for the dated sections of RESULTS.md or live in ``history/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = str(HERE.parent.parent / "shared" / "data")  # where the scripts read their data


@dataclass
class Scenario:
    """A maintained benchmark: ``script`` in this folder, its ``args``, how it takes its output path (``out_flag``),
    and what it needs beyond ``scripts/install.sh`` (``needs``: ``"data"``, ``"llama-bench"``)."""

    script: str
    args: list[str]
    what: str
    out_flag: str | None = "--out"
    needs: list[str] = field(default_factory=list)


SCENARIOS = {
    "engines": Scenario("bench_engines.py", ["--rounds", "3", "--threads", "1,2",
                                             "--models", "smollm2-135m,gemma3-270m"],
                        "pp512/tg128 beside llama.cpp (and ik_llama.cpp) on the same GGUF, alternated",
                        needs=["llama-bench"]),
    "step-tokens": Scenario("bench_step_tokens.py", ["--model", "smollm2-135m", "--weights", "native",
                                                     "--tokens", "1,2,4,8,16", "--reps", "30", "--threads", "1"],
                            "cost of a T-token step against one token (multi-row kernels)"),
    "modes": Scenario("bench_depth.py", [], "adaptive depth: quality vs layers per token, every policy and bridge",
                      needs=["data"]),
    "lookup-drafts": Scenario("bench_ngram.py", ["--weights", "native", "--classes", "rewrite", "extract", "code",
                                                 "qa", "chat", "--prompts", "16", "--tokens", "64", "--repeats", "3",
                                                 "--hf-lookup", "0", "--specs", "speculative:draft=ngram"],
                              "lossless drafts from the context against full depth, per prompt class",
                              needs=["data"]),
    "batching": Scenario("bench_batch.py", ["--weights", "native"],
                         "32 documents: continuous batching against one request at a time", needs=["data"]),
    "paged-batch": Scenario("bench_paged_batch_steps.py", ["--model", "smollm2-135m", "--weights", "native",
                                                           "--threads", "1"],
                            "decode throughput of a paged batch of B rows", out_flag=None),
    "serving": Scenario("bench_serve.py", [], "OpenAI server: throughput, TTFT/TPOT/ITL under Poisson arrivals",
                        needs=["data"]),
    "serving-logprobs": Scenario("bench_serve_logprobs.py", ["--data", f"{DATA}/arc/ARC-Easy-Dev.jsonl"],
                                 "what logprobs cost the server", needs=["data"]),
    "structured": Scenario("bench_structured.py", [], "JSON-schema decoding against free decoding"),
    "lm-eval": Scenario("bench_lmeval_server.py", ["--data", f"{DATA}/arc/ARC-Easy-Dev.jsonl", "--limit", "100"],
                        "lm-eval wall time through the server and in process", needs=["data"]),
    "sparse": Scenario("bench_sparse.py", [], "block-sparse attention against dense SDPA on long prompts",
                       needs=["data"]),
    "onnx": Scenario("bench_onnx.py", ["--out", "/tmp/laserlm_onnx_bench", "--threads", "1", "--reps", "3"],
                     "onnxruntime export against the PyTorch engine", out_flag="--json"),
    "draft-head": Scenario("bench_draft_head.py", [], "cost of one token drafted by the shipped draft head",
                           out_flag=None),
    "kv-prealloc": Scenario("bench_kv_prealloc.py", ["--data", f"{DATA}/wikitext-2/test.txt", "--rounds", "2"],
                            "KV pool arena pre-allocated full vs staged: peak RSS and step latency", needs=["data"]),
    "kv-alloc": Scenario("bench_kv_prealloc.py", ["--data", f"{DATA}/wikitext-2/test.txt", "--rounds", "2",
                                                  "--configs", "full,staged,request,full-pt,request-pt",
                                                  "--loads", "light,heavy,churn"],
                         "the paged pool against per-request allocation under churn: step P50/P99, peak RSS",
                         needs=["data"]),
    "head-vocab": Scenario("head_vocab_curve.py", ["-m", "gemma3-270m", "--settings",
                                                   "sampled:32:1024@250,sampled:32:1024@750,full@250"],
                           "exit heads: the sampled tail KL against the full-vocabulary KL (time, held-out KL, "
                           "agreement)", needs=["data"]),
    "load": Scenario("bench_load.py", ["--models", "smollm2-135m", "gemma3-270m"],
                     "load time and peak RSS, cold and warm"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.split("\n\n")[0] + "\n\nscenarios:")
        for name, sc in SCENARIOS.items():
            extra = f"  [needs: {', '.join(sc.needs)}]" if sc.needs else ""
            extra += "" if sc.out_flag else "  [prints only]"
            print(f"  {name:<17} {sc.what} ({sc.script}){extra}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SCENARIOS:
        print(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    sc = SCENARIOS[name]
    if rest and rest[0] == "--":
        rest = rest[1:]
    if "data" in sc.needs and not Path(DATA).is_dir():
        print(f"scenario {name!r} needs the shared data directory, which does not exist here: {DATA} (the "
              "scripts read WikiText-2, ARC and the novel from it)", file=sys.stderr)
        return 2
    if "llama-bench" in sc.needs and "--llama-bench" not in rest:
        print(f"scenario {name!r} compares with llama.cpp: add `-- --llama-bench PATH/build/bin/llama-bench` (and "
              "`--ik-bench` for ik_llama.cpp; ../shared/DESIGN.md says how to build them); without them only laserlm "
              "runs", file=sys.stderr)
    cmd = [sys.executable, str(HERE / sc.script), *sc.args]
    if sc.out_flag is not None and sc.out_flag not in rest:
        out = HERE / "out" / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd += [sc.out_flag, str(out)]
    cmd += rest
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.call(cmd, env=env, cwd=HERE.parent)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
