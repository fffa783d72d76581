"""Self-speculative decoding: the shallow path drafts, the full model verifies (the lossless mode).

Sources: LayerSkip (Elhoushi et al. 2024, self-speculation with an early-exit draft and reuse of the
draft's computation), Draft & Verify (Zhang et al. 2023, layer-skipping drafts, adaptive draft length
by confidence), SWIFT (Xia et al. 2024); the acceptance rule is the standard one of speculative
sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"). Loop structure after
gpt-fast's ``speculative_decode``.

One *cycle*, with ``L`` decoder layers, draft depth ``N`` and at most ``K`` drafted tokens, starting
with ``cur`` (the last emitted token, not yet in the KV cache) at position ``P``:

1. **Draft.** Feed ``cur`` through layers ``0..N-1`` (writing their K/V at ``P`` in the engine's one
   :class:`~laserlm.runtime.kv_cache.KVCache`), apply the exit head (final norm + LM head by default,
   or any callable ``hidden [B, T, d] -> logits [B, T, V]``, e.g. a calibrated exit head) and draw
   ``d1 ~ q0``; feed ``d1`` at ``P+1`` ... until ``K`` tokens are drafted or the draft's confidence
   (max softmax probability of the exit head) falls below ``threshold`` (adaptive draft length).
   The draft attends to the verified K/V of its own layers: no second cache.
2. **Verify.** Roll the cache back to ``P`` and run ``[cur, d1..dm]`` (``m <= K``) through the full
   model in one forward of ``m+1`` positions; this rewrites the K/V of the drafted positions. With
   ``reuse`` (default, LayerSkip's "exit query cache") the verify starts from the draft's layer-``N``
   hidden states and runs only layers ``N..L-1``; the draft's K/V for layers ``< N`` are exactly what
   the full model computes for those tokens, so they stay. (The draft then also feeds ``dm`` through
   layers ``< N``, which the verify would otherwise do.)
3. **Accept.** Greedy: keep the longest prefix of drafts equal to the full model's argmax, then the
   full model's correction (or bonus) token. Sampling: accept ``d_i`` with probability
   ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection draw from ``norm(max(0, p_i - q_i))``;
   if all are accepted draw the bonus token from ``p_m``. ``p`` and ``q`` are both processed by
   :func:`~laserlm.runtime.sampling.filter_logits` (temperature, top-k, top-p), so the emitted
   tokens are distributed exactly as full-depth sampling with the same settings.
4. **Roll back** the cache to ``P + accepted + 1`` (:meth:`Engine.truncate`).

Greedy output is token-for-token the full model's greedy output (up to float rounding of a
batched vs single-token forward, which never flipped a token in our tests); scoring is teacher-forced
full depth (the mode is lossless, so its logits *are* the full model's).

Spec: ``speculative:draft_layers=12,k=4,threshold=0.5[,reuse=1]``; ``draft_layers``, ``k`` and
``threshold`` also take ``auto`` (``auto=1`` sets every option not given to ``auto``): a short
calibration on local validation text picks them (see :mod:`laserlm.speculative.calibration`).

``laser=PATH`` (issue #6) drafts with the calibrated exit head (tuned-lens adapter + final norm + LM
head, :class:`laserlm.depth.heads.ExitHead`) stored in a laser file (``laserlm calibrate --output``)
at exactly the draft depth. Without ``draft_layers`` the draft depth is the file's exit point closest
to the default depth ``L // 2`` (the shallower one on a tie); a ``draft_layers`` for which the file
has no head is an error listing the file's exit layers (a head trained for another depth is not
used: its adapter maps another layer's hidden states). ``draft_layers=auto`` is not supported with
``laser=`` (the file fixes the candidate depths); ``k`` and ``threshold`` may still be ``auto``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Literal, Optional, Union

import torch

from ..errors import InvalidArgumentError
from ..runtime.loop import Emitted
from ..runtime.modes import FullDepth, ScoreOutput
from ..runtime.options import from_spec
from ..runtime.sampling import check_finite, probabilities

ExitHead = Callable[[torch.Tensor], torch.Tensor]  # hidden [B, T, d] -> logits [B, T, V]

MAX_K = 64
DEFAULT_K = 4
DEFAULT_THRESHOLD = 0.0


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation (all cycles after the prefill).

    Attributes:
        cycles: draft-then-verify cycles (= full-depth verify forwards).
        drafted: drafted tokens sent to verification.
        accepted: drafted tokens accepted.
        emitted: tokens emitted by the cycles (accepted + one correction/bonus per cycle).
        draft_steps: single-token forwards through the draft layers.
        draft_s, verify_s: wall-clock seconds spent drafting (draft layers + exit head + sampling)
            and verifying (full-depth forward of the ``m+1`` positions + acceptance).
        prefill_s: seconds of the full-depth prompt forward (and first token).
    """

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0

    def summary(self) -> dict:
        """Rates: ``acceptance_rate`` = accepted / drafted; ``mean_accepted_length`` = tokens emitted
        per verify forward including the correction/bonus token (EAGLE's tau; 1.0 = no gain)."""
        c, d = max(self.cycles, 1), max(self.drafted, 1)
        return {
            **asdict(self),
            "acceptance_rate": round(self.accepted / d, 4) if self.drafted else float("nan"),
            "mean_accepted_length": round(self.emitted / c, 4) if self.cycles else float("nan"),
            "mean_drafted": round(self.drafted / c, 4) if self.cycles else float("nan"),
            "draft_fraction": round(self.draft_s / max(self.draft_s + self.verify_s, 1e-12), 4),
        }


