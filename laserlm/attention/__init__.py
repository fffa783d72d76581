"""Block-sparse attention for long contexts (seed 004's progressive attention; MInference, Quest).

- :mod:`.selection`: coarse block scores and the selection rules (threshold, mass), :class:`SparseConfig`;
- :mod:`.prefill`: exact attention on the selected blocks for many queries (gather-then-SDPA);
- :mod:`.decode`: Quest's per-block key min/max bounds for decode steps;
- :mod:`.kernel`: :class:`SparseAttention`, the engine kernel, and :func:`configure`.
"""

from .kernel import SparseAttention, configure, parse_attention
from .selection import SparseConfig

__all__ = ["SparseAttention", "SparseConfig", "configure", "parse_attention"]
