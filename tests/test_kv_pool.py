"""The paged KV pool: paged attention against the contiguous cache (real models and a tiny Gemma3 with a short
sliding window), eviction (StreamingLLM keeps exactly its sinks and window; the seed's depth-aware order), the
prefix cache (a hit gives the cold run's logits), copy-on-write, compaction and page accounting."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from laserlm.errors import InvalidArgumentError, PoolFullError
from laserlm.runtime import attention as attn
from laserlm.runtime.engine import Engine
from laserlm.runtime.eviction import DepthLRUEviction, StreamingEviction, parse_eviction
from laserlm.runtime.kv_pool import KVPool, PagedBatch, PagedCache, page_hashes, parse_budget

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1)
WINDOW = 8


def tiny_gemma3() -> Engine:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**TINY, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    return Engine(Gemma3ForCausalLM(cfg).eval(), max_seq_len=128)


def tiny_llama() -> Engine:
    torch.manual_seed(0)
    return Engine(LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=3)).eval(), max_seq_len=128)


def ids_of(n: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def decode_logits(engine, cache, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ``ids[:, :prompt_len]`` then feed the rest one token at a time; logits ``[T - prompt_len + 1, V]``."""
    out = [engine.prefill(ids[:, :prompt_len], cache=cache).logits[0, -1]]
    for t in range(prompt_len, ids.shape[1]):
        out.append(engine.decode_step(ids[:, t], cache=cache).logits[0, -1])
    return torch.stack(out)


# -- paged attention == contiguous cache -------------------------------------------------------------------
def check_paged_equals_contiguous(engine, ids, prompt_len, page_size=16):
    pool = KVPool.for_engine(engine, "64MiB", page_size=page_size)
    contiguous = decode_logits(engine, engine.new_cache(ids.shape[1]), ids, prompt_len)
    paged = decode_logits(engine, PagedCache(pool, ids.shape[1]), ids, prompt_len)
    # one request without evictions reads exactly the contiguous cache's keys: the same computation
    assert torch.equal(paged, contiguous)
    # the independent reference: one cache-free forward over the whole sequence
    ref = engine.forward(ids, logits="all", use_cache=False).logits[0, prompt_len - 1:]
    torch.testing.assert_close(paged, ref, atol=2e-4, rtol=1e-4)


def check_batch_rows(engine, seqs: list[torch.Tensor], steps: int, page_size: int = 16, atol: float = 2e-4,
                     rtol: float = 1e-4):
    """Rows of different lengths decoded together through a PagedBatch give each row's own logits."""
    pool = KVPool.for_engine(engine, "64MiB", page_size=page_size)
    caches = [PagedCache(pool, s.shape[1] + steps) for s in seqs]
    alone = []
    for s in seqs:
        c = engine.new_cache(s.shape[1] + steps)
        engine.prefill(s, cache=c)
        alone.append([engine.decode_step(torch.tensor([7 + i]), cache=c).logits[0, -1] for i in range(steps)])
    for s, c in zip(seqs, caches):
        engine.prefill(s, cache=c)
    for i in range(steps):
        with torch.inference_mode():
            h, st = engine.begin(torch.full((len(seqs), 1), 7 + i), cache=PagedBatch(caches))
            h = engine.run_layers(0, engine.num_layers, h, st)
            engine.commit(st)
            logits = engine.head(h)[:, -1]
        for r in range(len(seqs)):
            torch.testing.assert_close(logits[r], alone[r][i], atol=atol, rtol=rtol)
    assert [c.length for c in caches] == [s.shape[1] + steps for s in seqs]
    for c in caches:
        c.free()
    pool.check()
    assert pool.used_pages == 0


def test_paged_equals_contiguous_on_smollm2(smol):
    ids = torch.tensor([smol.tokenizer("The paged cache must give exactly the contiguous cache's logits, "
                                       "position after position, across page boundaries.")["input_ids"]])
    check_paged_equals_contiguous(smol.engine, ids, prompt_len=ids.shape[1] - 6)


