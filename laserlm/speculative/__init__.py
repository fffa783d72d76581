"""Speculative decoding: draft sources and verification (a mode on top of :mod:`laserlm.runtime`).

- :mod:`.self_speculative`: lossless self-speculative decoding (the first N layers draft, the full model
  verifies; LayerSkip / Draft & Verify / SWIFT), the ``speculative`` mode factory
  :func:`make_speculative` and :func:`laser_exit_head` (draft with a calibrated exit head from a laser file);
- :mod:`.calibration`: the short greedy search behind ``draft_layers=auto`` / ``k=auto`` / ``threshold=auto``.
"""

from .self_speculative import ExitHead, SpeculativeDecoding, SpeculativeStats, laser_exit_head, make_speculative

__all__ = ["ExitHead", "SpeculativeDecoding", "SpeculativeStats", "laser_exit_head",
           "make_speculative"]
