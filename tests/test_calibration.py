"""Tests of `laserlm calibrate` (laserlm.training): losses, exit-head training on the real model,
threshold calibration and its bound, gate features, the artifact and the CLI's errors."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch

from laserlm.depth.laser_file import FORMAT_VERSION
from laserlm.errors import CorruptModelError, InvalidArgumentError
from laserlm.training.losses import binary_focal_loss, focal_loss, kl_distillation, sampled_tail_kl
from laserlm.training.thresholds import (binom_cdf, binomial_p_value, calibrate_threshold, exit_decisions,
                                         position_losses)


# -- losses ------------------------------------------------------------------------------------------
def test_focal_loss_gamma0_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 7, generator=g, dtype=torch.float64)
    target = torch.randint(0, 7, (50,), generator=g)
    torch.testing.assert_close(focal_loss(logits, target, gamma=0).double(),
                               torch.nn.functional.cross_entropy(logits, target), rtol=1e-6, atol=1e-7)
    z = torch.randn(40, generator=g, dtype=torch.float64)
    y = (torch.rand(40, generator=g) > 0.5).double()
    torch.testing.assert_close(binary_focal_loss(z, y, gamma=0),
                               torch.nn.functional.binary_cross_entropy_with_logits(z, y))


def test_focal_loss_gamma2_matches_hand_computation():
    logits = [[2.0, -1.0, 0.5], [0.1, 0.2, 3.0], [-2.0, 1.0, 1.5]]
    target = [0, 1, 2]
    expect = []
    for row, t in zip(logits, target):  # plain-Python float64 reference
        z = [math.exp(v) for v in row]
        p = z[t] / sum(z)
        expect.append(-((1 - p) ** 2) * math.log(p))
    got = focal_loss(torch.tensor(logits, dtype=torch.float64), torch.tensor(target), gamma=2.0, reduction="none")
    torch.testing.assert_close(got.double(), torch.tensor(expect, dtype=torch.float64), rtol=1e-6, atol=1e-8)
    # binary, with alpha
    zs, ys, alpha = [1.5, -0.3, 0.0, -4.0], [1, 0, 1, 1], 0.25
    exp_b = []
    for z, y in zip(zs, ys):
        p1 = 1 / (1 + math.exp(-z))
        pt = p1 if y else 1 - p1
        exp_b.append(-(alpha if y else 1 - alpha) * (1 - pt) ** 2 * math.log(pt))
    got_b = binary_focal_loss(torch.tensor(zs, dtype=torch.float64), torch.tensor(ys), gamma=2.0, alpha=alpha,
                              reduction="none")
    torch.testing.assert_close(got_b, torch.tensor(exp_b, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_kl_distillation_matches_direct_sum():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 9, generator=g, dtype=torch.float64), torch.randn(4, 9, generator=g, dtype=torch.float64)
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    torch.testing.assert_close(kl_distillation(s, t, reduction="none").double(), (p * (p / q).log()).sum(-1),
                               rtol=1e-5, atol=1e-7)
    assert float(kl_distillation(t, t)) == pytest.approx(0.0, abs=1e-6)


def _tail_kl_float64(student: torch.Tensor, teacher: torch.Tensor, k: int) -> torch.Tensor:
    """``[N]``: KL(teacher || student) over {each row's teacher top-k, the rest}, both over the full vocabulary."""
    lp, lq = torch.log_softmax(teacher.double(), -1), torch.log_softmax(student.double(), -1)
    top = lp.topk(k, -1).indices
    p_k, q_k = lp.gather(1, top).exp(), lq.gather(1, top).exp()
    p_t, q_t = 1 - p_k.sum(-1), 1 - q_k.sum(-1)
    return (p_k * (p_k / q_k).log()).sum(-1) + p_t * (p_t / q_t).log()


def test_sampled_tail_kl_with_every_other_token_drawn_is_the_float64_tail_kl():
    from laserlm.training.train import sampled_columns

    g = torch.Generator().manual_seed(3)
    V, N, k = 300, 6, 5
    student = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    t_lp, t_ids = torch.log_softmax(teacher, -1).topk(k, -1)
    cols, t_pos, u, log_w = sampled_columns(t_ids, V, negatives=V, generator=g)  # all V - U others drawn
    assert log_w == 0.0 and sorted(cols.tolist()) == list(range(V))
    s = student[:, cols].clone().requires_grad_(True)
    got = sampled_tail_kl(s[:, :u], s[:, u:], log_w, t_pos, t_lp, reduction="none")
    torch.testing.assert_close(got.double(), _tail_kl_float64(student, teacher, k), rtol=1e-5, atol=1e-6)
    # the gradient is the full tail KL's, on the same columns
    ref = student.clone().requires_grad_(True)
    _tail_kl_float64(ref, teacher, k).sum().backward()
    got.sum().backward()
    torch.testing.assert_close(s.grad.double(), ref.grad[:, cols], rtol=1e-4, atol=1e-6)


def test_sampled_tail_kl_weights_each_negative():
    """Every other token drawn twice at weight 1/2 (log weight -log 2) is the exact tail KL again: the importance
    weight enters with the right sign and size. A row whose top-k is every column has no tail and a finite gradient."""
    g = torch.Generator().manual_seed(4)
    V, N, k = 120, 5, 4
    student = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    t_lp, t_ids = torch.log_softmax(teacher, -1).topk(k, -1)
    union, t_pos = torch.unique(t_ids, return_inverse=True)
    taken = torch.zeros(V, dtype=torch.bool)
    taken[union] = True
    others = torch.nonzero(~taken).squeeze(-1)
    neg = torch.cat([others, others])
    got = sampled_tail_kl(student[:, union], student[:, neg], -math.log(2), t_pos, t_lp, reduction="none")
    torch.testing.assert_close(got.double(), _tail_kl_float64(student, teacher, k), rtol=1e-5, atol=1e-6)
    wrong = sampled_tail_kl(student[:, union], student[:, neg], math.log(2), t_pos, t_lp, reduction="none")
    assert not torch.allclose(wrong.double(), _tail_kl_float64(student, teacher, k), rtol=1e-3)
    # no tail: a 3-token vocabulary, all of it the teacher's top-k
    s3 = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    lp3, ids3 = torch.log_softmax(torch.randn(2, 3, generator=g, dtype=torch.float64), -1).topk(3, -1)
    loss = sampled_tail_kl(s3, s3[:, :0], 0.0, ids3, lp3)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s3.grad).all()
    lq3 = torch.log_softmax(s3.detach(), -1)
    exact = (lp3.exp() * (lp3 - lq3.gather(1, ids3))).sum(-1).mean()
    assert float(loss) == pytest.approx(float(exact), rel=1e-5)


