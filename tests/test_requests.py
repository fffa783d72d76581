"""Requests carry their own state: explicit positions in the engine, per-request KV caches, stateless modes,
and two or more requests under different modes interleaved step by step on one engine producing exactly what
each produces alone (issue 12)."""

from __future__ import annotations

import pytest
import torch

from laserlm.errors import ContextLengthError, InvalidArgumentError
from laserlm.runtime.loop import generate_tokens
from laserlm.runtime.runner import advance, start
from laserlm.mode_table import make_mode
from laserlm.runtime.request import new_request
from laserlm.runtime.sampling import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. It was a sunny day and",
           "In 1905, Albert Einstein published four papers that",
           "def fibonacci(n):\n    "]
SPECS = ["full", "adaptive:threshold=0.3,bridge=deferred,patience=2", "adaptive:threshold=0.3,bridge=none,patience=0",
         "adaptive:threshold=0.3,bridge=propagate,patience=2", "speculative:draft_layers=12,k=3", "static:drop=12/13"]


def _ids(smol, text):
    return torch.tensor(smol.tokenizer(text)["input_ids"])


def test_interleaved_requests_match_each_alone(smol):
    eng = smol.engine
    n = 10
    jobs = []
    for i, spec in enumerate(SPECS):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True,
                                **({"temperature": 0.8, "seed": i} if i % 2 else {}))
        jobs.append((spec, make_mode(spec, eng), _ids(smol, PROMPTS[i % len(PROMPTS)]), params))
    alone = {spec: [ev.token_id for ev in generate_tokens(eng, mode, ids, params, n)]
             for spec, mode, ids, params in jobs}
    reqs = [(mode, new_request(eng, ids, params, n)) for _, mode, ids, params in jobs]
    for mode, req in reqs:  # every prompt first, then one step of each request in turn
        start(eng, mode, req)
    while any(req.remaining > 0 for _, req in reqs):
        for mode, req in reqs:
            if req.remaining > 0:
                advance(eng, mode, req)
    for (spec, *_), (_, req) in zip(jobs, reqs):
        assert req.output_ids == alone[spec], spec
    # the adaptive requests really exited early (and the deferred one had pending work), so their state mattered
    for (spec, *_), (_, req) in zip(jobs, reqs):
        if spec.startswith("adaptive"):
            assert any(info.get("exit_layer", 30) < 30 for info in req.infos), spec
        if "deferred" in spec:
            assert any(info.get("deferred_layers", 0) > 0 for info in req.infos)


def test_interleaved_full_depth_equals_transformers(smol, smol_ref):
    """Two full-depth requests interleaved token by token: each equals transformers' greedy generate."""
    eng = smol.engine
    mode = make_mode("full", eng)
    n = 8
    ids = [_ids(smol, p) for p in PROMPTS[:2]]
    reqs = [new_request(eng, x, SamplingParams(max_new_tokens=n, ignore_eos=True), n) for x in ids]
    for r in reqs:
        start(eng, mode, r)
    for _ in range(n - 1):
        for r in reqs:
            advance(eng, mode, r)
    for x, r in zip(ids, reqs):
        out = smol_ref.generate(x.unsqueeze(0), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert r.output_ids == out[0, x.shape[0]:].tolist()


def test_engine_explicit_positions(smol):
    eng = smol.engine
    ids = _ids(smol, PROMPTS[0])
    cache = eng.new_cache(32)
    full = eng.forward(ids.unsqueeze(0), logits="all", use_cache=False).logits[0]
    eng.forward(ids[:5].unsqueeze(0), start=0, cache=cache)
    assert cache.length == 5
    # rewrite positions 3..5 (start before the end of the cache), then continue after them
    out = eng.forward(ids[3:6].unsqueeze(0), logits="all", start=3, cache=cache).logits[0]
    torch.testing.assert_close(out, full[3:6], atol=1e-4, rtol=1e-4)
    assert cache.length == 6
    with pytest.raises(InvalidArgumentError, match="cannot write at position 8"):
        eng.forward(ids[6:7].unsqueeze(0), start=8, cache=cache)
    with pytest.raises(ContextLengthError, match="context full"):
        eng.forward(torch.zeros(1, 40, dtype=torch.long), start=0, cache=cache)
    with pytest.raises(ContextLengthError, match="exceed the context size"):
        eng.new_cache(eng.max_seq_len + 1)


def test_laserlm_builds_each_mode_once(smol):
    a = smol.mode("adaptive:threshold=0.9")
    assert smol.mode("adaptive:threshold=0.9") is a and smol.mode(" adaptive:threshold=0.9 ") is a
    assert smol.mode("full") is not a
