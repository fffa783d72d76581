"""Continuous batching: each request of a mixed batch gets exactly the tokens it gets alone (also when admitted
mid-batch, with chunked prefill, mixed modes and sampling), the bounded queue and the budget errors, cancel, and
a property test that every page is free again after many random requests."""

from __future__ import annotations

import random

import pytest
import torch
from test_kv_pool import ids_of, tiny_gemma3, tiny_llama

from laserlm.depth import AdaptiveDepth  # noqa: F401  (the adaptive mode is built through make_mode)
from laserlm.errors import ContextLengthError, InvalidArgumentError, PoolFullError
from laserlm.mode_table import make_mode
from laserlm.runtime.loop import generate_tokens
from laserlm.runtime.modes import FullDepth
from laserlm.runtime.sampling import SamplingParams
from laserlm.runtime.scheduler import BatchConfig, Scheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The weather today is", "Once upon a time, in a small village by the sea, there lived",
           "Python is a programming language that", "The capital of France is",
           "Here is a list of the planets of the solar system, in order from the sun:",
           "def fibonacci(n):"]


def alone(engine, mode, ids, params, n):
    return [ev.token_id for ev in generate_tokens(engine, mode, ids, params, n)]


def run_all(sched: Scheduler) -> None:
    for _ in range(10_000):
        if not sched.has_unfinished:
            return
        sched.step()
    raise AssertionError("scheduler did not finish")


def test_mixed_batch_equals_each_request_alone(smol):
    """Seven requests of different lengths, at most 3 running (so four are admitted mid-batch), prompts prefilled
    8 tokens per step; full depth greedy, full depth sampled (own seeds), an adaptive-depth and a speculative
    request (their own steps, on paged caches)."""
    eng, tok = smol.engine, smol.tokenizer
    ids = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS + ["The weather today is sunny and"]]
    full = FullDepth()
    adaptive = make_mode("adaptive:policy=confidence,threshold=0.9,patience=1", eng)
    speculative = make_mode("speculative:draft_layers=12,k=3", eng)
    plan = [(speculative, SamplingParams(max_new_tokens=11, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=12, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)),
            (adaptive, SamplingParams(max_new_tokens=10, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=14, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=7, temperature=1.0, seed=11, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    expected = [alone(eng, m, i, p, p.max_new_tokens) for (m, p), i in zip(plan, ids)]
    sched = Scheduler(eng, BatchConfig(kv_budget="32MiB", max_batch=3, prefill_chunk=8), smol.eos_ids)
    rids = [sched.submit(i, p, m) for (m, p), i in zip(plan, ids)]
    run_all(sched)
    got = [[e.token_id for e in sched.get(r).events] for r in rids]
    assert got == expected
    assert sched.stats["batched_forwards"] > 0 and sched.stats["prefill_chunks"] > len(plan)
    assert all(sched.get(r).finish_reason == "length" for r in rids)
    sched.pool.check()
    assert sched.pool.used_pages == 0 and sched.pool.reserved == 0


def test_four_modes_interleaved_through_the_scheduler(smol):
    """Four requests of four different modes (full, adaptive, lookup-draft speculative, static pruning) admitted
    together and stepped one scheduler step at a time on one engine: each gets exactly its solo tokens, and every
    mode is driven only through the :class:`Mode` contract (no mode is probed by name)."""
    from laserlm.runtime.modes import Mode

    eng, tok = smol.engine, smol.tokenizer
    specs = ["full", "adaptive:policy=confidence,threshold=0.9,patience=1", "speculative:draft=ngram",
             "static:drop=12/13"]
    modes = [make_mode(s, eng) for s in specs]
    assert all(isinstance(m, Mode) for m in modes)
    ids = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS[:4]]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=5, ignore_eos=True)]
    expected = [alone(eng, m, i, p, 10) for m, i, p in zip(modes, ids, params)]
    sched = Scheduler(eng, BatchConfig(kv_budget="32MiB", max_batch=4, prefill_chunk=4), smol.eos_ids)
    rids = [sched.submit(i, p, m) for m, i, p in zip(modes, ids, params)]
    steps = 0
    while sched.has_unfinished:
        sched.step()
        steps += 1
        assert steps < 1000
    got = [[e.token_id for e in sched.get(r).events] for r in rids]
    assert got == expected
    assert len({len(sched.get(r).events) for r in rids}) == 1 and steps > 10  # interleaved, not run one by one
    assert any(e.info.get("exit_layer", 30) < 30 for e in sched.get(rids[1]).events)  # adaptive really exited
    assert sum(e.layers for e in sched.get(rids[3]).events) < 30 * 10  # static really skipped layers
    sched.pool.check()
    assert sched.pool.used_pages == 0


