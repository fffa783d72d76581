"""Speculative decoding: draft sources and verification (a mode on top of :mod:`laserlm.runtime`).

- :mod:`.self_speculative`: lossless self-speculative decoding (the first N layers draft, the full model
  verifies; LayerSkip / Draft & Verify / SWIFT), the ``speculative`` mode factory
  :func:`make_speculative` and :func:`laser_exit_head` (draft with a calibrated exit head from a laser file);
- :mod:`.drafts`: draft sources without a model (n-gram / prompt lookup over the request, a bounded suffix cache
  over earlier requests) and the per-step policy that picks a source and a draft length (``draft=`` option);
- :mod:`.calibration`: the short greedy search behind ``draft_layers=auto`` / ``k=auto`` / ``threshold=auto``, and
  the verify cost measurement behind ``verify_cost=auto``.
"""

from .drafts import DraftPolicy, NgramIndex, SuffixCache
from .self_speculative import (ExitHead, SpeculativeDecoding, SpeculativeState, SpeculativeStats, laser_exit_head,
                               make_speculative)

__all__ = ["DraftPolicy", "ExitHead", "NgramIndex", "SpeculativeDecoding", "SpeculativeState", "SpeculativeStats",
           "SuffixCache", "laser_exit_head", "make_speculative"]
