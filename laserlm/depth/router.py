"""Seed 004's DynamicRouter: a sequence-level route (how many layer groups) for a whole request.

After the first decoder layer, a linear classifier on the mean-pooled hidden state of the prompt picks
a route ``r``: the request runs the first ``r`` exit points' worth of layers and reads every token
from the exit head there (``r = E``: full depth). This module is the inference side (the router and
:func:`pooled_first_layer`, used by :class:`~laserlm.depth.adaptive.AdaptiveDepth` with ``router=1``); the
labels and the training live in :mod:`laserlm.training.router`. The router is stored in the laser file
(:mod:`laserlm.depth.laser_file`).
"""

from __future__ import annotations

import torch
from torch import nn

ROUTER_LAYER = 1  # pooled hidden state after the first decoder layer (seed 004)
MIN_ROUTE_CONFIDENCE = 0.9  # below this the request runs at full depth (our safety rule, not the seed's)


class DynamicRouter(nn.Module):
    """Linear classifier ``[B, d] -> [B, E + 1]`` route logits over standardised pooled hidden states.

    Args:
        hidden_size: ``d``.
        exit_points: the E exit points (route ``r < E`` exits at ``exit_points[r]``; ``E`` is full depth).
    """

    def __init__(self, hidden_size: int, exit_points: list[int]):
        super().__init__()
        self.exit_points = list(exit_points)
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("std", torch.ones(hidden_size))
        self.linear = nn.Linear(hidden_size, len(exit_points) + 1)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear((pooled.float() - self.mean) / self.std)

    @torch.no_grad()
    def route(self, engine, prompt_ids: torch.Tensor, min_confidence: float = MIN_ROUTE_CONFIDENCE) -> int:
        """Number of decoder layers to run for this request (an exit point, or ``num_layers``).

        Conservative: a shallower route is taken only when the router gives it probability >= ``min_confidence``;
        otherwise full depth (the router is trained on few prompts and is not covered by the threshold guarantee).
        """
        probs = torch.softmax(self(pooled_first_layer(engine, prompt_ids).unsqueeze(0))[0], -1)
        r = int(probs.argmax())
        if r >= len(self.exit_points) or float(probs[r]) < min_confidence:
            return engine.num_layers
        return self.exit_points[r]


@torch.inference_mode()
def pooled_first_layer(engine, prompt_ids: torch.Tensor) -> torch.Tensor:
    """``[d]`` mean over prompt positions of the hidden state after decoder layer 0 (no cache)."""
    h, state = engine.begin(prompt_ids.reshape(1, -1), use_cache=False)
    h = engine.run_layers(0, ROUTER_LAYER, h, state)
    return h[0].float().mean(0)
