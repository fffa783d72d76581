"""The backbone stage: train the decoder itself (LoRA factors) so that early exits agree with the full model.

Adaptive depth saves little on a checkpoint trained to predict only at its last layer: its intermediate states do
not yet carry the final prediction. Following the seeds' curriculum and LayerSkip, this stage fine-tunes the backbone at a low learning rate
so that the hidden states at the exit points already carry the full model's prediction:

- **Curriculum** (seed 004 §5.1): the first ``frozen_tokens`` train the exit adapters alone with the backbone frozen
  (no backward through the decoder); then the LoRA factors (:mod:`laserlm.training.lora`) train jointly with the
  adapters at ``backbone_lr_ratio`` (0.01, seed 004) times the adapters' learning rate.
- **Loss**: ``distill_weight * KL_L + exit_weight * sum_e w_e KL_e`` where ``KL_L`` is the self-distillation KL of the
  adapted model's last layer to the *original* model's full-depth distribution (keeps the model the user chose) and
  ``KL_e`` the same KL at exit point ``e`` through the shared final norm + LM head after that exit's affine adapter
  (a tuned lens, Belrose et al. 2023). ``w_e ∝ e`` (rising with depth, LayerSkip's early-exit scale, Elhoushi et al.
  2024 §4.2), summing to 1. The teacher is the original model's top-``top_k`` log-probabilities, computed once and
  cached; the KL runs over the union ``U`` of the batch's teacher top-k tokens (teacher renormalised over its top-k,
  student normalised over ``U``), so the 49k-wide LM head is not paid at every exit (a top-k distillation: mass the
  student puts outside ``U`` is not penalised; agreement is always measured over the full vocabulary). The last
  layer's KL (``final_kl="tail"``, the default) is over {teacher top-k, the rest} with the student's full-vocabulary
  softmax (:func:`tail_kl`), so the adapted model cannot move its argmax off the original's for free.
- **Layer dropout** (LayerSkip §4.1): during joint training, each sequence skips decoder layer ``l`` with probability
  ``p_l = layer_dropout * (exp(l ln 2 / (L - 1)) - 1)``: 0 at the first layer, ``layer_dropout`` at the last
  (their exponential depth schedule, without their time curriculum). A skipped layer passes its input on unchanged.
- **Seed 000 §4.1 settings**: linear warm-up of ``warmup_steps``; exit points below the minimum depth ``L/4`` are not
  trained (nothing can exit there); gradient clipping adapted inside 0.2-1.0 (AutoClip, as the head stage's
  ``adaptive_clip``); cross-layer gradient normalisation (§4.2): each decoder layer's LoRA factors, and each exit's
  adapter, get a gradient of the same norm (:class:`~laserlm.training.train.GradientControl`). Exit thresholds play
  no part in this loss (every exit point is trained on every token), so the seed's threshold decay does not apply
  here; the calibration certifies thresholds afterwards.

The run is resumable: ``<work>/backbone.ckpt.pt`` holds the factors, adapters, optimizer, step and the gradient
control's history (written every ``ckpt_every`` steps and at the end); the data order and each step's layer-dropout
draws are functions of ``(seed, step)``, so a resumed run gives the weights of an uninterrupted one. Budgets
(``max_tokens``, ``max_minutes``) are not part of the run's identity: raise ``max_tokens`` and resume to train on.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..errors import InvalidArgumentError
from ..models.files import write_torch_atomic
from .lora import LORA_TARGETS, apply_lora, check_lora_args, load_factors, lora_factors
from .train import GradientControl

CKPT = "backbone.ckpt.pt"
TEACHER = "teacher.pt"


@dataclass
class BackboneConfig:
    """Settings of the backbone stage (module docstring); defaults and their sources in the comments."""

    exit_points: list[int] = field(default_factory=list)  # layers run before each exit; default: groups of 5 >= L/4
    rank: int = 16
    alpha: float = 32.0                  # LoRA scale alpha / r = 2 (Hu et al. 2021 use alpha = 2r in their GPT runs)
    targets: tuple[str, ...] = LORA_TARGETS
    head_lr: float = 1e-3                # exit adapters: the tuned-lens LR (DESIGN.md anchor, as the head stage)
    backbone_lr_ratio: float = 0.01      # seed 004 §5.1: the backbone at 0.01x
    warmup_steps: int = 50               # seed 000 §4.1: linear warm-up
    frozen_tokens: int = 16384           # seed 004 §5.1 stage 1: adapters alone, backbone frozen
    grad_clip: float = 1.0               # upper end of the seed's 0.2-1.0
    adaptive_clip: bool = True           # seed 000 §4.1: clipping adjusted within 0.2-1.0
    cross_layer_norm: bool = True        # seed 000 §4.2: gradients normalised across layers
    layer_dropout: float = 0.1           # LayerSkip p_max (their continual-pretraining runs use 0.1-0.2)
    exit_weight: float = 1.0
    distill_weight: float = 1.0
    top_k: int = 16
    final_kl: str = "tail"               # last layer: "tail" (top-k + tail bucket, full vocabulary) or "union"
    seq_len: int = 128
    batch: int = 8
    max_tokens: int = 200_000            # training tokens (batch x seq_len per step), frozen part included
    max_minutes: float | None = None
    ckpt_every: int = 25
    eval_every_tokens: int = 0           # 0: evaluate only at the end (a callback decides what evaluation is)
    autocast: str = "float32"            # or "bfloat16": forward/backward under CPU autocast
    seed: int = 0

    def validate(self, num_layers: int) -> BackboneConfig:
        check_lora_args(self.rank, self.alpha, self.targets, num_layers)
        for name in ("head_lr", "backbone_lr_ratio", "grad_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be > 0, got {v!r}")
        for name in ("exit_weight", "distill_weight", "layer_dropout"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be >= 0, got {v!r}")
        if self.layer_dropout >= 1:
            raise InvalidArgumentError(f"layer dropout must be < 1, got {self.layer_dropout}")
        for name in ("top_k", "batch", "ckpt_every", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be an integer >= 1, got {v!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 8:
            raise InvalidArgumentError(f"sequence length must be an integer >= 8, got {self.seq_len!r}")
        if self.warmup_steps < 0 or self.frozen_tokens < 0 or self.eval_every_tokens < 0:
            raise InvalidArgumentError("warm-up steps, frozen tokens and the evaluation interval must be >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise InvalidArgumentError(f"--max-minutes must be > 0, got {self.max_minutes}")
        if self.final_kl not in ("tail", "union"):
            raise InvalidArgumentError(f"final KL must be tail or union, got {self.final_kl!r}")
        if self.autocast not in ("float32", "bfloat16"):
            raise InvalidArgumentError(f"autocast must be float32 or bfloat16, got {self.autocast!r}")
        if not self.exit_points:
            raise InvalidArgumentError("the backbone stage needs at least one exit point")
        if bad := [e for e in self.exit_points if not 1 <= e < num_layers]:
            raise InvalidArgumentError(f"exit points {bad} out of range 1-{num_layers - 1}")
        return self

    def run_key(self) -> dict:
        """What the trained weights depend on (budgets and checkpoint cadence excluded, so a run can be extended)."""
        d = asdict(self)
        for k in ("max_tokens", "max_minutes", "ckpt_every", "eval_every_tokens"):
            d.pop(k)
        d["targets"] = list(d["targets"])
        return d


def default_exit_points(num_layers: int, every: int = 5) -> list[int]:
    """Exit points of groups of ``every`` layers at or above the minimum depth ``ceil(L / 4)`` (seed 000 §4.1)."""
    min_depth = math.ceil(num_layers / 4)
    return [e for e in range(every, num_layers, every) if e >= min_depth]


def dropout_rates(num_layers: int, p_max: float) -> torch.Tensor:
    """LayerSkip's per-layer dropout ``p_l = p_max (exp(l ln2 / (L-1)) - 1)``, ``[L]`` float64 (0 at l=0, p_max at
    l=L-1; Elhoushi et al. 2024, eq. 2's depth factor)."""
    l = torch.arange(num_layers, dtype=torch.float64)
    return p_max * (torch.exp(l * math.log(2) / max(1, num_layers - 1)) - 1)