def test_generate_batch_matches_generate(smol):
    """The offline API: same text, tokens and finish reasons as one ``generate`` per prompt (EOS and stop strings
    included)."""
    kw = dict(max_new_tokens=24, stop=["\n\n"])
    singles = [smol.generate(p, **kw) for p in PROMPTS[:4]]
    batch = smol.generate_batch(PROMPTS[:4], batch_options={"max_batch": 2}, **kw)
    assert [b.token_ids for b in batch] == [s.token_ids for s in singles]
    assert [b.text for b in batch] == [s.text for s in singles]
    assert [b.finish_reason for b in batch] == [s.finish_reason for s in singles]
    assert {s.finish_reason for s in singles} >= {"stop"}  # the stop string matters in this set
    summary = smol.last_batch_summary
    assert summary["pages_used"] == 0 and summary["finished"] == 4
    # the loop's time (what `laserlm batch` divides by) covers every request's time in the scheduler
    assert summary["setup_s"] >= 0 and max(b.total_s for b in batch) <= summary["run_s"]


def test_tiny_gemma3_batch_past_the_sliding_window():
    engine = tiny_gemma3()
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 256, (n,), generator=gen) for n in (3, 17, 30)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = [alone(engine, FullDepth(), i, params, 12) for i in ids]
    sched = Scheduler(engine, BatchConfig(kv_budget="8MiB", page_size=4, prefill_chunk=5))
    rids = [sched.submit(i, params) for i in ids]
    run_all(sched)
    assert [[e.token_id for e in sched.get(r).events] for r in rids] == expected


def test_queue_bound_and_budget_errors():
    engine = tiny_llama()  # 3 layers
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    # 24 pages of 4 positions: one request of 8 + 8 positions needs 4 pages x 3 layers = 12
    sched = Scheduler(engine, BatchConfig(kv_budget="32t", page_size=4, max_queue=2))
    assert sched.pool.num_pages == 24
    with pytest.raises(PoolFullError, match="needs up to 36 KV pages .* KV budget is 32t"):
        sched.submit(torch.arange(40), params)  # 40 + 8 positions = 12 pages per layer
    rids = [sched.submit(torch.arange(8) + i, params) for i in range(2)]
    sched.step()  # both admitted: they reserve all 24 pages
    rids += [sched.submit(torch.arange(8) + i, params) for i in range(2, 4)]
    sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    with pytest.raises(PoolFullError, match="waiting queue full: it holds its maximum of 2 .* 2 running requests .* hold 24 of 24 pages .*32t"):
        sched.submit(torch.arange(8), params)
    run_all(sched)  # the queued requests run once pages are free: nothing admitted or queued is lost
    assert all(len(sched.get(r).events) == 8 for r in rids)
    with pytest.raises(ContextLengthError):
        sched.submit(torch.zeros(engine.max_seq_len, dtype=torch.long), params)
    with pytest.raises(InvalidArgumentError, match="empty prompt"):
        sched.submit(torch.tensor([], dtype=torch.long), params)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        sched.submit(torch.arange(4), SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidArgumentError, match="max_batch"):
        Scheduler(engine, BatchConfig(max_batch=0))


def test_eviction_lets_a_long_request_fit_a_small_budget():
    engine = tiny_llama()
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    with pytest.raises(PoolFullError, match="enable eviction"):
        Scheduler(engine, BatchConfig(kv_budget="48t", page_size=4)).submit(torch.arange(10), params)
    sched = Scheduler(engine, BatchConfig(kv_budget="48t", page_size=4, eviction="streaming:sinks=4,window=16"))
    rid = sched.submit(torch.arange(10), params)
    run_all(sched)
    assert len(sched.get(rid).events) == 60 and sched.pool.stats["evicted_pages"] > 0
    assert sched.pool.used_pages == 0


