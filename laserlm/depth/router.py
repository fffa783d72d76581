"""Seed 004's DynamicRouter: one route (a set of decoder layers) for a whole request, chosen after layer 1.

Seed 004 §2.1 reads the hidden state of the first position after the first layer and picks a compute path
that skips *middle* layers for simple samples (40 % of them on its data). Here a route is a :class:`Route`:
the decoder layers a request runs, for its prompt and every generated token alike, and the head that reads the
last one. Two kinds of routes are built by calibration (:mod:`laserlm.training.router`):

- **skip routes**: every layer except a set of middle layers, chosen by ShortGPT's Block Influence
  (:func:`laserlm.depth.pruning.block_influence`; Men et al. 2024), read by the model's own final norm + LM head;
- **cap routes**: the first ``e`` layers, read by the trained exit head at exit point ``e``;

plus full depth (always the last route). The dropped layers never run for that request, so their K/V are never
needed: unlike a per-token exit there is no bridge, and the saving is the route's share of the layers.

**Which position.** An encoder's first position ([CLS]) sees the whole input; in a causal decoder the first
position sees only the first token, so its state after layer 1 is the same for every prompt that starts alike.
The router therefore reads ``position="last"`` by default (the last prompt token, which has attended to all of
them; on SmolLM2 its certified router saved the most layers: RESULTS, "The router as the seed describes it");
``mean`` (over the prompt's positions) and ``first`` (the seed's literal reading) are kept for measurement.

The router is a linear classifier over the standardised feature; a request takes the most probable route only
when its probability is above the router's ``confidence`` threshold, which calibration certifies against the
full model's greedy tokens (:func:`laserlm.training.router.certify_router`); otherwise it runs full depth.
Used by mode ``routed`` (:class:`RoutedDepth`), stored in the laser file (:mod:`laserlm.depth.laser_file`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..runtime.modes import Mode, ScoreOutput
from ..runtime.runner import Emitted
from .stats import summarize_events

ROUTER_LAYER = 1  # the feature is the hidden state after the first decoder layer (seed 004)
POSITIONS = ("last", "first", "mean")
ROUTER_PROMPT = 64  # tokens the router sees when a sequence is scored teacher-forced (no prompt to read)


@dataclass(frozen=True)
class Route:
    """One compute path: ``kept`` decoder layers (sorted, always including layer 0, which computes the router's
    feature) and ``exit``: the exit point whose trained exit head reads the last kept layer (``None``: the
    model's final norm + LM head)."""

    kept: tuple
    exit: int | None = None

    def check(self, num_layers: int) -> "Route":
        """Raises InvalidArgumentError for layers out of range, duplicates, no layer 0, or an exit head that
        does not sit after the last kept layer."""
        kept = tuple(int(i) for i in self.kept)
        if not kept or kept[0] != 0 or list(kept) != sorted(set(kept)) or kept[-1] >= num_layers:
            raise InvalidArgumentError(f"a route keeps distinct sorted layers in 0-{num_layers - 1} starting at "
                                       f"layer 0, got {list(kept)}")
        if self.exit is not None and int(self.exit) != kept[-1] + 1:
            raise InvalidArgumentError(f"a route's exit head at {self.exit} must read its last kept layer "
                                       f"{kept[-1]}")
        return Route(kept, None if self.exit is None else int(self.exit))

    def skipped(self, num_layers: int) -> list[int]:
        """The layers this route does not run (a cap route: everything after its exit)."""
        keep = set(self.kept)
        return [i for i in range(num_layers) if i not in keep]

    def describe(self, num_layers: int) -> str:
        if len(self.kept) == num_layers:
            return "full"
        if self.exit is not None:
            return f"exit@{self.exit}"
        return "skip " + ",".join(str(i) for i in self.skipped(num_layers))

    def to_dict(self) -> dict:
        return {"kept": list(self.kept), "exit": self.exit}


def runs(kept) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]``: contiguous half-open runs of layer indices."""
    out: list[tuple[int, int]] = []
    for i in kept:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def run_after_router_layer(engine, kept, h1: torch.Tensor, state) -> torch.Tensor:
    """Run a route's ``kept`` layers after the router's layer (the states ``h1 [B, T, d]`` after it, which every
    route shares) and return the last kept layer's states."""
    h = h1
    for a, b in runs(kept):
        a = max(a, ROUTER_LAYER)
        if a < b:
            h = engine.run_layers(a, b, h, state)
    return h


