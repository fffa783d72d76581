"""Token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.

Conventions follow transformers/vLLM: ``temperature == 0`` means greedy; ``top_k == 0`` and
``top_p == 1`` disable those filters; top-k is applied before top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgumentError, NonFiniteLogitsError
from .options import is_int, is_number


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_new_tokens: upper bound on generated tokens (>= 1).
        temperature: 0 for greedy decoding, else > 0 (logits are divided by it).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = off), in (0, 1].
        seed: seed of the sampling generator (None = nondeterministic).
        stop: strings that end generation; the stop string is not included in the output.
        ignore_eos: keep generating after an end-of-sequence token.
        presence_penalty: subtracted from the logit of every token already generated, in [-2, 2] (OpenAI; 0 = off).
        frequency_penalty: subtracted once per earlier occurrence in the output, in [-2, 2] (OpenAI; 0 = off).
        repetition_penalty: in [0.01, 100] (a smaller one overflows logits to inf); a token seen in the prompt or the
            output has its logit divided by it when positive, multiplied when negative (CTRL, Keskar et al. 2019, as
            vLLM and transformers; 1 = off).
        constraint: a :class:`~laserlm.runtime.structured.GrammarConstraint` (per-request state: the tokens a
            grammar allows next, e.g. a JSON schema), or None.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constraint: object = None

    def validate(self) -> SamplingParams:
        """Check every value; raises :class:`InvalidArgumentError` naming the bad one."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (not is_int(self.seed)
                                      or not 0 <= self.seed < 2**64):
            raise InvalidArgumentError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidArgumentError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -2 <= v <= 2:
                raise InvalidArgumentError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not is_number(r) or not 0.01 <= r <= 100:
            raise InvalidArgumentError(f"repetition_penalty must be in [0.01, 100] (1 = off), got {r!r}")
        return self

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (see :func:`apply_penalties`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: torch.Tensor,
                    output_ids: list[int]) -> torch.Tensor:
    """``logits [V]`` with vLLM's penalties applied (its ``apply_penalties``), returned as a new float32 tensor:

    - repetition (CTRL): each token in ``prompt_ids`` or ``output_ids``: ``l / r`` if ``l > 0`` else ``l * r``;
    - frequency: ``l -= frequency_penalty * count`` (occurrences in ``output_ids``);
    - presence: ``l -= presence_penalty`` for each token in ``output_ids``.

    Applied before temperature, top-k and top-p, so with temperature 0 the argmax of the penalised logits is taken.
    """
    out = logits.float().clone()
    v = out.shape[-1]
    if params.repetition_penalty != 1:
        seen = torch.zeros(v, dtype=torch.bool)
        seen[prompt_ids.reshape(-1).long()] = True
        if output_ids:
            seen[torch.tensor(output_ids, dtype=torch.long)] = True
        r = float(params.repetition_penalty)
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if output_ids and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=v)[:v].float()
        out = out - float(params.frequency_penalty) * counts - float(params.presence_penalty) * (counts > 0).float()
    return out


def check_mode_sampling(params: SamplingParams, mode) -> None:
    """Refuse penalties and grammar constraints for a mode that accepts tokens without :meth:`Request.sample`
    (``samples_each_token = False``: speculative decoding accepts drafted tokens against the unchanged target
    distribution).

    Raises:
        InvalidArgumentError: naming the mode.
    """
    if mode.samples_each_token:
        return
    name = mode.name
    if params.penalized:
        raise InvalidArgumentError(f"presence/frequency/repetition penalties are not supported with the {name} mode "
                                   "(its drafts are verified against the unpenalised distribution); use another mode "
                                   "or no penalty")
    if params.constraint is not None:
        raise InvalidArgumentError(f"structured output (response_format) is not supported with the {name} mode (its "
                                   "drafts are verified against the unconstrained distribution); use another mode")


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``logits [..., V]`` -> float32 ``[..., V]``; removed tokens get ``-inf``.

    The kept tokens' values are the logits shifted so that the row maximum is 0, then divided by the
    temperature (a constant shift: softmax is unchanged). Shifting first means a temperature so small that
    ``logits / temperature`` would overflow (``1e-38``, or one that rounds to 0 in float32) cannot produce
    ``inf - inf = NaN``: the most likely token(s) stay at 0 and every other token goes to a large negative
    value or ``-inf``, i.e. the distribution tends to the greedy one-hot (ties split evenly), which is the
    limit of ``softmax(logits / T)`` as ``T -> 0`` (transformers issue #24111).

    Top-p follows transformers' ``TopPLogitsWarper`` computation exactly (ascending sort, float32 cumulative
    sum, drop a token while the mass up to and including it is ``<= 1 - top_p``, the top token always stays),
    so both keep the same set even where the mass before a token rounds across ``top_p`` (vLLM #1623).
    """
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    # 0 / T stays 0 even when T underflows to 0 in float32; the rest goes to -large or -inf, never NaN
    logits = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / temperature)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """Return ``logits [..., V]`` unchanged when they can be sampled from: no NaN, no ``+inf``, and at least
    one finite value per row (``-inf`` alone is allowed: a model may mask tokens that way).

    Raises:
        NonFiniteLogitsError: NaN or ``+inf`` values, or a row that is all ``-inf`` (the message gives the
            counts and the dtype). Without this check greedy decoding of NaN logits emits token 0 forever.
    """
    # one reduction on the way that passes: a row's max is finite exactly when the row has no NaN (max propagates
    # NaN), no +inf, and is not all -inf; the counts are taken only to word the error
    if logits.numel() and bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return logits
    nan = torch.isnan(logits)
    posinf = torch.isposinf(logits)
    bad_rows = ~torch.isfinite(logits).any(dim=-1)
    if bool(nan.any()) or bool(posinf.any()) or bool(bad_rows.any()):
        raise NonFiniteLogitsError(
            f"the model produced non-finite logits ({int(nan.sum())} NaN, {int(posinf.sum())} +inf of "
            f"{logits.numel()} values, dtype {str(logits.dtype).removeprefix('torch.')}): its activations "
            "overflowed or its weights are damaged; load it with dtype float32"
        )
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from, ``[..., V]`` float32 (one-hot for greedy).

    Raises:
        NonFiniteLogitsError: ``logits`` contain NaN or inf (:func:`check_finite`).
    """
    check_finite(logits)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick next tokens from ``logits [B, V]`` -> ``[B]`` int64.

    Raises:
        NonFiniteLogitsError: ``logits`` contain NaN or inf (:func:`check_finite`).
    """
    check_finite(logits)
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
