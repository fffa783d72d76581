"""Long-text metrics: how a configuration's agreement with full depth and its NLL gap change along a long
document (one sequence, every position conditioned on everything before it).

Definitions (per scored position ``t``, 0-based index of the predicted token's predecessor):

- ``agree_t = 1`` when the configuration's top-1 equals the full model's top-1 at ``t``, else 0;
- ``gap_t = NLL_config(t) - NLL_full(t)`` in nats (the NLL of the document's own next token);
- **decay per 1k tokens**: minus the least-squares slope of ``agree_t`` on ``t``, times 1000 (a positive
  value: agreement falls by that much per 1000 tokens of context); for the gap, the slope times 1000 (a
  positive value: the gap grows);
- **long-text consistency score**: the mean of ``agree_t`` over positions ``t >= 2048`` (``LONG_FROM``), i.e.
  top-1 agreement with full depth once the context is longer than 2048 tokens;
- binned means over windows of ``bin_size`` positions for the plot / table.

Block-sparse attention and adaptive depth with a KV bridge are the techniques whose error can accumulate
with context (seed 004's long-context goal); full depth against itself scores agreement 1, gap 0, decay 0.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

LONG_FROM = 2048
LONG_TEXT = "gutenberg/1400-0.txt"
START_MARK = "*** START OF"


def slope_per_1k(values: torch.Tensor, positions: torch.Tensor) -> float:
    """Least-squares slope of ``values [n]`` on ``positions [n]``, per 1000 positions (float64).

    Raises:
        InvalidArgumentError: fewer than 2 points or all positions equal.
    """
    y = values.double().reshape(-1)
    x = positions.double().reshape(-1)
    if y.numel() < 2 or y.numel() != x.numel():
        raise InvalidArgumentError("a slope needs at least 2 (value, position) pairs of equal length")
    xc = x - x.mean()
    den = float((xc * xc).sum())
    if den == 0.0:
        raise InvalidArgumentError("a slope needs at least 2 distinct positions")
    return float((xc * (y - y.mean())).sum()) / den * 1000.0


def long_text_metrics(agree: torch.Tensor, gap: torch.Tensor, positions: torch.Tensor | None = None,
                      bin_size: int = 512, long_from: int = LONG_FROM) -> dict:
    """Metrics of one configuration along a document: ``agree [n]`` (0/1), ``gap [n]`` (nats), ``positions [n]``
    (default ``0 .. n-1``).

    Returns ``{"agreement", "nll_gap", "agreement_decay_per_1k", "nll_gap_growth_per_1k", "consistency",
    "consistency_positions", "bins": [{"start", "agreement", "nll_gap"}]}``; ``consistency`` is ``None`` when
    the document has no position ``>= long_from``.
    """
    agree = agree.double().reshape(-1)
    gap = gap.double().reshape(-1)
    pos = torch.arange(agree.numel()) if positions is None else positions.reshape(-1)
    if agree.numel() != gap.numel() or agree.numel() != pos.numel():
        raise InvalidArgumentError("agree, gap and positions must have the same length")
    if bin_size < 1:
        raise InvalidArgumentError(f"bin size must be >= 1, got {bin_size}")
    late = pos >= long_from
    bins = []
    for start in range(0, int(pos.max()) + 1, bin_size):
        m = (pos >= start) & (pos < start + bin_size)
        if m.any():
            bins.append({"start": start, "agreement": float(agree[m].mean()), "nll_gap": float(gap[m].mean())})
    return {"agreement": float(agree.mean()), "nll_gap": float(gap.mean()),
            "agreement_decay_per_1k": -slope_per_1k(agree, pos), "nll_gap_growth_per_1k": slope_per_1k(gap, pos),
            "consistency": float(agree[late].mean()) if late.any() else None,
            "consistency_positions": int(late.sum()), "bins": bins}


def document_text(text: str) -> str:
    """The body of a Project Gutenberg file: the text after the ``*** START OF ...`` line when present."""
    i = text.find(START_MARK)
    if i < 0:
        return text
    j = text.find("\n", i)
    return text[j + 1:] if j >= 0 else text
