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

from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgumentError
from ..runtime.runner import Emitted
from ..runtime.modes import Mode, ScoreOutput
from .batched import run_layers_frozen
from .bridge import Bridge, DeferredBridge, PendingToken, PropagateBridge, make_bridge
from .groups import LayerGroups
from .policies import ExitPolicy, PredictorPolicy, find_predictor, transition_score
from .stats import summarize_events
from .walk import PatienceState, WalkResult, update_patience, walk_groups
from ..runtime.options import is_int

@dataclass
class DepthState:
    """Per-request state of adaptive depth (kept in ``Request.state``).

    Attributes:
        patience: the patience streak / lock.
        pending: the deferred bridge's token whose remaining layers run with the next token.
        valid: the ``none`` bridge's key masks, ``layer -> [max_len]`` bool (False: a skipped slot).
        prev_probs: the previous token's attention probabilities ``[H, S]`` at the ATS layer.
        recent: the last tokens (at most the complexity predictor's context), oldest first.
        prev_exit: the previous token's exit depth as a fraction of the layers (1.0 after the prompt).
        last_ats: the ATS of the last token run (NaN: none), the predictor's "previous token's ATS".
    """

    patience: PatienceState
    pending: PendingToken | None = None
    valid: dict = field(default_factory=dict)
    prev_probs: torch.Tensor | None = None
    recent: list = field(default_factory=list)
    prev_exit: float = 1.0
    last_ats: float = float("nan")