def test_paged_batch_rows_on_smollm2(smol):
    tok = smol.tokenizer
    seqs = [torch.tensor([tok(t)["input_ids"]]) for t in
            ("Hello", "The capital of France is Paris and the capital of Spain is",
             "Once upon a time there was a little paged cache that")]
    check_batch_rows(smol.engine, seqs, steps=4)


def test_paged_requests_run_the_native_layer_kernel(monkeypatch):
    """On packed native weights a paged request with nothing evicted runs the compiled whole-layer kernel on its
    pages (``LayerStack.run_paged``: attention reads through the page table, the new K/V are written into their
    pages) and gives exactly the contiguous cache's logits; a batch of any size runs it with all rows in one call,
    exactly each row alone; the packed PyTorch ops (``native_layers = False``) stay close."""
    import laserlm
    from laserlm.runtime import packed_layers

    lm = laserlm.load("smollm2-135m", weights="native")
    if packed_layers.kernels.ops() is None:
        pytest.skip("the compiled kernels are not available here")
    calls = {"stack": 0, "per_layer": 0}
    real_stack, real_layer = packed_layers.native_stack_run, packed_layers._native_layer

    def counting_stack(stack, layers, start, stop, *args):
        out, j = real_stack(stack, layers, start, stop, *args)
        calls["stack"] += (j - start) if out is not None else 0
        return out, j

    def counting_layer(*args):
        calls["per_layer"] += 1
        return real_layer(*args)

    monkeypatch.setattr(packed_layers, "native_stack_run", counting_stack)
    monkeypatch.setattr(packed_layers, "_native_layer", counting_layer)
    ids = torch.tensor([lm.tokenizer("Paged native decoding must read the same keys and values as the "
                                     "contiguous cache, across a page boundary.")["input_ids"]])
    prompt_len = ids.shape[1] - 6
    contiguous = decode_logits(lm.engine, lm.engine.new_cache(ids.shape[1]), ids, prompt_len)
    calls.update(stack=0, per_layer=0)
    pool = KVPool.for_engine(lm.engine, "32MiB")
    paged = decode_logits(lm.engine, PagedCache(pool, ids.shape[1]), ids, prompt_len)
    assert calls == {"stack": 7 * lm.engine.num_layers, "per_layer": 0}  # prompt (< 16 tokens) + 6 steps
    assert torch.equal(paged, contiguous)
    for n_rows in (2, 5):  # rows of different lengths, across page boundaries (pages of 16 and of 4)
        calls.update(stack=0, per_layer=0)
        rows = [ids[:, :n] for n in range(3, 3 + 3 * n_rows, 3)]  # prompts of at most 15 tokens: all on the kernel
        check_batch_rows(lm.engine, rows, steps=3, atol=0, rtol=0)
        check_batch_rows(lm.engine, rows, steps=2, page_size=4, atol=0, rtol=0)
        assert calls["per_layer"] == 0 and calls["stack"] > 0
    saved, lm.engine._stack = lm.engine._stack, False  # without the LayerStack: the per-layer kernel, row by row
    try:
        calls.update(stack=0, per_layer=0)
        check_batch_rows(lm.engine, [ids[:, :5], ids[:, :11]], steps=2, atol=0, rtol=0)
        assert calls["stack"] == 0 and calls["per_layer"] > 0
    finally:
        lm.engine._stack = saved
    lm.engine.native_layers = False  # the packed PyTorch ops on the same pages (int16 activation rounding differs)
    try:
        check_batch_rows(lm.engine, [ids[:, :n] for n in (3, 9, 17)], steps=2, atol=5e-2, rtol=0)
    finally:
        lm.engine.native_layers = True


def test_paged_tiny_gemma3_sliding_window():
    engine = tiny_gemma3()
    ids = ids_of(40)  # 5x the sliding window; pages of 4 positions so windows cut through pages
    check_paged_equals_contiguous(engine, ids, prompt_len=30, page_size=4)
    check_batch_rows(engine, [ids_of(3, 2), ids_of(21, 3), ids_of(33, 4)], steps=3, page_size=4)


