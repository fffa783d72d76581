"""Draft proposers: n-gram (prompt lookup) drafts and a bounded suffix cache (no model), the shallow path
(:func:`propose_shallow`) and a trained draft head (:func:`propose_head`). The per-step policy that picks a
source and a draft length is :mod:`.policy`; the acceptance rule, :mod:`.verify`.

Sources:

- **n-gram / prompt lookup** (Saxena 2023, "Prompt Lookup Decoding", the method behind transformers'
  ``generate(prompt_lookup_num_tokens=...)`` and vLLM's ``ngram`` proposer): the last ``n`` tokens of the
  request (prompt + generated text, ``n`` from ``max_ngram`` down to ``min_match``) are looked up among
  its earlier tokens; the tokens that followed the most recent earlier occurrence are the draft.
  :class:`NgramIndex` keeps, per request, a hash map ``n-gram -> last end position`` for every
  ``n <= max_ngram``, updated incrementally, so a lookup costs ``O(max_ngram)`` dict probes.
- **suffix cache** (after SuffixDecoding, Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to
  Speeding Up Large Language Model Inference", which drafts from suffix trees over earlier requests):
  :class:`SuffixCache` indexes the tokens (prompt + output) of the earlier requests of the process in the
  same n-gram maps, bounded to ``max_tokens`` stored tokens (oldest requests are evicted first). It is a
  hashed n-gram index rather than a suffix tree: matches are at most ``max_ngram`` tokens long and a draft
  is the single continuation of the most recent occurrence (no frequency-weighted tree of continuations).
- **shallow path** (the model's first layers and an exit head): :func:`propose_shallow`.
- **draft head** (a trained EAGLE-style layer on the model's last features, :mod:`.draft_head`): :func:`propose_head`.

Lookup drafts have no draft distribution: they are *deterministic* drafts, ``q = one-hot(d)``. The lossless
acceptance rule for them is the speculative-sampling rule (Leviathan et al. 2023, Algorithm 1; Chen et al.
2023) with that ``q``: accept ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``; on rejection sample
from ``norm(max(0, p - q))``, which is ``p`` with ``d`` removed and renormalised. (Equivalently: draw
``t ~ p``, accept iff ``t == d``, else emit ``t``.) Greedy decoding accepts iff ``d`` is the argmax.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..errors import InvalidArgumentError
from ..runtime.options import is_int
from ..runtime.sampling import check_finite, probabilities

MAX_NGRAM = 16
DEFAULT_MAX_NGRAM = 3
# min_match 1: a 1-token match drafts. It is the weakest evidence (lowest prior), but on grounded prompts a 1-token
# match is how a copy resynchronises after a correction token. What 1-token probes can cost is bounded by the loss
# budget and the pooled misses instead.
DEFAULT_MIN_MATCH = 1
DEFAULT_SUFFIX_TOKENS = 65536
MAX_SUFFIX_TOKENS = 1 << 26
SOURCES = ("ngram", "suffix", "layers", "head")


def parse_draft(value) -> tuple[str, ...]:
    """``"ngram+layers"`` (or a sequence of names) -> ``("ngram", "layers")``: the draft sources, in priority
    order (ties of the policy and ``adaptive=0`` take the first).

    Raises:
        InvalidArgumentError: empty, an unknown source (known: ngram, suffix, layers, head) or a repeated one.
    """
    parts = value.split("+") if isinstance(value, str) else list(value)
    names = tuple(str(p).strip().lower() for p in parts)
    if not names or any(not n for n in names):
        raise InvalidArgumentError(f"draft must name draft sources joined by '+' (of {', '.join(SOURCES)}), "
                                   f"got {value!r}")
    bad = [n for n in names if n not in SOURCES]
    if bad:
        raise InvalidArgumentError(f"unknown draft source(s) {', '.join(bad)} in draft={value!r}; "
                                   f"known: {', '.join(SOURCES)}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"draft={value!r} names a source twice")
    return names


def check_ngram(max_ngram, min_match) -> None:
    """Raises InvalidArgumentError: ``max_ngram`` not an integer in ``[1, 16]`` or ``min_match`` not in
    ``[1, max_ngram]``."""
    if not is_int(max_ngram) or not 1 <= max_ngram <= MAX_NGRAM:
        raise InvalidArgumentError(f"max_ngram (longest n-gram matched) must be an integer in [1, {MAX_NGRAM}], "
                                   f"got {max_ngram!r}")
    if not is_int(min_match) or not 1 <= min_match <= max_ngram:
        raise InvalidArgumentError(f"min_match (shortest n-gram match that drafts) must be an integer in "
                                   f"[1, max_ngram={max_ngram}], got {min_match!r}")


class _Maps:
    """``max_ngram`` hash maps ``n-gram tuple -> value`` (shared by the request index and the suffix cache)."""

    def __init__(self, max_ngram: int):
        self.maps: list[dict] = [{} for _ in range(max_ngram)]

    def entries(self) -> int:
        return sum(len(m) for m in self.maps)


class NgramIndex:
    """The n-gram index of one request's tokens (prompt + generated), for prompt-lookup drafts.

    ``tokens`` is the request's token list; an n-gram ending at position ``e`` is indexed once a token at
    ``e + 1`` exists (it then has a continuation). Lookups find the most recent earlier occurrence.
    """

    def __init__(self, max_ngram: int, tokens=()):
        self.max_ngram = max_ngram
        self.tokens: list[int] = [int(t) for t in tokens]
        self._maps = _Maps(max_ngram).maps
        self._indexed = 0  # end positions < _indexed are in the maps

    def extend(self, tokens) -> None:
        """Append tokens (ints) to the request's sequence."""
        self.tokens.extend(int(t) for t in tokens)

    def _update(self) -> None:
        toks, maps = self.tokens, self._maps
        for e in range(self._indexed, len(toks) - 1):
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                maps[n - 1][tuple(toks[e - n + 1:e + 1])] = e
        self._indexed = max(self._indexed, len(toks) - 1)

    def lookup(self, k: int, min_match: int = 1) -> tuple[int, list[int]]:
        """The longest match (``n`` from ``max_ngram`` down to ``min_match``) of the sequence's last ``n``
        tokens at an earlier position, and the ``k`` tokens that followed it; ``(0, [])`` when none. A
        continuation that runs into the end of the sequence goes on as a repeat of the period it found
        (the most recent match of a repeating pattern ends ``p`` tokens back: the draft repeats those ``p``)."""
        self._update()
        toks = self.tokens
        t = len(toks)
        for n in range(min(self.max_ngram, t - 1), min_match - 1, -1):
            e = self._maps[n - 1].get(tuple(toks[t - n:]))
            if e is not None:
                out = toks[e + 1:e + 1 + k]
                while len(out) < k:  # the continuation reaches the end: the pattern repeats (LZ77-style overlap)
                    out.append(out[len(out) - (t - e - 1)])
                return n, out
        return 0, []