def test_sampled_columns_draws_distinct_others_with_their_weight():
    from laserlm.training.train import sampled_columns

    g = torch.Generator().manual_seed(0)
    t_ids = torch.tensor([[7, 3, 9], [3, 11, 7]])
    cols, t_pos, u, log_w = sampled_columns(t_ids, 50, negatives=8, generator=g)
    assert u == 4 and cols[:u].tolist() == [3, 7, 9, 11]
    assert torch.equal(cols[t_pos], t_ids)
    neg = cols[u:].tolist()
    assert len(neg) == 8 == len(set(neg)) and not set(neg) & {3, 7, 9, 11} and all(0 <= x < 50 for x in neg)
    assert log_w == pytest.approx(math.log(46 / 8))


def test_sampled_tail_kl_normaliser_estimate_is_unbiased():
    """Averaged over draws, the estimated normaliser of the student equals the full one (float64, 4,000 draws)."""
    from laserlm.training.train import sampled_columns

    g = torch.Generator().manual_seed(5)
    V = 400
    s = torch.randn(1, V, generator=g, dtype=torch.float64) * 3
    t_ids = s.topk(4, -1).indices
    z = []
    for _ in range(4000):
        cols, _, u, log_w = sampled_columns(t_ids, V, negatives=16, generator=g)
        z.append(float(s[0, cols[:u]].exp().sum() + math.exp(log_w) * s[0, cols[u:]].exp().sum()))
    assert sum(z) / len(z) == pytest.approx(float(s.exp().sum()), rel=0.02)


def test_head_vocab_rule():
    from laserlm.training.train import HeadTrainConfig, head_vocab

    assert head_vocab(HeadTrainConfig(), 49152) == "full"
    assert head_vocab(HeadTrainConfig(), 128256) == "sampled"
    assert head_vocab(HeadTrainConfig(vocab="sampled"), 49152) == "sampled"
    assert head_vocab(HeadTrainConfig(vocab="full"), 262144) == "full"
    with pytest.raises(InvalidArgumentError, match="top 64 tokens of 64"):
        head_vocab(HeadTrainConfig(vocab="sampled", teacher_topk=64), 64)
    with pytest.raises(InvalidArgumentError, match="exit-head vocabulary must be one of"):
        HeadTrainConfig(vocab="some").validate()


def test_head_vocab_help_states_the_auto_rule(capsys):
    from laserlm.cli import main
    from laserlm.training.train import SAMPLED_VOCAB_ABOVE

    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    assert f"sampled above {SAMPLED_VOCAB_ABOVE:,} tokens" in " ".join(capsys.readouterr().out.split())