def test_cancel_frees_pages_at_once():
    engine = tiny_llama()
    sched = Scheduler(engine, BatchConfig(kv_budget="1MiB", page_size=4))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    a = sched.submit(torch.arange(10), params)
    b = sched.submit(torch.arange(10) + 3, params)
    for _ in range(4):
        sched.step()
    held_by_a = sched.get(a).request.cache.owned_pages()
    used, reserved = sched.pool.used_pages, sched.pool.reserved
    assert held_by_a > 0
    assert sched.cancel(a)
    assert sched.pool.used_pages == used - held_by_a
    assert sched.pool.reserved == reserved - sched.get(a).reserved
    assert sched.get(a).finish_reason == "cancelled" and not sched.cancel(a)
    c = sched.submit(torch.arange(5), params)
    assert sched.cancel(c) and sched.get(c).status == "finished"  # a waiting request too
    run_all(sched)
    assert len(sched.get(b).events) == 30 and sched.pool.used_pages == 0
    sched.pool.check()


def test_random_requests_leave_every_page_free():
    """Property test: 60 random requests (lengths, budgets, sampling, cancels, shared prefixes, eviction on or
    off, compaction every 7 finishes) under 6 random scheduler configs; afterwards every page is free or cached,
    reference counts match, and nothing is reserved."""
    engine = tiny_llama()
    rng = random.Random(0)
    seen = {"evicted_pages": 0, "prefix_hit_pages": 0, "compactions": 0, "cow_copies": 0, "cancelled": 0,
            "rejected": 0, "finished": 0}
    for trial in range(8):
        cfg = BatchConfig(kv_budget=f"{rng.choice([64, 128, 400])}t", page_size=rng.choice([2, 4, 8]),
                          max_batch=rng.choice([1, 3, 8]), max_queue=rng.choice([4, 50]),
                          prefill_chunk=rng.choice([3, 16]), compact_every=7, compact_threshold=0.0,
                          eviction=rng.choice([None, "streaming:sinks=2,window=8", "depth_lru:budget=16,recent=4"]),
                          prefix_cache=rng.choice([True, False]))
        sched = Scheduler(engine, cfg, eos_ids=[0])
        base = [rng.randrange(1, 256) for _ in range(20)]
        live = []
        for i in range(10):
            n = rng.randrange(1, 20)
            ids = torch.tensor(base[:n] if rng.random() < 0.5 else [rng.randrange(1, 256) for _ in range(n)])
            params = SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 1.0]),
                                    seed=rng.randrange(100), ignore_eos=rng.random() < 0.5)
            try:
                live.append(sched.submit(ids, params))
            except PoolFullError:
                seen["rejected"] += 1
            for _ in range(rng.randrange(0, 4)):
                sched.step()
            if live and rng.random() < 0.2:
                sched.cancel(rng.choice(live))
        run_all(sched)
        sched.pool.check()
        assert sched.pool.used_pages == 0 and sched.pool.reserved == 0, (trial, cfg)
        assert all(sched.get(r).status == "finished" for r in live)
        for key in ("evicted_pages", "prefix_hit_pages", "compactions", "cow_copies"):
            seen[key] += sched.pool.stats[key]
        seen["cancelled"] += sum(sched.get(r).finish_reason == "cancelled" for r in live)
        seen["finished"] += len(live)
    # the random plans exercised every path that moves pages
    assert all(v > 0 for k, v in seen.items() if k != "cow_copies"), seen


# -- the `laserlm batch` command ---------------------------------------------------------------------------
def test_cli_batch_writes_one_json_line_per_prompt(smol, tmp_path, capsys):
    import json

    from laserlm.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:3]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(prompts), "-n", "6", "-o", str(out), "--no-progress", "--max-batch", "2",
                 "--kv-budget", "64MiB"]) == 0
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [ln["index"] for ln in lines] == [0, 1, 2]
    assert [ln["text"] for ln in lines] == [smol.generate(p, max_new_tokens=6).text for p in PROMPTS[:3]]
    assert all(ln["generated_tokens"] <= 6 and ln["finish_reason"] in ("length", "eos") for ln in lines)
    assert "3 requests" in capsys.readouterr().err