def exit_weights(exit_points: list[int]) -> torch.Tensor:
    """``w_e ∝ e``, summing to 1 (deeper exits weigh more, LayerSkip's early-exit scale)."""
    w = torch.tensor(exit_points, dtype=torch.float64)
    return (w / w.sum()).float()


# -- the teacher -------------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_topk(model, records: torch.Tensor, k: int, batch: int = 8, progress: bool = True) -> dict:
    """The original model's top-``k`` next-token log-probabilities (full vocabulary softmax) at every position.

    Args:
        model: the transformers causal LM *before* any adaptation (or with LoRA ``B = 0``).
        records: ``[R, T]`` token ids.

    Returns ``{"ids": [R, T, k] int32, "logprobs": [R, T, k] float16, "top1": [R, T] int64}``.
    """
    ids_out, lp_out = [], []
    bar = tqdm(total=records.shape[0], desc="teacher (original model)", unit="record", disable=not progress)
    for i in range(0, records.shape[0], batch):
        logits = model(input_ids=records[i:i + batch], use_cache=False).logits.float()
        lp = torch.log_softmax(logits, -1)
        v, ix = lp.topk(k, dim=-1)
        ids_out.append(ix.int())
        lp_out.append(v.half())
        bar.update(min(batch, records.shape[0] - i))
    bar.close()
    ids = torch.cat(ids_out)
    return {"ids": ids, "logprobs": torch.cat(lp_out), "top1": ids[..., 0].long()}


