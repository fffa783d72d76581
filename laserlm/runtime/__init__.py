"""Runtime: engine (layer loop with explicit positions), KV cache, attention hook, sampling, requests and the one
generation loop."""

from .engine import Engine, ForwardOutput, StepStats
from .kv_cache import CacheWindow, KVCache
from .loop import RequestRun, generate_tokens
from .runner import Emitted, advance, start
from .request import Request, new_request

__all__ = ["CacheWindow", "Emitted", "Engine", "ForwardOutput", "KVCache", "Request", "RequestRun", "StepStats",
           "advance", "generate_tokens", "new_request", "start"]
