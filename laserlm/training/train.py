"""Training loops: exit-head adapters (KL distillation, backbone frozen) and the optional joint stage.

Curriculum (seed 004): stage 1 trains exit heads, then gates (:mod:`.gates`), everything else frozen;
stage 2 (optional, ``joint_epochs > 0``) fine-tunes heads and gates together at a low learning rate.

Defaults and their sources:
- head stage LR ``1e-3`` (Adam), 250 steps: DESIGN.md's measurement on SmolLM2-135M (an affine tuned
  lens trained 250 Adam steps on 6k WikiText-2 valid tokens lifted layer-20 agreement 0.11 -> 0.43).
  The seed's 3e-5 is for fine-tuning the backbone jointly; with the backbone frozen and
  zero-initialised adapters it barely moves them in 250 steps, so the head stage uses the tuned-lens
  LR (Belrose et al. 2023 train their lenses at 1e-3 as well).
- on a vocabulary above 65,536 tokens the head stage trains on a sampled KL (:func:`.losses.sampled_tail_kl`)
  for 750 steps: a step reads a few thousand LM-head rows instead of all of them, and three times the steps
  match the full loss's heads (benchmarks/RESULTS.md, "Exit heads on a large vocabulary").
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
from .losses import binary_focal_loss, kl_distillation, sampled_tail_kl


HEAD_VOCAB = ("auto", "full", "sampled")
# Above this vocabulary size ``vocab="auto"`` trains exit heads on the sampled loss. A full-vocabulary step on
# Llama-3.2-1B (128,256 x 2,048 head, 3 exit points, 128 positions: a teacher pass, then a forward and an input
# gradient per exit) is about 0.47 TFLOP; SmolLM2 (49,152) keeps the exact loss its measured heads were trained with.
SAMPLED_VOCAB_ABOVE = 65536
HEAD_STEPS = {"full": 250, "sampled": 750}  # the head stage's default steps per loss (HeadTrainConfig.steps None)
CHECK_POSITIONS = 256  # sampled loss: positions held back from its steps for the exact check (keep_better_heads)


@dataclass
class HeadTrainConfig:
    """Head stage (stage 1). ``lr`` 1e-3 / 250 steps: DESIGN.md tuned-lens anchor; clip 1.0: seed 004.

    ``steps`` None means :data:`HEAD_STEPS` of the loss in use (the sampled loss's steps are far cheaper and each
    learns less: see the module docstring).
    """

    steps: int | None = None
    batch_tokens: int = 128  # 256 ran several times slower per position on the shared 2-core machine
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    adaptive_clip: bool = False      # clip at a low percentile of recent norms, within [0.2, 1.0] (seed range)
    cross_layer_norm: bool = False   # equal gradient norm per exit point (gradient equilibrium)
    seed: int = 0
    bf16_head: bool = True  # LM-head matmuls of training steps in bfloat16; evaluation stays float32
    vocab: str = "auto"     # full | sampled | auto (sampled above SAMPLED_VOCAB_ABOVE tokens): see sampled_tail_kl
    teacher_topk: int = 32  # sampled: the teacher's top-k tokens kept per position (the rest is one tail bucket)
    negatives: int = 1024   # sampled: other tokens drawn per step to estimate the student's normaliser

    def validate(self) -> HeadTrainConfig:
        if self.steps is not None:
            _check_positive("steps", self.steps, allow_zero=True)
        _check_positive("batch_tokens", self.batch_tokens)
        if self.vocab not in HEAD_VOCAB:
            raise InvalidArgumentError(f"exit-head vocabulary must be one of {', '.join(HEAD_VOCAB)}, "
                                       f"got {self.vocab!r}")
        _check_positive("teacher_topk", self.teacher_topk)
        _check_positive("negatives", self.negatives)
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


class HeadLogits:
    """Final norm + LM head (+ soft cap) with the LM-head weight in ``dtype``, or only some of its rows.

    The LM head (``V x d`` = 49152 x 576 on SmolLM2) dominates a head-training step; in bfloat16 the
    matmuls run ~2x faster here (AVX512-BF16), so training uses a bfloat16 copy made once.
    ``__call__(hidden [.., d]) -> [.., V']`` float32, ``V'`` = V or the number of rows kept by :meth:`rows`.
    """

    def __init__(self, model_adapter, dtype: torch.dtype = torch.bfloat16):
        self.base = model_adapter
        self.weight = model_adapter.lm_head.weight.detach().to(dtype)
        bias = getattr(model_adapter.lm_head, "bias", None)
        self.bias = bias.detach().float() if bias is not None else None

    def rows(self, ids: torch.Tensor) -> HeadLogits:
        """The same head restricted to the vocabulary rows ``ids [V']`` (int64), in that order."""
        sub = object.__new__(HeadLogits)
        sub.base, sub.weight = self.base, self.weight[ids]
        sub.bias = self.bias[ids] if self.bias is not None else None
        return sub

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.base.norm(hidden).to(self.weight.dtype)
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


def head_vocab(cfg: HeadTrainConfig, vocab_size: int) -> str:
    """``"full"`` or ``"sampled"``: the exit-head loss ``cfg`` asks for on a vocabulary of ``vocab_size`` tokens.

    Raises:
        InvalidArgumentError: the sampled loss asked for with a top-k that leaves no tail (``teacher_topk >= V``).
    """
    kind = cfg.vocab if cfg.vocab != "auto" else ("sampled" if vocab_size > SAMPLED_VOCAB_ABOVE else "full")
    if kind == "sampled" and cfg.teacher_topk >= vocab_size:
        raise InvalidArgumentError(f"the sampled exit-head loss keeps the teacher's top {cfg.teacher_topk} tokens of "
                                   f"{vocab_size}: use fewer, or --head-vocab full")
    return kind


def head_loss_settings(cfg: HeadTrainConfig, vocab_size: int) -> dict:
    """What the head stage trains with on a ``vocab_size`` vocabulary: ``{"loss", "steps"[, "teacher_topk",
    "negatives"]}`` (for run summaries)."""
    kind = head_vocab(cfg, vocab_size)
    out = {"loss": kind, "steps": cfg.steps if cfg.steps is not None else HEAD_STEPS[kind]}
    if kind == "sampled":
        out.update(teacher_topk=cfg.teacher_topk, negatives=cfg.negatives)
    return out


@torch.no_grad()
def teacher_topk_of(logits_fn, final_hidden: torch.Tensor, k: int, batch_tokens: int = 512,
                    progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model's top-``k`` next tokens and their full-vocabulary log-probabilities at every position.

    Args:
        logits_fn: final norm + LM head, ``[n, d] -> [n, V]``.
        final_hidden: ``[N, d]`` last-layer hidden states.

    Returns ``(ids [N, k] int64, logprobs [N, k] float32)``, ids by descending probability.
    """
    ids, lps = [], []
    for s in tqdm(range(0, final_hidden.shape[0], batch_tokens), desc="teacher top-k", unit="batch",
                  disable=not progress):
        lp, ix = torch.log_softmax(logits_fn(final_hidden[s:s + batch_tokens]).float(), -1).topk(k, dim=-1)
        ids.append(ix)
        lps.append(lp)
    return torch.cat(ids), torch.cat(lps)


def sampled_columns(t_ids: torch.Tensor, vocab_size: int, negatives: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """The LM-head rows one sampled-loss step evaluates (:func:`.losses.sampled_tail_kl`).

    Args:
        t_ids: ``[n, k]`` the batch's teacher top-k ids.
        negatives: how many of the other ``V - U`` tokens to draw (uniformly, without replacement).

    Returns ``(cols [U + R], t_pos [n, k], U, log((V - U) / R))``: the union ``U`` of the teacher ids then the ``R``
    negatives, each teacher id's column, and the negatives' log importance weight (0 when all others are drawn).
    """
    union, t_pos = torch.unique(t_ids, return_inverse=True)
    u = union.numel()
    rest = vocab_size - u
    r = min(negatives, rest)
    if r == 0:
        return union, t_pos, u, 0.0
    taken = torch.zeros(vocab_size, dtype=torch.bool)
    taken[union] = True
    others = torch.nonzero(~taken).squeeze(-1)                                   # [V - U]
    neg = others[torch.randperm(rest, generator=generator)[:r]]
    return torch.cat([union, neg]), t_pos, u, math.log(rest / r)


@torch.no_grad()
def keep_better_heads(heads: nn.ModuleDict, start: dict, teacher_fn, data: ExitStates,
                      positions: torch.Tensor | None = None, report: dict | None = None) -> list[int]:
    """Put back the starting adapter of every exit head whose exact (full-vocabulary) KL on ``positions`` of ``data``
    is not below its starting adapter's; returns those exit points.

    The sampled loss is an estimate: on a flat teacher distribution (random weights; most of the mass in the tail)
    its noise can move an adapter away from a better start, which this check undoes.

    Args:
        start: ``str(exit_point) -> state_dict`` of the heads before training.
        teacher_fn: the full model's head in float32 (``Engine.head``), ``[n, d] -> [n, V]``.
        positions: ``[n]`` int64 indices into ``data`` (positions the training steps did not read); None: all.
        report: filled with ``exact_kl_start`` / ``exact_kl_trained`` (exit point -> mean KL, nats).
    """
    idx = positions if positions is not None else torch.arange(len(data))
    teacher = torch.log_softmax(teacher_fn(data.final_hidden[idx]).float(), -1)
    reverted, before, after = [], {}, {}
    for e in data.exit_points:
        head, h = heads[str(e)], data.hidden[e][idx]
        trained = {k: v.clone() for k, v in head.state_dict().items()}
        after[e] = float(kl_distillation(head(h), teacher, reduction="mean"))
        head.load_state_dict(start[str(e)])
        before[e] = float(kl_distillation(head(h), teacher, reduction="mean"))
        if after[e] < before[e]:
            head.load_state_dict(trained)
        else:
            reverted.append(e)
    if report is not None:
        report.update(exact_kl_start={str(e): round(v, 5) for e, v in before.items()},
                      exact_kl_trained={str(e): round(v, 5) for e, v in after.items()})
    return reverted


def train_heads(heads: nn.ModuleDict, teacher_fn, data: ExitStates, cfg: HeadTrainConfig,
                progress: bool = True, report: dict | None = None) -> list[float]:
    """Train every exit head's adapter by ``KL(p_full || p_exit)`` on ``data``; returns the loss curve.

    On a large vocabulary (``cfg.vocab``, :func:`head_vocab`) each step evaluates only the LM-head rows of the batch's
    teacher top-k and ``cfg.negatives`` sampled others (:func:`.losses.sampled_tail_kl`): on Llama-3.2-1B's 128k
    vocabulary at most 1/25 of the rows. A few positions (:data:`CHECK_POSITIONS`, spread over the data) are
    held back from the steps for the exact check. The loss it reports is that estimate; evaluation
    (:func:`compute_exit_outputs`) and certification always use the full vocabulary, and a head whose exact KL
    ends no lower than where it started gets its starting adapter back (:func:`keep_better_heads`).

    Args:
        heads: ``str(exit_point) -> ExitHead`` (see :func:`.heads.make_exit_heads`).
        teacher_fn: the full model's head (``Engine.head``), applied to ``data.final_hidden``; the
            teacher distribution of a batch is computed once, without gradient, for all exit points.
        data: collected states (training split).
        report: filled with :func:`head_loss_settings` and ``"reverted"`` (exit points given back their start).

    Raises:
        InvalidArgumentError: bad settings (:meth:`HeadTrainConfig.validate`, :func:`head_vocab`).
    """
    cfg.validate()
    params = [p for p in heads.parameters() if p.requires_grad]
    base = heads[str(data.exit_points[0])]._base
    V = vocab_size(base.lm_head)
    plan = head_loss_settings(cfg, V) if params else {"loss": "none", "steps": 0}
    sampled, steps = plan["loss"] == "sampled", plan["steps"]
    if report is not None:
        report.update(plan, reverted=[])
    if steps == 0:
        return []
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps))
    n = len(data)
    pool = torch.arange(n)  # the positions the steps draw from
    losses = []
    exact_teacher = teacher_fn
    fast = HeadLogits(base) if cfg.bf16_head and bf16_matmul_is_faster() else None
    if fast is not None:
        teacher_fn = fast
    if sampled:
        start = {str(e): {k: v.clone() for k, v in heads[str(e)].state_dict().items()} for e in data.exit_points}
        full = fast if fast is not None else HeadLogits(base, torch.float32)  # a float copy of the head: V x d x 4 B
        t_ids, t_lp = teacher_topk_of(teacher_fn, data.final_hidden, cfg.teacher_topk, progress=progress)
        held = torch.zeros(n, dtype=torch.bool)
        if n >= 2 * CHECK_POSITIONS:  # spread over the data (every document), never read by a step
            held[torch.linspace(0, n - 1, CHECK_POSITIONS).long()] = True
        check = torch.nonzero(held).squeeze(-1) if held.any() else None
        pool = pool[~held]
    control = GradientControl([[p for p in heads[str(e)].parameters() if p.requires_grad] for e in data.exit_points],
                              cfg.grad_clip, cfg.adaptive_clip, cfg.cross_layer_norm)
    bar = tqdm(range(steps), desc="train exit heads", unit="step", disable=not progress)
    for _ in bar:
        idx = pool[torch.randint(0, pool.numel(), (min(cfg.batch_tokens, pool.numel()),), generator=g)]
        loss = 0.0
        if sampled:
            cols, t_pos, u, log_w = sampled_columns(t_ids[idx], V, cfg.negatives, g)
            part = full.rows(cols)
            for e in data.exit_points:
                logits = part(heads[str(e)].adapt(data.hidden[e][idx]))
                loss = loss + sampled_tail_kl(logits[:, :u], logits[:, u:], log_w, t_pos, t_lp[idx])
        else:
            with torch.no_grad():
                teacher = teacher_fn(data.final_hidden[idx]).float()
            for e in data.exit_points:
                head, h = heads[str(e)], data.hidden[e][idx]
                student = fast(head.adapt(h)) if fast is not None else head(h)
                loss = loss + kl_distillation(student, teacher)
        loss = loss / len(data.exit_points)
        losses.append(_optimizer_step(loss, opt, sched, control))
        bar.set_postfix(kl=f"{losses[-1]:.3f}")
    if sampled:
        reverted = keep_better_heads(heads, start, exact_teacher, data, check, report)
        if report is not None:
            report["reverted"] = reverted
    return losses


def vocab_size(lm_head: nn.Module) -> int:
    """The LM head's output size, read without dequantizing a packed head (``out_features``)."""
    n = getattr(lm_head, "out_features", None)
    return int(n) if n is not None else int(lm_head.weight.shape[0])


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
