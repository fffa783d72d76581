"""Model loading (bundled names, GGUF, local dirs, hub ids) and per-architecture adapters."""

from .adapters import ModelAdapter, get_adapter
from .cache import cache_root
from .loader import SUPPORTED_MODEL_TYPES, LoadedModel, load_model
from .registry import BUNDLED, DEFAULT_MODEL

__all__ = ["BUNDLED", "DEFAULT_MODEL", "SUPPORTED_MODEL_TYPES", "LoadedModel", "ModelAdapter", "cache_root",
           "get_adapter", "load_model"]