def check_suffix_tokens(max_tokens) -> int:
    """``max_tokens`` of a suffix cache, checked.

    Raises:
        InvalidArgumentError: not an integer in ``[1, 2**26]``.
    """
    if not is_int(max_tokens) or not 1 <= max_tokens <= MAX_SUFFIX_TOKENS:
        raise InvalidArgumentError(f"suffix_tokens (suffix cache bound, tokens) must be an integer in "
                                   f"[1, {MAX_SUFFIX_TOKENS}], got {max_tokens!r}")
    return max_tokens


class SuffixCache:
    """A bounded n-gram index over the token sequences (prompt + output) of earlier requests of a process.

    Args:
        max_tokens: at most this many tokens are stored over all sequences (>= 1); when a sequence grows
            past it the oldest *other* sequences are evicted (with their index entries); a single sequence
            longer than the bound keeps only its first ``max_tokens`` tokens.
        max_ngram: longest n-gram indexed, in ``[1, 16]``.

    ``len(cache)`` is the stored tokens (always ``<= max_tokens``); :meth:`index_entries` the index size
    (at most ``max_ngram * max_tokens``).

    Raises:
        InvalidArgumentError: ``max_tokens`` not an integer in ``[1, 2**26]`` or a bad ``max_ngram``.
    """

    def __init__(self, max_tokens: int = DEFAULT_SUFFIX_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM):
        check_suffix_tokens(max_tokens)
        check_ngram(max_ngram, 1)
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self._seqs: OrderedDict[str, list[int]] = OrderedDict()  # oldest first
        self._maps = _Maps(max_ngram).maps  # n-gram -> (sequence id, end position)
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def index_entries(self) -> int:
        return sum(len(m) for m in self._maps)

    def sequences(self) -> int:
        return len(self._seqs)

    def extend(self, seq_id: str, tokens) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created if new) and index its new n-grams."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
        while self._total + len(tokens) > self.max_tokens and len(self._seqs) > 1:
            oldest = next(iter(self._seqs))
            if oldest == seq_id:
                self._seqs.move_to_end(seq_id)
                oldest = next(iter(self._seqs))
            self._evict(oldest)
        tokens = tokens[:max(self.max_tokens - self._total, 0)]
        if not tokens:
            return
        start = len(seq)
        seq.extend(tokens)
        self._total += len(tokens)
        for e in range(max(start - 1, 0), len(seq) - 1):  # n-grams ending at e now have a continuation
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                self._maps[n - 1][tuple(seq[e - n + 1:e + 1])] = (seq_id, e)

    def _evict(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id)
        self._total -= len(seq)
        for e in range(len(seq) - 1):
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                key = tuple(seq[e - n + 1:e + 1])
                if self._maps[n - 1].get(key, (None,))[0] == seq_id:
                    del self._maps[n - 1][key]

    def lookup(self, tokens: list[int], k: int, min_match: int = 1, exclude: str | None = None,
               max_ngram: int | None = None) -> tuple[int, list[int]]:
        """The longest match of the last ``n`` of ``tokens`` (``n`` from ``max_ngram`` down to
        ``min_match``) in a stored sequence other than ``exclude``, and up to ``k`` tokens that followed it;
        ``(0, [])`` when none."""
        top = min(self.max_ngram if max_ngram is None else max_ngram, self.max_ngram, len(tokens))
        for n in range(top, min_match - 1, -1):
            hit = self._maps[n - 1].get(tuple(tokens[len(tokens) - n:]))
            if hit is not None and hit[0] != exclude:
                seq = self._seqs[hit[0]]
                return n, seq[hit[1] + 1:hit[1] + 1 + k]
        return 0, []


