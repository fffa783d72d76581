"""What each layer contributes, measured before any training on a short calibration text.

- **Raw exit-head agreement**: top-1 of the final norm + LM head applied to the hidden state after layer i,
  compared with the full model's top-1 (DESIGN.md: useless without training on small models).
- **Quick lens**: an affine map per layer fitted in closed form (ridge least squares) from the hidden state
  after layer i to the final hidden state on the first half of the tokens, scored on the second half
  (a tuned lens, Belrose et al. 2023, without gradient steps). Its max probability gives a confidence-exit
  simulation (CALM, Schuster et al. 2022) on exact hidden states: an optimistic bound, no KV bridge error.
- **Block Influence** ``BI_i = 1 - E_t[cos(h_i, h_{i+1})]`` (ShortGPT, Men et al. 2024; same definition as
  :func:`laserlm.depth.pruning.block_influence`).
- **Skip sensitivity**: top-1 agreement and mean NLL increase when layer i's attention (or MLP) output is
  replaced by zeros and the remaining layers run unchanged (the residual stream carries on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError


@dataclass
class HiddenStates:
    """Hidden states of one stand-alone forward over ``ids [N]``.

    Attributes:
        ids: ``[N]`` token ids.
        hidden: ``[L + 1, N, d]`` float32; ``hidden[0]`` the embeddings, ``hidden[i + 1]`` after layer i.
        logits_top1: ``[N]`` the full model's top-1 token at each position.
        nll: ``[N - 1]`` the full model's NLL (nats) of token ``t + 1`` at position t.
    """

    ids: torch.Tensor
    hidden: torch.Tensor
    logits_top1: torch.Tensor
    nll: torch.Tensor


@torch.inference_mode()
def collect(engine, ids: torch.Tensor) -> HiddenStates:
    """Run ``ids [N]`` (N >= 8) through every layer once, keeping each layer's output.

    Raises:
        InvalidArgumentError: fewer than 8 tokens.
    """
    ids = ids.reshape(-1)
    if ids.shape[0] < 8:
        raise InvalidArgumentError(f"the profile needs at least 8 calibration tokens, got {ids.shape[0]}")
    h, st = engine.begin(ids.unsqueeze(0), use_cache=False)
    hs = [h[0].float()]
    for i in range(engine.num_layers):
        h = engine.run_layer(i, h, st)
        hs.append(h[0].float())
    logits = engine.head(h)[0]
    return HiddenStates(ids, torch.stack(hs), logits.argmax(-1), _nll(logits, ids))


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="none")


def block_influence(hs: HiddenStates) -> list[float]:
    """ShortGPT Block Influence per layer from collected states, ``[L]``."""
    h = hs.hidden.double()
    return [float(1.0 - F.cosine_similarity(h[i], h[i + 1], dim=-1).mean()) for i in range(h.shape[0] - 1)]


def fit_lens(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-2) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge least squares ``y ≈ x @ W + b`` for ``x, y [N, d]``: returns ``(W [d, d], b [d])`` float64.

    The ridge term is ``ridge * mean(diag(XᵀX))`` so it scales with the hidden-state norm.
    """
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    a = xc.T @ xc
    a += torch.eye(a.shape[0], dtype=a.dtype) * ridge * a.diagonal().mean().clamp_min(1e-12)
    w = torch.linalg.solve(a, xc.T @ yc)
    return w, my - mx @ w


@dataclass
class LayerQuality:
    """Per-layer agreement with the full model on the held-out half (``[L]`` lists, fractions in [0, 1]).

    Attributes:
        raw_agreement: top-1 of the plain exit head after layer i equals the full model's.
        lens_agreement: the same with the quick lens.
        lens_top1, lens_conf: ``[L, M]`` the lens's top-1 and max probability per held-out position.
        full_top1: ``[M]`` the full model's top-1 on the held-out positions.
    """

    raw_agreement: list[float]
    lens_agreement: list[float]
    lens_top1: torch.Tensor
    lens_conf: torch.Tensor
    full_top1: torch.Tensor


