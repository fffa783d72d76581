"""Speed and memory benchmarks of decoding modes (llama-bench pp/tg, TTFT/TPOT/ITL, RSS, KV bytes)."""

from .measure import EngineTarget, HFTarget, Samples, run_bench, summarize

__all__ = ["EngineTarget", "HFTarget", "Samples", "run_bench", "summarize"]
