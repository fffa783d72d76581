"""Training and certifying seed 004's DynamicRouter (:mod:`laserlm.depth.router`, the inference side).

1. **Routes** (:func:`build_routes`): full depth; a *cap* route per exit point (the first ``e`` layers and the
   trained exit head there); and *skip* routes that drop 10/20/30/40 % of the layers from the middle of the model
   (between a quarter of the depth and the last layer), the ones with the lowest Block Influence (ShortGPT, Men et
   al. 2024; :func:`laserlm.depth.pruning.block_influence`).
2. **Labels** (:func:`collect_router_data`, :func:`labels_of`): for each prompt, the full model's greedy
   continuation, and for every route whether its teacher-forced greedy prediction matches each continuation token.
   The label is the route with the fewest layers whose agreement on the continuation is at least the quality target
   (at level 1.0, the route that reproduces the whole continuation: teacher-forced agreement at every position is
   the same as re-generating it, by induction on the tokens).
3. **Training** (:func:`train_router`): the focal loss (seed 004 §5.1) on the first split of the prompts.
4. **Certification** (:func:`certify_router`): the router's confidence threshold is chosen on a second split by
   the same fixed-sequence test as the gate thresholds (:func:`laserlm.training.thresholds.fixed_sequence_test`):
   a prompt's loss is the share of its continuation positions where its route disagrees with the full model's
   greedy token (a full-depth request: 0), so the certified threshold keeps the mean top-1 agreement with the full
   model at the target with probability ``>= 1 - delta``, assuming new prompts are exchangeable with the
   calibration prompts.
   Positions of one prompt share its route, so each prompt gives one loss (its share of disagreeing positions) and
   the test is the Hoeffding-Bentkus one for bounded losses over prompts; the candidate thresholds come from the
   prompts the router was fitted on, not the calibration prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..depth.router import POSITIONS, ROUTER_LAYER, DynamicRouter, Route, router_feature, run_after_router_layer, runs
from ..errors import InvalidArgumentError
from ..runtime.loop import greedy_ids
from ..runtime.modes import FullDepth
from .losses import focal_loss
from .thresholds import Calibration, fixed_sequence_test, resolve_target

SKIP_FRACTIONS = (0.1, 0.2, 0.3, 0.4)  # shares of the layers a skip route drops (seed 004: 40 % for simple samples)


def middle_layers(num_layers: int) -> list[int]:
    """The layers a skip route may drop: from a quarter of the depth (the seed's minimum depth) to the one
    before the last (the last layer feeds the LM head and has the highest Block Influence in every model we
    profiled)."""
    return list(range(max(1, num_layers // 4), num_layers - 1))


def skip_routes(block_influence: torch.Tensor, fractions=SKIP_FRACTIONS) -> list[Route]:
    """Skip routes from ``block_influence [L]``: for each fraction f, drop the ``round(f L)`` middle layers with
    the lowest Block Influence (duplicates and empty drops removed)."""
    L = int(block_influence.shape[0])
    mid = middle_layers(L)
    order = sorted(mid, key=lambda i: float(block_influence[i]))
    out, seen = [], set()
    for f in fractions:
        n = min(len(order), int(round(f * L)))
        drop = frozenset(order[:n])
        if n == 0 or drop in seen:
            continue
        seen.add(drop)
        out.append(Route(tuple(i for i in range(L) if i not in drop)))
    return out


def build_routes(num_layers: int, exits: list[int], block_influence: torch.Tensor) -> list[Route]:
    """Cap routes at ``exits``, skip routes (:func:`skip_routes`), then full depth; shallower routes first (by
    layer count; a skip route before a cap route of the same count)."""
    caps = [Route(tuple(range(e)), e) for e in exits if 1 <= e < num_layers]
    shallow = sorted(skip_routes(block_influence) + caps, key=lambda r: (len(r.kept), r.exit is not None))
    return shallow + [Route(tuple(range(num_layers)))]


def greedy_continuation(engine, prompt_ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` full-depth greedy tokens after ``prompt_ids [T]`` (the one generation loop, its own cache)."""
    return torch.tensor(greedy_ids(engine, FullDepth(), prompt_ids.reshape(-1), n), dtype=torch.long)


@torch.inference_mode()
def route_agreement(engine, heads: dict, routes: list[Route], prompt_ids: torch.Tensor,
                    continuation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced agreement of every route with the full model's ``continuation [m]`` after ``prompt_ids [p]``.

    Returns:
        ``(agree [R, m] bool, h1 [p, d])``: whether route r's greedy prediction at continuation position j equals
        ``continuation[j]`` (the full-depth route: all true), and the prompt's hidden states after layer 1.
    """
    seq = torch.cat([prompt_ids, continuation[:-1]]).reshape(1, -1)
    p, m = prompt_ids.shape[0], continuation.shape[0]
    h0, st = engine.begin(seq, use_cache=False)
    h1 = engine.run_layers(0, ROUTER_LAYER, h0, st)
    L = engine.num_layers
    # Routes share their leading run of layers (a cap route at e is layers 0..e-1; a skip route runs 0..f-1 before
    # its first dropped layer f): one pass through the layers serves every such prefix, so a prompt costs the
    # deepest prefix plus each skip route's layers after its first drop, not the sum of all routes.
    prefix = {ROUTER_LAYER: h1}  # j -> states after layers 0..j-1

    def after(j: int) -> torch.Tensor:
        have = max(i for i in prefix if i <= j)
        if have < j:
            prefix[j] = engine.run_layers(have, j, prefix[have], st)
        return prefix[j]

    starts = [max(_prefix_end(r.kept), ROUTER_LAYER) for r in routes]
    for j in sorted({j for r, j in zip(routes, starts) if len(r.kept) < L}):  # shallow first: one pass
        after(j)
    rows = []
    for r, j in zip(routes, starts):
        if len(r.kept) == L:
            rows.append(torch.ones(m, dtype=torch.bool))
            continue
        h = run_after_router_layer(engine, tuple(i for i in r.kept if i >= j), after(j), st)
        head = engine.head if r.exit is None else heads[r.exit]
        rows.append(head(h[0, p - 1: p - 1 + m]).argmax(-1) == continuation)
    return torch.stack(rows), h1[0, :p].float()


def _prefix_end(kept) -> int:
    """``j`` such that ``kept`` starts with layers ``0..j-1`` (0 when it does not start at layer 0)."""
    a, b = runs(kept)[0]
    return b if a == 0 else 0


@dataclass
class RouterData:
    """Per prompt: ``features`` (position name -> ``[P, d]`` layer-1 features), ``agree [P, R, m]`` (route r's
    teacher-forced agreement with the full model at each continuation position) and ``labels [P]``
    (:func:`labels_of`; routes are ordered shallow to full)."""

    features: dict
    agree: torch.Tensor
    labels: torch.Tensor

    def subset(self, sl: slice) -> "RouterData":
        return RouterData({k: v[sl] for k, v in self.features.items()}, self.agree[sl], self.labels[sl])


def labels_of(agree: torch.Tensor, level: float = 1.0) -> torch.Tensor:
    """``[P]``: the first route (the one with the fewest layers) whose share of agreeing positions in its row of
    ``agree [P, R, m]`` is at least ``level`` (1.0: every position, i.e. it re-generates the continuation); the last
    route is full depth."""
    ok = agree.double().mean(-1) >= level - 1e-9
    ok[:, -1] = True
    return ok.float().argmax(-1)


def collect_router_data(engine, heads: dict, token_ids: torch.Tensor, routes: list[Route], num_prompts: int = 96,
                        prompt_len: int = 32, continuation: int = 16, progress: bool = True) -> RouterData:
    """Cut ``num_prompts`` prompts of ``prompt_len`` tokens from ``token_ids`` and measure every route on them.

    Raises:
        InvalidArgumentError: bad sizes, or not enough tokens for the requested prompts.
    """
    if num_prompts < 1 or prompt_len < 1 or continuation < 1:
        raise InvalidArgumentError("router prompts, prompt length and continuation must be >= 1")
    if token_ids.shape[0] < num_prompts * prompt_len:
        raise InvalidArgumentError(f"router needs {num_prompts * prompt_len} tokens of text, got {token_ids.shape[0]}")
    feats = {k: [] for k in POSITIONS}
    agree = []
    for i in tqdm(range(num_prompts), desc="router labels", unit="prompt", disable=not progress):
        prompt = token_ids[i * prompt_len: (i + 1) * prompt_len]
        cont = greedy_continuation(engine, prompt, continuation)
        a, h1 = route_agreement(engine, heads, routes, prompt, cont)
        agree.append(a)
        for k in POSITIONS:
            feats[k].append(router_feature(h1, k))
    agree_t = torch.stack(agree)
    return RouterData({k: torch.stack(v) for k, v in feats.items()}, agree_t, labels_of(agree_t))


def train_router(router: DynamicRouter, features: torch.Tensor, labels: torch.Tensor, steps: int = 200,
                 lr: float = 1e-2, gamma: float = 2.0, weight_decay: float = 1e-3, seed: int = 0) -> list[float]:
    """Full-batch AdamW on the focal loss (seed 004) over ``features [P, d]`` and route ``labels [P]``.

    The bias starts at the log class prior and the weights at zero, so with few prompts the router leans to the
    common route; when every label is the same the router is that constant (nothing to learn). The
    standardisation floor (a tenth of the mean feature std) keeps prompts unlike the training ones from getting
    huge scores."""
    torch.manual_seed(seed)
    k = router.linear.out_features
    counts = torch.bincount(labels, minlength=k).float()
    with torch.no_grad():
        router.linear.weight.zero_()
        router.linear.bias.copy_(torch.log((counts + 0.5) / (counts.sum() + 0.5 * k)))
        router.mean.copy_(features.mean(0))
        if features.shape[0] > 1:
            std = features.std(0)
            router.std.copy_(std.clamp_min(float(std.mean()) * 0.1 + 1e-6))
        else:
            router.std.copy_(torch.ones_like(router.std))
    if int((counts > 0).sum()) <= 1:  # a single route seen: the constant router (the logit gap makes it certain)
        with torch.no_grad():
            router.linear.bias.copy_(torch.where(counts > 0, 10.0, -10.0))
        return []
    opt = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for _ in range(steps):
        loss = focal_loss(router(features), labels, gamma=gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def route_losses(decisions: torch.Tensor, agree: torch.Tensor) -> torch.Tensor:
    """``[P]`` float64: each prompt's share of continuation positions where its route (``decisions [P]``) disagrees
    with the full model (``agree [P, R, m]``); a full-depth prompt loses 0 (it *is* the reference). One loss per
    prompt, because the positions of a prompt share its route and are not independent evidence."""
    full = agree.shape[1] - 1
    got = agree[torch.arange(agree.shape[0]), decisions]  # [P, m]
    wrong = ~got & (decisions != full).unsqueeze(-1)
    return wrong.double().mean(-1)


def confidence_candidates(router: DynamicRouter, features: torch.Tensor) -> list[float]:
    """Confidence thresholds from strict to loose: 1.0 (never route; the rule is ``p > confidence``), then just
    below each distinct top probability of a shallower route on ``features`` (the *fit* prompts, so the sequence is
    fixed before the calibration prompts are seen), descending; float64, like :meth:`DynamicRouter.decide`."""
    p, r = router.probabilities(features).max(-1)
    probs = sorted({float(x) for x, ri in zip(p.tolist(), r.tolist()) if ri != router.full}, reverse=True)
    return [1.0] + [math.nextafter(x, 0.0) for x in probs if x <= 1.0]


def certify_router(router: DynamicRouter, features: torch.Tensor, agree: torch.Tensor, *, target_agreement: float,
                   delta: float = 0.1, candidates: list[float] | None = None) -> Calibration:
    """The loosest confidence threshold whose route disagreement is certified ``<= 1 - target_agreement`` at level
    ``delta`` on the calibration prompts (``features [P, d]``, ``agree [P, R, m]``); sets ``router.confidence``
    (1.0 when nothing is certified: every request runs full depth).

    Each prompt contributes one loss in [0, 1] (:func:`route_losses`), tested with the Hoeffding-Bentkus p-value
    (valid for bounded losses), so the guarantee is about prompts exchangeable with the calibration prompts.
    ``candidates``: from strict to loose, chosen without the calibration prompts (:func:`confidence_candidates` on
    the fit prompts); default: from ``features`` themselves (then the sequence depends on the data it is tested on).

    Raises:
        InvalidArgumentError: target or delta out of range, no calibration prompts.
    """
    target, _ = resolve_target(target_agreement, None, delta, None)
    if features.shape[0] == 0:
        raise InvalidArgumentError("router certification needs calibration prompts")

    def losses_at(conf):
        d = router.decide(features, conf)
        return route_losses(d, agree), float((d != router.full).double().mean())

    cands = confidence_candidates(router, features) if candidates is None else candidates
    cal = fixed_sequence_test(cands, losses_at, target, delta, "hoeffding_bentkus", what="router confidence",
                              none_means="every request runs full depth", unit="prompts")
    router.confidence = 1.0 if cal.threshold is None else float(cal.threshold)
    return cal


def route_report(router: DynamicRouter, features: torch.Tensor, agree: torch.Tensor, num_layers: int) -> dict:
    """What the router does at its confidence on ``features [P, d]`` / ``agree [P, R, m]``: route histogram,
    agreement with the full model per continuation position, and mean layers per token."""
    d = router.decide(features)
    kept = torch.tensor([len(r.kept) for r in router.routes], dtype=torch.float64)[d]
    names = [r.describe(num_layers) for r in router.routes]
    return {"prompts": int(d.numel()),
            "routes": {names[i]: int((d == i).sum()) for i in range(len(names)) if int((d == i).sum())},
            "agreement": round(1 - float(route_losses(d, agree).mean()), 5) if d.numel() else None,
            "mean_layers": round(float(kept.mean()), 3) if d.numel() else None,
            "layers_saved": round(1 - float(kept.mean()) / num_layers, 4) if d.numel() else None}