@torch.inference_mode()
def propose_shallow(engine, request, cur: int, k: int, draft_layers: int, head, reuse: bool,
                    threshold: float) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], int]:
    """The shallow path (the model's first ``draft_layers`` layers and an exit ``head``): up to ``k`` tokens after
    ``cur``, written into the request's cache at the positions they will be verified at (the verify rewrites them).

    Stops early when the head's top probability falls below ``threshold``. With ``reuse`` one more step computes the
    last draft's layer-``draft_layers`` hidden state, so the verify can start from there. Returns ``(drafts,
    q [V] per sampled draft (empty when greedy), layer-N hiddens [1, 1, d] per step, steps)``."""
    params, cache, gen = request.params, request.cache, request.generator
    start = cache.length
    drafts: list[int] = []
    q_probs: list[torch.Tensor] = []
    hiddens: list[torch.Tensor] = []
    x = cur
    steps = 0
    for j in range(k + 1):
        if j == k and not reuse:
            break  # without reuse the verify computes the last draft's lower layers itself
        h, state = engine.begin(torch.tensor([[x]]), start=start + j, cache=cache)
        h = engine.run_layers(0, draft_layers, h, state)
        engine.commit(state)
        steps += 1
        hiddens.append(h)
        if j == k:
            break  # the last draft only needs its layer-N hidden state (for reuse)
        logits = check_finite(head(h)[0, -1].float())
        if threshold > 0 and float(torch.softmax(logits, dim=-1).max()) < threshold:
            break
        if params.greedy:
            x = int(logits.argmax())
        else:
            q = probabilities(logits, params)
            x = int(torch.multinomial(q, 1, generator=gen))
            q_probs.append(q)
        drafts.append(x)
    return drafts, q_probs, hiddens, steps


def propose_head(engine, request, k: int, draft_model, head_threshold: float):
    """Up to ``k`` tokens from a trained draft head (:func:`~.draft_head.draft_chain`) on the request's feature
    state; ``(drafts, q or None)``: sampled drafts carry the head's distribution over the whole vocabulary (zero
    outside the head's own)."""
    from .draft_head import draft_chain  # noqa: PLC0415

    params, gen = request.params, request.generator
    sample = None
    if not params.greedy:
        def sample(lg):
            full = torch.full((engine.config.vocab_size,), float("-inf"))
            full[draft_model.vocab_ids] = lg
            q = probabilities(full, params)
            return int(torch.multinomial(q, 1, generator=gen)), q
    return draft_chain(draft_model, request.state.head, k, head_threshold, sample)


__all__ = ["DEFAULT_MAX_NGRAM", "DEFAULT_MIN_MATCH", "DEFAULT_SUFFIX_TOKENS", "MAX_NGRAM", "MAX_SUFFIX_TOKENS",
           "NgramIndex", "SOURCES", "SuffixCache", "check_ngram", "check_suffix_tokens", "parse_draft",
           "propose_head", "propose_shallow"]
