"""Block scoring and selection rules for block-sparse attention.

Blocks are runs of ``block_size`` consecutive positions. Query block ``i`` and key block ``j`` get a
*coarse logit* from mean-pooled queries and keys (seed 004's progressive attention; MInference, MoBA
and XAttention score blocks the same way)::

    s[i, j] = scaling * mean_q(Q_i) . mean_k(K_j)

By bilinearity ``s[i, j]`` is exactly the *average true logit* over all (query, key) pairs of the two
blocks, so selecting on ``s`` keeps every block pair whose average logit passes the rule (what
:func:`select_blocks` promises; ``tests/test_sparse_attention.py`` checks it on real activations).

Rules (per query head; a key block is then kept for a KV head if any query head of its GQA group keeps
it, so K/V reads are really saved and every head's promise still holds):

- ``threshold`` (default; the seed's length-adaptive threshold ``c / sqrt(d_k) * log(n)``, ``c = 0.5``):
  keep key block ``j`` iff ``(max_j' s[i, j'] - s[i, j]) / sqrt(d_k) <= c / sqrt(d_k) * log(n)``, i.e. the
  gap to the best block measured on the per-dimension score ``q.k / d_k`` (with ``scaling = 1/sqrt(d_k)``
  that is ``s / sqrt(d_k)``) is within the seed's threshold. Equivalently: the logit gap is at most
  ``c * log(n)``, i.e. the block's coarse weight is at least ``n**-c`` times the best block's. ``n`` is the
  number of keys the block's last query can see (causal length), so the rule keeps relatively more
  blocks as the context grows. ``c = inf`` keeps every block (dense).
- ``mass`` (alternative, MInference/XAttention-style): the fewest key blocks whose coarse softmax mass
  (softmax over ``s[i, j] + log(keys in block j)``, visible blocks only) reaches ``tau``; ``tau = 1``
  keeps every block.

The first (sink) block and the local blocks (those holding the query block's own positions, plus
``local_blocks - 1`` blocks before them) are always kept (StreamingLLM sinks + local window).

Error bound (what the tests check on real activations). For one query with exact attention
probabilities ``p_k`` and values ``v_k``, let ``D`` be the dropped keys and ``delta = sum_{k in D} p_k``
the dropped mass. Sparse attention renormalises over the kept keys: ``o' = sum_{k not in D} p_k v_k /
(1 - delta)``. Then ``o - o' = sum_D p_k v_k - delta * o' = delta * (vbar_D - o')`` with ``vbar_D`` the
``p``-weighted mean of the dropped values, so::

    ||o - o'|| <= delta * max_{k in D} ||v_k - o'|| <= 2 * delta * max_k ||v_k||

i.e. the relative error is at most the dropped mass times the value spread over ``||o||``.

Bad settings: block size < 1, threshold < 0 or NaN, tau outside (0, 1] and unknown rules raise
:class:`~laserlm.errors.InvalidArgumentError`; a sequence with fewer than ``min_blocks`` key blocks
(including one shorter than a block) silently uses dense attention. Any block size >= 1 works (no
power of two needed; the last block may be partial).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..runtime.options import is_int

RULES = ("threshold", "mass")


@dataclass
class SparseConfig:
    """Settings of block-sparse attention.

    Attributes:
        block_size: positions per block (query and key blocks); a positive integer. Default 64
            (large enough that a block's gather and SDPA call amortize, small enough to skip context).
        rule: ``"threshold"`` or ``"mass"`` (see module docstring).
        threshold: coefficient ``c`` of the seed's threshold ``c / sqrt(d_k) * log(n)``; ``>= 0``, ``inf``
            keeps every block. Default 0.5 (the seed's).
        tau: target coarse softmax mass of the ``mass`` rule, in ``(0, 1]``.
        local_blocks: local key blocks always kept (1 = only the block(s) holding the query positions).
        dense_layers: the first ``dense_layers`` decoder layers use dense attention.
        decode_max_tokens: forwards with at most this many new tokens use the decode (Quest) path.
        token_budget: optional cap on the keys a decode query reads (Quest's token budget; 0 = no cap).
        min_blocks: sequences with fewer key blocks than this fall back to dense attention.

    Raises (from :meth:`validate`):
        InvalidArgumentError: block size < 1, threshold < 0 or NaN, tau outside (0, 1], unknown rule,
            negative layer counts.
    """

    # messages of the option parser (laserlm.runtime.options.from_spec, used by parse_attention)
    UNKNOWN_MESSAGE = "unknown {what} option {quoted}; known: {known}"
    BAD_VALUE_MESSAGE = "{what} option {name}={value!r} is not a valid {type}"

    block_size: int = 64
    rule: str = "threshold"
    threshold: float = 0.5
    tau: float = 0.95
    local_blocks: int = 1
    dense_layers: int = 2
    decode_max_tokens: int = 16
    token_budget: int = 0
    min_blocks: int = 4

    def validate(self) -> SparseConfig:
        if not is_int(self.block_size) or self.block_size < 1:
            raise InvalidArgumentError(f"block size must be a positive integer, got {self.block_size!r}")
        if self.rule not in RULES:
            raise InvalidArgumentError(f"unknown sparse rule {self.rule!r}; expected one of {', '.join(RULES)}")
        if not isinstance(self.threshold, (int, float)) or math.isnan(self.threshold) or self.threshold < 0:
            raise InvalidArgumentError(f"sparse threshold must be a number >= 0 (inf = dense), got {self.threshold!r}")
        if not isinstance(self.tau, (int, float)) or not 0.0 < self.tau <= 1.0:
            raise InvalidArgumentError(f"sparse mass tau must be in (0, 1], got {self.tau!r}")
        for name in ("local_blocks", "dense_layers", "token_budget", "min_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative integer, got {v!r}")
        if self.local_blocks < 1:
            raise InvalidArgumentError(f"local_blocks must be >= 1, got {self.local_blocks}")
        if not isinstance(self.decode_max_tokens, int) or self.decode_max_tokens < 0:
            raise InvalidArgumentError(f"decode_max_tokens must be >= 0, got {self.decode_max_tokens!r}")
        return self

    def gap(self, n_keys: torch.Tensor | float) -> torch.Tensor | float:
        """Largest allowed logit gap ``c * log(n)`` for ``n`` visible keys (tensor or float)."""
        if isinstance(n_keys, torch.Tensor):
            return self.threshold * torch.log(n_keys.clamp(min=2).to(torch.float32))
        return self.threshold * math.log(max(n_keys, 2))


def pool_blocks(x: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Mean over blocks of the sequence axis.

    ``x [..., L_pad, D]`` with ``L_pad`` a multiple of ``block_size`` and zeros after ``length``;
    returns ``[..., L_pad / block_size, D]`` (the last block averaged over its real rows only).
    """
    nb = x.shape[-2] // block_size
    sums = x.reshape(*x.shape[:-2], nb, block_size, x.shape[-1]).sum(-2)
    counts = torch.full((nb,), float(block_size), dtype=x.dtype)
    counts[-1] = length - (nb - 1) * block_size
    return sums / counts[:, None]


def block_counts(length: int, block_size: int) -> torch.Tensor:
    """Number of real positions in each block of a sequence of ``length`` positions, ``[nb]`` float32."""
    nb = -(-length // block_size)
    c = torch.full((nb,), float(block_size))
    c[-1] = length - (nb - 1) * block_size
    return c


def select_blocks(scores: torch.Tensor, visible: torch.Tensor, forced: torch.Tensor, n_keys: torch.Tensor,
                  key_counts: torch.Tensor, cfg: SparseConfig) -> torch.Tensor:
    """Apply the selection rule to coarse logits.

    Args:
        scores: ``[N, G, nQ, nK]`` coarse logits (``N`` = batch x KV heads, ``G`` query heads per KV head).
        visible: ``[nQ, nK]`` or ``[N, nQ, nK]`` bool, key blocks the query block may see at all.
        forced: ``[nQ, nK]`` bool, blocks always kept (sink + local), intersected with ``visible``.
        n_keys: ``[nQ]`` visible keys of each query block's last query (the ``n`` of ``log(n)``).
        key_counts: ``[nK]`` real positions per key block (used by the ``mass`` rule).
        cfg: the settings.

    Returns:
        ``[N, nQ, nK]`` bool: key blocks kept per KV head (union over its ``G`` query heads).
    """
    vis = visible if visible.dim() == 3 else visible.unsqueeze(0)
    s = scores.float().masked_fill(~vis.unsqueeze(1), float("-inf"))
    if cfg.rule == "threshold":
        if math.isinf(cfg.threshold):
            keep = torch.ones_like(s, dtype=torch.bool)
        else:
            best = s.amax(-1, keepdim=True)
            keep = s >= best - cfg.gap(n_keys)[:, None]
    else:
        logits = s + torch.log(key_counts)
        p = torch.softmax(logits, dim=-1)
        ps, order = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(ps, dim=-1) - ps  # mass of the blocks ranked higher
        keep_sorted = before < cfg.tau * (1 - 1e-6) if cfg.tau < 1 else torch.ones_like(ps, dtype=torch.bool)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    keep = keep.any(1) | forced.unsqueeze(0)
    return keep & vis


def forced_blocks(q_start: torch.Tensor, q_end: torch.Tensor, num_key_blocks: int, cfg: SparseConfig) -> torch.Tensor:
    """Always-kept key blocks ``[nQ, nK]`` bool: the sink block 0 and the local blocks.

    ``q_start/q_end [nQ]``: key index of the first and one past the last query of each query block.
    Local blocks: the key blocks containing those positions and ``local_blocks - 1`` blocks before them.
    """
    bs = cfg.block_size
    j = torch.arange(num_key_blocks)
    first = torch.div(q_start, bs, rounding_mode="floor") - (cfg.local_blocks - 1)
    last = torch.div(q_end - 1, bs, rounding_mode="floor")
    forced = (j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])
    forced[:, 0] = True
    return forced