class SpeculativeDecoding:
    """The ``speculative`` decoding mode (see the module docstring for the algorithm).

    Args:
        num_layers: decoder layers ``L`` of the engine's model (for validation).
        draft_layers: draft depth ``N``, in ``[1, L-1]``.
        k: maximum drafted tokens per cycle, in ``[1, 64]``.
        threshold: adaptive draft length: stop drafting when the exit head's max probability is
            below it; in ``[0, 1]`` (0 = always draft ``k``).
        reuse: verify from the draft's layer-``N`` hidden states (runs layers ``N..L-1`` only).
        exit_head: ``hidden [B, T, d] -> logits [B, T, V]`` applied after layer ``N``; ``None`` = the
            model's final norm + LM head (:meth:`Engine.head`). A calibrated exit head (tuned lens)
            plugs in here.
        exit_head_name: label for stats.

    Raises:
        InvalidArgumentError: any option out of range.
    """

    name = "speculative"

    def __init__(self, num_layers: int, draft_layers: int | None = None, k: int = DEFAULT_K,
                 threshold: float = DEFAULT_THRESHOLD, reuse: bool = True, exit_head: ExitHead | None = None,
                 exit_head_name: str | None = None):
        if draft_layers is None:
            draft_layers = max(1, num_layers // 2)
        if isinstance(draft_layers, bool) or not isinstance(draft_layers, int) or not 1 <= draft_layers < num_layers:
            raise InvalidArgumentError(
                f"draft_layers must be an integer in [1, {num_layers - 1}] for this {num_layers}-layer model "
                f"(the draft must be shallower than the full model), got {draft_layers!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise InvalidArgumentError(f"k (drafted tokens per cycle) must be an integer in [1, {MAX_K}], got {k!r}")
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise InvalidArgumentError(f"threshold (draft confidence) must be in [0, 1], got {threshold!r}")
        if exit_head is not None and not callable(exit_head):
            raise InvalidArgumentError("exit_head must be a callable hidden [B, T, d] -> logits [B, T, V]")
        self.num_layers = num_layers
        self.draft_layers = draft_layers
        self.k = k
        self.threshold = float(threshold)
        self.reuse = bool(reuse)
        self.exit_head = exit_head
        self.exit_head_name = exit_head_name or ("lm_head" if exit_head is None else type(exit_head).__name__)
        self.calibration: dict | None = None  # filled by the auto calibration

    def config(self) -> dict:
        return {"draft_layers": self.draft_layers, "k": self.k, "threshold": self.threshold,
                "reuse": self.reuse, "exit_head": self.exit_head_name}

    def _check_engine(self, engine) -> None:
        if engine.num_layers != self.num_layers:
            raise InvalidArgumentError(f"this speculative mode was built for a {self.num_layers}-layer model, "
                                       f"the engine has {engine.num_layers} layers")

    # -- the mode interface: per-request state is the request's SpeculativeStats -----------------
    def new_state(self, engine, request=None) -> SpeculativeStats:
        """Raises InvalidArgumentError: the engine's model has another number of layers than the mode's."""
        self._check_engine(engine)
        return SpeculativeStats()

    @torch.inference_mode()
    def prefill(self, engine, request) -> list[Emitted]:
        t0 = time.perf_counter()
        out = engine.prefill(request.prompt_ids.unsqueeze(0), cache=request.cache)
        cur = request.sample(out.logits[0, -1])
        request.state.prefill_s = time.perf_counter() - t0
        return [Emitted(cur, engine.num_layers, {"kind": "prefill"})]

    @torch.inference_mode()
    def step(self, engine, request) -> list[Emitted]:
        """One draft + verify cycle from ``request.last_token``. ``Emitted.layers`` is the cycle's sequential
        decoder-layer passes (draft steps x N + verify depth) divided by the tokens it emitted."""
        st = request.state
        cache = request.cache
        room = cache.max_len - cache.length - 1  # positions left after cur's
        k = max(min(self.k, request.remaining - 1, room), 0)
        emitted, drafted, layers = self._cycle(engine, request, request.last_token, k)
        accepted = len(emitted) - 1
        out = []
        for i, tok in enumerate(emitted):
            kind = "accepted" if i < accepted else ("bonus" if accepted == drafted else "correction")
            out.append(Emitted(tok, layers / len(emitted),
                               {"cycle": st.cycles - 1, "drafted": drafted, "accepted": accepted, "kind": kind}))
        return out

    def summary(self, request) -> dict:
        """``{"speculative": {config..., counters..., rates...}}`` (merged into ``GenerationResult.extra``)."""
        out = {**self.config(), **request.state.summary()}
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return {"speculative": out}

    @torch.inference_mode()
    def score(self, engine, input_ids: torch.Tensor) -> ScoreOutput:
        """Teacher-forced logits ``[T, V]``: speculative decoding is lossless, so these are the full
        model's (computed at full depth; ``layers`` = L for every position)."""
        return FullDepth().score(engine, input_ids)

    def _cycle(self, engine, request, cur: int, k: int) -> tuple[list[int], int, float]:
        """One draft + verify cycle from ``cur``; returns (emitted tokens, drafted count, layer passes)."""
        params, st, cache, gen = request.params, request.state, request.cache, request.generator
        n_draft, n_layers = self.draft_layers, engine.num_layers
        head = self.exit_head or engine.head
        start = cache.length
        # 1. draft: step j feeds x_j (x_0 = cur) at start + j through layers < N
        t0 = time.perf_counter()
        drafts: list[int] = []
        q_probs: list[torch.Tensor] = []
        hiddens: list[torch.Tensor] = []
        x = cur
        steps = 0
        for j in range(k + 1):
            if j == k and not self.reuse:
                break  # without reuse the verify computes the last draft's lower layers itself
            h, state = engine.begin(torch.tensor([[x]]), start=start + j, cache=cache)
            h = engine.run_layers(0, n_draft, h, state)
            engine.commit(state)
            steps += 1
            hiddens.append(h)
            if j == k:
                break  # the last draft only needs its layer-N hidden state (for reuse)
            logits = check_finite(head(h)[0, -1].float())
            if self.threshold > 0 and float(torch.softmax(logits, dim=-1).max()) < self.threshold:
                break
            if params.greedy:
                x = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                x = int(torch.multinomial(q, 1, generator=gen))
                q_probs.append(q)
            drafts.append(x)
        m = len(drafts)
        t1 = time.perf_counter()
        # 2. verify [cur, d1..dm] at full depth (positions start .. start+m), rewriting the drafted positions
        h_in, state = engine.begin(torch.tensor([[cur] + drafts]), start=start, cache=cache)
        if self.reuse:
            h = engine.run_layers(n_draft, n_layers, torch.cat(hiddens[: m + 1], dim=1), state)
        else:
            h = engine.run_layers(0, n_layers, h_in, state)
        engine.commit(state)
        p_logits = engine.head(h)[0]  # [m+1, V]
        # 3. accept
        if params.greedy:
            target = check_finite(p_logits).argmax(-1).tolist()
            a = 0
            while a < m and drafts[a] == target[a]:
                a += 1
            last = target[a]
        else:
            p = probabilities(p_logits, params)
            a, last = 0, None
            while a < m:
                d = drafts[a]
                ratio = float(p[a, d]) / float(q_probs[a][d])
                if ratio >= 1.0 or float(torch.rand((), generator=gen)) < ratio:
                    a += 1
                    continue
                residual = (p[a] - q_probs[a]).clamp_min(0)
                if float(residual.sum()) <= 0:  # p == q: rejection has probability 0; guard rounding
                    residual = p[a]
                last = int(torch.multinomial(residual, 1, generator=gen))
                break
            if last is None:
                last = int(torch.multinomial(p[m], 1, generator=gen))
        # 4. roll back rejected positions: keep cur and the accepted drafts
        engine.truncate(start + a + 1, cache=cache)
        t2 = time.perf_counter()
        st.cycles += 1
        st.drafted += m
        st.accepted += a
        st.emitted += a + 1
        st.draft_steps += steps
        st.draft_s += t1 - t0
        st.verify_s += t2 - t1
        layers = steps * n_draft + (n_layers - n_draft if self.reuse else n_layers)
        return drafts[:a] + [last], m, float(layers)


# -- spec-string factory --------------------------------------------------------------------------
AUTO_OPTIONS = ("draft_layers", "k", "threshold")


@dataclass
class SpeculativeOptions:
    """Options of mode ``speculative`` (parsed by :func:`laserlm.runtime.options.from_spec`); ``None``: not
    given (the :class:`SpeculativeDecoding` default); ``"auto"``: chosen by the calibration."""

    draft_layers: Optional[Union[int, Literal["auto"]]] = None
    k: Optional[Union[int, Literal["auto"]]] = None
    threshold: Optional[Union[float, Literal["auto"]]] = None
    reuse: Optional[bool] = None
    auto: bool = False
    laser: Optional[str] = None


OPTIONS = tuple(f.name for f in fields(SpeculativeOptions))


def laser_exit_head(engine, path, draft_layers: int | None) -> tuple[int, torch.nn.Module, str]:
    """The calibrated exit head of the laser file ``path`` at the draft depth.

    Args:
        engine: the engine the file must have been made for (architecture + weight hash checked by
            :func:`laserlm.depth.laser_file.load_laser_file`).
        path: laser file written by ``laserlm calibrate --output`` (or :func:`save_laser_file`).
        draft_layers: draft depth ``N`` (the head stored for exit layer ``N``, i.e. after layers
            ``0..N-1``, is used); ``None`` = the file's exit point in ``[1, L-1]`` closest to ``L // 2``
            (ties: the shallower).

    Returns:
        ``(draft_layers, head, name)``; ``head`` maps ``hidden [B, T, d] -> logits [B, T, V]`` float32.

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a (readable) laser file.
        InvalidArgumentError: the file was made for another model; it has no exit head at
            ``draft_layers`` (the message lists the exit layers it has) or none shallower than ``L``.
    """
    from pathlib import Path  # noqa: PLC0415

    from ..depth.laser_file import load_laser_file  # noqa: PLC0415

    art = load_laser_file(path, engine)
    n_layers = engine.num_layers
    exits = sorted(int(e) for e in art.heads)
    usable = [e for e in exits if 1 <= e < n_layers]
    listed = ", ".join(map(str, exits)) or "none"
    if draft_layers is None:
        if not usable:
            raise InvalidArgumentError(f"laser file {path} has no exit head shallower than the model's {n_layers} "
                                       f"layers to draft with (its exit layers: {listed})")
        draft_layers = min(usable, key=lambda e: (abs(e - n_layers // 2), e))
    elif draft_layers not in art.heads:
        raise InvalidArgumentError(f"laser file {path} has no exit head at draft_layers={draft_layers}; "
                                   f"its exit layers are: {listed}")
    return draft_layers, art.heads[draft_layers], f"laser:{Path(path).name}@{draft_layers}"


def make_speculative(engine, **opts) -> SpeculativeDecoding:
    """``speculative:draft_layers=N,k=K,threshold=T,reuse=0|1[,laser=PATH]`` -> :class:`SpeculativeDecoding`.

    ``draft_layers``, ``k`` and ``threshold`` accept ``auto``; ``auto=1`` makes every option not
    given ``auto``. Auto options are chosen by :func:`~laserlm.speculative.calibration.calibrate`
    (about a minute of greedy decoding on WikiText-2 valid / ARC-Easy dev for smollm2-135m on 2 CPU cores,
    announced by one line on stderr, with a tqdm bar on a terminal), whose search is kept in
    ``mode.calibration`` and reported in the generation stats.

    ``laser=PATH`` drafts with the laser file's calibrated exit head at the draft depth (see
    :func:`laser_exit_head` for the default depth and the errors).

    Raises:
        InvalidArgumentError: unknown option, malformed or out-of-range value, missing calibration data,
            a laser file for another model or without a head at the draft depth.
        ModelNotFoundError / CorruptModelError: the laser file is missing / unreadable.
    """
    o = from_spec(SpeculativeOptions, opts, "speculative")
    if o.auto:
        for key in AUTO_OPTIONS:
            if getattr(o, key) is None:
                setattr(o, key, "auto")
    auto = {key for key in AUTO_OPTIONS if getattr(o, key) == "auto"}
    kwargs: dict = {key: getattr(o, key) for key in (*AUTO_OPTIONS, "reuse")
                    if getattr(o, key) is not None and key not in auto}
    if o.laser is not None:
        if "draft_layers" in auto:
            raise InvalidArgumentError("draft_layers=auto is not supported with laser=: give draft_layers=N "
                                       "(one of the laser file's exit layers) or omit it")
        if not o.laser.strip():
            raise InvalidArgumentError("speculative option laser needs a laser file path (laser=PATH)")
        SpeculativeDecoding(engine.num_layers, **kwargs)  # validate the numbers before reading the file
        kwargs["draft_layers"], kwargs["exit_head"], kwargs["exit_head_name"] = laser_exit_head(
            engine, o.laser, kwargs.get("draft_layers"))
    mode = SpeculativeDecoding(engine.num_layers, **kwargs)  # validates the fixed options first
    if auto:
        from .calibration import calibrate  # noqa: PLC0415

        fixed = {key: getattr(mode, key) for key in ("draft_layers", "k", "threshold") if key not in auto}
        report = calibrate(engine, exit_head=mode.exit_head, reuse=mode.reuse, **fixed)
        best = report["chosen"]
        mode = SpeculativeDecoding(engine.num_layers, draft_layers=best["draft_layers"], k=best["k"],
                                   threshold=best["threshold"], reuse=mode.reuse, exit_head=mode.exit_head,
                                   exit_head_name=mode.exit_head_name)
        mode.calibration = report
    return mode


__all__ = ["SpeculativeDecoding", "SpeculativeOptions", "SpeculativeStats", "make_speculative", "laser_exit_head",
           "ExitHead"]