def test_cli_batch_errors(tmp_path, capsys):
    from helpers import run_cli

    assert "cannot read prompt file" in run_cli(capsys, ["batch", str(tmp_path / "missing.txt")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": 3}\n')
    assert "bad.jsonl line 2: expected" in run_cli(capsys, ["batch", str(bad)])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert "no prompts in" in run_cli(capsys, ["batch", str(empty)])
    good = tmp_path / "p.txt"
    good.write_text("Hello\n")
    assert "KV budget 'lots'" in run_cli(capsys, ["batch", str(good), "--kv-budget", "lots", "-n", "2"])
    assert "max_batch must be a positive integer" in run_cli(capsys, ["batch", str(good), "--max-batch", "0"])
    assert "temperature" in run_cli(capsys, ["batch", str(good), "--temperature", "-1"])


def test_review_findings_are_refused_or_fixed(smol):
    """Found by a review: each of these once broke the scheduler or answered with a raw traceback."""
    engine = tiny_llama()
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    # eviction: admission reserves the pages a prefill chunk adds before the policy runs (it ran out before)
    sched = Scheduler(engine, BatchConfig(kv_budget="160t", eviction="streaming:sinks=0,window=16", prefill_chunk=64,
                                          prefix_cache=False))
    rids = [sched.submit(torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(i)), p)
            for i in range(2)]
    run_all(sched)
    assert all(len(sched.get(r).events) == 8 for r in rids) and sched.pool.used_pages == 0
    # speculative decoding rolls positions back over evicted pages: refused under eviction
    spec = make_mode("speculative:draft_layers=1,k=4", engine)
    with pytest.raises(InvalidArgumentError, match="eviction does not combine with speculative"):
        sched.submit(torch.arange(10), p, spec)
    # token ids outside the vocabulary, floats, several prompts at once
    for bad, words in [(torch.tensor([300, 5]), r"\[0, 256\)"), (torch.tensor([-1, 3]), r"\[0, 256\)"),
                       (torch.tensor([1.5, 2.0]), "integers"), (torch.tensor([[1, 2], [3, 4]]), "one prompt")]:
        with pytest.raises(InvalidArgumentError, match=words):
            sched.submit(bad, p)
    with pytest.raises(InvalidArgumentError, match="unknown request id"):
        sched.get("nope")
    # block-sparse attention: a clear refusal instead of a crash in its decode kernel
    smol.set_attention("sparse")
    try:
        with pytest.raises(InvalidArgumentError, match="block-sparse attention does not run with the paged KV pool"):
            smol.generate_batch(["Hello there"], max_new_tokens=2)
        with pytest.raises(InvalidArgumentError, match=r"does not run with per-request KV allocation \(--kv-prealloc"):
            smol.generate_batch(["Hello there"], max_new_tokens=2, batch_options={"kv_prealloc": "request"})
    finally:
        smol.set_attention("dense")
    with pytest.raises(InvalidArgumentError, match="unknown batch option"):
        smol.generate_batch(["Hello"], batch_options={"max_batchh": 2})
    with pytest.raises(InvalidArgumentError, match="list of texts"):
        smol.generate_batch("Hello", max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="compact_threshold"):
        BatchConfig(compact_threshold="x").validate()
    # a request's total time is its time in the scheduler (it was the replay's)
    r = smol.generate_batch(["The capital of France is"], max_new_tokens=4, kv_budget="64MiB")[0]
    assert r.total_s >= r.ttft_s > 0
    # submit admits at once, so a burst is not refused while the pool is empty
    burst = Scheduler(engine, BatchConfig(kv_budget="1MiB", max_queue=1))
    ids = [burst.submit(torch.arange(5) + i, p) for i in range(4)]
    assert len(burst.running) == 4 and not burst.waiting
    run_all(burst)
    assert burst.pop(ids[0]).status == "finished" and ids[0] not in burst.sequences


def test_adaptive_requests_batch_with_their_own_exits(smol):
    """Adaptive requests (propagate bridge) of one mode run as one batched forward, each row with its own exits and
    patience; each gets the tokens and exit layers it gets alone."""
    eng, tok = smol.engine, smol.tokenizer
    mode = make_mode("adaptive:policy=confidence,threshold=0.8,patience=1", eng)
    assert mode.batchable(eng)
    ids = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS[:4]]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    runs = [generate_tokens(eng, mode, i, params, 10) for i in ids]
    expected = [[(ev.token_id, ev.layers) for ev in run] for run in runs]
    assert any(layers < eng.num_layers for e in expected for _, layers in e[1:])  # some tokens exit
    sched = Scheduler(eng, BatchConfig(kv_budget="32MiB", max_batch=4), smol.eos_ids)
    rids = [sched.submit(i, params, mode) for i in ids]
    run_all(sched)
    got = [[(e.token_id, e.layers) for e in sched.get(r).events] for r in rids]
    assert got == expected
    assert sched.stats["batched_rows"] >= 4 * 8 and sched.stats["single_steps"] == 0
    assert not make_mode("adaptive:policy=confidence,threshold=0.8,bridge=none", eng).batchable(eng)


