"""The adaptive-depth decode loop (the seed's Laser layer scheduler), built from Engine primitives.

Per generated token: ``Engine.begin`` -> run layer group 1 -> [exit?] -> group 2 -> ... -> exit head ->
bridge fills the skipped layers' K/V -> commit. The prompt is prefilled at **full depth** (prefill is
compute-bound and batched; exiting early there would save little and would make every later token read
approximate K/V of the whole prompt).

Schedule rules (seed):

- exit points are group boundaries at or above the min depth (:mod:`laserlm.depth.groups`);
- at each exit point the :mod:`policy <laserlm.depth.policies>` decides;
- **patience rule** (``patience = k``, default 3, 0 disables): after ``k`` consecutive tokens exit at the same
  group ``g``, the following tokens run straight to group ``g`` without checking earlier exit points and are
  checked only there; the first token that fails its check at ``g`` runs to full depth without further
  checks and normal checking at every exit point resumes with the next token;
- the attention transition score (ATS) is measured at ``ats_layer`` (default: the layer just before the
  first exit point) from the attention probabilities of that layer's own pass
  (``AttentionContext.want_probs``), compared with the previous token's (zero-padded), mean cosine over heads.

Bridges (:mod:`laserlm.depth.bridge`): ``propagate`` and ``none`` act at the exit; ``deferred`` keeps the
exited token pending and runs its remaining layers in the next step: the new token runs alone up to the
pending token's exit layer ``e``, then both tokens run together as a 2-token forward at positions
``[p, p+1]`` from layer ``e`` on (the new token attends to the now exact K/V of the pending one). If the
new token exits before or during that, the pending token finishes its layers alone. Either way the cache
holds exactly the K/V of full-depth decoding once the step ends (up to float rounding of 2-row matmuls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..runtime.generate import TokenEvent
from ..runtime.modes import ScoreOutput
from ..runtime.sampling import make_generator, sample
from .bridge import Bridge, DeferredBridge, begin_at, make_bridge
from .groups import LayerGroups
from .policies import ExitPoint, ExitPolicy, transition_score
from .stats import EventStream

ROUTER_PROMPT = 64  # tokens the router sees when scoring a sequence teacher-forced (calibration's prompt length)


@dataclass
class PatienceState:
    """Streak of consecutive tokens exiting at ``group``; ``locked`` is the group being skipped to."""

    group: int | None = None
    streak: int = 0
    locked: int | None = None


class AdaptiveDepth:
    """Adaptive-depth decoding mode (``adaptive``).

    Args:
        engine: the :class:`~laserlm.runtime.engine.Engine`.
        groups: :class:`~laserlm.depth.groups.LayerGroups` (min depth included).
        policy: an :class:`~laserlm.depth.policies.ExitPolicy`.
        bridge: ``"propagate"`` | ``"deferred"`` | ``"none"`` or a :class:`~laserlm.depth.bridge.Bridge`.
        patience: k of the patience rule (0 disables).
        heads: optional ``exit layer -> ExitHead`` (trained heads); other exit points use the model's head.
        ats_layer: layer where the ATS is measured (only when the policy needs it).
        score: how :meth:`score` runs: ``"decode"`` (token by token, any bridge) or ``"replay"`` (batched, exact
            only for ``deferred``; the default there).
        router: optional sequence-level router (seed 004's DynamicRouter, ``route(engine, prompt_ids) -> layers``):
            at prefill it picks a depth for the whole request from the prompt's first-layer hidden states; every
            generated token then stops at that exit point at the latest (earlier exit points still ask the
            policy). For teacher-forced :meth:`score` the route is chosen from the first ``ROUTER_PROMPT``
            tokens of the sequence.

    Raises:
        InvalidArgumentError: bad patience or an ATS layer at or after the first exit point.
    """

    name = "adaptive"

    def __init__(self, engine, groups: LayerGroups, policy: ExitPolicy, bridge="propagate", patience: int = 3,
                 heads: dict | None = None, ats_layer: int | None = None, score: str | None = None,
                 router=None):
        self.groups = groups
        self.router = router
        self.route_layer = groups.num_layers
        self.policy = policy
        self.bridge: Bridge = make_bridge(bridge) if isinstance(bridge, str) else bridge
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise InvalidArgumentError(f"patience must be a non-negative integer, got {patience!r}")
        self.patience = patience
        self.heads = dict(heads or {})
        L = groups.num_layers
        self.ats_layer = None
        if getattr(policy, "needs_ats", False):
            first = groups.exit_points[0] if groups.exit_points else L
            if ats_layer is None:
                ats_layer = first - 1
            if not isinstance(ats_layer, int) or not 0 <= ats_layer < first:
                raise InvalidArgumentError(
                    f"ats_layer must be a layer before the first exit point (0-{first - 1}), got {ats_layer!r} (a laser "
                    "file's gates read the ATS at the layer they were trained with: keep the file's groups)")
            self.ats_layer = ats_layer
        self.state = PatienceState()
        self._prev_probs = None
        if router is not None and router.exit_points != [b for _, b in groups.bounds if b in router.exit_points]:
            raise InvalidArgumentError(f"the router's exit points {router.exit_points} are not group boundaries of "
                                       f"{groups.describe()}")
        if score is None:
            score = "replay" if isinstance(self.bridge, DeferredBridge) and router is None else "decode"
        if score not in ("decode", "replay"):
            raise InvalidArgumentError(f"score must be 'decode' or 'replay', got '{score}'")
        if score == "replay" and (not isinstance(self.bridge, DeferredBridge) or router is not None):
            raise InvalidArgumentError("score=replay is exact only for bridge=deferred without a router; "
                                       "use score=decode")
        self.score_method = score

    def describe(self) -> str:
        return (f"adaptive(groups={self.groups.describe()}, min_depth={self.groups.min_depth}, "
                f"policy={self.policy.describe()}, bridge={self.bridge.name}, patience={self.patience}"
                f"{', router' if self.router is not None else ''})")

    # -- helpers ---------------------------------------------------------------------------------
    def _head(self, engine, layer: int):
        head = self.heads.get(layer)
        return head if head is not None else engine.head

    def _configure(self, engine, state) -> None:
        self.bridge.configure(engine, state)
        if self.ats_layer is not None:
            state.ctx.want_probs = frozenset({self.ats_layer})

    def _ats(self, state) -> float | None:
        cur = state.ctx.probs[self.ats_layer][0, :, -1, :]  # [H, S]
        prev, self._prev_probs = self._prev_probs, cur
        return None if prev is None else float(transition_score(prev, cur))

    def reset(self, engine) -> None:
        """Start a new sequence: empty the cache, the bridge and the patience streak."""
        engine.reset()
        self.bridge.reset(engine)
        self.state = PatienceState()
        self._prev_probs = None

    # -- prefill and one step --------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, engine, input_ids: torch.Tensor) -> torch.Tensor:
        """Reset, then run ``input_ids [T]`` at full depth; returns the last position's logits ``[V]``."""
        self.reset(engine)
        if self.router is not None:
            self.route_layer = self.router.route(engine, input_ids.reshape(-1))
        h, st = engine.begin(input_ids.reshape(1, -1))
        self._configure(engine, st)
        h = engine.run_layers(0, engine.num_layers, h, st)
        engine.commit(st)
        if self.ats_layer is not None:
            self._ats(st)
        return engine.head(h[:, -1:])[0, 0]

    def _check(self, engine, g: int, h, h_in, ats, locked, checks_on, head=None):
        """Ask the policy at the end of group ``g`` (``h``/``h_in`` ``[d]``); returns ``(exit?, point, checks_on)``.
        Applies min depth and the patience lock (shared by :meth:`step` and the replayed score)."""
        b = self.groups.bounds[g][1]
        point = ExitPoint(g, b, engine.num_layers, h, h_in, head=head if head is not None else self._head(engine, b), ats=ats)
        if self.route_layer <= b < engine.num_layers:  # the router's depth for this request is a hard cap
            return True, point, checks_on
        if b == engine.num_layers or not checks_on or not self.groups.can_exit(g):
            return False, None, checks_on
        if locked is not None and g < locked:
            return False, None, checks_on
        if self.policy(point):
            return True, point, checks_on
        if locked is not None and g == locked:  # the patience lock fails: full depth, checks resume later
            self.state = PatienceState()
            checks_on = False
        return False, point, checks_on

    def _finish(self, exit_group: int | None, locked: int | None) -> None:
        """Update the patience streak after a token (exit group or ``None`` for full depth)."""
        s = self.state
        if exit_group is None:
            if locked is None:
                self.state = PatienceState()
            return
        if locked is None:
            if s.group == exit_group:
                s.streak += 1
            else:
                s.group, s.streak = exit_group, 1
            if self.patience and s.streak >= self.patience:
                s.locked = exit_group

    @torch.inference_mode()
    def step(self, engine, token_id: int) -> tuple[torch.Tensor, dict]:
        """Process one token at the next position; returns ``(logits [V] float32, info)``.

        ``info``: ``exit_group``, ``exit_layer`` (layers of this token's forward before its head),
        ``head_evals`` (exit-head evaluations), ``bridge``, ``bridge_layers`` (skipped layers bridged),
        ``deferred_layers`` (layers run in this step for the previous, pending token), ``compute_layers``
        (decoder layers run in this step, both tokens), ``patience`` (whether the patience lock applied).
        """
        L = engine.num_layers
        bounds = self.groups.bounds
        pos = engine.cache.length
        pend = None
        if isinstance(self.bridge, DeferredBridge):
            pend, self.bridge.pending = self.bridge.pending, None
        h, st = engine.begin(torch.tensor([[int(token_id)]], dtype=torch.long))
        self._configure(engine, st)
        locked = self.state.locked
        checks_on = True
        joint = None  # [hidden [1, 2, d], state] of the 2-token forward (deferred bridge)
        deferred_layers = 0
        head_evals = 0
        ats = None
        exit_group = None
        point = None
        for g, (a, b) in enumerate(bounds):
            h_in = h
            if pend is not None and joint is None and a == pend.layer:
                _, stj = begin_at(engine, pend.position, [pend.token_id, int(token_id)])
                joint = [torch.cat([pend.hidden, h], dim=1), stj]
            if joint is not None:
                joint[0] = engine.run_layers(a, b, joint[0], joint[1])
                h = joint[0][:, -1:]
                deferred_layers += b - a
            else:
                h = engine.run_layers(a, b, h, st)
            if self.ats_layer is not None and a <= self.ats_layer < b:
                ats = self._ats(st)
            done, point, checks_on = self._check(engine, g, h[0, 0], h_in[0, 0], ats, locked, checks_on)
            head_evals += point.head_evals if point is not None else 0
            if done:
                exit_group = g
                break
        info = {"bridge": self.bridge.name, "patience": locked is not None}
        if exit_group is not None:
            b = bounds[exit_group][1]
            if point._logits is None:
                head_evals += 1
            logits = point.logits
            if pend is not None:  # finish the pending token alone from where it stands
                start, hp = (pend.layer, pend.hidden) if joint is None else (b, joint[0][:, :1])
                _, stp = begin_at(engine, pend.position, [pend.token_id])
                engine.run_layers(start, L, hp, stp)
                deferred_layers += L - start
            info["bridge_layers"] = self.bridge.on_exit(engine, st, b, h, token_id)
        else:
            b = L
            logits = engine.head(h)[0, 0]
            info["bridge_layers"] = 0
        self._finish(exit_group, locked)
        engine.cache.length = pos + 1
        info.update(exit_group=exit_group if exit_group is not None else len(bounds) - 1, exit_layer=b,
                    head_evals=head_evals, deferred_layers=deferred_layers, compute_layers=b + deferred_layers)
        return logits, info

    def _boundary_states(self, engine, ids):
        """Full-depth batched forward of ``ids [T]``: hidden ``[T, d]`` at every group boundary, final logits
        ``[T, V]`` and the ATS layer's probs. When ``engine._depth_replay_memo`` is a dict (opt-in, for sweeps
        that replay the same text under many policies with frozen weights) results are memoised there."""
        bounds = self.groups.bounds
        memo = engine.__dict__.get("_depth_replay_memo")
        key = (ids.numpy().tobytes(), bounds, self.ats_layer)
        if memo is not None and key in memo:
            return memo[key]
        h, st = engine.begin(ids.unsqueeze(0), use_cache=False)
        if self.ats_layer is not None:
            st.ctx.want_probs = frozenset({self.ats_layer})
        hs = {0: h[0]}
        for a, b in bounds:
            h = engine.run_layers(a, b, h, st)
            hs[b] = h[0]
        final = engine.head(h)[0]
        probs = st.ctx.probs.get(self.ats_layer) if self.ats_layer is not None else None
        if memo is not None:
            if len(memo) >= 8:
                memo.pop(next(iter(memo)))
            memo[key] = (hs, final, probs)
        return hs, final, probs

    @torch.inference_mode()
    def replay_score(self, engine, input_ids) -> ScoreOutput:
        """Teacher-forced score of the ``deferred`` bridge by replay: one batched full-depth forward keeps the
        hidden state at every group boundary, then the policy (min depth, patience, ATS) is replayed token by
        token on them. Exact in exact arithmetic because with the deferred bridge every token reads the exact
        K/V of all earlier tokens; equal to :meth:`score` with ``score=decode`` up to float rounding
        (tested). Position 0 is the full-depth prefill, as in :meth:`score`."""
        ids = input_ids.reshape(-1)
        t = ids.shape[0]
        L = engine.num_layers
        bounds = self.groups.bounds
        self.reset(engine)
        hs, final, probs = self._boundary_states(engine, ids)
        out = final.clone()
        layers = torch.full((t,), float(L))
        self.last_infos = []
        batched: dict[int, torch.Tensor] = {}  # exit layer -> [T, V] logits, computed on first use

        def head_at(b: int, i: int):
            def head(_h):
                if b not in batched:
                    batched[b] = self._head(engine, b)(hs[b].unsqueeze(0))[0].float()
                return batched[b][i]
            return head

        for i in range(1, t):
            locked = self.state.locked
            checks_on = True
            ats = None
            if probs is not None:
                ats = float(transition_score(probs[0, :, i - 1, :i], probs[0, :, i, :i + 1]))
            exit_group = None
            head_evals = 0
            for g, (a, b) in enumerate(bounds):
                done, point, checks_on = self._check(engine, g, hs[b][i], hs[a][i], ats, locked, checks_on,
                                                     head=head_at(b, i))
                head_evals += point.head_evals if point is not None else 0
                if done:
                    exit_group = g
                    head_evals += 0 if point._logits is not None else 1
                    out[i] = point.logits
                    layers[i] = b
                    break
            self._finish(exit_group, locked)
            self.last_infos.append({"exit_layer": int(layers[i]), "head_evals": head_evals,
                                    "exit_group": exit_group if exit_group is not None else len(bounds) - 1})
        return ScoreOutput(out, layers)

    # -- the mode interface ----------------------------------------------------------------------
    def tokens(self, engine, prompt_ids, params, max_tokens):
        """Generate after ``prompt_ids [T]``; prefill at full depth, then one :meth:`step` per token.
        Each TokenEvent's ``layers`` is the token's exit layer; ``info`` holds the step details. Returns an
        :class:`~laserlm.depth.stats.EventStream` (its ``summary()`` gives the exit-layer histogram)."""
        return EventStream(self._tokens(engine, prompt_ids, params, max_tokens))

    def _tokens(self, engine, prompt_ids, params, max_tokens):
        generator = None if params.greedy else make_generator(params.seed)
        L = engine.num_layers
        t0 = time.perf_counter()
        logits = self.prefill(engine, prompt_ids)
        token = int(sample(logits.unsqueeze(0), params, generator)[0])
        now = time.perf_counter()
        yield TokenEvent(token, L, now - t0, {"exit_layer": L, "exit_group": len(self.groups) - 1,
                                              "phase": "prefill", "compute_layers": L})
        for _ in range(max_tokens - 1):
            t0 = now
            logits, info = self.step(engine, token)
            token = int(sample(logits.unsqueeze(0), params, generator)[0])
            now = time.perf_counter()
            yield TokenEvent(token, info["exit_layer"], now - t0, info)

    @torch.inference_mode()
    def score(self, engine, input_ids) -> ScoreOutput:
        """Teacher-forced logits ``[T, V]`` by decoding ``input_ids [T]`` token by token with this policy and
        bridge (position 0 is the full-depth prefill), so the cache behaves exactly as in generation.
        ``layers [T]`` = exit layer per position. Step details of the last call are in ``self.last_infos``."""
        if self.score_method == "replay":
            return self.replay_score(engine, input_ids)
        ids = input_ids.reshape(-1)
        t = ids.shape[0]
        out = torch.empty(t, engine.config.vocab_size, dtype=torch.float32)
        layers = torch.empty(t)
        out[0] = self.prefill(engine, ids[:1])
        if self.router is not None:
            self.route_layer = self.router.route(engine, ids[:ROUTER_PROMPT])
        layers[0] = engine.num_layers
        self.last_infos = []
        for i in range(1, t):
            logits, info = self.step(engine, int(ids[i]))
            out[i] = logits
            layers[i] = info["exit_layer"]
            self.last_infos.append(info)
        return ScoreOutput(out, layers)
