"""Runtime: KV cache, attention hook, engine (layer loop), sampling and generation."""

from .engine import Engine, ForwardOutput, StepStats
from .kv_cache import KVCache

__all__ = ["Engine", "ForwardOutput", "KVCache", "StepStats"]