# -- threshold calibration ---------------------------------------------------------------------------
def _exact_binom_cdf(k, n, p):
    p = Fraction(p)
    return float(sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1)))


@pytest.mark.parametrize("k,n,p", [(0, 10, 0.1), (3, 50, 0.05), (12, 400, 0.01), (40, 1000, 0.05), (7, 7, 0.3)])
def test_binomial_bound_matches_direct_computation(k, n, p):
    assert binom_cdf(k, n, p) == pytest.approx(_exact_binom_cdf(k, n, p), rel=1e-9, abs=1e-300)
    assert binomial_p_value(k, n, p) == pytest.approx(_exact_binom_cdf(k, n, p), rel=1e-9, abs=1e-300)


def test_calibrated_threshold_meets_target_and_is_the_loosest_certified():
    g = torch.Generator().manual_seed(0)
    e, n = 3, 1500
    probs = torch.rand(e, n, generator=g)
    # exits agree more often when the gate is confident
    agree = torch.rand(e, n, generator=g) < (0.6 + 0.4 * probs)
    cands = [1.0] + torch.linspace(0.99, 0.0, 100).tolist()
    target, delta = 0.97, 0.1
    cal = calibrate_threshold(probs, agree, target_agreement=target, delta=delta, candidates=cands)
    assert cal.threshold is not None and cal.threshold < 1.0
    # the chosen threshold meets the target on the calibration split
    dec = exit_decisions(probs, cal.threshold)
    losses = position_losses(dec, agree)
    assert 1 - float(losses.mean()) >= target
    assert float(losses.mean()) == pytest.approx(cal.risk)
    # fixed sequence: every candidate up to the chosen one has p <= delta, the next one does not
    k = cands.index(cal.threshold)
    assert k > 0
    for lam in cands[: k + 1]:
        lo = position_losses(exit_decisions(probs, lam), agree)
        assert binom_cdf(int(lo.sum()), n, 1 - target) <= delta
    lo = position_losses(exit_decisions(probs, cands[k]), agree)
    assert _exact_binom_cdf(int(lo.sum()), n, 1 - target) <= delta
    nxt = position_losses(exit_decisions(probs, cands[k + 1]), agree)
    assert _exact_binom_cdf(int(nxt.sum()), n, 1 - target) > delta
    assert "with probability >= 0.9" in cal.guarantee


@pytest.mark.parametrize("k,n,alpha", [(2, 100, 0.05), (30, 1000, 0.05), (12, 2000, 0.01), (0, 300, 0.01)])
def test_hoeffding_bentkus_is_a_valid_upper_bound_of_the_exact_tail(k, n, alpha):
    from laserlm.training.thresholds import hoeffding_bentkus_p_value

    exact = _exact_binom_cdf(k, n, alpha)
    hb = hoeffding_bentkus_p_value(k / n, n, alpha)
    chernoff = math.exp(-n * ((k / n) * math.log(max(k / n, 1e-12) / alpha)
                              + (1 - k / n) * math.log((1 - k / n) / (1 - alpha))))
    assert exact <= hb + 1e-15
    assert hb == pytest.approx(min(chernoff, math.e * exact, 1.0), rel=1e-6)


def test_perplexity_target_bounds_mean_nll_increase():
    g = torch.Generator().manual_seed(5)
    e, n = 2, 3000
    probs = torch.rand(e, n, generator=g)
    full = torch.rand(n, generator=g) * 3
    nll = full + (1 - probs) * torch.rand(e, n, generator=g) * 2  # confident exits cost less
    agree = torch.ones(e, n, dtype=torch.bool)
    cal = calibrate_threshold(probs, agree, max_ppl_increase=0.05, nll=nll, full_nll=full, delta=0.1,
                              candidates=[1.0] + torch.linspace(0.99, 0.0, 50).tolist())
    assert cal.method == "clt" and "asymptotic" in cal.guarantee and cal.threshold is not None
    d = position_losses(exit_decisions(probs, cal.threshold), agree, nll, full, "ppl_increase")
    se = float(d.std()) / math.sqrt(n)
    assert float(d.mean()) + 1.2815 * se <= math.log(1.05) + 1e-9  # one-sided 90 % normal bound


def test_exit_decisions_first_exit_above_threshold():
    probs = torch.tensor([[0.2, 0.95, 0.5], [0.9, 0.1, 0.5], [0.1, 0.1, 0.5]])
    assert exit_decisions(probs, 0.8).tolist() == [1, 0, 3]
    assert exit_decisions(probs, 0.5).tolist() == [1, 0, 3]  # strict '>' like GatePolicy
    assert exit_decisions(probs, None).tolist() == [3, 3, 3]


