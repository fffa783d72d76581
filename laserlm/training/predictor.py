"""Training and certifying the complexity predictor (seed 000 §2.1; :mod:`laserlm.depth.predictor`).

- **Inputs** of a calibration position: the input token and the ``context`` tokens before it in its chunk (their
  embeddings), the previous position's ATS (when collected) and the previous position's exit depth.
- **Training** (teacher forcing): labels ``agree[e]`` (the trained exit head at exit point ``e`` keeps the full
  model's top-1, the gates' labels), binary focal loss (gamma 2, Lin et al. 2017, as the gates) on every exit
  point's logit; the previous position's exit depth is its *oracle* depth (the first exit point whose head
  agrees, 1.0 when none), since the predictor's own decisions do not exist yet. Full-batch AdamW.
- **Certification**: at decoding time the previous exit depth is the predictor's own decision, which depends
  on the threshold, so for every candidate threshold the decisions are made position by position in order
  (:func:`sequential_decisions`, all candidates at once). The Learn-then-Test fixed-sequence test of
  :func:`laserlm.training.thresholds.fixed_sequence_test` then picks the loosest certified threshold. Losses are
  the exit heads' on exact hidden states, so the certificate is about the ``deferred`` bridge (exact cache; the
  ``propagate`` bridge changes later tokens' inputs and is not covered).
- The first position of each chunk is the prompt (full depth, as in scoring) and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..depth.predictor import ComplexityPredictor, exit_index, predictor_scalars, window_embeddings, window_ids
from ..errors import InvalidArgumentError
from .losses import binary_focal_loss
from .thresholds import candidate_thresholds, fixed_sequence_test, position_losses, resolve_target, shallow_exit_bias


@dataclass
class PredictorTrainConfig:
    """Predictor stage: AdamW LR 3e-3, 300 full-batch steps, focal gamma 2, context 4 tokens, 32 channels."""

    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 1e-3
    gamma: float = 2.0
    context: int = 4
    channels: int = 32
    seed: int = 0


@dataclass
class PredictorInputs:
    """Inputs of ``N`` positions: ``emb [N, k+1, d]``, ``prev_ats [N]`` (NaN: none), ``oracle_prev [N]``
    (previous position's oracle exit depth / L), ``first [N]`` bool (a chunk's first position)."""

    emb: torch.Tensor
    prev_ats: torch.Tensor
    oracle_prev: torch.Tensor
    first: torch.Tensor


def split_token_ids(tokens: torch.Tensor, split, seq_len: int) -> torch.Tensor:
    """``[len(split)]`` input token id of every position of ``split`` (whole chunks of ``seq_len`` positions of
    the token stream ``tokens``, see :func:`laserlm.training.collect.collect_exit_states`)."""
    return tokens[split.chunk * seq_len + torch.arange(len(split)) % seq_len]


def oracle_depth(agree: torch.Tensor, exits: list[int], num_layers: int) -> torch.Tensor:
    """``agree [E, N]`` bool -> ``[N]`` the first exit point whose head agrees, as a fraction of the layers
    (1.0 when none does)."""
    depth = torch.tensor(list(exits) + [num_layers], dtype=torch.float32) / num_layers
    ok = torch.cat([agree, torch.ones(1, agree.shape[1], dtype=torch.bool)], dim=0)
    return depth[ok.float().argmax(0)]


@torch.no_grad()
def predictor_inputs(engine, tokens: torch.Tensor, split, seq_len: int, agree: torch.Tensor, exits: list[int],
                     context: int) -> PredictorInputs:
    """Build :class:`PredictorInputs` for ``split`` (``agree [E, N]`` gives the oracle previous depth)."""
    ids = split_token_ids(tokens, split, seq_len)
    first = torch.ones(len(split), dtype=torch.bool)
    first[1:] = split.chunk[1:] != split.chunk[:-1]
    emb = window_embeddings(engine.adapter.embed, window_ids(ids, context, first))
    L = engine.num_layers
    oracle = oracle_depth(agree, exits, L)
    prev = torch.ones(len(split))
    prev[1:] = oracle[:-1]
    prev[first] = 1.0
    ats = torch.full((len(split),), float("nan"))
    if split.ats is not None:
        ats[1:] = split.ats[:-1].float()
        ats[first] = float("nan")
    return PredictorInputs(emb, ats, prev, first)


def train_predictor(predictor: ComplexityPredictor, inputs: PredictorInputs, agree: torch.Tensor,
                    cfg: PredictorTrainConfig) -> list[float]:
    """Fit ``predictor`` on ``agree [E, N]`` labels (teacher forcing); returns the loss curve (every 50 steps).

    Raises:
        InvalidArgumentError: no positions.
    """
    if agree.shape[1] == 0:
        raise InvalidArgumentError("the predictor's training split is empty")
    torch.manual_seed(cfg.seed)
    scal = predictor_scalars(inputs.prev_ats, inputs.oracle_prev, predictor.uses_ats)
    y = agree.T.float()
    keep = ~inputs.first
    opt = torch.optim.AdamW(predictor.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    curve = []
    predictor.train()
    for step in range(cfg.steps):
        opt.zero_grad()
        logits = predictor(inputs.emb[keep], scal[keep])
        loss = binary_focal_loss(logits.reshape(-1), y[keep].reshape(-1), gamma=cfg.gamma)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            curve.append(round(float(loss.detach()), 5))
    predictor.eval()
    return curve


@torch.no_grad()
def teacher_forced_probs(predictor: ComplexityPredictor, inputs: PredictorInputs) -> torch.Tensor:
    """``[E, N]`` exit probabilities with the oracle previous depth (for candidate thresholds and AUROC)."""
    scal = predictor_scalars(inputs.prev_ats, inputs.oracle_prev, predictor.uses_ats)
    return torch.sigmoid(predictor(inputs.emb, scal)).T


@torch.no_grad()
def sequential_decisions(predictor: ComplexityPredictor, inputs: PredictorInputs, thresholds: list[float],
                         num_layers: int) -> torch.Tensor:
    """``[C, N]`` exit index (``E`` = full depth) of every position under each of ``C`` thresholds, made in
    order as the scheduler makes them: each position's "previous exit depth" is the decision just made for the
    position before it under the same threshold (1.0 after a chunk's first position, the prompt, which never
    exits)."""
    c, n = len(thresholds), inputs.emb.shape[0]
    E = len(predictor.exit_points)
    depth_of = torch.tensor(list(predictor.exit_points) + [num_layers], dtype=torch.float32) / num_layers
    lam = torch.tensor(thresholds, dtype=torch.float32)
    out = torch.full((c, n), E, dtype=torch.long)
    prev = torch.ones(c)
    for t in range(n):
        if bool(inputs.first[t]):
            prev = torch.ones(c)
            continue
        emb = inputs.emb[t:t + 1].expand(c, -1, -1)
        scal = predictor_scalars(inputs.prev_ats[t].expand(c), prev, predictor.uses_ats)
        probs = torch.sigmoid(predictor(emb, scal))  # [C, E]
        ok = torch.cat([probs > lam.unsqueeze(1), torch.ones(c, 1, dtype=torch.bool)], dim=1)
        idx = ok.float().argmax(1)
        out[:, t] = idx
        prev = depth_of[idx]
    return out


def certify_predictor(predictor: ComplexityPredictor, inputs: PredictorInputs, agree: torch.Tensor,
                      num_layers: int, *, target_agreement: float | None, max_ppl_increase: float | None,
                      nll: torch.Tensor | None, full_nll: torch.Tensor | None, delta: float, method: str | None,
                      candidates: list[float], counted: torch.Tensor | None = None):
    """Loosest certified predictor threshold (fixed-sequence Learn-then-Test on the calibration split).

    Args:
        agree, nll: ``[E, N]``; ``full_nll [N]``; ``counted [N]`` bool positions that count (default all but
            each chunk's first).
        candidates: thresholds from strict to loose (e.g. :func:`candidate_thresholds` of the gate split).

    Returns ``(Calibration, decisions [C, N])``.
    """
    target, method = resolve_target(target_agreement, max_ppl_increase, delta, method)
    kind = target["kind"]
    keep = ~inputs.first if counted is None else (counted & ~inputs.first)
    dec = sequential_decisions(predictor, inputs, candidates, num_layers)
    E = agree.shape[0]
    index = {lam: i for i, lam in enumerate(candidates)}

    def losses_at(lam):
        d = dec[index[lam]]
        losses = position_losses(d, agree, nll, full_nll, kind)[keep]
        return losses, float((d[keep] < E).double().mean()) if bool(keep.any()) else 0.0

    return fixed_sequence_test(candidates, losses_at, target, delta, method), dec


def held_out_report(predictor: ComplexityPredictor, inputs: PredictorInputs, agree: torch.Tensor, num_layers: int,
                    threshold: float | None, counted: torch.Tensor | None = None, allowed: float | None = None) -> dict:
    """Measured agreement, mean layers and exit fraction of the predictor at ``threshold`` on a held-out split
    (decisions made in order, as when decoding). A ``"warning"`` entry appears when the predictor's exits are
    biased toward the first exit point (:func:`laserlm.training.thresholds.shallow_exit_bias`; ``allowed``: the
    target's allowed disagreement rate)."""

    keep = ~inputs.first if counted is None else (counted & ~inputs.first)
    E = agree.shape[0]
    if threshold is None:
        d = torch.full((inputs.emb.shape[0],), E, dtype=torch.long)
    else:
        d = sequential_decisions(predictor, inputs, [threshold], num_layers)[0]
    loss = position_losses(d, agree)[keep]
    layers = torch.tensor(list(predictor.exit_points) + [num_layers], dtype=torch.float64)[d[keep]]
    report = {"positions": int(keep.sum()), "agreement": round(1 - float(loss.mean()), 5),
            "mean_layers": round(float(layers.mean()), 3), "exit_fraction": round(float((d[keep] < E).double().mean()), 4),
            "exit_histogram": {str(e): int((d[keep] == i).sum()) for i, e in enumerate(list(predictor.exit_points) + [num_layers])}}
    bias = shallow_exit_bias(d[keep], loss, E, allowed, who="complexity predictor")
    if bias:
        report["warning"] = bias.format(exit=predictor.exit_points[0])
    return report


__all__ = ["PredictorInputs", "PredictorTrainConfig", "candidate_thresholds", "certify_predictor", "exit_index",
           "held_out_report", "oracle_depth", "predictor_inputs", "sequential_decisions", "split_token_ids",
           "teacher_forced_probs", "train_predictor"]
