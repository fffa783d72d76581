"""The seed's complexity predictor (seed 000 §2.1): how deep must a token go, decided before any layer runs.

A small 1-D CNN over the (RMS-normalised) input embeddings of the current token and the ``context`` tokens
before it, plus two scalars about the previous token — its attention transition score (ATS; seed: < 0.7 means
"go deeper") and its exit depth as a fraction of the layers — outputs one logit per exit point:
``sigmoid(logit_e)`` estimates P(stopping at exit point ``e`` keeps the full model's top-1). The decision rule is
the gates': a token stops at the first allowed exit point whose probability exceeds the threshold, so the
route is known before the first layer runs (the adaptive mode can plan it) and the threshold is certified the same
way (Learn-then-Test on the calibration split; see :mod:`laserlm.training.predictor`).

Inputs never include the current token's own layer outputs: only its embedding, earlier tokens' embeddings,
and the previous token's ATS / exit depth (``tests/test_predictor.py`` perturbs the layers and checks that the
decisions do not change).

Shapes: ``forward(emb [n, context + 1, d], scalars [n, 2]) -> logits [n, E]`` float32 (oldest token first,
the current token last; zero rows where a position has no earlier token).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import InvalidArgumentError

DEFAULT_CONTEXT = 4
DEFAULT_CHANNELS = 32
NUM_SCALARS = 2  # previous token's ATS, previous token's exit depth / L


class ComplexityPredictor(nn.Module):
    """Pre-layer exit predictor (see the module docstring).

    Args:
        hidden_size: d (the embedding width).
        exit_points: the exit points (layer counts) it predicts, in depth order (E of them).
        context: previous tokens seen (k); the CNN's window is ``k + 1`` tokens.
        channels: convolution channels.
        uses_ats: whether the previous token's ATS is a real input (else it is fed 0).

    Raises:
        InvalidArgumentError: no exit points, ``context < 0``, ``channels < 1``.
    """

    def __init__(self, hidden_size: int, exit_points: list[int], context: int = DEFAULT_CONTEXT,
                 channels: int = DEFAULT_CHANNELS, uses_ats: bool = False):
        super().__init__()
        if not exit_points:
            raise InvalidArgumentError("the complexity predictor needs at least one exit point")
        if context < 0 or channels < 1:
            raise InvalidArgumentError(f"predictor context must be >= 0 and channels >= 1, got {context}, {channels}")
        self.hidden_size, self.exit_points = hidden_size, [int(e) for e in exit_points]
        self.context, self.channels, self.uses_ats = int(context), int(channels), bool(uses_ats)
        k = min(3, context + 1)
        self.conv1 = nn.Conv1d(hidden_size, channels, k)
        self.conv2 = nn.Conv1d(channels, channels, 1)
        self.out = nn.Linear(2 * channels + NUM_SCALARS, len(self.exit_points))
        with torch.no_grad():
            self.out.weight.mul_(0.1)
            self.out.bias.fill_(-4.0)  # starts as "do not exit", like the gates

    def forward(self, emb: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        x = emb.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # zero rows stay zero
        h = torch.relu(self.conv1(x.transpose(1, 2)))
        h = torch.relu(self.conv2(h))
        feats = torch.cat([h.mean(-1), h[..., -1], scalars.float()], dim=-1)
        return self.out(feats)

    def config_dict(self) -> dict:
        return {"exit_points": self.exit_points, "context": self.context, "channels": self.channels,
                "uses_ats": self.uses_ats, "hidden_size": self.hidden_size}


def window_ids(ids: torch.Tensor, context: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, context + 1]`` token ids of each position and the ``context`` before it (``-1``: none).

    Args:
        ids: ``[N]`` token ids in order.
        first: ``[N]`` bool, positions that start a new sequence (no earlier token; default: only position 0).
    """
    n = ids.shape[0]
    out = torch.full((n, context + 1), -1, dtype=torch.long)
    pos = torch.arange(n)
    marks = torch.where(first, pos, torch.zeros_like(pos)) if first is not None else torch.zeros_like(pos)
    seq_start = marks.cummax(0).values
    for j in range(context + 1):
        src = pos - (context - j)
        ok = src >= seq_start
        out[ok, j] = ids[src[ok]]
    return out


def window_embeddings(embed, windows: torch.Tensor) -> torch.Tensor:
    """``[N, k + 1]`` ids (``-1``: none) -> ``[N, k + 1, d]`` float32 embeddings (zeros for none)."""
    e = embed(windows.clamp_min(0)).float()
    return e * (windows >= 0).unsqueeze(-1).float()


def predictor_scalars(prev_ats: torch.Tensor, prev_exit: torch.Tensor, uses_ats: bool) -> torch.Tensor:
    """``[N, 2]``: the previous token's ATS (NaN -> 0; 0 when the predictor does not use it) and its exit depth
    as a fraction of the layers."""
    ats = torch.nan_to_num(prev_ats.float(), nan=0.0) if uses_ats else torch.zeros_like(prev_exit, dtype=torch.float32)
    return torch.stack([ats, prev_exit.float()], dim=-1)


def exit_index(probs: torch.Tensor, threshold: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``probs [n, E]`` -> ``[n]`` index of the first exit point whose probability exceeds ``threshold``
    (``E``: full depth); ``allowed [E]`` bool masks exit points below min depth."""
    ok = probs > threshold
    if allowed is not None:
        ok = ok & allowed.unsqueeze(0)
    ok = torch.cat([ok, torch.ones(ok.shape[0], 1, dtype=torch.bool)], dim=1)
    return ok.float().argmax(1)