def test_paged_gemma3_270m_past_its_sliding_window():
    """The real Gemma3-270M: 530 prompt tokens (its sliding window is 512) then decode, paged == contiguous."""
    import laserlm

    lm = laserlm.load("gemma3-270m", dtype="float32")
    window = lm.engine.config.sliding_window
    ids = torch.randint(10, 20000, (1, window + 24), generator=torch.Generator().manual_seed(0))
    check_paged_equals_contiguous(lm.engine, ids, prompt_len=window + 18)
    check_batch_rows(lm.engine, [ids[:, :5], ids[:, :window + 8]], steps=2)


# -- eviction ----------------------------------------------------------------------------------------------
def masked_reference_step(engine, ref_cache, token: torch.Tensor, keep: dict[int, set[int]]) -> torch.Tensor:
    """One decode step on a contiguous cache that masks, per layer, every cached position outside ``keep``
    (the attention hook the ``none`` bridge uses): the independent reference for an evicting paged cache."""
    t = ref_cache.length
    valid = {}
    for layer, positions in keep.items():
        v = torch.zeros(ref_cache.max_len, dtype=torch.bool)
        v[sorted(p for p in positions if p < t)] = True
        v[t] = True
        valid[layer] = v
    with torch.inference_mode():
        h, st = engine.begin(token.reshape(1, 1), cache=ref_cache)
        st.ctx.key_valid = valid
        h = engine.run_layers(0, engine.num_layers, h, st)
        engine.commit(st)
        return engine.head(h)[0, -1]


def kept_positions(cache, layer: int) -> set[int]:
    ps = cache.pool.page_size
    return {i * ps + o for i in cache.kept_pages(layer) for o in range(ps)} & set(range(cache.length))


