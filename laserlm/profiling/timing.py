"""Per-layer decode time on this machine: the measured costs every prediction of :mod:`.costs` is built on.

One decode step is split into its parts, each timed with ``time.perf_counter`` around the engine's own
primitives (the same code path a full-depth decode runs): ``begin`` (embedding + rotary + cache window),
each decoder layer (``Engine.run_layer``), and the exit head (final norm + LM head, ``Engine.head``). On the
native CPU stack a run of layers is one kernel call (``Engine.run_layers``), so timing the layers one by one also
pays a per-call cost once per layer; the step is therefore also timed as one run of all layers, and the
difference gives that per-call cost (``call_s``), which is taken out of every layer's time.
The step writes one position after ``context`` prompt tokens and is never committed, so every repetition
sees the same cache. Times are medians over repetitions (seconds); ``tokens > 1`` times a forward of that
many new tokens (a speculative verify of ``k + 1`` tokens).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError


@dataclass
class StepTimes:
    """Median seconds of the parts of one forward of ``tokens`` new tokens after ``context`` cached ones.

    Attributes:
        begin_s: embedding + rotary + cache window.
        layer_s: ``[L]`` seconds per decoder layer.
        head_s: final norm + LM head over the ``tokens`` positions.
        tokens, context: the forward's shape.
        call_s: seconds of entering one run of consecutive layers (one ``Engine.run_layers`` call), paid once
            per run on top of its layers' ``layer_s``: ``(sum of the one-by-one layer times - one run of all
            layers) / (L - 1)``, at least 0. Near 0 on the PyTorch path; on the native stack, the kernel call.
    """

    begin_s: float
    layer_s: list[float]
    head_s: float
    tokens: int
    context: int
    call_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Predicted seconds of one full-depth forward: begin + one run of every layer + head."""
        return self.begin_s + sum(self.layer_s) + self.call_s + self.head_s

    def layers_s(self, start: int, stop: int) -> float:
        """Seconds of decoder layers ``start .. stop-1``."""
        return sum(self.layer_s[start:stop])


@torch.inference_mode()
def time_step(engine, context: int = 64, tokens: int = 1, reps: int = 10, warmup: int = 2,
              seed: int = 0) -> StepTimes:
    """Time the parts of a forward of ``tokens`` new tokens after ``context`` prompt tokens.

    Args:
        engine: a :class:`~laserlm.runtime.engine.Engine`.
        context: prompt tokens in the cache before the timed forward (random ids, seeded).
        tokens: new tokens per timed forward (1: a decode step).
        reps, warmup: timed and untimed repetitions; medians are reported.

    Raises:
        InvalidArgumentError: non-positive sizes or ``context + tokens`` beyond the context size.
    """
    if context < 1 or tokens < 1 or reps < 1 or warmup < 0:
        raise InvalidArgumentError(f"time_step needs context, tokens, reps >= 1 (got {context}, {tokens}, {reps})")
    if context + tokens > engine.max_seq_len:
        raise InvalidArgumentError(f"{context + tokens} positions exceed the context size {engine.max_seq_len}")
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    prompt = torch.randint(min(100, vocab - 1), vocab, (1, context), generator=g)
    new = torch.randint(min(100, vocab - 1), vocab, (1, tokens), generator=g)
    cache = engine.new_cache(context + tokens)
    engine.forward(prompt, cache=cache, start=0)
    L = engine.num_layers
    begins, heads, runs, layers = [], [], [], [[] for _ in range(L)]
    clock = time.perf_counter
    for r in range(warmup + reps):
        t0 = clock()
        h, st = engine.begin(new, start=context, cache=cache)
        t1 = clock()
        lt = []
        for i in range(L):
            a = clock()
            h = engine.run_layer(i, h, st)
            lt.append(clock() - a)
        a = clock()
        engine.head(h[:, -tokens:])
        t_head = clock() - a
        h, st = engine.begin(new, start=context, cache=cache)  # the same step again, as one run of all layers
        a = clock()
        engine.run_layers(0, L, h, st)
        t_run = clock() - a
        if r >= warmup:
            begins.append(t1 - t0)
            heads.append(t_head)
            runs.append(t_run)
            for i, x in enumerate(lt):
                layers[i].append(x)
    med = statistics.median
    layer_s = [med(x) for x in layers]
    call_s = max(0.0, (sum(layer_s) - med(runs)) / (L - 1)) if L > 1 else 0.0
    layer_s = [max(0.0, x - call_s) for x in layer_s]
    return StepTimes(med(begins), layer_s, med(heads), tokens, context, call_s)


@torch.inference_mode()
def time_module(fn, reps: int = 50) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (after 3 untimed calls)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a = time.perf_counter()
        fn()
        out.append(time.perf_counter() - a)
    return statistics.median(out)


def parameter_shares(engine) -> dict:
    """Fractions of one decoder layer's weight elements in attention (q/k/v/o), in the K/V projections
    alone (what the propagate bridge runs for a skipped layer) and in the MLP, from the model config.

    Decode on CPU is bound by the bytes of weights read (DESIGN.md), so these shares stand in for the
    time shares of a layer's parts.
    """
    cfg = engine.config
    d = cfg.hidden_size
    hd = engine.adapter.head_dim
    q = cfg.num_attention_heads * hd * d
    kv = 2 * engine.adapter.num_kv_heads * hd * d
    o = cfg.num_attention_heads * hd * d
    mlp = 3 * d * cfg.intermediate_size
    total = q + kv + o + mlp
    return {"attention": (q + kv + o) / total, "kv_projection": kv / total, "mlp": mlp / total,
            "layer_params": total}
