"""Training loops: exit-head adapters (KL distillation, backbone frozen) and the optional joint stage.

Curriculum (seed 004): stage 1 trains exit heads, then gates (:mod:`.gates`), everything else frozen;
stage 2 (optional, ``joint_epochs > 0``) fine-tunes heads and gates together at a low learning rate.

Defaults and their sources:
- head stage LR ``1e-3`` (Adam), 250 steps: DESIGN.md's measurement on SmolLM2-135M (an affine tuned
  lens trained 250 Adam steps on 6k WikiText-2 valid tokens lifted layer-20 agreement 0.11 -> 0.43).
  The seed's 3e-5 is for fine-tuning the backbone jointly; with the backbone frozen and
  zero-initialised adapters it barely moves them in 250 steps, so the head stage uses the tuned-lens
  LR (Belrose et al. 2023 train their lenses at 1e-3 as well).
- joint stage LR ``3e-5`` with linear warm-up, gradient clipping at 1.0, exit-threshold decay 0.95 per
  epoch: seed 004.
- two further options from the seed's guidance, off by default because they showed no gain on the
  bundled models: *adaptive clipping* inside the seed's
  0.2-1.0 range (the clip follows a low percentile of the recent gradient norms: AutoClip, Seetharaman et al.
  2020) and *cross-layer gradient normalisation* (each exit point's parameters get a gradient of the same
  norm, the mean over exits: the "gradient equilibrium" of Li et al. 2019, "Improved techniques for training
  adaptive deep networks", applied to the per-exit modules because the backbone is frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import InvalidArgumentError
from .collect import ExitStates
from .gates import gate_inputs
from .heads import gate_scalars_batch
from .losses import binary_focal_loss, kl_distillation


@dataclass
class HeadTrainConfig:
    """Head stage (stage 1). ``lr`` 1e-3 / 250 steps: DESIGN.md tuned-lens anchor; clip 1.0: seed 004."""

    steps: int = 250
    batch_tokens: int = 128  # 256 ran several times slower per position on the shared 2-core machine
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    adaptive_clip: bool = False      # clip at a low percentile of recent norms, within [0.2, 1.0] (seed range)
    cross_layer_norm: bool = False   # equal gradient norm per exit point (gradient equilibrium)
    seed: int = 0
    bf16_head: bool = True  # LM-head matmuls of training steps in bfloat16; evaluation stays float32

    def validate(self) -> HeadTrainConfig:
        _check_positive("steps", self.steps, allow_zero=True)
        _check_positive("batch_tokens", self.batch_tokens)
        _check_positive("lr", self.lr)
        _check_positive("grad_clip", self.grad_clip)
        if self.weight_decay < 0 or self.warmup_steps < 0:
            raise InvalidArgumentError("weight decay and warm-up steps must be >= 0")
        return self


@dataclass
class JointTrainConfig:
    """Joint stage (stage 2), seed 004 defaults: LR 3e-5, linear warm-up, clip 1.0, threshold decay 0.95/epoch.

    ``exit_threshold`` is the training-time gate threshold: tokens whose gate probability reaches it
    would exit at that exit point, so their distillation loss gets weight ``1 + exit_weight``; it is
    multiplied by ``threshold_decay`` after each epoch (more tokens exit as training proceeds).
    """

    epochs: int = 0
    steps_per_epoch: int = 100
    batch_tokens: int = 256
    lr: float = 3e-5
    warmup_steps: int = 20
    grad_clip: float = 1.0
    adaptive_clip: bool = False
    cross_layer_norm: bool = False
    exit_threshold: float = 0.9
    threshold_decay: float = 0.95
    exit_weight: float = 1.0
    gate_loss_weight: float = 1.0
    gamma: float = 2.0
    seed: int = 0

    def validate(self) -> JointTrainConfig:
        _check_positive("joint epochs", self.epochs, allow_zero=True)
        _check_positive("joint lr", self.lr)
        if not 0 < self.threshold_decay <= 1:
            raise InvalidArgumentError(f"threshold decay must be in (0, 1], got {self.threshold_decay}")
        if not 0 < self.exit_threshold <= 1:
            raise InvalidArgumentError(f"exit threshold must be in (0, 1], got {self.exit_threshold}")
        return self


def _check_positive(name, value, allow_zero=False):
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidArgumentError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def lr_lambda(warmup_steps: int):
    """Linear warm-up from ~0 to 1 over ``warmup_steps``, then constant."""
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


ADAPTIVE_CLIP_RANGE = (0.2, 1.0)  # seed 004: "gradient clipping adjusted between 0.2 and 1.0"
ADAPTIVE_CLIP_PERCENTILE = 10    # AutoClip (Seetharaman et al. 2020) clips at the 10th percentile of past norms
ADAPTIVE_CLIP_WINDOW = 100       # recent steps the percentile is taken over


class GradientControl:
    """What happens to the gradients between ``backward`` and the optimizer step.

    1. ``cross_layer_norm``: each group (one exit point's parameters) is rescaled so that its gradient norm is the
       mean of the groups' norms (the sum of the groups' norms is kept; exits whose loss is small no longer get a small update, the
       "gradient equilibrium" of Li et al. 2019).
    2. Clipping of the total norm to ``grad_clip``; with ``adaptive_clip`` the clip is the 10th percentile of the
       last 100 pre-clip norms, kept within [0.2, 1.0] (AutoClip, Seetharaman et al. 2020, in the seed's range).

    ``__call__()`` returns the total gradient norm before clipping.
    """

    def __init__(self, groups: list[list[torch.Tensor]], grad_clip: float, adaptive_clip: bool = False,
                 cross_layer_norm: bool = False):
        self.groups = [g for g in groups if g]
        self.params = [p for g in self.groups for p in g]
        self.grad_clip, self.adaptive_clip, self.cross_layer_norm = grad_clip, adaptive_clip, cross_layer_norm
        self.history: list[float] = []

    def clip_value(self) -> float:
        if not self.adaptive_clip:
            return self.grad_clip
        lo, hi = ADAPTIVE_CLIP_RANGE
        if not self.history:
            return hi
        recent = sorted(self.history[-ADAPTIVE_CLIP_WINDOW:])
        q = recent[min(len(recent) - 1, len(recent) * ADAPTIVE_CLIP_PERCENTILE // 100)]
        return min(hi, max(lo, q))

    def __call__(self) -> float:
        if self.cross_layer_norm and len(self.groups) > 1:
            norms = [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in g
                                                           if p.grad is not None])) for g in self.groups]
            mean = torch.stack(norms).mean()
            for g, n in zip(self.groups, norms):
                if n > 0:
                    for p in g:
                        if p.grad is not None:
                            p.grad.mul_(mean / n)
        clip = self.clip_value()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        self.history.append(norm)
        return norm


def _optimizer_step(loss: torch.Tensor, opt, sched, control: GradientControl) -> float:
    """Backward, normalise / clip the gradients (``control``), step optimizer and schedule; returns the loss value."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    control()
    opt.step()
    sched.step()
    return float(loss.detach())


class Bf16Logits:
    """Final norm + LM head (+ soft cap) with a bfloat16 copy of the LM-head weight, made once.

    The LM head (``V x d`` = 49152 x 576 on SmolLM2) dominates a head-training step; in bfloat16 the
    matmuls run ~2x faster here (AVX512-BF16). ``__call__(hidden [.., d]) -> [.., V]`` float32.
    """

    def __init__(self, model_adapter):
        self.base = model_adapter
        self.weight = model_adapter.lm_head.weight.detach().to(torch.bfloat16)
        bias = getattr(model_adapter.lm_head, "bias", None)
        self.bias = bias.detach().float() if bias is not None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.base.norm(hidden).to(torch.bfloat16)
        out = (x @ self.weight.T).float()
        if self.bias is not None:
            out = out + self.bias
        cap = self.base.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap is not None else out


_BF16_FASTER: bool | None = None


def bf16_matmul_is_faster() -> bool:
    """Whether a bfloat16 matmul (64 x 576 @ 576 x 2048, LM-head shaped) runs faster than float32 on this CPU, timed
    once per process (best of 3 each; at this size emulated bf16 is ~100x slower, native bf16 ~2x faster, so the
    answer does not hinge on timing noise as it did with a smaller probe). With AVX512-BF16 or AMX it is ~2x faster; without them (e.g. AMD Zen 3,
    AVX2 only) PyTorch emulates it and one head-training step took ~32 s instead of well under a second."""
    global _BF16_FASTER
    if _BF16_FASTER is None:
        import time  # noqa: PLC0415

        def best(dtype):
            a, b = torch.randn(64, 576).to(dtype), torch.randn(576, 2048).to(dtype)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
            return min(times)

        _BF16_FASTER = best(torch.bfloat16) < best(torch.float32)
    return _BF16_FASTER


def train_heads(heads: nn.ModuleDict, teacher_fn, data: ExitStates, cfg: HeadTrainConfig,
                progress: bool = True) -> list[float]:
    """Train every exit head's adapter by ``KL(p_full || p_exit)`` on ``data``; returns the loss curve.

    Args:
        heads: ``str(exit_point) -> ExitHead`` (see :func:`.heads.make_exit_heads`).
        teacher_fn: the full model's head (``Engine.head``), applied to ``data.final_hidden``; the
            teacher distribution of a batch is computed once, without gradient, for all exit points.
        data: collected states (training split).
    """
    cfg.validate()
    params = [p for p in heads.parameters() if p.requires_grad]
    if cfg.steps == 0 or not params:
        return []
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps))
    n = len(data)
    losses = []
    fast = None
    if cfg.bf16_head and bf16_matmul_is_faster():
        first = heads[str(data.exit_points[0])]
        fast = Bf16Logits(first._base)
        teacher_fn = fast
    control = GradientControl([[p for p in heads[str(e)].parameters() if p.requires_grad] for e in data.exit_points],
                              cfg.grad_clip, cfg.adaptive_clip, cfg.cross_layer_norm)
    bar = tqdm(range(cfg.steps), desc="train exit heads", unit="step", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, n, (min(cfg.batch_tokens, n),), generator=g)
        with torch.no_grad():
            teacher = teacher_fn(data.final_hidden[idx]).float()
        loss = 0.0
        for e in data.exit_points:
            head, h = heads[str(e)], data.hidden[e][idx]
            student = fast(head.adapt(h)) if fast is not None else head(h)
            loss = loss + kl_distillation(student, teacher)
        loss = loss / len(data.exit_points)
        losses.append(_optimizer_step(loss, opt, sched, control))
        bar.set_postfix(kl=f"{losses[-1]:.3f}")
    return losses


