"""The trained draft head (issue 39): lossless greedy and sampled output with ``draft=head``, the reduced-vocabulary
logits against a float64 computation on real hidden states, drafts inside the vocabulary, resumable training, and
refusal of a head made for other weights."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from laserlm.errors import CorruptModelError, InvalidArgumentError
from laserlm.runtime import Engine
from laserlm.runtime.loop import generate_tokens
from laserlm.runtime.sampling import SamplingParams
from laserlm.speculative import SpeculativeDecoding
from laserlm.speculative.draft_head import HeadState, draft_chain, load_draft_head, save_draft_head
from laserlm.training.draft_head import train_draft_head
from test_speculative import ALPHA, chi2_pvalue, exact_marginals, one_thread  # noqa: F401


def tiny(seed=0, vocab=16, layers=3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=layers, max_position_embeddings=128,
                      initializer_range=0.3, tie_word_embeddings=False)
    return Engine(LlamaForCausalLM(cfg).eval(), max_seq_len=64)


def sampled_records(engine, n, length, seed=0):
    """Records sampled from the tiny model itself (so a draft head has something to learn)."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, engine.config.vocab_size, (n, 1), generator=g)
    with torch.inference_mode():
        for _ in range(length - 1):
            p = torch.softmax(engine.forward(seqs, use_cache=False).logits[:, -1], -1)
            seqs = torch.cat([seqs, torch.multinomial(p, 1, generator=g)], 1)
    return seqs


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    eng = tiny()
    dm, report = train_draft_head(eng, sampled_records(eng, 32, 24), vocab=16, epochs=30, batch=8, lr=3e-3,
                                  progress=False)
    return eng, dm, report


def test_training_learns_the_target(trained):
    _, _, report = trained
    first, last = report["history"][0], report["history"][-1]
    assert last["loss"] < 0.7 * first["loss"]
    assert last["top1"] > 0.4, report["history"][-1]


def test_greedy_equals_full_depth_tiny(one_thread, trained):
    eng, dm, _ = trained
    prompt = torch.tensor([1, 5, 7])
    full = [e.token_id for e in generate_tokens(eng, SpeculativeDecoding(3, draft="ngram", adaptive=False),
                                                prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), 30)]
    eng2 = Engine(eng.model, max_seq_len=64)
    from laserlm.mode_table import make_mode  # noqa: PLC0415

    ref = [e.token_id for e in generate_tokens(eng2, make_mode("full", eng2), prompt,
                                               SamplingParams(max_new_tokens=30, ignore_eos=True), 30)]
    mode = SpeculativeDecoding(3, draft="head", draft_head=dm, k=4, adaptive=False)
    run = generate_tokens(eng, mode, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), 30)
    got = [e.token_id for e in run]
    assert got == ref == full
    assert run.request.state.by_source["head"]["accepted"] > 0


def test_sampling_distribution_matches_full_model(one_thread, trained):
    """Tokens 2-4 come from head drafts accepted or rejected by the speculative rule: their distribution must
    match the full model's exact one (chi-square at ALPHA)."""
    eng, dm, _ = trained
    prompt, depth, samples = [1, 5, 7], 4, 1200
    mode = SpeculativeDecoding(3, draft="head", draft_head=dm, k=3, adaptive=False)
    counts = torch.zeros(depth, 16)
    drafted = accepted = 0
    for seed in range(samples):
        params = SamplingParams(max_new_tokens=depth, seed=seed, temperature=1.0)
        run = generate_tokens(eng, mode, torch.tensor(prompt), params, depth)
        for pos, ev in enumerate(run):
            counts[pos, ev.token_id] += 1
        drafted += run.request.state.drafted
        accepted += run.request.state.accepted
    assert 0.2 < accepted / drafted < 0.95, accepted / drafted
    exact = exact_marginals(eng, prompt, SamplingParams(temperature=1.0), depth, eng.num_layers)
    for pos in range(depth):
        pval, df = chi2_pvalue(counts[pos], exact[pos])
        assert pval > ALPHA, f"token {pos + 1}: chi-square p={pval:.2g} (df={df})"


def test_training_resumes_to_the_same_weights(one_thread, tmp_path):
    eng = tiny(seed=1)
    recs = sampled_records(eng, 8, 16, seed=1)
    whole, _ = train_draft_head(eng, recs, vocab=16, epochs=3, batch=4, progress=False)
    part, rep = train_draft_head(eng, recs, vocab=16, epochs=3, batch=4, work_dir=tmp_path, max_minutes=0.0,
                                 progress=False)
    assert not rep["finished"] and len(rep["history"]) == 1
    resumed, rep = train_draft_head(eng, recs, vocab=16, epochs=3, batch=4, work_dir=tmp_path, progress=False)
    assert rep["finished"] and len(rep["history"]) == 3
    for (name, a), b in zip(whole.head.state_dict().items(), resumed.head.state_dict().values()):
        assert torch.equal(a, b), name