def topk_kl(hidden: torch.Tensor, head_weight: torch.Tensor, head_bias, softcap, t_ids: torch.Tensor,
            t_lp: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher top-k || student) over positions, the student normalised over the union of the teacher ids.

    Args:
        hidden: ``[N, d]`` final-normed hidden states (the student).
        head_weight: ``[V, d]`` the LM head; ``head_bias`` ``[V]`` or None; ``softcap``: Gemma's logit cap or None.
        t_ids: ``[N, k]`` teacher token ids; ``t_lp``: ``[N, k]`` their log-probabilities.

    Returns a scalar (nats).
    """
    union, inv = torch.unique(t_ids.long(), return_inverse=True)  # [U], [N, k] index of each id in U
    logits = hidden @ head_weight[union].T.to(hidden.dtype)
    if head_bias is not None:
        logits = logits + head_bias[union]
    logits = logits.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logq = torch.log_softmax(logits, -1).gather(1, inv)  # [N, k]
    logp = torch.log_softmax(t_lp.float(), -1)           # the teacher renormalised over its top-k
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def tail_kl(hidden: torch.Tensor, head_weight: torch.Tensor, head_bias, softcap, t_ids: torch.Tensor,
            t_lp: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) over the partition {top-k tokens, everything else}, the student over the full vocabulary.

    Unlike :func:`topk_kl`, mass the student moves to any token outside the teacher's top-k is paid for (it lands
    in the tail bucket), so the student's argmax cannot wander off to a token the teacher ranks low for free. Costs
    one full LM-head product (``[N, V]``), so the backbone stage uses it at the last layer only.

    Args:
        hidden: ``[N, d]`` final-normed hidden states (the student).
        head_weight: ``[V, d]`` the LM head; ``head_bias`` ``[V]`` or None; ``softcap``: Gemma's logit cap or None.
        t_ids: ``[N, k]`` teacher token ids; ``t_lp``: ``[N, k]`` their full-vocabulary log-probabilities.

    Returns a scalar (nats): ``sum_k p_k (log p_k - log q_k) + p_tail (log p_tail - log q_tail)``.
    """
    logits = hidden @ head_weight.T.to(hidden.dtype)
    if head_bias is not None:
        logits = logits + head_bias
    logits = logits.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logq = torch.log_softmax(logits, -1).gather(1, t_ids.long())        # [N, k]
    logp = t_lp.float()
    tiny = torch.finfo(torch.float32).tiny
    p_tail = (1 - logp.exp().sum(-1)).clamp_min(0)                      # [N]
    q_tail = (1 - logq.exp().sum(-1)).clamp_min(tiny)
    head = (logp.exp() * (logp - logq)).sum(-1)
    tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(tiny).log() - q_tail.log()), torch.zeros_like(p_tail))
    return (head + tail).mean()


