"""The calibrate summary's warning about exit gates biased toward shallow layers (held-out exit histogram)."""

from __future__ import annotations

import torch

from laserlm.training.pipeline import shallow_exit_bias


def test_shallow_bias_warns_only_when_shallow_exits_dominate_and_lose():
    # 4 exit points + full depth (index 4); 30 exits at point 0 with 5 disagreements, 10 at point 2
    dec = torch.tensor([0] * 30 + [2] * 10 + [4] * 60)
    loss = torch.zeros(100)
    loss[:5] = 1.0
    w = shallow_exit_bias(dec, loss, 4, allowed=0.01)
    assert w is not None and "75% of the held-out exits" in w and "0.167 > the 0.010" in w
    assert "layer 8" in w.format(exit=8)
    assert shallow_exit_bias(dec, torch.zeros(100), 4, allowed=0.01) is None  # shallow but lossless: fine
    dec2 = torch.tensor([0] * 10 + [2] * 30 + [4] * 60)
    assert shallow_exit_bias(dec2, loss, 4, allowed=0.01) is None  # most exits deeper
    assert shallow_exit_bias(torch.tensor([0] * 10 + [4] * 90), torch.ones(100), 4, 0.01) is None  # too few exits
    assert shallow_exit_bias(dec, loss, 4, allowed=None) is not None
