"""Model loading (bundled names, GGUF, local dirs, hub ids) and per-architecture adapters."""

from .adapters import ModelAdapter, get_adapter
from .loader import SUPPORTED_MODEL_TYPES, LoadedModel, cache_root, load_model
from .registry import BUNDLED, DEFAULT_MODEL

__all__ = ["BUNDLED", "DEFAULT_MODEL", "SUPPORTED_MODEL_TYPES", "LoadedModel", "ModelAdapter", "cache_root",
           "get_adapter", "load_model"]