def test_no_certifiable_threshold_means_never_exit():
    probs = torch.rand(2, 200, generator=torch.Generator().manual_seed(3))
    agree = torch.zeros(2, 200, dtype=torch.bool)
    cal = calibrate_threshold(probs, agree, target_agreement=0.99, delta=0.05, candidates=[0.999, 0.5, 0.0])
    # the strictest candidate lets nobody exit only if no prob exceeds it; here some do and all disagree
    assert cal.threshold is None and "never exit" in cal.guarantee


@pytest.mark.parametrize("kw,msg", [
    ({"target_agreement": 1.2}, "target agreement must be in"),
    ({"target_agreement": 0.9, "delta": 0.0}, "delta must be in"),
    ({}, "exactly one target"),
    ({"target_agreement": 0.9, "method": "magic"}, "unknown p-value method"),
    ({"max_ppl_increase": 0.05}, "needs per-position NLLs"),
])
def test_calibration_bad_arguments(kw, msg):
    with pytest.raises(InvalidArgumentError, match=msg):
        calibrate_threshold(torch.rand(2, 10), torch.ones(2, 10, dtype=torch.bool), **kw)


# -- exit heads on the real model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_states(smol):
    from laserlm.depth.groups import make_groups
    from laserlm.training.collect import collect_exit_states, load_text_tokens

    groups = make_groups("20/30", smol.engine.num_layers, min_depth=20)
    tokens = load_text_tokens(smol.tokenizer, max_tokens=3 * 128 + 1)
    states = collect_exit_states(smol.engine, tokens, groups, seq_len=128, ats_layer=19, progress=False)
    train, held = states.split_chunks([2 / 3, 1 / 3])
    return groups, train, held


def test_collected_states_match_engine_forward(smol, smol_states):
    _, train, _ = smol_states
    from laserlm.training.collect import load_text_tokens

    ids = load_text_tokens(smol.tokenizer, max_tokens=129)[:128]
    out = smol.engine.forward(ids.unsqueeze(0), logits="all", use_cache=False).logits[0]
    assert torch.equal(out.argmax(-1), train.full_top1[:128])
    assert torch.equal(train.labels[:127], ids[1:])


def test_training_reduces_held_out_kl(smol, smol_states):
    from laserlm.training.heads import make_exit_heads
    from laserlm.training.train import HeadTrainConfig, compute_exit_outputs, train_heads

    groups, train, held = smol_states
    heads = make_exit_heads(smol.engine, [20], "affine")
    before = compute_exit_outputs(heads, smol.engine.head, held, 30)  # identity adapter = logit lens
    plain = compute_exit_outputs(None, smol.engine.head, held, 30)
    torch.testing.assert_close(before.kl[20], plain.kl[20], rtol=1e-4, atol=1e-4)
    curve = train_heads(heads, smol.engine.head, train, HeadTrainConfig(steps=20, batch_tokens=128), progress=False)
    after = compute_exit_outputs(heads, smol.engine.head, held, 30)
    kl0, kl1 = float(before.kl[20].mean()), float(after.kl[20].mean())
    assert kl1 < 0.7 * kl0, (kl0, kl1)
    assert curve[-1] < curve[0]


def test_sampled_head_training_reduces_the_full_vocabulary_kl(smol, smol_states):
    """The sampled loss (about 2,000 of SmolLM2's 49,152 LM-head rows a step), given three times the steps as its
    default does, trains a head whose full-vocabulary KL on held-out positions falls as far as the exact loss's."""
    from laserlm.training.heads import make_exit_heads
    from laserlm.training.train import HeadTrainConfig, compute_exit_outputs, train_heads

    _, train, held = smol_states
    kls = {}
    for vocab in ("full", "sampled"):
        heads = make_exit_heads(smol.engine, [20], "affine")
        cfg = HeadTrainConfig(steps=20 if vocab == "full" else 60, batch_tokens=128, vocab=vocab)
        report = {}
        train_heads(heads, smol.engine.head, train, cfg, progress=False, report=report)
        assert report["loss"] == vocab and report["steps"] == cfg.steps and report["reverted"] == []
        if vocab == "sampled":  # the exact check ran, on held-back positions, and the head improved there
            assert report["teacher_topk"] == 32 and report["negatives"] == 1024
            assert report["exact_kl_trained"]["20"] < report["exact_kl_start"]["20"]
        kls[vocab] = float(compute_exit_outputs(heads, smol.engine.head, held, 30).kl[20].mean())
    kl0 = float(compute_exit_outputs(None, smol.engine.head, held, 30).kl[20].mean())
    assert kls["sampled"] < 0.7 * kl0, (kl0, kls)
    assert kls["sampled"] < 1.05 * kls["full"], (kl0, kls)