@dataclass
class ExitOutputs:
    """What the exit heads say on a set of positions (heads fixed).

    Attributes:
        agree: ``exit -> [N]`` bool, exit head top-1 == full-model top-1.
        kl: ``exit -> [N]`` ``KL(p_full || p_exit)`` in nats.
        nll: ``exit -> [N]`` negative log-likelihood of the text's next token under the exit head.
        scalars: ``exit -> [N, 6]`` gate scalars (:func:`laserlm.depth.heads.gate_scalars_batch`).
        full_nll: ``[N]`` the full model's NLL of the next token.
    """

    agree: dict
    kl: dict
    nll: dict
    scalars: dict
    full_nll: torch.Tensor

    def summary(self) -> dict:
        """``exit -> {agreement, kl}`` means."""
        return {e: {"agreement": float(self.agree[e].float().mean()), "kl": float(self.kl[e].mean())}
                for e in self.agree}


@torch.no_grad()
def compute_exit_outputs(heads, teacher_fn, data: ExitStates, num_layers: int,
                         batch_tokens: int = 512) -> ExitOutputs:
    """Apply each exit head to ``data``; ``heads``: ``str(exit) -> ExitHead`` or ``None`` (plain logit lens
    = ``teacher_fn`` on the exit hidden state)."""
    agree, kl, nll, scal = ({e: [] for e in data.exit_points} for _ in range(4))
    full_nll = []
    for s in range(0, len(data), batch_tokens):
        sl = slice(s, s + batch_tokens)
        teacher = torch.log_softmax(teacher_fn(data.final_hidden[sl]).float(), -1)
        labels = data.labels[sl].unsqueeze(-1)
        full_nll.append(-teacher.gather(-1, labels).squeeze(-1))
        for e in data.exit_points:
            h = data.hidden[e][sl]
            logits = (heads[str(e)](h) if heads is not None else teacher_fn(h)).float()
            logp = torch.log_softmax(logits, -1)
            agree[e].append(logits.argmax(-1) == data.full_top1[sl])
            kl[e].append((teacher.exp() * (teacher - logp)).sum(-1))
            nll[e].append(-logp.gather(-1, labels).squeeze(-1))
            ats = data.ats[sl] if data.ats is not None else None
            scal[e].append(gate_scalars_batch(logits, h, data.hidden[data.group_start[e]][sl], ats, e, num_layers))
    cat = lambda d: {e: torch.cat(v) for e, v in d.items()}  # noqa: E731
    return ExitOutputs(cat(agree), cat(kl), cat(nll), cat(scal), torch.cat(full_nll))