def test_none_bridge_returns_the_pages_of_skipped_layers(smol):
    """Under the ``none`` bridge a page whose positions all skipped its layer goes back to the pool: the tokens are
    still those of the request alone on a contiguous cache, and the pages released (and the reservation lowered)
    are exactly the (page, layer) pairs that the exit layers say hold no K/V: a page at layer j is empty when every
    token in it exited at or before layer j."""
    eng, tok = smol.engine, smol.tokenizer
    L, ps, n = eng.num_layers, 4, 40
    mode = make_mode("adaptive:policy=confidence,threshold=0.3,bridge=none,patience=0", eng)
    ids = torch.tensor(tok(PROMPTS[1])["input_ids"])
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    expected = [(ev.token_id, ev.layers) for ev in generate_tokens(eng, mode, ids, params, n)]
    sched = Scheduler(eng, BatchConfig(kv_budget="32MiB", page_size=ps), smol.eos_ids)
    rid = sched.submit(ids, params, mode)
    reserved = sched.pool.reserved
    sched.step()  # prefill
    for _ in range(n - 1):
        sched.step()
        if sched.get(rid).status == "finished":
            break
        held = sched.get(rid).request.cache.owned_pages()
        assert sched.pool.reserved == reserved - sched.pool.stats["skipped_pages"]
        assert held <= sched.pool.reserved
    seq = sched.get(rid)
    assert [(e.token_id, e.layers) for e in seq.events] == expected
    # the independent count: decode event k ran the token at position P + k - 1 and exited after `layers` layers
    P = ids.numel()
    exit_at = {P + k - 1: int(e.layers) for k, e in enumerate(seq.events) if k >= 1}
    last = max(exit_at)
    want = 0
    for page in range(-(-P // ps), (last + 1) // ps):  # pages that hold no prompt position and are full
        deepest = max(exit_at[p] for p in range(page * ps, (page + 1) * ps))
        want += L - deepest
    assert want > 0  # tokens did exit early enough to empty whole pages
    assert sched.pool.stats["skipped_pages"] == want
    sched.pool.check()
    assert sched.pool.used_pages == 0 and sched.pool.reserved == 0


def test_speculative_requests_batch_above_the_threshold(smol):
    """Speculative requests (n-gram drafts) under continuous batching: up to ``batch_above`` of them each run their
    own draft + verify cycle; more take one plain batched full-depth step together. Either way greedy output is the
    full model's (checked against full-depth decoding of each prompt alone)."""
    eng, tok = smol.engine, smol.tokenizer
    ids = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS[:4]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = [[ev.token_id for ev in generate_tokens(eng, FullDepth(), i, params, 12)] for i in ids]
    for above, batched in ((1, True), (8, False)):
        mode = make_mode(f"speculative:draft=ngram,batch_above={above}", eng)
        assert mode.batchable(eng)
        sched = Scheduler(eng, BatchConfig(kv_budget="32MiB", max_batch=4), smol.eos_ids)
        rids = [sched.submit(i, params, mode) for i in ids]
        run_all(sched)
        assert [[e.token_id for e in sched.get(r).events] for r in rids] == expected
        sources = {e.info.get("source") for r in rids for e in sched.get(r).events[1:]}
        assert sched.stats["batched_forwards"] > 0
        # the four short prompts are prefilled in one step, so all four always decode together
        assert (sources == {"none"}) if batched else ("ngram" in sources), sources
        for r in rids:  # batched plain steps count as cycles too: 11 decode tokens after prefill's
            seq = sched.get(r)
            st = seq.request.state
            assert st.emitted == 11 and st.cycles == sum(v["cycles"] for v in st.by_source.values())
            assert min(e.info["cycle"] for e in seq.events[1:]) == 0
    with pytest.raises(InvalidArgumentError, match="batch_above"):
        make_mode("speculative:draft=ngram,batch_above=0", eng)


def test_kv_groups_under_the_none_bridge_never_fail_an_admitted_request(smol):
    """With blocks per layer group, pages that skipped layers return go to *their* block (the deep layers'), so they
    cannot serve a newcomer's shallow layers: the reservation keeps them, and every admitted request still finishes
    with the tokens it gets alone. (A first version lowered the reservation as with one block, admitted a second
    request on the deep block's free pages, and failed mid-decode with the shallow block full.)"""
    eng, tok = smol.engine, smol.tokenizer
    spec, n, ps = "adaptive:policy=confidence,threshold=0.05,bridge=none,patience=0", 64, 4
    mode = make_mode(spec, eng)
    ids = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS[:3]]
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    expected = [alone(eng, mode, i, params, n) for i in ids]
    per_layer = max(-(-(i.numel() + n) // ps) for i in ids)
    budget = f"{(2 * per_layer - 2) * ps}t"  # two requests at every layer but for 2 pages: the second waits for returns
    for groups in (None, "10/30"):
        sched = Scheduler(eng, BatchConfig(kv_budget=budget, page_size=ps, prefix_cache=False, kv_groups=groups),
                          smol.eos_ids)
        rids = [sched.submit(i, params, make_mode(spec, eng)) for i in ids]
        most = 0
        while sched.has_unfinished:
            sched.step()
            most = max(most, len(sched.running))
        assert [[e.token_id for e in sched.get(r).events] for r in rids] == expected, groups
        assert sched.pool.stats["skipped_pages"] > 0
        assert most >= 2 or groups is not None  # with one block, the returned pages admitted a second request
        sched.pool.check()


@pytest.fixture(scope="module")
def smol_native():
    import laserlm

    return laserlm.load("smollm2-135m", weights="native")


def test_native_batch_of_many_equals_each_request_alone_whatever_the_chunking(smol_native):
    """On the default packed weights every row of a step is computed as it would be alone (the block kernels and the
    layer kernel's attention do not depend on the rows that share a call), and a prompt position is computed as a
    decode step computes it: 20 greedy requests decoding together (more than the 16 rows of a verify), their prompts
    prefilled in shared chunks of 7 or 64 tokens, give exactly the tokens of each request run alone (its prompt in
    one forward). A hostile-input run of the server once saw greedy answers change under 24 concurrent streams."""
    eng, tok = smol_native.engine, smol_native.tokenizer
    texts = [p + " " + "word " * (i % 5) * 7 for i, p in enumerate(PROMPTS * 4)][:20]
    ids = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    assert max(len(i) for i in ids) > 16 and min(len(i) for i in ids) < 16  # prompts on both sides of a step's rows
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = [alone(eng, FullDepth(), i, params, 10) for i in ids]
    for chunk in (7, 64):
        sched = Scheduler(eng, BatchConfig(kv_budget="256MiB", max_batch=20, prefill_chunk=chunk), smol_native.eos_ids)
        rids = [sched.submit(i, params) for i in ids]
        run_all(sched)
        assert [[e.token_id for e in sched.get(r).events] for r in rids] == expected, f"prefill_chunk={chunk}"
        assert sched.stats["batched_rows"] >= 20 * 5  # the requests did decode together


def _staged_plan(engine, prealloc: str, seed: int, groups=None):
    """One random plan of requests (lengths, budgets, sampling, shared prefixes, cancels) on a small budget; returns
    what the scheduler admitted and produced, and the largest arena it held (pages)."""
    rng = random.Random(seed)
    cfg = BatchConfig(kv_budget=f"{rng.choice([96, 160, 400])}t", page_size=rng.choice([2, 4]),
                      max_batch=rng.choice([2, 4, 8]), max_queue=rng.choice([3, 50]), prefill_chunk=rng.choice([3, 16]),
                      compact_every=5, compact_threshold=0.0, prefix_cache=rng.choice([True, False]),
                      kv_prealloc=prealloc, kv_groups=groups)
    sched = Scheduler(engine, cfg, eos_ids=[0])
    base = [rng.randrange(1, 256) for _ in range(24)]
    admitted, live, largest = [], [], sched.pool.capacity
    for _ in range(12):
        n = rng.randrange(1, 24)
        ids = torch.tensor(base[:n] if rng.random() < 0.5 else [rng.randrange(1, 256) for _ in range(n)])
        params = SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 1.0]),
                                seed=rng.randrange(100), ignore_eos=True)
        try:
            live.append(sched.submit(ids, params))
            admitted.append(True)
        except PoolFullError:
            admitted.append(False)
        for _ in range(rng.randrange(0, 4)):
            sched.step()
            largest = max(largest, sched.pool.capacity)
            assert sched.pool.k.shape[1] - 1 == sched.pool.capacity <= sched.pool.num_pages  # never past the ceiling
        if live and rng.random() < 0.15:
            sched.cancel(rng.choice(live))
    while sched.has_unfinished:
        sched.step()
        largest = max(largest, sched.pool.capacity)
    sched.pool.check()
    assert sched.pool.used_pages == 0 and sched.pool.reserved == 0
    tokens = [[ev.token_id for ev in sched.get(r).events] for r in live]
    return admitted, tokens, largest, sched.pool.num_pages, sched.pool.stats["arena_growths"]


