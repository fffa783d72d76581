"""Per-request statistics of adaptive-depth generation: the exit-layer histogram and compute summary.

:class:`EventStream` wraps a mode's TokenEvent generator; ``Generation`` calls its ``summary()`` at the end of
a request and merges the result into ``GenerationResult.extra`` (hence into ``laserlm generate --json``).
"""

from __future__ import annotations

from collections import Counter


def summarize_events(infos: list[dict]) -> dict:
    """Aggregate TokenEvent infos: ``exit_layer_histogram`` (exit layer -> tokens, prefill token included),
    ``mean_exit_layer``, ``mean_compute_layers`` (decoder layers run per token, deferred work included),
    ``head_evals_per_token`` and ``bridged_layers_per_token`` over the decode steps."""
    if not infos:
        return {}
    hist = Counter(int(i["exit_layer"]) for i in infos if "exit_layer" in i)
    steps = [i for i in infos if i.get("phase") != "prefill"]
    out = {
        "exit_layer_histogram": {str(k): hist[k] for k in sorted(hist)},
        "mean_exit_layer": round(sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())), 3),
    }
    if steps:
        n = len(steps)
        out["mean_compute_layers"] = round(sum(i.get("compute_layers", 0) for i in steps) / n, 3)
        out["head_evals_per_token"] = round(sum(i.get("head_evals", 0) for i in steps) / n, 3)
        out["bridged_layers_per_token"] = round(sum(i.get("bridge_layers", 0) for i in steps) / n, 3)
    return out


class EventStream:
    """Iterator over a TokenEvent generator that remembers the events' ``info`` for :meth:`summary`."""

    def __init__(self, events):
        self._events = iter(events)
        self.infos: list[dict] = []

    def __iter__(self):
        return self

    def __next__(self):
        ev = next(self._events)
        self.infos.append(ev.info)
        return ev

    def summary(self) -> dict:
        return summarize_events(self.infos)