def test_streaming_eviction_keeps_exactly_sinks_and_window():
    engine = tiny_llama()
    ps, sinks, window = 4, 4, 8
    pool = KVPool.for_engine(engine, "16MiB", page_size=ps)
    cache = PagedCache(pool, 64, eviction=StreamingEviction(sinks=sinks, window=window))
    ref_cache = engine.new_cache(64)
    ids = ids_of(41)
    engine.prefill(ids[:, :20], cache=cache)
    engine.prefill(ids[:, :20], cache=ref_cache)
    for t in range(20, 41):
        expected = set(range(ps)) | set(range((cache.length - window) // ps * ps, cache.length))
        keep = {layer: kept_positions(cache, layer) for layer in range(engine.num_layers)}
        assert all(k == expected for k in keep.values()), (cache.length, keep)
        got = engine.decode_step(ids[:, t], cache=cache).logits[0, -1]
        torch.testing.assert_close(got, masked_reference_step(engine, ref_cache, ids[:, t], keep), atol=2e-5, rtol=1e-5)
    assert cache.evicted > 0 and pool.stats["evicted_pages"] == cache.evicted
    cache.free()
    pool.check()
    assert pool.used_pages == 0


def test_depth_lru_evicts_in_the_documented_order():
    engine = tiny_llama()  # 3 layers
    ps = 4
    policy = DepthLRUEviction(budget=12, sinks=0, recent=4)  # 3 pages per layer on average: 9 page slots
    pool = KVPool.for_engine(engine, "16MiB", page_size=ps)
    cache = PagedCache(pool, 64)
    ref_cache = engine.new_cache(64)
    ids = ids_of(25)
    engine.prefill(ids[:, :24], cache=cache)  # 6 logical pages x 3 layers = 18 pages
    engine.prefill(ids[:, :24], cache=ref_cache)
    # score = (5 - i) / 5 + layer / 2 (newest logical page 5; page 5 holds the last 4 positions: protected)
    expected = [(2, 0), (2, 1), (2, 2), (1, 0), (2, 3), (1, 1), (2, 4), (1, 2), (0, 0), (1, 3), (0, 1), (1, 4),
                (0, 2), (0, 3), (0, 4)]
    assert policy.order(cache) == expected
    policy.apply(cache)
    assert cache.owned_pages() == 9
    for layer in range(3):
        dropped = {i for (lay, i) in expected[:9] if lay == layer}
        assert set(cache.kept_pages(layer)) == set(range(6)) - dropped
    # the gathered keys differ per layer now; attention equals the per-layer masked contiguous reference
    keep = {layer: kept_positions(cache, layer) for layer in range(3)}
    got = engine.decode_step(ids[:, 24], cache=cache).logits[0, -1]
    torch.testing.assert_close(got, masked_reference_step(engine, ref_cache, ids[:, 24], keep), atol=2e-5, rtol=1e-5)
    cache.free()
    pool.check()


def test_eviction_specs_and_errors():
    assert parse_eviction(None) is None and parse_eviction("none") is None
    assert parse_eviction("streaming:sinks=8,window=64") == StreamingEviction(8, 64)
    assert parse_eviction("depth_lru:budget=256") == DepthLRUEviction(budget=256)
    for bad, words in [("lru", "unknown eviction policy"), ("streaming:window=0", "positive"),
                       ("streaming:size=3", "unknown eviction streaming option"),
                       ("depth_lru:budget=8,recent=16", "must cover")]:
        with pytest.raises(InvalidArgumentError, match=words):
            parse_eviction(bad)


# -- prefix cache ------------------------------------------------------------------------------------------
def test_prefix_hit_gives_the_cold_logits(smol):
    engine = smol.engine
    tok = smol.tokenizer
    shared = "You are a helpful assistant. Answer briefly and precisely, in one sentence. Question: "
    a = torch.tensor(tok(shared + "what is the capital of France?")["input_ids"])
    b = torch.tensor(tok(shared + "how many legs does a spider have?")["input_ids"])
    pool = KVPool.for_engine(engine, "64MiB")
    first = PagedCache(pool, a.numel() + 4)
    engine.prefill(a.unsqueeze(0), cache=first)
    first.register_prefix(a.tolist(), "full")
    first.free()  # its prompt pages stay cached
    assert pool.cached_pages == 30 * (a.numel() // 16) and pool.used_pages == 0
    warm = PagedCache(pool, b.numel() + 4)
    hit = warm.attach_prefix(b.tolist(), "full")
    common = next(i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())) if x != y)
    assert hit == common // 16 * 16 and hit >= 16
    warm_logits = decode_logits_from(engine, warm, b, hit)
    cold_pool = KVPool.for_engine(engine, "64MiB")
    cold_logits = decode_logits_from(engine, PagedCache(cold_pool, b.numel() + 4), b, 0)
    torch.testing.assert_close(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(warm_logits.argmax(-1), cold_logits.argmax(-1))
    # another path key never hits
    other = PagedCache(pool, b.numel())
    assert other.attach_prefix(b.tolist(), "static:0-10") == 0
    for c in (warm, other):
        c.free()
    pool.check()


def decode_logits_from(engine, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    out = [engine.prefill(ids[start:].unsqueeze(0), cache=cache, start=start).logits[0, -1]]
    for t in (11, 12, 13):
        out.append(engine.decode_step(torch.tensor([t]), cache=cache).logits[0, -1])
    return torch.stack(out)


def test_writing_into_a_shared_page_copies_it():
    engine = tiny_llama()
    pool = KVPool.for_engine(engine, "16MiB", page_size=4)
    ids = ids_of(13)
    a = PagedCache(pool, 20)
    engine.prefill(ids, cache=a)
    a.register_prefix(ids[0].tolist(), "full")
    b = PagedCache(pool, 20)
    assert b.attach_prefix(ids[0].tolist(), "full") == 12
    shared = b.table[:, :3].clone()
    assert torch.equal(shared, a.table[:, :3])
    before = pool.k[:, shared.flatten()].clone()
    engine.prefill(ids_of(13, seed=9), cache=b)  # rewrites positions 0..12 of b: must not touch a's pages
    assert torch.equal(pool.k[:, shared.flatten()], before)
    assert not torch.equal(b.table[:, :3], shared) and pool.stats["cow_copies"] == 9
    a.free()
    b.free()
    pool.check()


# -- accounting --------------------------------------------------------------------------------------------
def test_budget_parsing():
    assert parse_budget("8192t", 30, 1024, 16).pages == 512 * 30
    assert parse_budget(1, 2, 2**10, 16).pages == 1024
    assert parse_budget("1GiB", 2, 2**20, 16).pages == 1024
    for bad in ("-1", "lots", "0MiB"):
        with pytest.raises(InvalidArgumentError, match="KV budget"):
            parse_budget(bad, 2, 1024, 16)
    with pytest.raises(InvalidArgumentError, match="fewer than one page per layer"):
        parse_budget("1", 30, 2**16, 16)  # 16 pages of 64 KiB for 30 layers


def test_pool_full_and_release():
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=3, page_size=2)
    pages = [pool.allocate() for _ in range(3)]
    assert pages == [1, 2, 3] and pool.free_pages == 0
    with pytest.raises(PoolFullError, match="KV pool full"):
        pool.allocate()
    pool.release(2)
    assert pool.allocate() == 2
    pool.release(1)
    with pytest.raises(RuntimeError, match="released more often than taken"):
        pool.release(1)


def test_compaction_moves_pages_down_and_keeps_the_logits():
    engine = tiny_llama()
    pool = KVPool.for_engine(engine, "16MiB", page_size=4)
    caches = [PagedCache(pool, 40) for _ in range(4)]
    for i, c in enumerate(caches):
        engine.prefill(ids_of(9 + 3 * i, seed=i), cache=c)
    for c in caches[::2]:
        c.free()
    assert pool.fragmentation()["external"] > 0.3
    keep = caches[1]
    before = engine.forward(torch.tensor([[5]]), cache=keep, start=keep.length - 1).logits  # rewrite last position
    moved = pool.compact()
    assert moved > 0 and pool.fragmentation()["external"] == 0.0
    after = engine.forward(torch.tensor([[5]]), cache=keep, start=keep.length - 1).logits
    assert torch.equal(before, after)
    pool.check()


def test_page_hashes_chain():
    a = page_hashes(list(range(40)), 16, "full")
    b = page_hashes(list(range(32)) + [0] * 8, 16, "full")
    c = page_hashes([1] + list(range(1, 40)), 16, "full")
    assert len(a) == 2 and a == b  # only full pages; same first 32 tokens
    assert c[0] != a[0] and c[1] != a[1]  # a change in page 0 changes every later key
    assert page_hashes(list(range(40)), 16, "other") != a


def test_staged_pool_doubles_up_to_the_budget_and_keeps_the_pages():
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=10, page_size=2, prealloc="staged",
                  first_pages=2)
    assert pool.capacity == 2 and pool.free_pages == 10 and pool.k.shape[1] == 3
    pages, caps = [], []
    for i in range(10):
        p = pool.allocate()
        pool.k[:, p] = float(i + 1)  # a mark per page: a growth must copy it
        pages.append(p)
        caps.append(pool.capacity)
    assert pages == list(range(1, 11)) and caps == [2, 2, 4, 4, 8, 8, 8, 8, 10, 10]
    assert all(float(pool.k[0, p, 0, 0]) == i + 1 for i, p in enumerate(pages))
    assert pool.stats["arena_growths"] == 3 and pool.free_pages == 0
    with pytest.raises(PoolFullError, match="KV pool full"):
        pool.allocate()
    for p in pages:
        pool.release(p)
    pool.check()  # every page free again, none past the budget
    with pytest.raises(InvalidArgumentError, match="pre-allocation must be one of"):
        KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=10, prealloc="lazy")