def joint_finetune(heads: nn.ModuleDict, gates: nn.ModuleDict, teacher_fn, data: ExitStates, num_layers: int,
                   cfg: JointTrainConfig, progress: bool = True) -> list[float]:
    """Stage 2: heads and gates together (seed 004 curriculum). Returns the loss curve.

    Loss per batch = mean over exits of the token-weighted KL (weight ``1 + exit_weight`` where the
    gate would exit at the current training threshold) + ``gate_loss_weight`` x gate focal loss with
    labels from the *current* heads. The threshold decays by ``threshold_decay`` per epoch.
    """
    cfg.validate()
    if cfg.epochs == 0:
        return []
    params = [p for m in (heads, gates) for p in m.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps))
    control = GradientControl([[p for m in (heads[str(e)], gates[str(e)]) for p in m.parameters() if p.requires_grad]
                               for e in data.exit_points], cfg.grad_clip, cfg.adaptive_clip, cfg.cross_layer_norm)
    g = torch.Generator().manual_seed(cfg.seed)
    n, threshold, losses = len(data), cfg.exit_threshold, []
    for epoch in range(cfg.epochs):
        bar = tqdm(range(cfg.steps_per_epoch), desc=f"joint epoch {epoch + 1}/{cfg.epochs} (threshold "
                   f"{threshold:.3f})", unit="step", disable=not progress)
        for _ in bar:
            idx = torch.randint(0, n, (min(cfg.batch_tokens, n),), generator=g)
            with torch.no_grad():
                teacher = teacher_fn(data.final_hidden[idx]).float()
            total = 0.0
            for e in data.exit_points:
                h = data.hidden[e][idx]
                logits = heads[str(e)](h)
                kl = kl_distillation(logits, teacher, reduction="none")
                ats = data.ats[idx] if data.ats is not None else None
                scalars = gate_scalars_batch(logits.detach(), h, data.hidden[data.group_start[e]][idx], ats, e,
                                             num_layers)
                gate_logit = gates[str(e)](h, gate_inputs(gates[str(e)], scalars))
                label = (logits.detach().argmax(-1) == data.full_top1[idx]).float()
                weight = 1.0 + cfg.exit_weight * (torch.sigmoid(gate_logit.detach()) > threshold).float()
                total = total + (weight * kl).mean() + cfg.gate_loss_weight * binary_focal_loss(
                    gate_logit, label, gamma=cfg.gamma)
            loss = total / len(data.exit_points)
            losses.append(_optimizer_step(loss, opt, sched, control))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        threshold *= cfg.threshold_decay
    return losses