def test_staged_preallocation_admits_what_the_full_arena_admits(monkeypatch):
    """Pre-allocation in steps (seed 004): on random plans the staged pool admits and refuses exactly the requests the
    fully pre-allocated one does, every request gets the same tokens, the arena never exceeds the budget, and it grew
    (the plans filled more than the first arena) without reaching the budget in every plan."""
    import laserlm.runtime.kv_pool as kv_pool

    engine = tiny_llama()
    monkeypatch.setattr(kv_pool, "STAGED_FIRST_PAGES", 8)  # a first arena smaller than every budget here
    grew, below = 0, 0
    for seed in range(6):
        full = _staged_plan(engine, "full", seed)
        staged = _staged_plan(engine, "staged", seed)
        assert staged[0] == full[0] and staged[1] == full[1], seed
        assert full[2] == full[3] and full[4] == 0  # the full arena holds the budget from the start, and never grows
        assert staged[2] <= staged[3]
        grew += staged[4] > 0
        below += staged[2] < staged[3]
    assert grew == 6 and below > 0
    with pytest.raises(InvalidArgumentError, match="kv_prealloc must be one of"):
        BatchConfig(kv_prealloc="lazy").validate()


def test_per_request_allocation_matches_the_pool_and_frees_each_cache():
    """Per-request allocation (``kv_prealloc="request"``, the baseline seed 004 measures its pool against): on random
    plans it admits and refuses exactly what the pooled scheduler does and every request gets the same tokens (the
    batched rows read their own contiguous caches through a padded gather); each request's cache exists only while
    it runs, so the KV bytes held equal the running requests' caches and fall to the (empty) arena at the end."""
    engine = tiny_llama()
    for seed in range(4):
        full = _staged_plan(engine, "full", seed)
        own = _staged_plan(engine, "request", seed)
        assert own[0] == full[0] and own[1] == full[1], seed
        assert own[2] == 0  # no arena pages at all
    sched = Scheduler(engine, BatchConfig(kv_budget="400t", page_size=4, max_batch=4, kv_prealloc="request"))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    rids = [sched.submit(ids_of(n, seed=n)[0], params) for n in (3, 9, 17)]
    sched.step()
    running = [sched.get(r).request.cache for r in rids]
    a = engine.adapter
    per_position = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4
    assert sched.kv_bytes == per_position * sum(n + 6 for n in (3, 9, 17))  # the pool allocated nothing
    assert sched.summary()["kv_prealloc"] == "request" and sched.stats["prefix_hit_tokens"] == 0
    run_all(sched)
    assert all(c.freed and c.nbytes == 0 for c in running)
    assert sched.kv_bytes == 0 and sched.pool.reserved == 0
    with pytest.raises(InvalidArgumentError, match="per-request allocation"):
        Scheduler(engine, BatchConfig(kv_prealloc="request", eviction="streaming:window=32"))
    with pytest.raises(InvalidArgumentError, match="holds no pages"):
        sched.pool.allocate()


