"""The complexity predictor (seed 000 §2.1): its inputs never include the current token's layer outputs, the
scheduler's decisions equal the planned route, replay equals decoding, sequential decisions equal a plain loop,
and a certified threshold holds on a held-out split."""

from __future__ import annotations

import pytest
import torch

from laserlm.depth.groups import make_groups
from laserlm.depth.policies import PredictorPolicy, make_policy
from laserlm.depth.predictor import ComplexityPredictor, exit_index, window_ids
from laserlm.depth.adaptive import AdaptiveDepth
from laserlm.errors import InvalidArgumentError
from laserlm.training.predictor import (PredictorInputs, certify_predictor, held_out_report, oracle_depth,
                                        sequential_decisions, train_predictor, PredictorTrainConfig)
from laserlm.training.thresholds import binom_cdf, position_losses

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_engine(seed=0, layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    from laserlm.runtime.engine import Engine

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return Engine(LlamaForCausalLM(cfg).eval(), max_seq_len=128)


def random_predictor(exits, uses_ats=False, seed=1):
    torch.manual_seed(seed)
    p = ComplexityPredictor(64, exits, context=3, channels=8, uses_ats=uses_ats)
    with torch.no_grad():  # decisions that vary with the token (some exit, some not), little feedback
        torch.manual_seed(1)
        p.out.weight.normal_(0, 2.0)
        p.out.weight[:, -1] = 0.3  # the previous exit depth
        p.out.bias.fill_(-1.0)
    return p.eval()


def test_window_ids_match_a_loop():
    ids = torch.arange(10, 20)
    first = torch.zeros(10, dtype=torch.bool)
    first[[0, 4]] = True
    w = window_ids(ids, 2, first)
    for t in range(10):
        start = 0 if t < 4 else 4
        ref = [int(ids[j]) if j >= start else -1 for j in (t - 2, t - 1, t)]
        assert w[t].tolist() == ref


@torch.inference_mode()
@pytest.mark.parametrize("uses_ats", [False, True])
def test_decisions_ignore_the_tokens_own_layer_outputs(uses_ats):
    """Perturbing every layer the current token runs after the ATS layer (all of them without ATS) changes the
    model's outputs but not one exit decision; the decisions equal the route planned from the inputs alone."""
    eng = tiny_engine()
    groups = make_groups("2", 8, 2)  # exit points 2, 4, 6
    pred = random_predictor(groups.exit_points, uses_ats)
    policy = PredictorPolicy(pred, 0.5)
    mode = AdaptiveDepth(eng, groups, policy, bridge="propagate", patience=0)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))
    before = mode.score(eng, ids)
    layers = before.layers[1:]
    assert 0 < int((layers < 8).sum()) < layers.numel()  # some tokens exit, some do not: the test can fail
    first_perturbed = (mode.ats_layer + 1) if uses_ats else 0
    with torch.no_grad():
        for layer in eng.adapter.layers[first_perturbed:]:
            for w in (layer.mlp.down_proj.weight, layer.self_attn.o_proj.weight):
                w.mul_(3.0).add_(0.05 * torch.randn_like(w))
    after = mode.score(eng, ids)
    assert not torch.allclose(before.logits, after.logits)  # the perturbation mattered
    assert torch.equal(before.layers, after.layers)
    if not uses_ats:  # the planned route from embeddings + previous exit depth alone
        from laserlm.depth.predictor import predictor_scalars, window_embeddings

        prev = 1.0
        for i in range(1, ids.shape[0]):
            w = window_ids(ids[: i + 1], pred.context)[-1:]
            probs = torch.sigmoid(pred(window_embeddings(eng.adapter.embed, w),
                                       predictor_scalars(torch.tensor([float("nan")]), torch.tensor([prev]), False)))
            e = int(exit_index(probs, 0.5)[0])
            planned = (groups.exit_points + [8])[e]
            assert planned == int(before.layers[i])
            prev = planned / 8