def test_features_and_records_are_reused_only_for_the_same_data(one_thread, tmp_path, monkeypatch):
    """The work directory's features.pt is read back for the same records and model, rebuilt for other records or
    a damaged file; records_<part>.pt likewise, per part (keyed by size, data and model)."""
    import laserlm.training.draft_head as dh  # noqa: PLC0415

    eng = tiny(seed=2)
    recs = sampled_records(eng, 6, 12, seed=2)
    calls = []
    real = dh.collect_features

    def counting(engine, records, **kw):
        calls.append(records.shape)
        return real(engine, records, **kw)

    monkeypatch.setattr(dh, "collect_features", counting)
    first, _ = train_draft_head(eng, recs, vocab=16, epochs=1, batch=3, work_dir=tmp_path, progress=False)
    again, _ = train_draft_head(eng, recs, vocab=16, epochs=1, batch=3, work_dir=tmp_path / "other", progress=False)
    assert len(calls) == 2  # two directories, two collections
    (tmp_path / "draft_head.ckpt").unlink()
    cached, _ = train_draft_head(eng, recs, vocab=16, epochs=1, batch=3, work_dir=tmp_path, progress=False)
    assert len(calls) == 2  # same records and model: read back
    for a, b in zip(again.head.state_dict().values(), cached.head.state_dict().values()):
        assert torch.equal(a, b)
    (tmp_path / "draft_head.ckpt").unlink()
    train_draft_head(eng, recs.flip(0), vocab=16, epochs=1, batch=3, work_dir=tmp_path, progress=False)
    assert len(calls) == 3  # other records: collected again
    (tmp_path / "features.pt").write_bytes(b"damaged")
    (tmp_path / "draft_head.ckpt").unlink()
    train_draft_head(eng, recs, vocab=16, epochs=1, batch=3, work_dir=tmp_path, progress=False)
    assert len(calls) == 4

    made = []
    monkeypatch.setattr(dh, "_make_part", lambda engine, name, n, *a: made.append(name) or (recs[:n].reshape(-1), {}))
    for chat, text in ((2, 1), (2, 1), (3, 1)):
        got, _ = dh.training_records(eng, chat, text, 12, data="d", progress=False, work_dir=tmp_path)
        assert torch.equal(got, torch.cat([recs[:chat], recs[:text]]))
    assert made == ["chat", "text", "chat"]  # read back from records_<part>.pt; another chat size made chat again


def test_file_round_trip_and_refusals(one_thread, trained, tmp_path):
    eng, dm, rep = trained
    path = save_draft_head(tmp_path / "h.safetensors", eng, dm.head, dm.vocab_ids, rep)
    dm2, meta = load_draft_head(path, eng)
    for a, b in zip(dm.head.state_dict().values(), dm2.head.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b)  # stored in bfloat16
    with pytest.raises(InvalidArgumentError, match="another model"):
        load_draft_head(path, tiny(seed=5))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError):
        load_draft_head(bad, eng)


def test_head_options_need_draft_head(one_thread, trained):
    eng, _, _ = trained
    with pytest.raises(InvalidArgumentError, match="draft head"):
        SpeculativeDecoding(3, draft="head")
    from laserlm.mode_table import make_mode  # noqa: PLC0415

    with pytest.raises(InvalidArgumentError, match="head"):
        make_mode("speculative:draft=ngram,head_threshold=0.5", eng)


# -- the bundled model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_head():
    import laserlm  # noqa: PLC0415
    from laserlm.speculative.draft_head import shipped_head_path  # noqa: PLC0415

    lm = laserlm.load("smollm2-135m", weights="native")
    path = shipped_head_path(lm.engine)
    if path is None:
        pytest.fail("smollm2-135m ships a draft head (laserlm/speculative/heads/)")
    return lm, load_draft_head(path, lm.engine)[0]


def test_reduced_vocabulary_logits_against_float64(smol_head):
    lm, dm = smol_head
    eng = lm.engine
    ids = lm.tokenizer("The capital of France is Paris, and", return_tensors="pt").input_ids
    with torch.inference_mode():
        h, st = eng.begin(ids, use_cache=False)
        h = eng.run_layers(0, eng.num_layers, h, st)[0].float()
        fast = dm.logits(h).double()  # the Q8_0 copy of the rows that drafting runs
        rows_q, dm.infer_rows = dm.infer_rows, None
        try:
            got = dm.logits(h).double()
        finally:
            dm.infer_rows = rows_q
        x = h.double()
        w = eng.adapter.norm.weight.double()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eng.config.rms_norm_eps) * w
        rows = eng.adapter.lm_head.weight[dm.vocab_ids].double()  # dequantized Q8_0 rows
        want = normed @ rows.T
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
    assert rows_q is not None and (fast - want).abs().max() < 0.02 * want.abs().max()
    assert torch.equal(fast.argmax(-1), want.argmax(-1))


