"""Training losses for exit heads, exit gates and the router.

- :func:`focal_loss` / :func:`binary_focal_loss`: Lin et al., "Focal Loss for Dense Object Detection"
  (ICCV 2017), ``FL(p_t) = -alpha_t (1 - p_t)^gamma log p_t``; seed 004 uses it for gates and the
  router because most tokens are easy (the exit is either clearly right or clearly wrong).
  ``gamma = 0`` and no ``alpha`` is exactly cross-entropy.
- :func:`kl_distillation`: ``KL(p_full || p_exit)`` of next-token distributions, the tuned-lens
  objective (Belrose et al., "Eliciting Latent Predictions from Transformers with the Tuned Lens",
  2023) and the usual self-distillation loss of early-exit heads (LayerSkip, EE-LLM).
- :func:`sampled_tail_kl`: the same KL on a large vocabulary at the cost of a few thousand LM-head rows: the
  teacher's top-k plus its tail mass, the student's normaliser estimated from the batch's teacher tokens and
  uniformly sampled other tokens (sampled softmax with an importance weight: Jean et al., "On Using Very Large
  Target Vocabulary for Neural Machine Translation", ACL 2015).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def focal_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float = 2.0,
               alpha: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
    """Multi-class focal loss.

    Args:
        logits: ``[N, C]`` unnormalised class scores.
        target: ``[N]`` int64 class indices.
        gamma: focusing parameter (>= 0); 0 gives cross-entropy.
        alpha: optional ``[C]`` class weights (``alpha_t`` in the paper).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``[N]``).
    """
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    loss = -((1.0 - logp.exp()).clamp_min(0.0) ** gamma) * logp if gamma else -logp
    if alpha is not None:
        loss = loss * alpha.to(loss.dtype)[target]
    return _reduce(loss, reduction)


def binary_focal_loss(logit: torch.Tensor, target: torch.Tensor, gamma: float = 2.0,
                      alpha: float | None = None, reduction: str = "mean") -> torch.Tensor:
    """Binary focal loss on logits.

    Args:
        logit: ``[N]`` scores; ``sigmoid(logit)`` is the probability of class 1.
        target: ``[N]`` in {0, 1} (float or bool).
        gamma: focusing parameter; 0 gives binary cross-entropy.
        alpha: optional weight of class 1 (class 0 gets ``1 - alpha``).
    """
    target = target.to(logit.dtype)
    logp1 = F.logsigmoid(logit)
    logp0 = F.logsigmoid(-logit)
    logpt = target * logp1 + (1 - target) * logp0
    loss = -((1.0 - logpt.exp()).clamp_min(0.0) ** gamma) * logpt if gamma else -logpt
    if alpha is not None:
        loss = loss * (target * alpha + (1 - target) * (1 - alpha))
    return _reduce(loss, reduction)


def kl_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    temperature: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """``KL(softmax(teacher / T) || softmax(student / T))`` per row, in nats.

    Args:
        student_logits: ``[N, V]`` exit-head logits.
        teacher_logits: ``[N, V]`` full-model logits (no gradient needed).
        temperature: softening temperature ``T`` (the loss is scaled by ``T^2`` as in Hinton et al. 2015).
        reduction: ``"mean"`` over rows, ``"sum"`` or ``"none"`` (``[N]``).
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1) * temperature ** 2
    return _reduce(kl, reduction)


def sampled_tail_kl(union_logits: torch.Tensor, negative_logits: torch.Tensor, negative_log_weight: float,
                    t_pos: torch.Tensor, t_lp: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``KL(p_full || p_exit)`` over the partition {teacher top-k, everything else}, the student's normaliser estimated.

    The student's logits are known only on ``U`` columns (the union of the batch's teacher top-k ids) and on ``R``
    negatives drawn uniformly from the ``V - U`` other tokens; each negative stands for ``(V - U) / R`` tokens, so
    ``Z = sum_U exp(s) + (V - U) / R * sum_R exp(s)`` is an unbiased estimate of the full normaliser. With every other
    token drawn once (``R = V - U``, weight 1) the loss is exactly the tail KL over the full vocabulary. A row whose
    tail is empty (its top-k is every column) has no tail term. Mass the student moves to a token outside the
    teacher's top-k lands in the tail bucket and is paid for, as in :func:`laserlm.training.backbone.tail_kl`.

    Args:
        union_logits: ``[N, U]`` student logits on the union columns.
        negative_logits: ``[N, R]`` student logits on the sampled negatives (``R`` may be 0).
        negative_log_weight: ``log((V - U) / R)``, nats (0 when every other token is drawn).
        t_pos: ``[N, k]`` int64, the column in ``U`` of each of the row's teacher top-k tokens.
        t_lp: ``[N, k]`` the teacher's full-vocabulary log-probabilities of those tokens.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``[N]``).

    Returns the loss in nats: ``sum_k p_k (log p_k - log q_k) + p_tail (log p_tail - log q_tail)``.
    """
    s_u = union_logits.float()
    rest = negative_logits.float() + negative_log_weight
    log_z = torch.logsumexp(torch.cat([s_u, rest], -1), -1)                          # [N]
    logq = s_u.gather(1, t_pos) - log_z.unsqueeze(-1)                                # [N, k]
    lowest = torch.finfo(torch.float32).min  # not -inf: an empty tail must not give a NaN gradient
    others = s_u.scatter(1, t_pos, lowest)                                           # the row's top-k removed
    has_tail = torch.ones_like(log_z, dtype=torch.bool) if rest.shape[-1] else (others > lowest).any(-1)
    logq_tail = torch.logsumexp(torch.cat([others, rest], -1), -1) - log_z           # [N]
    logp = t_lp.float()
    p = logp.exp()
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    tiny = torch.finfo(torch.float32).tiny
    head = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
    tail = torch.where(has_tail & (p_tail > 0), p_tail * (p_tail.clamp_min(tiny).log() - logq_tail),
                       torch.zeros_like(p_tail))
    return _reduce(head + tail, reduction)


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