def router_feature(h1: torch.Tensor, position: str) -> torch.Tensor:
    """``[d]`` float32 feature of one prompt from ``h1 [T, d]``, its hidden states after layer 1.

    Raises:
        InvalidArgumentError: unknown position.
    """
    if position == "last":
        return h1[-1].float()
    if position == "first":
        return h1[0].float()
    if position == "mean":
        return h1.float().mean(0)
    raise InvalidArgumentError(f"router position must be one of {', '.join(POSITIONS)}, got {position!r}")


class DynamicRouter(nn.Module):
    """Linear classifier ``[B, d] -> [B, R]`` route logits over standardised features (route ``R - 1``: full depth).

    Args:
        hidden_size: ``d``.
        routes: the R :class:`Route` s, the last one full depth.
        position: which prompt position's layer-1 state is the feature (:data:`POSITIONS`).
        confidence: a shallower route is taken only when its probability is ``> confidence`` (1.0: never).

    Raises:
        InvalidArgumentError: fewer than two routes, the last not full depth, or an unknown position.
    """

    def __init__(self, hidden_size: int, routes: list[Route], position: str = "last", confidence: float = 1.0):
        super().__init__()
        if len(routes) < 2:
            raise InvalidArgumentError("a router needs at least one shallower route besides full depth")
        if position not in POSITIONS:
            raise InvalidArgumentError(f"router position must be one of {', '.join(POSITIONS)}, got {position!r}")
        self.routes = list(routes)
        self.position = position
        self.confidence = float(confidence)
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("std", torch.ones(hidden_size))
        self.linear = nn.Linear(hidden_size, len(routes))

    @property
    def full(self) -> int:
        return len(self.routes) - 1

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        return self.linear((feature.float() - self.mean) / self.std)

    @torch.no_grad()
    def decide(self, features: torch.Tensor, confidence: float | None = None) -> torch.Tensor:
        """``[B]`` route indices for ``features [B, d]``: the most probable route when its probability is
        ``> confidence`` (default: the router's own; 1.0 never routes), else full depth."""
        conf = self.confidence if confidence is None else float(confidence)
        p, r = self.probabilities(features).max(-1)
        return torch.where(p > conf, r, torch.full_like(r, self.full))

    @torch.no_grad()
    def probabilities(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` route probabilities in float64 (so a threshold just below a probability, as calibration's
        candidates are, compares as intended)."""
        return torch.softmax(self(features).double(), -1)

    def config_dict(self) -> dict:
        return {"routes": [r.to_dict() for r in self.routes], "position": self.position,
                "confidence": self.confidence, "layer": ROUTER_LAYER}

    @classmethod
    def from_config(cls, hidden_size: int, num_layers: int, cfg: dict) -> "DynamicRouter":
        """Raises InvalidArgumentError / KeyError / TypeError on a malformed config (the file reader turns them
        into CorruptModelError)."""
        raw = cfg["routes"]
        if not isinstance(raw, list) or not raw:
            raise InvalidArgumentError("the router has no routes")
        for r in raw:
            if not all(type(i) is int for i in r["kept"]) or not (r.get("exit") is None or type(r["exit"]) is int):
                raise InvalidArgumentError(f"route layers must be integers, got {r}")
        routes = [Route(tuple(r["kept"]), r.get("exit")).check(num_layers) for r in raw]
        if len(routes[-1].kept) != num_layers:
            raise InvalidArgumentError("the router's last route must be full depth")
        conf = cfg.get("confidence", 1.0)
        if isinstance(conf, bool) or not isinstance(conf, (int, float)) or not 0.0 <= conf <= 1.0:
            raise InvalidArgumentError(f"router confidence must be in [0, 1], got {conf!r}")
        if cfg.get("layer", ROUTER_LAYER) != ROUTER_LAYER:
            raise InvalidArgumentError(f"the router reads layer {cfg.get('layer')!r}; this laserlm reads layer "
                                       f"{ROUTER_LAYER}")
        return cls(hidden_size, routes, cfg.get("position", "last"), float(conf))


class RoutedDepth(Mode):
    """Mode ``routed``: each request runs the layers of the route its router picks from the prompt.

    Prefill runs layer 0 over the prompt (into the cache, as every route keeps it), reads the feature, picks the
    route, and runs the rest of the route's layers; every generated token runs the same layers. Per request,
    ``request.state`` holds the route index. ``Emitted.layers`` is the route's layer count.

    Args:
        router: the :class:`DynamicRouter` (from a laser file).
        heads: ``exit point -> exit head`` for cap routes (the same file's trained heads).
        confidence: overrides the router's certified confidence threshold.

    Raises:
        InvalidArgumentError: a cap route without its exit head, routes that do not fit the model, or a
            confidence outside [0, 1].
    """

    name = "routed"

    def __init__(self, engine, router: DynamicRouter, heads: dict | None = None, confidence: float | None = None):
        L = engine.num_layers
        self.router = router
        self.routes = [r.check(L) for r in router.routes]
        if len(self.routes[-1].kept) != L:
            raise InvalidArgumentError("the router's last route must be full depth")
        heads = heads or {}
        missing = [r.exit for r in self.routes if r.exit is not None and r.exit not in heads]
        if missing:
            raise InvalidArgumentError(f"the router's cap routes need exit heads at {missing}; the laser file has "
                                       f"heads at {sorted(heads)}")
        self.heads = heads
        if confidence is not None and not 0.0 <= confidence <= 1.0:
            raise InvalidArgumentError(f"router confidence must be in [0, 1], got {confidence}")
        self.confidence = router.confidence if confidence is None else float(confidence)

    def describe(self) -> str:
        return f"routed(routes={len(self.routes)}, position={self.router.position}, confidence={self.confidence:g})"

    def new_state(self, engine, request=None) -> dict:
        return {"route": len(self.routes) - 1}

    def _head(self, engine, route: int):
        r = self.routes[route]
        return engine.head if r.exit is None else self.heads[r.exit]

    @torch.inference_mode()
    def choose(self, engine, h1: torch.Tensor) -> int:
        """Route index for one prompt from its layer-1 states ``h1 [T, d]``."""
        feat = router_feature(h1, self.router.position).unsqueeze(0)
        return int(self.router.decide(feat, self.confidence)[0])

    @torch.inference_mode()
    def _forward(self, engine, ids: torch.Tensor, route: int | None, start, cache, last: bool,
                 read: int | None = None):
        """``ids [T]`` through layer 0, then (route chosen here from the first ``read`` positions' states, default
        all, when ``route`` is None) the route's other layers; returns ``(logits [T or 1, V] float32, route)``."""
        h, st = engine.begin(ids.reshape(1, -1), start=start, cache=cache, use_cache=cache is not None)
        h = engine.run_layers(0, ROUTER_LAYER, h, st)
        if route is None:
            route = self.choose(engine, h[0, :read])
        h = run_after_router_layer(engine, self.routes[route].kept, h, st)
        engine.commit(st)
        if last:
            h = h[:, -1:]
        return self._head(engine, route)(h)[0].float(), route

    def _emit(self, request, logits) -> list[Emitted]:
        r = self.routes[request.state["route"]]
        n = len(r.kept)
        return [Emitted(request.sample(logits[-1]), n, {"route": request.state["route"], "exit_layer": r.kept[-1] + 1,
                                                        "compute_layers": n})]

    def prefill(self, engine, request) -> list[Emitted]:
        """The whole prompt on the route its layer-1 state picks (the prompt's K/V exist for those layers only)."""
        logits, request.state["route"] = self._forward(engine, request.prompt_ids, None, 0, request.cache, True)
        return self._emit(request, logits)

    def step(self, engine, request) -> list[Emitted]:
        logits, _ = self._forward(engine, torch.tensor([request.last_token]), request.state["route"], None,
                                  request.cache, True)
        return self._emit(request, logits)

    def summary(self, request) -> dict:
        out = summarize_events(request.infos)
        out["route"] = self.routes[request.state["route"]].describe(len(self.routes[-1].kept))
        return out

    @torch.inference_mode()
    def score(self, engine, input_ids) -> ScoreOutput:
        """Teacher-forced logits ``[T, V]`` on the route picked from the first :data:`ROUTER_PROMPT` tokens (a
        scored sequence has no prompt of its own; for a short context followed by a scored continuation the route
        may read continuation tokens, so two continuations of one context can be scored on different routes)."""
        logits, route = self._forward(engine, input_ids.reshape(-1), None, None, None, False, read=ROUTER_PROMPT)
        return ScoreOutput(logits, torch.full((logits.shape[0],), float(len(self.routes[route].kept))))
