"""Low-rank adapters (LoRA, Hu et al. 2021) on a transformers decoder's projections, and their merge.

The backbone stage (:mod:`laserlm.training.backbone`) trains the decoder layers at a low learning rate; with
LoRA each projection ``W [out, in]`` becomes ``W + (alpha / r) * B @ A`` with ``A [r, in]`` (small random) and
``B [out, r]`` (zeros at the start, so the adapted model starts equal to the original). Only ``A`` and ``B`` train;
the delta file (:mod:`laserlm.models.delta`) stores them, and loading merges them into the float weights before
packing.

Names: a factor is keyed ``layers.<i>.<proj>.lora_A`` / ``.lora_B`` with ``proj`` one of :data:`LORA_TARGETS`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..models.delta import LORA_OWNER as _OWNER, LORA_TARGETS, merge_factors  # noqa: F401  (re-exported)



class LoRALinear(nn.Module):
    """``y = base(x) + scale * (x @ A^T) @ B^T`` with the base ``nn.Linear`` frozen.

    Args:
        base: the projection (its weight ``[out, in]`` and bias stay frozen).
        rank: r >= 1; ``alpha``: the scale is ``alpha / r`` (Hu et al. 2021).
        generator: draws ``A`` (Kaiming-uniform as in the reference implementation); ``B`` starts at zero.

    ``forward(x [.., in]) -> [.., out]``.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = float(alpha) / rank
        dtype = base.weight.dtype
        a = torch.empty(rank, base.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)) of the reference LoRA code
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # transformers code reads .weight (dtype / device probes)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    def delta(self) -> torch.Tensor:
        """``scale * B @ A``: ``[out, in]`` float64 (the merge adds it to the float weight)."""
        return self.scale * (self.lora_B.detach().double() @ self.lora_A.detach().double())


def check_lora_args(rank: int, alpha: float, targets, num_layers: int, layers=None) -> tuple[str, ...]:
    """Validate the LoRA settings; returns the targets as a tuple.

    Raises:
        InvalidArgumentError: rank < 1, alpha <= 0 or not finite, an unknown target, a layer out of range.
    """
    if not isinstance(rank, int) or rank < 1:
        raise InvalidArgumentError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise InvalidArgumentError(f"LoRA alpha must be > 0, got {alpha!r}")
    targets = tuple(targets)
    if not targets or (bad := [t for t in targets if t not in LORA_TARGETS]):
        raise InvalidArgumentError(f"unknown LoRA targets {list(bad) if targets else '(none)'}; use some of "
                                   f"{', '.join(LORA_TARGETS)}")
    if layers is not None and (bad := [i for i in layers if not 0 <= int(i) < num_layers]):
        raise InvalidArgumentError(f"LoRA layers {bad} out of range 0-{num_layers - 1}")
    return targets


def _decoder_layers(model) -> nn.ModuleList:
    return model.model.layers


def apply_lora(model, rank: int = 16, alpha: float = 32.0, targets=LORA_TARGETS, layers=None,
               seed: int = 0) -> dict[str, LoRALinear]:
    """Wrap ``targets`` of every decoder layer (or of ``layers``) of a transformers causal LM in :class:`LoRALinear`.

    The model's own parameters are frozen; the returned ``{"layers.<i>.<proj>": module}`` hold the trainable
    factors. The model computes exactly as before until ``B`` moves away from zero.

    Raises:
        InvalidArgumentError: bad settings (:func:`check_lora_args`), or a model already wrapped.
    """
    decoder = _decoder_layers(model)
    targets = check_lora_args(rank, alpha, targets, len(decoder), layers)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, layer in enumerate(decoder):
        if layers is not None and i not in set(layers):
            continue
        for proj in targets:
            owner = getattr(layer, _OWNER[proj])
            base = getattr(owner, proj)
            if isinstance(base, LoRALinear):
                raise InvalidArgumentError("the model already carries LoRA adapters")
            if not isinstance(base, nn.Linear):
                raise InvalidArgumentError(f"layer {i} {proj} is a {type(base).__name__}, not a float nn.Linear; "
                                           "LoRA training needs float weights (load with --weights fp32)")
            mod = LoRALinear(base, rank, alpha, generator=g)
            setattr(owner, proj, mod)
            out[f"layers.{i}.{proj}"] = mod
    return out


def lora_factors(mods: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """``{"layers.<i>.<proj>.lora_A": [r, in], ".lora_B": [out, r]}`` float32 copies of the factors."""
    out = {}
    for name, m in mods.items():
        out[f"{name}.lora_A"] = m.lora_A.detach().float().clone()
        out[f"{name}.lora_B"] = m.lora_B.detach().float().clone()
    return out


def load_factors(mods: dict[str, LoRALinear], factors: dict[str, torch.Tensor]) -> None:
    """Copy factors (as from :func:`lora_factors`) into the wrapped modules.

    Raises:
        InvalidArgumentError: a missing factor or one of another shape.
    """
    with torch.no_grad():
        for name, m in mods.items():
            for part in ("lora_A", "lora_B"):
                t = factors.get(f"{name}.{part}")
                p = getattr(m, part)
                if t is None or tuple(t.shape) != tuple(p.shape):
                    raise InvalidArgumentError(f"LoRA factor {name}.{part} missing or of shape "
                                               f"{None if t is None else tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))


def unwrap_lora(model) -> None:
    """Put the base projections back (drops the factors; nothing is merged)."""
    for layer in _decoder_layers(model):
        for proj, owner_name in _OWNER.items():
            owner = getattr(layer, owner_name)
            m = getattr(owner, proj, None)
            if isinstance(m, LoRALinear):
                setattr(owner, proj, m.base)


__all__ = ["LORA_TARGETS", "LoRALinear", "apply_lora", "check_lora_args", "load_factors", "lora_factors",
           "merge_factors", "unwrap_lora"]
