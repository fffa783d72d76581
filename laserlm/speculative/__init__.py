"""Speculative decoding: draft sources and verification (a mode on top of :mod:`laserlm.runtime`).

- :mod:`.self_speculative`: lossless self-speculative decoding (the first N layers draft, the full model
  verifies; LayerSkip / Draft & Verify / SWIFT);
- :mod:`.factory`: the ``speculative`` spec -> a configured mode (:func:`make_speculative`) and
  :func:`laser_exit_head` (draft with a calibrated exit head from a laser file);
- :mod:`.proposers`: draft sources without a model (n-gram / prompt lookup over the request, a bounded suffix
  cache over earlier requests; ``draft=`` option); :mod:`.draft_head`: the trained draft head;
- :mod:`.policy`: the per-step policy that picks a source and a draft length, the verify cost model and the loss
  budget;
- :mod:`.calibration`: the short greedy search behind ``draft_layers=auto`` / ``k=auto`` / ``threshold=auto``, and
  the verify cost measurement behind ``verify_cost=auto``.
"""

from .policy import DraftPolicy
from .proposers import NgramIndex, SuffixCache
from .factory import laser_exit_head, make_speculative
from .self_speculative import ExitHead, SpeculativeDecoding, SpeculativeState, SpeculativeStats

__all__ = ["DraftPolicy", "ExitHead", "NgramIndex", "SpeculativeDecoding", "SpeculativeState", "SpeculativeStats",
           "SuffixCache", "laser_exit_head", "make_speculative"]