@torch.inference_mode()
def test_replay_equals_decoding_and_composition():
    eng = tiny_engine(seed=2)
    groups = make_groups("2", 8, 2)
    pred = random_predictor(groups.exit_points, uses_ats=True, seed=4)
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(5))
    dec = AdaptiveDepth(eng, groups, PredictorPolicy(pred, 0.5), bridge="deferred", patience=0, score="decode")
    rep = AdaptiveDepth(eng, groups, PredictorPolicy(pred, 0.5), bridge="deferred", patience=0, score="replay")
    a, b = dec.score(eng, ids), rep.score(eng, ids)
    assert torch.equal(a.layers, b.layers)
    torch.testing.assert_close(a.logits, b.logits, atol=2e-4, rtol=1e-4)
    both = make_policy("predictor+saturation", predictor=pred, predictor_threshold=0.5, saturation_threshold=0.99)
    comb = AdaptiveDepth(eng, groups, both, bridge="deferred", patience=0, score="replay").score(eng, ids)
    assert bool((comb.layers >= a.layers).all())  # AND with another rule exits no earlier
    assert not dec.batchable(eng)
    with pytest.raises(InvalidArgumentError, match="needs a trained complexity predictor"):
        make_policy("predictor")


def _synthetic(n, seed, exits=(2, 4, 6), d=64, k=3):
    """Positions whose exit heads agree when embedding feature 0 is high (the predictor can learn it)."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(n, k + 1, d, generator=g)
    score = emb[:, -1, 0]
    agree = torch.stack([torch.rand(n, generator=g) < torch.sigmoid(2 * score + 1.5 * j - 1) for j in range(len(exits))])
    first = torch.zeros(n, dtype=torch.bool)
    first[::50] = True
    prev = torch.ones(n)
    prev[1:] = oracle_depth(agree, list(exits), 8)[:-1]
    prev[first] = 1.0
    return PredictorInputs(emb, torch.full((n,), float("nan")), prev, first), agree


def test_sequential_decisions_match_a_loop():
    pred = random_predictor([2, 4, 6])
    inputs, _ = _synthetic(120, 0)
    lams = [0.9, 0.5, 0.2]
    dec = sequential_decisions(pred, inputs, lams, 8)
    depth = {0: 2 / 8, 1: 4 / 8, 2: 6 / 8, 3: 1.0}
    for c, lam in enumerate(lams):
        prev = 1.0
        for t in range(120):
            if bool(inputs.first[t]):
                assert int(dec[c, t]) == 3
                prev = 1.0
                continue
            with torch.no_grad():
                p = torch.sigmoid(pred(inputs.emb[t:t + 1], torch.tensor([[0.0, prev]])))
            e = int(exit_index(p, lam)[0])
            assert int(dec[c, t]) == e
            prev = depth[e]


def test_certified_threshold_holds_on_held_out_split():
    torch.manual_seed(0)
    pred = ComplexityPredictor(64, [2, 4, 6], context=3, channels=8)
    train_in, train_agree = _synthetic(3000, 1)
    train_predictor(pred, train_in, train_agree, PredictorTrainConfig(steps=150, lr=1e-2))
    cal_in, cal_agree = _synthetic(3000, 2)
    held_in, held_agree = _synthetic(3000, 3)
    cands = [1.0] + torch.linspace(0.99, 0.3, 40).tolist()
    target, delta = 0.95, 0.1
    cal, dec = certify_predictor(pred, cal_in, cal_agree, 8, target_agreement=target, max_ppl_increase=None,
                                 nll=None, full_nll=None, delta=delta, method=None, candidates=cands)
    assert cal.threshold is not None and cal.threshold < 1.0
    k = cands.index(cal.threshold)
    keep = ~cal_in.first
    for lam in cands[: k + 1]:  # every tested candidate up to the chosen one is certified (binomial tail)
        lo = position_losses(dec[cands.index(lam)], cal_agree)[keep]
        assert binom_cdf(int(lo.sum()), int(keep.sum()), 1 - target) <= delta
    rep = held_out_report(pred, held_in, held_agree, 8, cal.threshold)
    assert rep["agreement"] >= target and rep["exit_fraction"] > 0.05  # holds, and it saves something


def test_held_out_report_warns_when_the_predictor_sends_tokens_to_the_first_exit_and_they_disagree():
    pred = ComplexityPredictor(64, [2, 4, 6], context=3, channels=8)
    with torch.no_grad():  # every position exits at the first exit point (probability ~1 everywhere)
        pred.out.weight.zero_()
        pred.out.bias.fill_(20.0)
    inputs, _ = _synthetic(400, 4)
    wrong_first = torch.ones(3, 400, dtype=torch.bool)
    wrong_first[0, ::4] = False  # a quarter of the first exit's tokens disagree with full depth
    rep = held_out_report(pred, inputs, wrong_first, 8, threshold=0.5, allowed=0.05)
    assert rep["exit_histogram"]["2"] == rep["positions"]
    assert "complexity predictor looks biased toward shallow layers" in rep["warning"]
    assert "(layer 2)" in rep["warning"] and "> the 0.050" in rep["warning"]
    fine = held_out_report(pred, inputs, torch.ones(3, 400, dtype=torch.bool), 8, threshold=0.5, allowed=0.05)
    assert "warning" not in fine  # shallow but lossless: no warning


@torch.inference_mode()
@pytest.mark.parametrize("uses_ats", [False, True])
def test_batched_propagate_scoring_with_the_predictor_equals_token_by_token(uses_ats):
    """score_batch (what calibration decodes with under the propagate bridge) keeps the predictor's state per
    row: its exit layers and log-probabilities equal the scheduler's token-by-token propagate decoding of each
    sequence alone (different lengths: right padding must not leak into a row's history)."""
    from laserlm.depth.batched import score_batch, supports_batched_score

    eng = tiny_engine(seed=6)
    groups = make_groups("2", 8, 2)
    pred = random_predictor(groups.exit_points, uses_ats, seed=7)
    mode = AdaptiveDepth(eng, groups, PredictorPolicy(pred, 0.5), bridge="propagate", patience=0,
                         ats_layer=1 if uses_ats else None)
    assert supports_batched_score(mode)
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 17, 24)]
    got = score_batch(mode, eng, seqs)
    exits = 0
    for seq, r in zip(seqs, got):
        ref = mode.score(eng, torch.tensor(seq))
        assert r.layers.tolist() == ref.layers.tolist()
        lp = torch.log_softmax(ref.logits.float(), -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(r.logprobs, lp.double(), atol=1e-4, rtol=1e-4)
        exits += int((ref.layers[1:] < 8).sum())
    assert 0 < exits < sum(len(s) - 1 for s in seqs)  # some exit, some do not: the test can fail


@torch.inference_mode()
@pytest.mark.parametrize("bridge,uses_ats", [("propagate", True), ("none", False), ("deferred", True)])
def test_planned_route_equals_the_group_walk_in_one_layer_run(bridge, uses_ats, monkeypatch):
    """With the predictor alone the scheduler plans each token's route before its first layer and runs the layers up
    to the planned exit in one call; tokens, exit layers and logits equal the group-by-group walk's (the same mode
    with planning switched off). Under ``deferred`` a pending token forces the walk, which must still agree."""
    from laserlm.runtime.loop import SamplingParams, generate_tokens

    eng = tiny_engine(seed=9)
    groups = make_groups("2", 8, 2)
    pred = random_predictor(groups.exit_points, uses_ats, seed=10)
    mode = AdaptiveDepth(eng, groups, PredictorPolicy(pred, 0.5), bridge=bridge, patience=0)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(11))
    calls = []
    run_layers = eng.run_layers

    def counted(a, b, h, st):
        calls.append((a, b))
        return run_layers(a, b, h, st)

    monkeypatch.setattr(eng, "run_layers", counted)

    def run():
        calls.clear()
        events = list(generate_tokens(eng, mode, prompt, SamplingParams(max_new_tokens=24), 24))
        return [e.token_id for e in events], [e.info.get("exit_layer") for e in events], list(calls)

    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(12))
    planned_tokens, planned_layers, planned_calls = run()
    planned_score = mode.score(eng, ids)
    monkeypatch.setattr(AdaptiveDepth, "_planned_exit", lambda self, rs, predicted: None)
    walk_tokens, walk_layers, walk_calls = run()
    walk_score = mode.score(eng, ids)
    assert planned_tokens == walk_tokens and planned_layers == walk_layers
    assert torch.equal(planned_score.layers, walk_score.layers)
    torch.testing.assert_close(planned_score.logits, walk_score.logits, atol=1e-5, rtol=1e-5)
    exits = [x for x in planned_layers[1:] if x < 8]
    assert 0 < len(exits) < len(planned_layers) - 1  # some tokens exit, some do not: the test can fail
    if bridge != "deferred":  # one layer run per token (plus the prompt's), where the walk ran one per group
        assert len(planned_calls) == len(planned_tokens)
        assert len(walk_calls) > len(planned_calls)