@torch.inference_mode()
def layer_quality(engine, hs: HiddenStates, ridge: float = 1e-2, progress=None) -> LayerQuality:
    """Raw exit-head and quick-lens agreement per layer: the lens is fitted on the first half of the
    positions and everything is scored on the second half. ``progress``: optional callable per layer."""
    n = hs.ids.shape[0]
    fit, ev = slice(0, n // 2), slice(n // 2, n)
    full = hs.logits_top1[ev]
    final = hs.hidden[-1]
    raw, lens, tops, confs = [], [], [], []
    L = hs.hidden.shape[0] - 1
    for i in range(L):
        x = hs.hidden[i + 1]
        raw_top = engine.head(x[ev].to(engine.dtype)).argmax(-1)
        raw.append(float((raw_top == full).float().mean()))
        if i == L - 1:
            top, conf = raw_top, torch.softmax(engine.head(x[ev].to(engine.dtype)), -1).amax(-1)
        else:
            w, b = fit_lens(x[fit], final[fit], ridge)
            mapped = (x[ev].double() @ w + b).to(engine.dtype)
            p = torch.softmax(engine.head(mapped), -1)
            conf, top = p.max(-1)
        lens.append(float((top == full).float().mean()))
        tops.append(top)
        confs.append(conf.float())
        if progress:
            progress()
    return LayerQuality(raw, lens, torch.stack(tops), torch.stack(confs), full)


def confidence_exits(q: LayerQuality, exit_points: list[int], min_depth: int, threshold: float) -> dict:
    """Simulate a confidence exit rule on the lens: a token stops at the first exit point (a layer count,
    ``>= min_depth``) where the lens max probability is at least ``threshold``, else runs every layer.

    Returns ``{"threshold", "layers_per_token", "agreement", "exit_rate", "checks_per_token"}``
    (``checks_per_token``: exit points whose head was evaluated, per token).
    """
    L, m = q.lens_conf.shape
    points = [p for p in exit_points if min_depth <= p < L]
    depth = torch.full((m,), float(L))
    top = q.full_top1.clone()
    checks = torch.zeros(m)
    done = torch.zeros(m, dtype=torch.bool)
    for p in points:
        checks += (~done).float()
        stop = (~done) & (q.lens_conf[p - 1] >= threshold)
        depth[stop] = p
        top[stop] = q.lens_top1[p - 1][stop]
        done |= stop
    return {"threshold": threshold, "layers_per_token": float(depth.mean()),
            "agreement": float((top == q.full_top1).float().mean()), "exit_rate": float(done.float().mean()),
            "checks_per_token": float(checks.mean())}


class _ZeroOutput:
    """Forward hook replacing a submodule's output (a tensor or a tuple whose first item is one) by zeros."""

    def __call__(self, module, args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]),) + tuple(output[1:])
        return torch.zeros_like(output)


def skippable(engine) -> bool:
    """Whether the layers' attention and MLP outputs can be switched off by hooks: on the transformers submodules
    (float weights), or on the fused output projections ``o`` / ``down`` of a packed layer (int4/int8/native
    weights, run on the packed PyTorch path for that layer: the whole-layer kernel calls no module)."""
    layer = engine.adapter.layers[0]
    if 0 in getattr(engine, "_packed", ()):
        pk = layer.laserlm_packed
        return hasattr(pk, "o") and hasattr(pk, "down")
    return hasattr(layer, "self_attn") and hasattr(layer, "mlp")


@torch.inference_mode()
def skip_sensitivity(engine, hs: HiddenStates, part: str, layer: int, positions: int | None = None) -> dict:
    """Agreement with the full model and mean NLL increase (nats) when ``part`` (``"attention"`` or
    ``"mlp"``) of decoder layer ``layer`` outputs zeros; the forward restarts from the stored state before
    that layer, over the first ``positions`` tokens (default all). On packed weights the block's output projection
    (``o`` for attention, ``down`` for the MLP) outputs zeros: the same block output, since Gemma3's post-norm
    of zeros is zero.

    Raises:
        InvalidArgumentError: unknown part, or a model whose layers cannot be switched off (see
            :func:`skippable`).
    """
    if part not in ("attention", "mlp"):
        raise InvalidArgumentError(f"part must be 'attention' or 'mlp', got {part!r}")
    if not skippable(engine):
        raise InvalidArgumentError("skip sensitivity needs decoder layers with separate attention and MLP blocks")
    n = hs.ids.shape[0] if positions is None else min(positions, hs.ids.shape[0])
    ids = hs.ids[:n]
    layer_mod = engine.adapter.layers[layer]
    packed = layer in getattr(engine, "_packed", ())
    if packed:  # the packed PyTorch path of this layer, which calls the fused projections
        pk = layer_mod.laserlm_packed
        mod = pk.o if part == "attention" else pk.down
    else:  # the transformers layers, which call the hooked submodules
        mod = layer_mod.self_attn if part == "attention" else layer_mod.mlp
    handle = mod.register_forward_hook(_ZeroOutput())
    fast, native = engine.fast_layers, engine.native_layers
    if packed:
        engine.native_layers = False
    else:
        engine.fast_layers = False
    try:
        _, st = engine.begin(ids.unsqueeze(0), use_cache=False)
        h = hs.hidden[layer, :n].unsqueeze(0).to(engine.dtype)
        h = engine.run_layer(layer, h, st)
    finally:
        handle.remove()
        engine.fast_layers, engine.native_layers = fast, native
    h = engine.run_layers(layer + 1, engine.num_layers, h, st)
    logits = engine.head(h)[0]
    agree = float((logits.argmax(-1) == hs.logits_top1[:n]).float().mean())
    return {"agreement": agree, "nll_increase": float((_nll(logits, ids) - hs.nll[: n - 1]).mean())}


@torch.inference_mode()
def subset_quality(engine, hs: HiddenStates, kept: list[int]) -> dict:
    """Top-1 agreement and perplexity ratio (``exp`` of the mean NLL increase) of the model restricted to
    the ``kept`` layers (static pruning), on the held-out half of the positions."""
    h, st = engine.begin(hs.ids.unsqueeze(0), use_cache=False)
    for i in sorted(kept):
        h = engine.run_layer(i, h, st)
    logits = engine.head(h)[0]
    n = hs.ids.shape[0]
    ev = slice(n // 2, n)
    nll = _nll(logits, hs.ids)
    return {"agreement": float((logits.argmax(-1)[ev] == hs.logits_top1[ev]).float().mean()),
            "ppl_ratio": float(torch.exp((nll[n // 2:] - hs.nll[n // 2:]).mean()))}