def test_staged_pool_reuses_cached_prefix_pages_before_growing_and_survives_a_failed_growth(monkeypatch):
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=10, page_size=2, prealloc="staged",
                  first_pages=2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(("prefix", 0), a)
    pool.release(a)  # cached (registered, unreferenced)
    pool.release(b)  # free
    assert pool.allocate() == b and pool.allocate() == a  # the cached page is reused: the arena follows the load
    assert pool.capacity == 2 and pool.stats["arena_growths"] == 0 and pool.stats["cached_pages_reused"] == 1
    calls = []
    real = torch.zeros

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*args, **kw)

    monkeypatch.setattr(torch, "zeros", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.allocate()
    monkeypatch.setattr(torch, "zeros", real)
    assert pool.k.shape == pool.v.shape == (1, 3, 2, 4) and pool.capacity == 2  # unchanged by the failed growth
    assert pool.allocate() == 3 and pool.capacity == 4 and pool.k.shape == pool.v.shape == (1, 5, 2, 4)


def test_blocks_per_layer_group_keep_each_layer_in_its_block():
    """Seed 004's fixed block per execution group: with groups 0-1 / 2-2 of a 3-layer model every page of a layer
    comes from its group's block (taken, copied on write, reused from the prefix cache, compacted), the budget is
    rounded down to whole pages per layer, and the logits are the single block's."""
    from laserlm.runtime.kv_pool import parse_kv_groups

    assert parse_kv_groups(None, 30) == ((0, 30),)
    assert parse_kv_groups(12, 30) == ((0, 12), (12, 24), (24, 30)) == parse_kv_groups("12", 30)
    assert parse_kv_groups("8/16/30", 30) == ((0, 8), (8, 16), (16, 30)) == parse_kv_groups([(0, 8), (8, 16), (16, 30)], 30)
    for bad in ("8/16", "0/30", "16/8/30", "x", 0, True, [(0, 10), (12, 30)]):
        with pytest.raises(InvalidArgumentError, match="KV groups"):
            parse_kv_groups(bad, 30)
    pool = KVPool(num_layers=3, num_kv_heads=1, head_dim=4, num_pages=11, page_size=2, groups="2/3")
    assert pool.num_pages == 9 and pool.blocks == [(1, 7), (7, 10)]
    assert [pool.allocate(0), pool.allocate(2), pool.allocate(1)] == [1, 7, 2]
    for p in (1, 7, 2):
        pool.release(p)
    with pytest.raises(InvalidArgumentError, match="need the whole arena"):
        KVPool(num_layers=3, num_kv_heads=1, head_dim=4, num_pages=12, prealloc="staged", groups=1)

    engine = tiny_llama()
    ids = ids_of(23, seed=4)
    plain = decode_logits(engine, PagedCache(KVPool.for_engine(engine, "2MiB", page_size=4), 30), ids, 13)
    pool = KVPool.for_engine(engine, "2MiB", page_size=4, groups="1/3")
    assert len(pool.blocks) == 2 and "one block per layer group 0-0/1-2" in pool.describe()
    caches = []
    for i in range(3):  # requests of different lengths, one freed (holes), one sharing a prefix (copy-on-write)
        c = PagedCache(pool, 30)
        engine.prefill(ids_of(9 + 4 * i, seed=i), cache=c)
        if i == 1:
            c.register_prefix(ids_of(9 + 4 * i, seed=i)[0].tolist(), "full")
        caches.append(c)
    caches[0].free()  # unregistered: its pages leave holes in both blocks
    shared = PagedCache(pool, 30)
    assert shared.attach_prefix(ids_of(13, seed=1)[0].tolist(), "full") == 12
    engine.prefill(ids_of(13, seed=1)[:, 12:], cache=shared, start=12)
    engine.forward(torch.tensor([[3]]), cache=shared, start=11)  # rewrites a shared page: copy-on-write
    pool.check()  # asserts every page of every table lies in its layer's block
    assert pool.stats["cow_copies"] > 0 and pool.compact() > 0
    pool.check()
    blocks = decode_logits(engine, PagedCache(pool, 30), ids, 13)
    assert torch.equal(blocks, plain)