def test_keep_better_heads_gives_back_the_start_of_a_head_training_made_worse(smol, smol_states):
    """A head trained (exact loss) keeps its adapter; a head whose adapter was spoiled gets its start back, judged by
    the exact KL."""
    from laserlm.training.heads import make_exit_heads
    from laserlm.training.train import HeadTrainConfig, keep_better_heads, train_heads

    _, train, _ = smol_states
    trained, spoiled = make_exit_heads(smol.engine, [20], "affine"), make_exit_heads(smol.engine, [20], "affine")
    start = {"20": {n: v.clone() for n, v in trained["20"].state_dict().items()}}
    train_heads(trained, smol.engine.head, train, HeadTrainConfig(steps=10, batch_tokens=128, vocab="full"),
                progress=False)
    after = trained["20"].proj.weight.clone()
    with torch.no_grad():
        spoiled["20"].proj.weight.mul_(-1.0)  # every logit's sign flipped
    assert keep_better_heads(trained, start, smol.engine.head, train) == []
    assert torch.equal(trained["20"].proj.weight, after)
    assert keep_better_heads(spoiled, start, smol.engine.head, train) == [20]
    assert torch.equal(spoiled["20"].proj.weight, start["20"]["proj.weight"])


def test_batched_gate_scalars_match_a_float64_computation(smol, smol_states):
    from laserlm.depth.heads import ExitHead
    from laserlm.training.heads import gate_scalars_batch

    _, train, _ = smol_states
    head = ExitHead(smol.engine.adapter, "affine")
    with torch.no_grad():
        head.proj.bias.normal_(0, 0.1)
    idx = torch.tensor([1, 5, 70])
    h, h_in, ats = train.hidden[20][idx], train.hidden[0][idx], train.ats[idx]
    with torch.no_grad():
        logits = head(h)
        batch = gate_scalars_batch(logits, h, h_in, ats, 20, 30)
        p = torch.softmax(logits.double(), -1)
    top = p.sort(-1, descending=True).values
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(p.shape[-1])
    hd, hi = h.double(), h_in.double()
    sat = (hd * hi).sum(-1) / (hd.norm(dim=-1) * hi.norm(dim=-1))
    want = torch.stack([top[:, 0], top[:, 0] - top[:, 1], ent, sat, ats.double(), torch.full((3,), 20 / 30,
                        dtype=torch.float64)], -1)
    torch.testing.assert_close(batch.double(), want, rtol=1e-4, atol=1e-5)


def test_collected_ats_matches_direct_attention(smol, smol_states):
    """ATS at layer 19 recomputed from the attention probabilities of an independent pass."""
    from laserlm.training.collect import load_text_tokens

    _, train, _ = smol_states
    ids = load_text_tokens(smol.tokenizer, max_tokens=129)[:128]
    eng = smol.engine
    with torch.inference_mode():
        h, st = eng.begin(ids.unsqueeze(0), use_cache=False)
        st.ctx.want_probs = frozenset([19])
        eng.run_layers(0, 20, h, st)
        p = st.ctx.probs[19][0].double()  # [H, T, T]
    t = 37
    direct = torch.stack([torch.dot(p[k, t], p[k, t - 1]) / (p[k, t].norm() * p[k, t - 1].norm())
                          for k in range(p.shape[0])]).mean()
    assert float(train.ats[t]) == pytest.approx(float(direct), abs=1e-5)
    assert float(train.ats[0]) == 0.0


def test_test_split_is_refused(smol, tmp_path):
    from laserlm.training.collect import load_text_tokens

    f = tmp_path / "test.txt"
    f.write_text("hello world")
    with pytest.raises(InvalidArgumentError, match="test split"):
        load_text_tokens(smol.tokenizer, f)


# -- artifact ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_artifact(smol, tmp_path_factory):
    from laserlm.depth.laser_file import LaserArtifact, save_laser_file
    from laserlm.training.gates import make_gates
    from laserlm.training.heads import make_exit_heads
    from laserlm.depth.router import DynamicRouter, Route

    torch.manual_seed(0)
    heads = make_exit_heads(smol.engine, [10, 20], "lowrank", rank=8)
    gates = make_gates(576, [10, 20], uses_ats=True)
    router = DynamicRouter(576, [Route(tuple(range(10)), 10), Route(tuple(range(30)))])
    with torch.no_grad():
        for m in (heads, gates, router):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        router.mean.normal_()
    path = tmp_path_factory.mktemp("art") / "smol.laser.safetensors"
    save_laser_file(path, smol, LaserArtifact(heads=dict(heads), gates=dict(gates), router=router,
                                              thresholds={"gate_threshold": 0.8},
                                              config={"groups": "5", "min_depth": 8, "policy": "gate"}),
                    json_copy=True)
    return path, heads, gates, router