def test_per_request_allocation_mixed_batch_equals_each_request_alone(smol):
    """On the real model (its compiled layers run the pool's batched rows; per-request rows take the PyTorch path):
    five requests of different lengths, three running at once, full depth greedy and sampled and adaptive depth,
    each exactly its solo tokens."""
    eng, tok = smol.engine, smol.tokenizer
    ids = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS[:5]]
    full = FullDepth()
    adaptive = make_mode("adaptive:policy=confidence,threshold=0.9,patience=1,bridge=propagate", eng)
    plan = [(full, SamplingParams(max_new_tokens=12, ignore_eos=True)),
            (adaptive, SamplingParams(max_new_tokens=10, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)),
            (adaptive, SamplingParams(max_new_tokens=8, ignore_eos=True)),
            (full, SamplingParams(max_new_tokens=14, ignore_eos=True))]
    expected = [alone(eng, m, i, p, p.max_new_tokens) for (m, p), i in zip(plan, ids)]
    sched = Scheduler(eng, BatchConfig(kv_budget="32MiB", max_batch=3, prefill_chunk=8, kv_prealloc="request"),
                      smol.eos_ids)
    rids = [sched.submit(i, p, m) for (m, p), i in zip(plan, ids)]
    run_all(sched)
    assert [[e.token_id for e in sched.get(r).events] for r in rids] == expected
    assert sched.stats["batched_forwards"] > 0 and sched.kv_bytes == 0