# -- the model under training ---------------------------------------------------------------------------------
class _LayerTaps:
    """Forward hooks on every decoder layer: record the outputs at exit points and apply layer dropout (a
    per-sequence mask ``keep[l] [B]``; a skipped layer returns its input)."""

    def __init__(self, layers: nn.ModuleList, exit_points: list[int]):
        self.exits = set(exit_points)
        self.keep: torch.Tensor | None = None  # [L, B] bool, or None: no dropout
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(layers)]

    def _hook(self, i):
        def hook(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h = output[0] if isinstance(output, tuple) else output
            if self.keep is not None and not bool(self.keep[i].all()):
                m = self.keep[i].to(h.dtype).view(-1, 1, 1)
                h = h_in + m * (h - h_in)
            if i + 1 in self.exits:
                self.out[i + 1] = h
            return (h, *output[1:]) if isinstance(output, tuple) else h
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


class ExitAdapters(nn.Module):
    """One affine adapter per exit point (``h -> W h + b``, identity at init): the trainable part of the exit heads
    (:class:`~laserlm.depth.heads.ExitHead` ``adapter="affine"``), keyed ``str(exit)``."""

    def __init__(self, exit_points: list[int], d: int):
        super().__init__()
        self.proj = nn.ModuleDict()
        for e in exit_points:
            lin = nn.Linear(d, d)
            with torch.no_grad():
                lin.weight.copy_(torch.eye(d))
                lin.bias.zero_()
            self.proj[str(e)] = lin

    def forward(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.proj[str(e)](h)


@dataclass
class BackboneRun:
    """Result of :func:`train_backbone`: ``factors`` (LoRA, :func:`~laserlm.training.lora.lora_factors`), ``adapters``
    (state dict of :class:`ExitAdapters`), ``steps``, ``tokens``, ``seconds`` (this call), ``finished`` (the token
    budget was reached), ``log`` (per-evaluation records from ``evaluate``) and ``losses`` (per step)."""

    factors: dict
    adapters: dict
    steps: int
    tokens: int
    seconds: float
    finished: bool
    log: list = field(default_factory=list)
    losses: list = field(default_factory=list)


def _batch_rows(num_records: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """The record indices of ``step``: consecutive slices of a per-epoch permutation (a function of seed and step)."""
    start = step * batch
    rows = []
    while len(rows) < batch:
        epoch, off = divmod(start + len(rows), num_records)
        perm = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        rows.extend(perm[off:off + batch - len(rows)].tolist())
    return torch.tensor(rows)


def train_backbone(model, records: torch.Tensor, teacher: dict, cfg: BackboneConfig, work, progress: bool = True,
                   evaluate=None, resume: bool = True) -> BackboneRun:
    """Train LoRA factors and exit adapters on ``records`` (module docstring). ``model`` gets LoRA wrappers (left in
    place: the returned factors are also in the model).

    Args:
        model: a float transformers causal LM (``--weights fp32``), the original weights.
        records: ``[R, seq_len]`` training token ids; ``teacher``: :func:`teacher_topk` of them.
        work: directory of the checkpoint.
        evaluate: optional ``(model, adapters, tokens) -> dict`` run every ``eval_every_tokens`` and at the end (in
            eval mode, no dropout); its records go to ``log``.
        resume: continue from ``<work>/backbone.ckpt.pt`` when its run key matches (else start over).

    Raises:
        InvalidArgumentError: bad settings, records of another length than ``seq_len``, a teacher of other records.
    """
    layers = model.model.layers
    L = len(layers)
    cfg.validate(L)
    if records.dim() != 2 or records.shape[1] != cfg.seq_len:
        raise InvalidArgumentError(f"records must be [R, {cfg.seq_len}], got {tuple(records.shape)}")
    if tuple(teacher["ids"].shape[:2]) != tuple(records.shape) or teacher["ids"].shape[2] < cfg.top_k:
        raise InvalidArgumentError("the teacher cache does not match the training records")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    mods = apply_lora(model, cfg.rank, cfg.alpha, cfg.targets, seed=cfg.seed)
    d = model.config.hidden_size
    adapters = ExitAdapters(cfg.exit_points, d)
    head = model.lm_head
    head_w = head.weight.detach()
    head_b = head.bias.detach() if getattr(head, "bias", None) is not None else None
    softcap = getattr(model.config, "final_logit_softcapping", None)
    norm = model.model.norm
    lora_params = [p for m in mods.values() for p in (m.lora_A, m.lora_B)]
    opt = torch.optim.AdamW([{"params": list(adapters.parameters()), "lr": cfg.head_lr},
                             {"params": lora_params, "lr": cfg.head_lr * cfg.backbone_lr_ratio}], weight_decay=0.0)
    base_lrs = [cfg.head_lr, cfg.head_lr * cfg.backbone_lr_ratio]
    by_layer = [[p for name, m in mods.items() if name.split(".")[1] == str(i) for p in (m.lora_A, m.lora_B)]
                for i in range(L)]
    adapter_groups = [list(adapters.proj[str(e)].parameters()) for e in cfg.exit_points]
    controls = {False: GradientControl(adapter_groups, cfg.grad_clip, cfg.adaptive_clip, cfg.cross_layer_norm),
                True: GradientControl(adapter_groups + by_layer, cfg.grad_clip, cfg.adaptive_clip,
                                      cfg.cross_layer_norm)}
    step, log, losses = 0, [], []
    ckpt = work / CKPT
    key = cfg.run_key()
    if resume and ckpt.is_file():
        saved = torch.load(ckpt)
        if saved.get("key") == key and saved.get("records") == _records_digest(records):
            load_factors(mods, saved["factors"])
            adapters.load_state_dict(saved["adapters"])
            opt.load_state_dict(saved["opt"])
            for j, hist in saved["clip_history"].items():
                controls[j].history = list(hist)
            step, log, losses = saved["step"], list(saved["log"]), list(saved["losses"])
    per_step = cfg.batch * cfg.seq_len
    total_steps = math.ceil(cfg.max_tokens / per_step)
    frozen_steps = math.ceil(cfg.frozen_tokens / per_step)
    rates = dropout_rates(L, cfg.layer_dropout)
    w_exit = exit_weights(cfg.exit_points)
    taps = _LayerTaps(layers, cfg.exit_points)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    t0 = time.perf_counter()
    deadline = None if cfg.max_minutes is None else t0 + 60 * cfg.max_minutes
    bar = tqdm(total=total_steps * per_step, initial=min(step, total_steps) * per_step, desc="train backbone",
               unit="tok", unit_scale=True, disable=not progress)

    def save():
        write_torch_atomic({"key": key, "records": _records_digest(records), "factors": lora_factors(mods),
                            "adapters": adapters.state_dict(), "opt": opt.state_dict(),
                            "clip_history": {j: c.history for j, c in controls.items()},
                            "step": step, "log": log, "losses": losses}, ckpt)

    def run_eval():
        if evaluate is None:
            return
        model.eval()
        taps.keep = None
        rec = evaluate(model, adapters, step * per_step)
        rec.setdefault("tokens", step * per_step)
        log.append(rec)

    try:
        model.train()
        while step < total_steps:
            if deadline is not None and time.perf_counter() > deadline:
                break
            joint = step >= frozen_steps
            rows = _batch_rows(records.shape[0], cfg.batch, step, cfg.seed)
            ids = records[rows]
            t_ids = teacher["ids"][rows][..., :cfg.top_k].reshape(-1, cfg.top_k)
            t_lp = teacher["logprobs"][rows][..., :cfg.top_k].reshape(-1, cfg.top_k)
            g = torch.Generator().manual_seed(cfg.seed * 7_919 + step)
            if joint and cfg.layer_dropout > 0:
                taps.keep = torch.rand(L, ids.shape[0], generator=g, dtype=torch.float64) >= rates.unsqueeze(1)
            else:
                taps.keep = None
            for p in lora_params:
                p.requires_grad_(joint)
            warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
            for grp, lr in zip(opt.param_groups, base_lrs):
                grp["lr"] = lr * warm
            taps.out = {}
            with amp, (torch.enable_grad() if joint else torch.no_grad()):
                out = model.model(input_ids=ids, use_cache=False)
            with amp:
                loss = torch.zeros(())
                parts = {}
                if joint and cfg.distill_weight > 0:
                    final = out.last_hidden_state.reshape(-1, d)
                    final_kl = tail_kl if cfg.final_kl == "tail" else topk_kl
                    parts["final"] = final_kl(final, head_w, head_b, softcap, t_ids, t_lp)
                    loss = loss + cfg.distill_weight * parts["final"]
                for e, w in zip(cfg.exit_points, w_exit):
                    h = taps.out[e].reshape(-1, d)
                    if not joint:
                        h = h.detach()
                    parts[e] = topk_kl(norm(adapters(e, h)), head_w, head_b, softcap, t_ids, t_lp)
                    loss = loss + cfg.exit_weight * float(w) * parts[e]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            controls[joint]()
            opt.step()
            losses.append({k if isinstance(k, str) else f"exit{k}": round(float(v.detach()), 5) for k, v in parts.items()})
            step += 1
            bar.update(per_step)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", stage="joint" if joint else "frozen")
            if step % cfg.ckpt_every == 0:
                save()
            if cfg.eval_every_tokens and (step * per_step) // cfg.eval_every_tokens != \
                    ((step - 1) * per_step) // cfg.eval_every_tokens:
                run_eval()
                model.train()
    finally:
        bar.close()
        taps.remove()
        model.eval()
    if not log or log[-1]["tokens"] != step * per_step:
        run_eval()
    save()
    return BackboneRun(lora_factors(mods), adapters.state_dict(), step, step * per_step, time.perf_counter() - t0,
                       step >= total_steps, log, losses)


@torch.no_grad()
def evaluate_exits(model, adapters: ExitAdapters | None, exit_points: list[int], records: torch.Tensor,
                   original: dict, targets=(0.90, 0.95), batch: int = 8) -> dict:
    """Agreement with the *original* model on held-out ``records [R, T]``, full vocabulary, exact hidden states.

    Args:
        model: the (adapted) transformers model, in eval mode.
        adapters: the exit adapters (``None``: the plain shared head, a logit lens).
        original: ``{"top1": [R, T], "nll": [R, T - 1]}`` of the original model on ``records``.
        targets: agreement levels for the confidence-exit simulation.

    Returns ``{"full_agreement", "nll_ratio" (adapted mean NLL / original's), "exit_agreement": {e: a},
    "at": {target: {"threshold", "layers_per_token", "agreement", "exit_rate"}}}``. The simulation stops a token at the
    first exit point whose max probability reaches a threshold (CALM, Schuster et al. 2022) and otherwise takes the
    adapted model's last-layer token; it runs on exact hidden states (no KV bridge error), an optimistic bound of
    what certified adaptive depth can save. ``layers_per_token`` is the lowest over a threshold grid whose
    agreement reaches the target (``None`` when none does).
    """
    L = len(model.model.layers)
    taps = _LayerTaps(model.model.layers, exit_points)
    tops = {e: [] for e in exit_points}
    confs = {e: [] for e in exit_points}
    full_top, nll = [], []
    try:
        for i in range(0, records.shape[0], batch):
            ids = records[i:i + batch]
            taps.out = {}
            logits = model(input_ids=ids, use_cache=False).logits.float()
            full_top.append(logits.argmax(-1))
            nll.append(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                       reduction="none").view(ids.shape[0], -1))
            for e in exit_points:
                h = taps.out[e]
                if adapters is not None:
                    h = adapters(e, h)
                p = torch.softmax(_exit_logits(model, h), -1)
                c, t = p.max(-1)
                tops[e].append(t)
                confs[e].append(c)
    finally:
        taps.remove()
    ref = original["top1"].reshape(-1)
    full = torch.cat(full_top).reshape(-1)
    tops = {e: torch.cat(v).reshape(-1) for e, v in tops.items()}
    confs = {e: torch.cat(v).reshape(-1) for e, v in confs.items()}
    out = {"full_agreement": float((full == ref).float().mean()),
           "nll_ratio": float(torch.cat(nll).mean() / original["nll"].mean()),
           "exit_agreement": {e: float((tops[e] == ref).float().mean()) for e in exit_points}, "at": {}}
    grid = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999]
    for target in targets:
        best = None
        for th in grid:
            depth = torch.full_like(ref, L, dtype=torch.float32)
            tok = full.clone()
            done = torch.zeros_like(ref, dtype=torch.bool)
            for e in exit_points:
                stop = ~done & (confs[e] >= th)
                depth[stop] = e
                tok[stop] = tops[e][stop]
                done |= stop
            agree = float((tok == ref).float().mean())
            if agree >= target and (best is None or float(depth.mean()) < best["layers_per_token"]):
                best = {"threshold": th, "layers_per_token": round(float(depth.mean()), 3),
                        "agreement": round(agree, 4), "exit_rate": round(float(done.float().mean()), 4)}
        out["at"][str(target)] = best
    return out


def _exit_logits(model, h: torch.Tensor) -> torch.Tensor:
    """Final norm + LM head (+ Gemma's soft cap) of ``h [.., d]``: ``[.., V]`` float32, as the model's own forward."""
    logits = model.lm_head(model.model.norm(h)).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _records_digest(records: torch.Tensor) -> str:
    import hashlib  # noqa: PLC0415

    return hashlib.sha256(records.contiguous().numpy().tobytes()).hexdigest()[:16]


__all__ = ["BackboneConfig", "BackboneRun", "ExitAdapters", "default_exit_points", "dropout_rates", "exit_weights",
           "evaluate_exits", "reference_outputs", "tail_kl", "teacher_topk", "topk_kl", "train_backbone"]


@torch.no_grad()
def reference_outputs(model, records: torch.Tensor, batch: int = 8) -> dict:
    """``{"top1": [R, T], "nll": [R, T - 1]}`` of ``model`` (the original) on ``records [R, T]``: what
    :func:`evaluate_exits` measures agreement and the perplexity ratio against."""
    tops, nll = [], []
    for i in range(0, records.shape[0], batch):
        ids = records[i:i + batch]
        logits = model(input_ids=ids, use_cache=False).logits.float()
        tops.append(logits.argmax(-1))
        nll.append(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                   reduction="none").view(ids.shape[0], -1))
    return {"top1": torch.cat(tops), "nll": torch.cat(nll)}