def test_artifact_round_trip_identical_outputs(smol, saved_artifact):
    from laserlm.depth.laser_file import load_laser_file

    path, heads, gates, router = saved_artifact
    art = load_laser_file(path, smol)
    h = torch.randn(5, 576)
    s = torch.rand(5, 6)
    with torch.no_grad():
        for e in (10, 20):
            assert torch.equal(art.heads[e](h), heads[str(e)](h))
            assert torch.equal(art.gates[e](h, s), gates[str(e)](h, s))
        assert torch.equal(art.router(h), router(h))
    assert art.thresholds == {"gate_threshold": 0.8}
    assert json.loads(path.with_suffix(".json").read_text())["format_version"] == FORMAT_VERSION
    # the depth package's adaptive mode reads the same file
    mode = smol.mode(f"adaptive:laser={path},patience=0")
    assert mode.policy.threshold == 0.8 and set(mode.heads) == {10, 20}


def test_artifact_errors(smol, saved_artifact, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from laserlm.runtime.engine import Engine
    from laserlm.depth.laser_file import load_laser_file

    path = saved_artifact[0]
    tiny = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    with pytest.raises(InvalidArgumentError, match="made for another model"):
        load_laser_file(path, Engine(tiny, max_seq_len=32))
    data = path.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="cannot read laser file"):
        load_laser_file(trunc, smol)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads(meta["laserlm"])
    for name, edit, err, msg in [
        ("version", lambda c: c.update(format_version=99), CorruptModelError, "format version 99"),
        ("hash", lambda c: c.update(weights_sha256="0" * 64), InvalidArgumentError,
         "made for another model.*weights hash"),
    ]:
        c = json.loads(json.dumps(cfg))
        edit(c)
        p = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(p), metadata={"laserlm": json.dumps(c)})
        with pytest.raises(err, match=msg):
            load_laser_file(p, smol)