def test_drafts_stay_in_the_vocabulary(smol_head):
    lm, dm = smol_head
    eng = lm.engine
    ids = lm.tokenizer("Tell me a story about a dragon who", return_tensors="pt").input_ids
    st = HeadState()
    with torch.inference_mode():
        h, s = eng.begin(ids, use_cache=False)
        h = eng.run_layers(0, eng.num_layers, h, s)[0].float()
    st.add(h, ids[0, 1:].tolist() + [int(eng.head(h[None, -1:])[0, -1].argmax())], 0)
    drafts, _ = draft_chain(dm, st, 12, 0.0)
    assert len(drafts) == 12 and all(bool(dm.in_vocab[t]) for t in drafts)
    assert st.length == ids.shape[1]  # only true positions stay in the draft K/V


def test_smollm2_greedy_with_head_equals_full_depth(smol_head):
    lm, _ = smol_head
    from laserlm.evaluation.tasks import load_prompts  # noqa: PLC0415

    prompts = [p["prompt"] if isinstance(p, dict) else p for p in load_prompts()][:4]
    for prompt in prompts:
        full = lm.generate(prompt, max_new_tokens=48, mode="full", chat=True, ignore_eos=True)
        spec = lm.generate(prompt, max_new_tokens=48, mode="speculative:draft=head+ngram", chat=True,
                           ignore_eos=True)
        assert spec.token_ids == full.token_ids, prompt


def test_cli_trains_a_head_that_the_mode_loads(tmp_path, capsys):
    """`laserlm train-draft-head` end to end at tiny sizes on the bundled model; bad sizes fail before any work."""
    import json  # noqa: PLC0415

    import laserlm  # noqa: PLC0415
    from laserlm.cli import main  # noqa: PLC0415

    out = tmp_path / "h.safetensors"
    assert main(["train-draft-head", "-t", "1", "-o", str(out), "--vocab", "5"]) == 2
    assert "draft vocabulary size" in capsys.readouterr().err and not out.with_name("h.safetensors.work").exists()
    assert main(["train-draft-head", "-t", "1", "-o", str(out), "--chat-records", "2", "--instruction-records", "2",
                 "--text-records", "2", "--seq-len", "96", "--epochs", "1", "--vocab", "256", "--quiet",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == [6, 96] and report["vocab"] == 256
    assert not out.with_name("h.safetensors.work").exists()  # checkpoint and data are removed after a finished run
    lm = laserlm.load("smollm2-135m", weights="native")
    res = lm.generate("Tell me a story.", chat=True, max_new_tokens=12, ignore_eos=True,
                      mode=f"speculative:draft=head,head={out}")
    full = lm.generate("Tell me a story.", chat=True, max_new_tokens=12, ignore_eos=True)
    assert res.token_ids == full.token_ids


def test_tree_simulation_chain_is_the_decoding_chain(one_thread, trained):
    """benchmarks/bench_draft_tree.py prices chain against tree drafts offline. Its width-1 tree must draft exactly
    what ``draft_chain`` drafts in decoding from the same true pairs, and a wider tree must contain that chain's
    first token; ``accepted`` is the longest true prefix present as a path."""
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_draft_tree as bt  # noqa: PLC0415

    eng, dm, _ = trained
    ids = sampled_records(eng, 1, 20, seed=3)[0]
    feats = bt.features(eng, ids)
    with torch.inference_mode():
        out, (k, v) = dm.infer(feats[None, :-1], dm.embed(ids[None, 1:]), torch.arange(ids.numel() - 1))
    for j in (4, 9, 15):
        with torch.inference_mode():
            chain, _ = bt.draft_tree(dm, k[:, :, :j + 1], v[:, :, :j + 1], out[0, j], int(ids[j + 1]), j + 1, 1, 1, 4)
            tree, _ = bt.draft_tree(dm, k[:, :, :j + 1], v[:, :, :j + 1], out[0, j], int(ids[j + 1]), j + 1, 3, 2, 4)
        st = HeadState()
        st.add(feats[:j + 1], ids[1:j + 2].tolist(), 0)
        drafts, _ = draft_chain(dm, st, 4, 0.0)
        assert [len(lvl) for lvl in chain] == [1, 1, 1, 1]
        assert chain[-1][0] == tuple(drafts)
        assert [len(lvl) for lvl in tree] == [3, 3, 3, 3]
        assert (drafts[0],) in tree[0]
        assert all(p[:-1] in set(tree[i - 1]) for i in range(1, 4) for p in tree[i])  # a path's parent is kept
        assert bt.accepted(chain, drafts[:2] + [-1, -1]) == 2
        assert bt.accepted(chain, drafts) == 4
        assert bt.accepted(chain, [-1] + drafts[1:]) == 0
