"""Training seed 004's DynamicRouter (:mod:`laserlm.depth.router`, the inference side: the router itself
and :func:`~laserlm.depth.router.pooled_first_layer`). Labels: the shallowest route whose teacher-forced
greedy predictions over the full model's own greedy continuation of the prompt all match it, i.e.
the route that reproduces the full model's greedy continuation exactly (checking the teacher-forced
argmax at each continuation position is equivalent to re-generating, by induction on the tokens).
Trained with the focal loss (seed 004).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..depth.router import DynamicRouter, pooled_first_layer
from ..errors import InvalidArgumentError
from ..runtime.loop import greedy_ids
from ..runtime.modes import FullDepth
from .losses import focal_loss


def greedy_continuation(engine, prompt_ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` full-depth greedy tokens after ``prompt_ids [T]`` (the one generation loop, its own cache)."""
    return torch.tensor(greedy_ids(engine, FullDepth(), prompt_ids.reshape(-1), n), dtype=torch.long)


@torch.inference_mode()
def route_label(engine, heads: dict, prompt_ids: torch.Tensor, continuation: torch.Tensor,
                exit_points: list[int]) -> int:
    """Shallowest route index whose exit head reproduces ``continuation`` greedily (``E`` = full depth).

    ``heads``: ``exit_point -> fn(hidden [.., d]) -> logits`` (the trained exit heads).
    """
    seq = torch.cat([prompt_ids, continuation[:-1]]).reshape(1, -1)
    p, m = prompt_ids.shape[0], continuation.shape[0]
    h, state = engine.begin(seq, use_cache=False)
    start = 0
    for r, e in enumerate(exit_points):
        h = engine.run_layers(start, e, h, state)
        start = e
        pred = heads[e](h[0, p - 1: p - 1 + m]).argmax(-1)
        if torch.equal(pred, continuation):
            return r
    return len(exit_points)


@dataclass
class RouterData:
    """``pooled [P, d]`` first-layer pooled states and ``labels [P]`` route indices of P prompts."""

    pooled: torch.Tensor
    labels: torch.Tensor


def collect_router_data(engine, heads: dict, token_ids: torch.Tensor, exit_points: list[int],
                        num_prompts: int = 64, prompt_len: int = 64, continuation: int = 8,
                        progress: bool = True) -> RouterData:
    """Cut ``num_prompts`` prompts of ``prompt_len`` tokens from ``token_ids`` and label their routes.

    Raises:
        InvalidArgumentError: not enough tokens for the requested prompts.
    """
    if num_prompts < 1 or prompt_len < 1 or continuation < 1:
        raise InvalidArgumentError("router prompts, prompt length and continuation must be >= 1")
    if token_ids.shape[0] < num_prompts * prompt_len:
        raise InvalidArgumentError(f"router needs {num_prompts * prompt_len} tokens of text, got {token_ids.shape[0]}")
    pooled, labels = [], []
    for i in tqdm(range(num_prompts), desc="router labels", unit="prompt", disable=not progress):
        prompt = token_ids[i * prompt_len: (i + 1) * prompt_len]
        cont = greedy_continuation(engine, prompt, continuation)
        labels.append(route_label(engine, heads, prompt, cont, exit_points))
        pooled.append(pooled_first_layer(engine, prompt))
    return RouterData(torch.stack(pooled), torch.tensor(labels, dtype=torch.long))


def train_router(router: DynamicRouter, data: RouterData, steps: int = 200, lr: float = 1e-2,
                 gamma: float = 2.0, weight_decay: float = 1e-3, seed: int = 0) -> list[float]:
    """Full-batch AdamW on the focal loss (seed 004); features standardised with the data's statistics.

    The bias starts at the log class prior and the weights at zero, so with few prompts the router leans to the
    common route; when every label is the same the router is that constant (no fit: nothing to learn). The
    standardisation floor (a tenth of the mean feature std) keeps prompts unlike the training ones from getting
    huge scores."""
    torch.manual_seed(seed)
    k = router.linear.out_features
    counts = torch.bincount(data.labels, minlength=k).float()
    with torch.no_grad():
        router.linear.weight.zero_()
        router.linear.bias.copy_(torch.log((counts + 0.5) / (counts.sum() + 0.5 * k)))
    router.mean.copy_(data.pooled.mean(0))
    if data.pooled.shape[0] > 1:
        std = data.pooled.std(0)
        router.std.copy_(std.clamp_min(float(std.mean()) * 0.1 + 1e-6))
    else:
        router.std.copy_(torch.ones_like(router.std))
    if int((counts > 0).sum()) <= 1:  # a single route seen: the constant router (logit gap makes it certain)
        with torch.no_grad():
            router.linear.bias.copy_(torch.where(counts > 0, 10.0, -10.0))
        return []
    opt = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for _ in range(steps):
        loss = focal_loss(router(data.pooled), data.labels, gamma=gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