# -- CLI ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,msg", [
    (["--target-agreement", "1.5"], "--target-agreement must be in"),
    (["--delta", "0"], "--delta must be in"),
    (["--head-lr", "-1"], "--head-lr must be > 0"),
    (["--train-tokens", "abc"], "--train-tokens must be an integer"),
    (["--patience", "-1"], "--patience must be >= 0"),
    (["--target-agreement", "0.9", "--max-ppl-increase", "0.1"], "not allowed with argument"),
])
def test_cli_rejects_bad_values(argv, msg, capsys, tmp_path):
    from laserlm.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "-o", str(tmp_path / "a.safetensors"), *argv])
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--train-tokens", "100"], "train tokens must be an integer >= the sequence length"),
    (["--max-ppl-increase", "0.1", "--p-value", "binomial"], "supports only --p-value clt"),
    (["--patience", "3", "--bridge", "deferred"], "patience rule is certified on propagate decoding"),
])
def test_cli_inconsistent_values_fail_before_loading(argv, msg, capsys, tmp_path):
    from laserlm.cli import main

    assert main(["calibrate", "-o", str(tmp_path / "a.safetensors"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laserlm: error:") and msg in err


def test_cli_missing_output_dir(capsys, tmp_path):
    from laserlm.cli import main

    assert main(["calibrate", "-o", str(tmp_path / "nope" / "a.safetensors")]) == 2
    assert "output directory does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_end_to_end_small(tmp_path, capsys):
    from laserlm.cli import main

    out = tmp_path / "s.safetensors"
    argv = ["calibrate", "-o", str(out), "--train-tokens", "512", "--gate-tokens", "256", "--calib-tokens", "512",
            "--eval-tokens", "256", "--head-steps", "10", "--gate-steps", "20", "--router-prompts", "4",
            "--target-agreement", "0.9", "--quiet", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["exit_points"] == [10, 15, 20, 25] and out.is_file()
    assert main(argv + ["--resume"]) == 0


def test_generate_laser_option_builds_the_adaptive_spec():
    from laserlm.cli import laser_mode_spec
    from laserlm.errors import LaserLMError

    assert laser_mode_spec("full", "a.st") == "adaptive:laser=a.st"
    assert laser_mode_spec("adaptive:bridge=deferred", "a.st") == "adaptive:bridge=deferred,laser=a.st"
    assert laser_mode_spec("speculative:k=4", "a.st") == "speculative:k=4,laser=a.st"
    assert laser_mode_spec("routed", "a.st") == "routed:laser=a.st"
    with pytest.raises(LaserLMError, match="works with the adaptive, routed and speculative modes"):
        laser_mode_spec("static:layers=20", "a.st")


# -- the whole pipeline on a tiny random model (fast) -------------------------------------------------
def _tiny_lm(smol, seed=0):
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from laserlm.runtime.engine import Engine

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=smol.tokenizer.vocab_size + 100, max_position_embeddings=256,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    identity = {"name": "tiny", "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 32,
                "vocab_size": cfg.vocab_size}
    return SimpleNamespace(engine=Engine(model, max_seq_len=128), tokenizer=smol.tokenizer,
                           loaded=SimpleNamespace(identity=identity, name="tiny"))


def test_calibrate_pipeline_tiny_model_resume_and_joint(smol, tmp_path):
    from laserlm.depth.laser_file import load_laser_file
    from laserlm.training.gates import GateTrainConfig
    from laserlm.training.pipeline import CalibrateConfig, calibrate, format_summary
    from laserlm.training.train import HeadTrainConfig, JointTrainConfig

    lm = _tiny_lm(smol)
    cfg = CalibrateConfig(groups="2", seq_len=32, train_tokens=128, gate_tokens=64, calib_tokens=256,
                          eval_tokens=64, heads=HeadTrainConfig(steps=5, batch_tokens=32),
                          gates=GateTrainConfig(steps=5), joint=JointTrainConfig(epochs=2, steps_per_epoch=1),
                          router_prompts=4, router_prompt_len=8, router_continuation=2, target_agreement=0.5)
    out = tmp_path / "tiny.safetensors"
    s = calibrate(lm, cfg, out, progress=False)
    assert s["exit_points"] == [2, 4, 6] and len(s["per_exit"]) == 3
    assert sum(r["exit_fraction"] for r in s["per_exit"]) + s["held_out"]["full_depth_fraction"] == pytest.approx(1)
    assert "exit" in format_summary(s)
    assert s["head_loss"] == {"loss": "full", "steps": 5, "reverted": []}
    assert "exit heads: 5 steps of the full KL" in format_summary(s)
    sampled = {"loss": "sampled", "steps": 750, "teacher_topk": 32, "negatives": 1024, "reverted": [4]}
    text = format_summary({**s, "head_loss": sampled})
    assert "750 steps of the sampled KL (teacher top 32 + tail, 1024 sampled tokens a step)" in text
    assert "exit points [4] kept their starting adapter" in text
    art = load_laser_file(out, lm.engine)
    assert set(art.heads) == {2, 4, 6} and art.router is not None
    # seed 004's router: routes that skip middle layers besides the caps, certified, and runnable as mode routed
    assert any(r.exit is None and len(r.kept) < 8 and r.kept[-1] == 7 for r in art.router.routes)
    assert s["router"]["certificate"]["target"]["value"] == 0.5 and "router" in format_summary(s)
    assert art.router.confidence == (s["router"]["certificate"]["threshold"] or 1.0)
    from laserlm.mode_table import make_mode

    assert make_mode(f"routed:laser={out}", lm.engine).score(lm.engine, torch.randint(0, 100, (12,))).logits.shape[0] == 12
    thr = art.thresholds["gate_threshold"]
    assert 0 <= thr <= 1
    # the joint stage trained the heads further, and the artifact holds its heads, not the head stage's
    work_dir = tmp_path / "tiny.safetensors.work"
    staged = torch.load(work_dir / "heads.pt", weights_only=False)["heads"]
    joint = torch.load(work_dir / "joint.pt", weights_only=False)["heads"]
    assert any(not torch.equal(staged[k], joint[k]) for k in staged)
    shipped = {k: v for k, v in art.heads[4].state_dict().items() if f"4.{k}" in joint}
    assert shipped and all(torch.equal(v.float(), joint[f"4.{k}"].float()) for k, v in shipped.items())
    # the complexity predictor: trained, certified like the gates (propagate decoding of the calibration chunks),
    # stored and runnable as policy=predictor with the bridge it was certified for
    assert art.predictor is not None and art.predictor.exit_points == [2, 4, 6]
    p = s["predictor"]
    assert 0 <= art.thresholds["predictor_threshold"] <= 1 and p["bridge"] == "propagate"
    assert p["calibration"]["threshold"] == p["threshold"] and p["held_out"]["positions"] == 64
    assert sum(p["held_out"]["exit_histogram"].values()) == 64
    assert "complexity predictor (pre-layer, propagate bridge)" in format_summary(s)
    assert (tmp_path / "tiny.safetensors.work" / "propagate_predictor_calib.pt").is_file()
    from laserlm.depth import make_adaptive

    mode = make_adaptive(lm.engine, laser=str(out), policy="predictor", patience=0)
    assert mode.bridge.name == "propagate" and mode.predictor is not None
    out_score = mode.score(lm.engine, torch.randint(0, 100, (12,)))
    assert out_score.layers.shape == (12,)
    # resume with another target reuses the trained modules (identical heads) and re-calibrates
    work = tmp_path / "tiny.safetensors.work"
    mtimes = {p.name: p.stat().st_mtime_ns for p in work.glob("*.pt") if not p.name.startswith("propagate")}
    assert set(mtimes) == {"collect.pt", "heads.pt", "gates.pt", "joint.pt", "router.pt", "outputs.pt", "predictor.pt"}
    cfg.target_agreement = 0.3
    s2 = calibrate(lm, cfg, tmp_path / "tiny2.safetensors", resume=True, progress=False,
                   work_dir=tmp_path / "tiny.safetensors.work")
    art2 = load_laser_file(tmp_path / "tiny2.safetensors", lm.engine)
    h = torch.randn(3, 32)
    assert torch.equal(art2.heads[4](h), art.heads[4](h))
    assert s2["calibration"]["target"]["value"] == 0.3
    # a lower agreement target never certifies a stricter threshold, nor more layers per token
    assert art2.thresholds["gate_threshold"] <= thr
    assert s2["held_out"]["mean_layers"] <= s["held_out"]["mean_layers"]
    assert {n: (work / n).stat().st_mtime_ns for n in mtimes} == mtimes  # no stage ran again
    # the patience rule certified with the thresholds: only the thresholds are tested again (with the rule on), and
    # the file runs the rule it was certified with
    cfg.patience = 2
    s4 = calibrate(lm, cfg, tmp_path / "tiny3.safetensors", resume=True, progress=False, work_dir=work)
    assert {n: (work / n).stat().st_mtime_ns for n in mtimes} == mtimes
    art3 = load_laser_file(tmp_path / "tiny3.safetensors", lm.engine)
    assert art3.config["patience"] == 2 and s4["held_out"]["patience"] == 2 and art3.patience == 2
    assert make_adaptive(lm.engine, laser=str(tmp_path / "tiny3.safetensors")).patience == 2
    assert art2.patience == 0 and make_adaptive(lm.engine, laser=str(tmp_path / "tiny2.safetensors")).patience == 0
    assert "patience 2" in format_summary(s4)
    cfg.patience = 0
    # resume with other head settings retrains the heads and everything that reads them, not the collection
    manifest = json.loads((tmp_path / "tiny.safetensors.work" / "manifest.json").read_text())["stages"]
    assert set(manifest) == {"collect", "heads", "gates", "joint", "router", "outputs", "predictor"}
    cfg.heads.steps = 6
    s3 = calibrate(lm, cfg, out, resume=True, progress=False)
    after = json.loads((tmp_path / "tiny.safetensors.work" / "manifest.json").read_text())["stages"]
    assert after["collect"] == manifest["collect"]
    assert all(after[k]["hash"] != manifest[k]["hash"] for k in ("heads", "gates", "joint", "router", "outputs"))
    assert s3["settings"]["heads"]["steps"] == 6 and len(s3["per_exit"]) == 3


def test_calibration_multiplies_many_rows_as_decoding_does_and_restores_the_setting():
    """References (collected states, batched decoding) and token-by-token decoding must use one arithmetic: with
    bfloat16 many-row products the reference top-1 flipped at ~3 % of positions (a floor no threshold removes).
    ``decode_products`` switches every quantized matrix to the block kernels for the run, so an 18-position forward
    gives at every position exactly the logits of decoding token by token, and restores the user's choice."""
    import laserlm
    from laserlm.training.pipeline import decode_products

    eng = laserlm.load("smollm2-135m", weights="native", prefill_dtype="bfloat16").engine
    mods = [m for layer in eng.adapter.layers for m in layer.modules() if hasattr(m, "prefill_dtype")]
    assert mods and all(m.prefill_dtype == torch.bfloat16 for m in mods)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 11951, 314, 17, 18, 19, 20, 21]])
    with torch.inference_mode():
        eng.reset()
        stepped = torch.cat([eng.forward(ids[:, i:i + 1]).logits[0] for i in range(ids.shape[1])])
        with decode_products(eng) as ctx:
            assert len(ctx.mods) >= len(mods) and all(m.prefill_dtype == torch.int16 for m in ctx.mods)
            eng.reset()
            many = eng.forward(ids, logits="all").logits[0]
        assert all(m.prefill_dtype == torch.bfloat16 for m in mods)  # restored
        eng.reset()
        bf16 = eng.forward(ids, logits="all").logits[0]
    assert torch.equal(many, stepped)
    assert not torch.equal(bf16, stepped)  # the bfloat16 GEMM is another arithmetic: the switch reached the products