class AdaptiveDepth(Mode):
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

    The mode is a stateless config; per-request state (:class:`DepthState`) lives in ``request.state``.

    Raises:
        InvalidArgumentError: bad patience or an ATS layer at or after the first exit point.
    """

    name = "adaptive"
    prefill_key = "full"  # the prompt runs at full depth (exits start with the first generated token)

    def __init__(self, engine, groups: LayerGroups, policy: ExitPolicy, bridge="propagate", patience: int = 3,
                 heads: dict | None = None, ats_layer: int | None = None, score: str | None = None):
        self.groups = groups
        self.policy = policy
        self.bridge: Bridge = make_bridge(bridge) if isinstance(bridge, str) else bridge
        if not is_int(patience) or patience < 0:
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
        self.predictor = getattr(find_predictor(policy), "predictor", None)
        if self.predictor is not None and not set(self.predictor.exit_points) <= {b for _, b in groups.bounds}:
            raise InvalidArgumentError(f"the complexity predictor's exit points {self.predictor.exit_points} are not "
                                       f"group boundaries of {groups.describe()} (keep the laser file's groups)")
        if score is None:
            score = "replay" if isinstance(self.bridge, DeferredBridge) else "decode"
        if score not in ("decode", "replay"):
            raise InvalidArgumentError(f"score must be 'decode' or 'replay', got '{score}'")
        if score == "replay" and not isinstance(self.bridge, DeferredBridge):
            raise InvalidArgumentError("score=replay is exact only for bridge=deferred; use score=decode")
        self.score_method = score

    def describe(self) -> str:
        return (f"adaptive(groups={self.groups.describe()}, min_depth={self.groups.min_depth}, "
                f"policy={self.policy.describe()}, bridge={self.bridge.name}, patience={self.patience})")

    # -- helpers ---------------------------------------------------------------------------------
    def head_at(self, engine, layer: int):
        """The exit head at ``layer`` (a trained head from the laser file, else the model's norm + LM head)."""
        head = self.heads.get(layer)
        return head if head is not None else engine.head

    def _configure(self, engine, st, rs: DepthState) -> None:
        self.bridge.configure(engine, st, rs)
        if self.ats_layer is not None:
            st.ctx.want_probs = frozenset({self.ats_layer})

    def _ats(self, st, rs: DepthState) -> torch.Tensor:
        """``[1]`` ATS of the token just run at the ATS layer (NaN without a previous token)."""
        cur = st.ctx.probs[self.ats_layer][0, :, -1, :]  # [H, S]
        prev, rs.prev_probs = rs.prev_probs, cur
        rs.last_ats = float("nan") if prev is None else float(transition_score(prev, cur))
        return torch.tensor([rs.last_ats])

    def _predict(self, engine, rs: DepthState, token_id: int) -> torch.Tensor | None:
        """``[1, E]`` the complexity predictor's exit probabilities for ``token_id``, from its embedding, the
        embeddings of the request's recent tokens and the previous token's ATS and exit depth; computed before
        the token's first layer (``None`` without a predictor)."""
        p = self.predictor
        if p is None:
            return None
        from .predictor import predictor_scalars, window_embeddings  # noqa: PLC0415

        ids = ([-1] * p.context + list(rs.recent) + [int(token_id)])[-(p.context + 1):]
        emb = window_embeddings(engine.adapter.embed, torch.tensor([ids]))
        scal = predictor_scalars(torch.tensor([rs.last_ats]), torch.tensor([rs.prev_exit]), p.uses_ats)
        with torch.no_grad():
            return torch.sigmoid(p(emb, scal))

    def _remember(self, engine, rs: DepthState, token_id: int, exit_layer: int) -> None:
        """After a token: the predictor's history (recent tokens, previous exit depth)."""
        if self.predictor is not None:
            rs.recent = (list(rs.recent) + [int(token_id)])[-max(1, self.predictor.context):]
            rs.prev_exit = exit_layer / engine.num_layers

    def _walk(self, engine, run_group, rs: DepthState, final_head=None, head_at=None, predicted=None):
        """One token's walk (a batch of one) under the request's patience lock."""
        locked = torch.tensor([-1 if rs.patience.locked is None else rs.patience.locked])
        return walk_groups(self.groups, self.policy, head_at or (lambda b: self.head_at(engine, b)),
                           final_head or engine.head, 1, run_group, locked=locked, predicted=predicted)

    def _planned_exit(self, rs: DepthState, predicted: torch.Tensor | None) -> int | None:
        """The exit group of a token whose route is known before its first layer, or ``None`` when the walk must
        decide group by group (a patience lock applies, or a rule reads the token's own states).
        Known routes: a policy that can never exit (:attr:`ExitPolicy.never_exits`, e.g. a certified threshold of
        1.0) runs full depth; the complexity predictor alone fixes the route by the walk's rule: the first group at
        or above min depth whose end is one of its exit points with probability ``> threshold``; the last group =
        full depth."""
        L, bounds = self.groups.num_layers, self.groups.bounds
        if rs.patience.locked is not None:
            return None
        if getattr(self.policy, "never_exits", False):
            return len(bounds) - 1
        if predicted is None or type(self.policy) is not PredictorPolicy:
            return None
        points, thr = self.predictor.exit_points, self.policy.threshold
        for g, (_, b) in enumerate(bounds):
            if b == L:
                break
            if self.groups.can_exit(g) and b in points and bool(predicted[0, points.index(b)] > thr):
                return g
        return len(bounds) - 1

    def _run_planned(self, engine, run_group, group: int) -> WalkResult:
        """Run a planned route: the layers up to the planned exit in one call (one kernel run on packed weights
        instead of one per group), then that exit's head; the same result as :func:`walk_groups` would give."""
        L, b = self.groups.num_layers, self.groups.bounds[group][1]
        _, h, _ = run_group(group, 0, b, None)
        exited = b < L
        logits = (self.head_at(engine, b) if exited else engine.head)(h).float()
        return WalkResult(torch.tensor([group]), torch.tensor([b]), torch.tensor([exited]), logits,
                          torch.tensor([int(exited)]), torch.tensor([False]))

    def _after_token(self, rs: DepthState, res) -> None:
        exit_group = int(res.exit_group[0]) if bool(res.exited[0]) else None
        rs.patience = update_patience(rs.patience, self.patience, exit_group, bool(res.lock_failed[0]))

    # -- per request -----------------------------------------------------------------------------
    def new_state(self, engine, request=None) -> DepthState:
        return DepthState(PatienceState())

    @torch.inference_mode()
    def prefill_logits(self, engine, rs: DepthState, cache, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Run ``input_ids [T]`` at full depth into ``cache`` from position ``start`` (the positions before it
        are already cached); returns the last
        position's logits ``[V]``."""
        cache.crop(start)
        ids = input_ids.reshape(-1)
        h, st = engine.begin(ids[start:].reshape(1, -1), start=start, cache=cache)
        self._configure(engine, st, rs)
        h = engine.run_layers(0, engine.num_layers, h, st)
        engine.commit(st)
        if self.ats_layer is not None:
            self._ats(st, rs)
        if self.predictor is not None:
            rs.recent, rs.prev_exit = [int(x) for x in ids[-max(1, self.predictor.context):]], 1.0
        return engine.head(h[:, -1:])[0, 0]

    @torch.inference_mode()
    def decode(self, engine, rs: DepthState, cache, token_id: int) -> tuple[torch.Tensor, dict]:
        """Process one token at the end of ``cache``; returns ``(logits [V] float32, info)``.

        ``info``: ``exit_group``, ``exit_layer`` (layers of this token's forward before its head),
        ``head_evals`` (exit-head evaluations), ``bridge``, ``bridge_layers`` (skipped layers bridged),
        ``deferred_layers`` (layers run in this step for the previous, pending token), ``compute_layers``
        (decoder layers run in this step, both tokens), ``patience`` (whether the patience lock applied).
        """
        L = engine.num_layers
        token_id = int(token_id)
        pend, rs.pending = rs.pending, None
        h, st = engine.begin(torch.tensor([[token_id]], dtype=torch.long), cache=cache)
        self._configure(engine, st, rs)
        locked = rs.patience.locked
        run = {"h": h, "joint": None, "deferred": 0}  # joint: [hidden [1, 2, d], state] (deferred bridge)

        def run_group(g, a, b, exited):
            h_in = run["h"]
            if pend is not None and run["joint"] is None and a == pend.layer:
                _, stj = engine.begin(torch.tensor([[pend.token_id, token_id]]), start=pend.position, cache=cache)
                run["joint"] = [torch.cat([pend.hidden, h_in], dim=1), stj]
            if run["joint"] is not None:
                joint = run["joint"]
                joint[0] = engine.run_layers(a, b, joint[0], joint[1])
                run["h"] = joint[0][:, -1:]
                run["deferred"] += b - a
            else:
                run["h"] = engine.run_layers(a, b, h_in, st)
            ats = self._ats(st, rs) if self.ats_layer is not None and a <= self.ats_layer < b else None
            return h_in[:, 0], run["h"][:, 0], ats

        # before any layer of this token has run (not needed when nothing can exit)
        predicted = None if getattr(self.policy, "never_exits", False) else self._predict(engine, rs, token_id)
        plan = self._planned_exit(rs, predicted) if pend is None else None
        if plan is not None:  # the route is known (the predictor's plan, seed 000 §2.1): no per-group walk
            res = self._run_planned(engine, run_group, plan)
        else:
            res = self._walk(engine, run_group, rs, predicted=predicted)
        h, joint, deferred = run["h"], run["joint"], run["deferred"]
        exit_layer = int(res.exit_layer[0])
        self._remember(engine, rs, token_id, exit_layer)
        info = {"bridge": self.bridge.name, "patience": locked is not None, "bridge_layers": 0}
        if bool(res.exited[0]):
            if pend is not None:  # finish the pending token alone from where it stands
                first, hp = (pend.layer, pend.hidden) if joint is None else (exit_layer, joint[0][:, :1])
                _, stp = engine.begin(torch.tensor([[pend.token_id]]), start=pend.position, cache=cache)
                engine.run_layers(first, L, hp, stp)
                engine.commit(stp)
                deferred += L - first
            info["bridge_layers"] = self.bridge.on_exit(engine, st, exit_layer, h, token_id, rs)
        if joint is not None:
            engine.commit(joint[1])
        engine.commit(st)
        self._after_token(rs, res)
        info.update(exit_group=int(res.exit_group[0]), exit_layer=exit_layer, head_evals=int(res.head_evals[0]),
                    deferred_layers=deferred, compute_layers=exit_layer + deferred)
        return res.logits[0], info

    def prefill(self, engine, request) -> list[Emitted]:
        logits = self.prefill_logits(engine, request.state, request.cache, request.prompt_ids, request.prefilled)
        L = engine.num_layers
        return [Emitted(request.sample(logits), L, {"exit_layer": L, "exit_group": len(self.groups) - 1,
                                                    "phase": "prefill", "compute_layers": L})]

    def step(self, engine, request) -> list[Emitted]:
        """One token: :meth:`decode` of ``request.last_token``, then sampling. ``Emitted.layers`` is the token's
        exit layer; ``info`` holds the step details."""
        logits, info = self.decode(engine, request.state, request.cache, request.last_token)
        return [Emitted(request.sample(logits), info["exit_layer"], info)]

    # -- continuous batching ---------------------------------------------------------------------
    def batchable(self, engine) -> bool:
        """Whether :meth:`step_batch` reproduces :meth:`step`: the ``propagate`` bridge and no ATS (the frozen-row
        walk below writes exactly the propagate bridge's K/V; the ATS reads per-row attention history)."""
        return (isinstance(self.bridge, PropagateBridge) and self.ats_layer is None and engine.kernel is None
                and self.predictor is None)

    @torch.inference_mode()
    def step_batch(self, engine, requests) -> list[list[Emitted]]:
        """One token for each of ``requests`` (paged caches, :class:`~laserlm.runtime.kv_pool.PagedBatch`) in one
        batched forward; each row makes its own exit decision under its own patience lock.

        A row that exits is frozen: every later layer still runs on its exit state, which writes that layer's own
        projection of it, i.e. the ``propagate`` bridge's K/V (CALM's state propagation; the technique of
        :mod:`laserlm.depth.batched`). So a batched row costs full depth, like every row of a batched forward on
        a memory-bound CPU, and its logits are its exit head's. Equal to :meth:`step` per request up to float
        rounding of batched matmuls."""
        from ..runtime.kv_pool import batch_of  # noqa: PLC0415

        L, n = engine.num_layers, len(requests)
        ids = torch.tensor([[r.last_token] for r in requests], dtype=torch.long)
        h0, st = engine.begin(ids, cache=batch_of([r.cache for r in requests]))
        run = {"h": h0}

        def run_group(g, a, b, exited):
            h_in = run["h"]
            h = run["h"] = run_layers_frozen(engine, a, b, h_in, exited, st)
            return h_in[:, 0], h[:, 0], None

        locked = torch.tensor([-1 if r.state.patience.locked is None else r.state.patience.locked for r in requests])
        was_locked = [r.state.patience.locked is not None for r in requests]
        res = walk_groups(self.groups, self.policy, lambda b: self.head_at(engine, b), engine.head, n, run_group,
                          locked=locked, finish=True)
        engine.commit(st)
        out = []
        for i, r in enumerate(requests):
            exited = bool(res.exited[i])
            exit_layer = int(res.exit_layer[i])
            r.state.patience = update_patience(r.state.patience, self.patience,
                                               int(res.exit_group[i]) if exited else None, bool(res.lock_failed[i]))
            info = {"bridge": self.bridge.name, "patience": was_locked[i], "bridge_layers": L - exit_layer if exited
                    else 0, "exit_group": int(res.exit_group[i]), "exit_layer": exit_layer,
                    "head_evals": int(res.head_evals[i]), "deferred_layers": 0, "compute_layers": exit_layer,
                    "batched": True}
            out.append([Emitted(r.sample(res.logits[i]), exit_layer, info)])
        return out

    def summary(self, request) -> dict:
        """The exit-layer histogram and compute summary of a request (:func:`summarize_events`)."""
        return summarize_events(request.infos)

    # -- teacher-forced scoring ------------------------------------------------------------------
    def _boundary_states(self, engine, ids):
        """Full-depth batched forward of ``ids [T]``: hidden ``[T, d]`` at every group boundary, final logits
        ``[T, V]`` and the ATS layer's probs."""
        h, st = engine.begin(ids.unsqueeze(0), use_cache=False)
        if self.ats_layer is not None:
            st.ctx.want_probs = frozenset({self.ats_layer})
        hs = {0: h[0]}
        for a, b in self.groups.bounds:
            h = engine.run_layers(a, b, h, st)
            hs[b] = h[0]
        final = engine.head(h)[0]
        probs = st.ctx.probs.get(self.ats_layer) if self.ats_layer is not None else None
        return hs, final, probs

    @torch.inference_mode()
    def replay_score(self, engine, input_ids) -> ScoreOutput:
        """Teacher-forced score of the ``deferred`` bridge by replay: one batched full-depth forward keeps the
        hidden state at every group boundary, then the walk (min depth, patience, ATS) is replayed token by
        token on them. Exact in exact arithmetic because with the deferred bridge every token reads the exact
        K/V of all earlier tokens; equal to :meth:`score` with ``score=decode`` up to float rounding
        (tested). Position 0 is the full-depth prefill, as in :meth:`score`."""
        ids = input_ids.reshape(-1)
        t = ids.shape[0]
        L = engine.num_layers
        rs = self.new_state(engine)
        hs, final, probs = self._boundary_states(engine, ids)
        out = final.clone()
        layers = torch.full((t,), float(L))
        infos = []
        batched: dict[int, torch.Tensor] = {}  # exit layer -> [T, V] logits, computed on first use

        def head_at(b):
            def head(_h):
                if b not in batched:
                    batched[b] = self.head_at(engine, b)(hs[b].unsqueeze(0))[0].float()
                return batched[b][pos[0]:pos[0] + 1]
            return head

        def run_group(g, a, b, exited):
            i = pos[0]
            ats = None
            if probs is not None and a <= self.ats_layer < b:
                ats = transition_score(probs[0, :, i - 1, :i], probs[0, :, i, :i + 1]).reshape(1).float()
                rs.last_ats = float(ats[0])
            return hs[a][i:i + 1], hs[b][i:i + 1], ats

        pos = [0]
        if self.predictor is not None:
            rs.recent, rs.prev_exit = [int(ids[0])], 1.0
        for i in range(1, t):
            pos[0] = i
            predicted = self._predict(engine, rs, int(ids[i]))
            res = self._walk(engine, run_group, rs, final_head=lambda _h: final[pos[0]:pos[0] + 1], head_at=head_at,
                             predicted=predicted)
            self._remember(engine, rs, int(ids[i]), int(res.exit_layer[0]))
            out[i] = res.logits[0]
            layers[i] = float(res.exit_layer[0])
            self._after_token(rs, res)
            infos.append({"exit_layer": int(res.exit_layer[0]), "head_evals": int(res.head_evals[0]),
                          "exit_group": int(res.exit_group[0])})
        return ScoreOutput(out, layers, infos)

    @torch.inference_mode()
    def score(self, engine, input_ids) -> ScoreOutput:
        """Teacher-forced logits ``[T, V]`` of ``input_ids [T]`` under this policy and bridge: by replay
        (``score=replay``) or by decoding token by token with :meth:`decode` (position 0 is the full-depth
        prefill), so the cache behaves exactly as in generation. ``layers [T]`` = exit layer per position;
        ``infos`` = the step details."""
        if self.score_method == "replay":
            return self.replay_score(engine, input_ids)
        ids = input_ids.reshape(-1)
        t = ids.shape[0]
        out = torch.empty(t, engine.config.vocab_size, dtype=torch.float32)
        layers = torch.empty(t)
        rs = self.new_state(engine)
        cache = engine.new_cache(t)
        out[0] = self.prefill_logits(engine, rs, cache, ids[:1])
        layers[0] = engine.num_layers
        infos = []
        for i in range(1, t):
            logits, info = self.decode(engine, rs, cache, int(ids[i]))
            out[i] = logits
            layers[i] = info["exit_layer"]
            infos.append(info)
        return ScoreOutput(out, layers, infos)
