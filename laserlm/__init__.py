"""laserlm: adaptive-compute inference for Hugging Face causal language models."""

__version__ = "0.1.0"

from .api import LaserLM, load  # noqa: E402

__all__ = ["LaserLM", "load", "__version__"]
