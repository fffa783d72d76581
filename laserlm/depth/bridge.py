"""Bridges: how a decoder layer that a token skipped still gets that token's K/V for later tokens.

- :class:`PropagateBridge` (CALM's state propagation; the seed's "residual bridge"): for every skipped layer
  ``j``, K/V are computed from the exit hidden state with layer ``j``'s own input norm, K/V projections,
  K norm (Gemma3 / Qwen3) and rotary embedding, and written into the cache. Costs two small projections
  per skipped layer instead of a whole layer.
- :class:`DeferredBridge` (FREE, Bae et al. 2023; EE-LLM, Chen et al. 2024): the skipped layers of a token are
  run later, batched with the next token's forward from the exit layer on, so the cache becomes exact.
  The adaptive mode (:mod:`laserlm.depth.adaptive`) does the batching; the pending token is kept in the
  request's state.
- :class:`NoneBridge` (D-LLM, Jiang et al. 2024): the slot stays empty and is masked at the skipped layers
  through ``AttentionContext.key_valid``. On the paged KV pool a page whose positions all skipped its layer is
  returned to the pool (:meth:`laserlm.runtime.kv_pool.PagedCache.release_skipped`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..runtime.projections import project_kv  # noqa: F401  (re-exported by laserlm.depth)

BRIDGES = ("propagate", "deferred", "none")


class Bridge:
    """Base class (stateless). The adaptive mode calls :meth:`configure` after each ``Engine.begin`` of a token and
    :meth:`on_exit` when the token stops after ``layer`` layers; ``rs`` is the request's
    :class:`~laserlm.depth.adaptive.DepthState` (where a bridge keeps what it needs across tokens)."""

    name = "?"

    def configure(self, engine, state, rs) -> None:
        pass

    def on_exit(self, engine, state, layer: int, hidden: torch.Tensor, token_id: int, rs) -> int:
        """Handle the skipped layers ``layer .. L-1`` of the token at ``state.start``; returns how many layers
        were bridged."""
        raise NotImplementedError


class PropagateBridge(Bridge):
    """Write K/V of the skipped layers projected from the exit hidden state (see module docstring)."""

    name = "propagate"

    def on_exit(self, engine, state, layer, hidden, token_id, rs):
        engine.propagate(state, layer, hidden)
        return engine.num_layers - layer


class NoneBridge(Bridge):
    """Leave skipped slots empty and mask them (``AttentionContext.key_valid``)."""

    name = "none"

    def configure(self, engine, state, rs):
        for v in rs.valid.values():
            v[state.positions] = True  # fresh positions hold real K/V until a token skips
        state.ctx.key_valid = rs.valid

    def on_exit(self, engine, state, layer, hidden, token_id, rs):
        cache = state.window.cache
        for j in range(layer, engine.num_layers):
            if j not in rs.valid:
                rs.valid[j] = torch.ones(cache.max_len, dtype=torch.bool)
            rs.valid[j][state.start] = False
        release = getattr(cache, "release_skipped", None)  # the paged pool: pages with no K/V go back
        if release is not None:
            release(rs.valid, state.start)  # layers below the exit hold this position: their page stays
        return engine.num_layers - layer


@dataclass
class PendingToken:
    """A token whose layers ``layer .. L-1`` have not run yet (deferred bridge).

    Attributes: ``token_id``; ``position`` in the cache; ``layer`` = its exit layer; ``hidden [1, 1, d]`` = its
    hidden state after ``layer`` layers (the input of layer ``layer``)."""

    token_id: int
    position: int
    layer: int
    hidden: torch.Tensor


class DeferredBridge(Bridge):
    """Keep the exited token pending (``rs.pending``); the adaptive mode runs its remaining layers with the next
    token's forward."""

    name = "deferred"

    def on_exit(self, engine, state, layer, hidden, token_id, rs):
        rs.pending = PendingToken(int(token_id), state.start, layer, hidden.detach().clone())
        return engine.num_layers - layer


def make_bridge(name: str) -> Bridge:
    """``propagate`` | ``deferred`` | ``none`` -> a bridge object (InvalidArgumentError otherwise)."""
    table = {"propagate": PropagateBridge, "deferred": DeferredBridge, "none": NoneBridge}
    if name not in table:
        raise InvalidArgumentError(f"unknown bridge '{name}'; use one of {', '.join(BRIDGES)}")
    return table[name]()
