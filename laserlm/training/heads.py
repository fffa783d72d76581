"""Exit heads for training: the depth package's :class:`~laserlm.depth.heads.ExitHead` per exit point.

An exit head is the base model's final norm + LM head after an identity-initialised adapter, the
tuned lens of Belrose et al. 2023 ("Eliciting Latent Predictions from Transformers with the Tuned
Lens"): ``affine`` (``h -> W h + b``, ``W = I``) or ``lowrank`` (``h -> h + U D h``, ``U = 0``). Only the
adapter's parameters are trained; the base model's norm and LM head stay frozen and shared.

The gate features (:func:`gate_scalars_batch`) are the depth package's own, so gates trained here see
exactly the features the adaptive scheduler computes at run time.
"""

from __future__ import annotations

from torch import nn

from ..depth.heads import ADAPTER_KINDS, ExitHead, confidence_scalars, gate_scalars_batch  # noqa: F401  (re-exported)


def make_exit_heads(engine, exit_points: list[int], adapter: str = "affine", rank: int = 16) -> nn.ModuleDict:
    """One identity-initialised :class:`ExitHead` per exit point, keyed ``str(exit_point)``, in float32.

    Raises:
        InvalidArgumentError: unknown adapter kind or bad rank (from :class:`ExitHead`).
    """
    heads = nn.ModuleDict({str(e): ExitHead(engine.adapter, adapter, rank) for e in exit_points})
    return heads.float()