@torch.inference_mode()
def test_planned_route_on_the_packed_smollm2_kernel(monkeypatch):
    """The planned route on the real model's packed (native Q4_1) weights, where a layer range is one compiled
    kernel call: the same tokens and exit layers as the group walk, and one layer run per token."""
    import laserlm
    from laserlm.runtime.loop import SamplingParams, generate_tokens

    lm = laserlm.load("smollm2-135m", weights="native")
    eng = lm.engine
    groups = make_groups(None, eng.num_layers, None)
    torch.manual_seed(13)
    pred = ComplexityPredictor(eng.config.hidden_size, groups.exit_points, context=3, channels=8, uses_ats=True)
    with torch.no_grad():  # exit at the first exit point after a full-depth token, else not: alternating routes
        pred.out.weight.zero_()
        pred.out.weight[:, -1] = 20.0  # the previous exit depth (1.0 after a full-depth token)
        pred.out.bias.fill_(-10.0)
    mode = AdaptiveDepth(eng, groups, PredictorPolicy(pred.eval(), 0.5), bridge="propagate", patience=0)
    prompt = torch.tensor(lm.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"])
    calls = []
    run_layers = eng.run_layers
    monkeypatch.setattr(eng, "run_layers", lambda a, b, h, st: calls.append((a, b)) or run_layers(a, b, h, st))

    def run():
        calls.clear()
        events = list(generate_tokens(eng, mode, prompt, SamplingParams(max_new_tokens=16), 16))
        return [e.token_id for e in events], [e.info.get("exit_layer") for e in events], len(calls)

    planned = run()
    monkeypatch.setattr(AdaptiveDepth, "_planned_exit", lambda self, rs, predicted: None)
    walked = run()
    assert planned[:2] == walked[:2]
    assert 0 < sum(x < eng.num_layers for x in planned[1][1:]) < 15  # some exit, some do not
    assert planned[2] == 16 and walked[2] > planned[2]


@torch.inference_mode()
@pytest.mark.parametrize("policy", ["gate", "predictor", "gate+predictor"])
def test_a_threshold_of_one_runs_the_plain_full_depth_path(policy, monkeypatch):
    """A certified threshold of 1.0 means "never exit" (a probability never exceeds 1): the scheduler then runs each
    token's layers in one call, without the group walk, exit checks or the predictor, and its tokens equal full
    depth's."""
    from laserlm.depth import ExitGate
    from laserlm.depth.policies import AllOf, GatePolicy
    from laserlm.mode_table import make_mode
    from laserlm.runtime.loop import SamplingParams, generate_tokens

    eng = tiny_engine(seed=14)
    groups = make_groups("2", 8, 2)
    gates = {e: ExitGate(64, uses_ats=True, features="state") for e in groups.exit_points}
    pred = random_predictor(groups.exit_points, uses_ats=True, seed=15)
    parts = {"gate": GatePolicy(gates, 1.0), "predictor": PredictorPolicy(pred, 1.0)}
    chosen = [parts[p] for p in policy.split("+")]
    pol = chosen[0] if len(chosen) == 1 else AllOf(chosen)
    assert pol.never_exits and not GatePolicy(gates, 0.999).never_exits
    mode = AdaptiveDepth(eng, groups, pol, bridge="propagate", patience=0)
    prompt = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(16))
    want = [e.token_id for e in generate_tokens(eng, make_mode("full", eng), prompt, SamplingParams(max_new_tokens=12), 12)]
    calls, predictions = [], []
    run_layers = eng.run_layers
    monkeypatch.setattr(eng, "run_layers", lambda a, b, h, st: calls.append((a, b)) or run_layers(a, b, h, st))
    monkeypatch.setattr(AdaptiveDepth, "_predict", lambda *a: predictions.append(1))
    events = list(generate_tokens(eng, mode, prompt, SamplingParams(max_new_tokens=12), 12))
    assert [e.token_id for e in events] == want
    assert calls == [(0, 8)] * 12 and not predictions  # one run per token (the prompt's included), no prediction
    assert all(e.info["exit_layer"] == 8 for e in events)