def test_blocks_per_layer_group_admit_and_produce_what_one_block_does():
    """One block of the pool per layer group (seed 004's fixed block per execution group): on random plans (prefix
    cache, cancels, compaction after every 5 requests) the scheduler admits the same requests and gives the same tokens
    as with one block, and every page stays in its layer's block (``pool.check``)."""
    engine = tiny_llama()
    for seed in range(4):
        one = _staged_plan(engine, "full", seed)
        for groups in (1, "2/3"):
            blocks = _staged_plan(engine, "full", seed, groups)
            assert blocks[0] == one[0] and blocks[1] == one[1], (seed, groups)
    with pytest.raises(InvalidArgumentError, match="need kv_prealloc full"):
        BatchConfig(kv_groups=2, kv_prealloc="staged").validate()


def test_kv_groups_spec_errors_say_what_is_wrong():
    """The groups' syntax is checked without a model (so `serve --replicas` refuses before deploying), the tiling with
    it; each refusal names its reason."""
    import numpy as np

    from laserlm.runtime.kv_pool import parse_kv_groups

    for spec in ("abc", "0", "-1", "\uff18", "8//30", "16/8/30", 2.5, True, "8,16,30"):
        with pytest.raises(InvalidArgumentError, match="KV groups"):
            BatchConfig(kv_groups=spec).validate()
    assert BatchConfig(kv_groups="8/16/31").validate()  # the tiling needs the layer count
    assert parse_kv_groups(np.int64(10), 30) == ((0, 10), (10, 20), (20, 30))
    assert parse_kv_groups(" 7 ", 30)[-1] == (28, 30)
    with pytest.raises(InvalidArgumentError, match="more than the model's layers"):
        parse_kv_groups(31, 30)
    with pytest.raises(InvalidArgumentError, match="last boundary must be 30"):
        parse_kv_groups("8/16/29", 30)
    with pytest.raises(InvalidArgumentError, match="must increase"):
        parse_kv_groups("16/8/30", 30)
