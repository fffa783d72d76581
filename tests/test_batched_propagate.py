"""Batched propagate scoring (laserlm.depth.batched) against the token-by-token scheduler, batched policy
decisions against float64 rules, cheap ("state") exit gates, and threshold calibration on real
propagate decoding (laserlm.training.decoding) against an independent reference."""

from __future__ import annotations

import math

import pytest
import torch

from laserlm.depth import AdaptiveDepth, ExitGate, GatePolicy, make_groups, make_policy
from laserlm.depth.batched import score_batch, supports_batched_score
from laserlm.depth.heads import gate_scalars_batch
from laserlm.depth.walk import update_patience
from laserlm.depth.policies import AllOf, AnyOf, AttentionTransition, BatchPoint, Compensation, Confidence, Saturation
from laserlm.errors import InvalidArgumentError
from laserlm.runtime.engine import Engine
from laserlm.mode_table import make_mode

from test_depth import tiny_gemma3

TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure "
        "in Paris. Its base is square, measuring 125 metres on each side. During its construction, the Eiffel "
        "Tower surpassed the Washington Monument to become the tallest man-made structure in the world.")


def _sequential(mode, eng, seq):
    """Reference: the scheduler's own token-by-token score, reduced to what score_batch returns."""
    out = mode.score(eng, torch.tensor(seq))
    lp = torch.log_softmax(out.logits.float(), -1)[:-1].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
    return lp.double(), out.logits.argmax(-1), out.layers


def _random_state_gates(d, exits, seed=0, bias=1.0):
    g = torch.Generator().manual_seed(seed)
    gates = {}
    for e in exits:
        gate = ExitGate(d, uses_ats=True, features="state")
        with torch.no_grad():
            gate.linear.weight.copy_(torch.randn(gate.linear.weight.shape, generator=g) * 0.05)
            gate.linear.bias.fill_(bias)
        gates[e] = gate
    return gates


@pytest.mark.parametrize("spec", [
    "adaptive:policy=confidence,threshold=0.9,patience=0,bridge=propagate",
    "adaptive:policy=confidence+ats,threshold=0.8,ats_threshold=0.5,patience=0,bridge=propagate,min_depth=12",
])
def test_score_batch_equals_token_by_token_propagate(smol, spec):
    eng = smol.engine
    ids = smol.tokenizer(TEXT)["input_ids"]
    seqs = [ids[:24], ids[5:18], ids[10:31]]  # different lengths: right padding must not leak
    mode = make_mode(spec, eng)
    assert supports_batched_score(mode)
    got = score_batch(mode, eng, seqs)
    exits = 0
    for seq, r in zip(seqs, got):
        lp, am, layers = _sequential(mode, eng, seq)
        assert r.layers.tolist() == layers.tolist()
        assert torch.equal(r.argmax, am)
        torch.testing.assert_close(r.logprobs, lp, atol=1e-4, rtol=1e-4)
        exits += int((layers < eng.num_layers).sum())
    assert 0 < exits < sum(len(s) for s in seqs) - len(seqs)  # some tokens exit, some do not


def test_score_batch_state_gates_tiny_gemma3_sliding_window():
    eng = Engine(tiny_gemma3(), max_seq_len=64)
    groups = make_groups(2, eng.num_layers, 2)
    gates = _random_state_gates(64, groups.exit_points, bias=0.0)
    mode = AdaptiveDepth(eng, groups, GatePolicy(gates, 0.5), "propagate", patience=0)
    seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 13)]
    got = score_batch(mode, eng, seqs)
    exits = 0
    for seq, r in zip(seqs, got):
        lp, am, layers = _sequential(mode, eng, seq)
        assert r.layers.tolist() == layers.tolist()
        torch.testing.assert_close(r.logprobs, lp, atol=1e-4, rtol=1e-4)
        exits += int((layers < eng.num_layers).sum())
    assert exits > 0


def test_score_batch_keeps_each_rows_patience(smol):
    """With the patience rule on, every row keeps its own streak and lock: the exits equal the token-by-token
    adaptive mode's, the lock engages (and fails) on this text, and the decisions differ from patience 0's (so a
    batched scorer that ignored the rule would fail here)."""
    eng = smol.engine
    ids = smol.tokenizer(TEXT)["input_ids"]
    seqs = [ids[:40], ids[7:30], ids[12:49]]
    spec = "adaptive:policy=confidence,threshold=0.45,patience={},bridge=propagate,groups=3,min_depth=6"
    mode, plain = make_mode(spec.format(2), eng), make_mode(spec.format(0), eng)
    assert supports_batched_score(mode)
    got, base = score_batch(mode, eng, seqs), score_batch(plain, eng, seqs)
    locked = 0
    for seq, r in zip(seqs, got):
        out = mode.score(eng, torch.tensor(seq))
        assert r.layers.tolist() == out.layers.tolist()
        assert torch.equal(r.argmax, out.logits.argmax(-1))
        rs = mode.new_state(eng)  # replay the rule on the sequential exits: count the positions a lock applied to
        for info in out.infos:
            locked += rs.patience.locked is not None
            g = info["exit_group"] if info["exit_layer"] < eng.num_layers else None
            failed = rs.patience.locked is not None and g != rs.patience.locked
            rs.patience = update_patience(rs.patience, 2, g, failed)
    assert locked > 0
    assert any(a.layers.tolist() != b.layers.tolist() for a, b in zip(got, base))


def test_score_batch_rejects_unsupported_modes(smol):
    eng = smol.engine
    mode = make_mode("adaptive:bridge=deferred,patience=0", eng)
    assert not supports_batched_score(mode)
    with pytest.raises(InvalidArgumentError, match="bridge=propagate"):
        score_batch(mode, eng, [[1, 2, 3]])


def _batch_point(n=12, d=16, v=20, seed=0, with_ats=True):
    g = torch.Generator().manual_seed(seed)
    h_in = torch.randn(n, d, generator=g)
    h = h_in + torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g)
    w = torch.randn(d, v, generator=g) * 0.8
    ats = torch.rand(n, generator=g) if with_ats else None
    return BatchPoint(1, 10, 30, h, h_in, head=lambda x: (x.float() @ w), ats=ats)


def _reference_scalars(pts, features):
    """Gate features computed directly in float64 from the point's tensors (independent of the package)."""
    h, h_in = pts.hidden.double(), pts.hidden_in.double()
    sat = (h * h_in).sum(-1) / (h.norm(dim=-1) * h_in.norm(dim=-1))
    ats = pts.ats.double() if pts.ats is not None else torch.zeros(len(pts), dtype=torch.float64)
    pos = torch.full((len(pts),), pts.layer / pts.num_layers, dtype=torch.float64)
    state = torch.stack([sat, ats, pos], -1)
    if features == "state":
        return state
    p = torch.softmax(pts.head(pts.hidden).double(), -1)
    top = p.sort(-1, descending=True).values
    ent = -(p * p.log()).sum(-1) / math.log(p.shape[-1])
    return torch.cat([torch.stack([top[:, 0], top[:, 0] - top[:, 1], ent], -1), state], -1)


def _reference_gate(gate, pts):
    h = pts.hidden.double()
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = torch.cat([h, _reference_scalars(pts, gate.features)], -1)
    return torch.sigmoid(x @ gate.linear.weight.double()[0] + gate.linear.bias.double()[0])


def _reference_decision(name, pts):
    """The exit rule of each policy below, written out in float64 per row."""
    p = torch.softmax(pts.head(pts.hidden).double(), -1)
    top = p.sort(-1, descending=True).values
    h, h_in = pts.hidden.double(), pts.hidden_in.double()
    sat = (h * h_in).sum(-1) / (h.norm(dim=-1) * h_in.norm(dim=-1))
    ats = pts.ats.double() if pts.ats is not None else None
    rules = {
        "max": top[:, 0] > 0.6,
        "margin": top[:, 0] - top[:, 1] > 0.3,
        "entropy": -(p * p.log()).sum(-1) < 1.2,
        "sat": sat > 0.9,
        "ats": ats >= 0.5 if ats is not None else torch.zeros(len(pts), dtype=torch.bool),
        "comp": (h - h_in).norm(dim=-1) / h_in.norm(dim=-1) <= 0.6,
    }
    rules["all"] = (top[:, 0] > 0.5) & (sat > 0.85)
    rules["any"] = (sat > 0.95) | ((ats >= 0.7) if ats is not None else torch.zeros(len(pts), dtype=torch.bool))
    return rules[name]


def test_decide_batch_against_float64_rules():
    gates = _random_state_gates(16, [10], bias=0.2)
    head_gate = ExitGate(16, uses_ats=True, features="head")
    with torch.no_grad():
        head_gate.linear.weight.normal_(0, 0.3)
    policies = {"max": Confidence(0.6, "max"), "margin": Confidence(0.3, "margin"),
                "entropy": Confidence(1.2, "entropy", 20), "sat": Saturation(0.9), "ats": AttentionTransition(0.5),
                "comp": Compensation(0.6), "all": AllOf([Confidence(0.5), Saturation(0.85)]),
                "any": AnyOf([Saturation(0.95), AttentionTransition(0.7)])}
    for with_ats in (True, False):
        pts = _batch_point(with_ats=with_ats)
        for name, pol in policies.items():
            assert pol.decide_batch(pts).tolist() == _reference_decision(name, pts).tolist(), pol.describe()
        for gate, thr in ((gates[10], 0.55), (head_gate, 0.5)):
            want = (_reference_gate(gate, pts) > thr).tolist()
            assert GatePolicy({10: gate}, thr).decide_batch(pts).tolist() == want
        assert not GatePolicy({11: head_gate}, 0.5).decide_batch(pts).any()  # no gate at this exit point
    pts = _batch_point()
    conf = torch.softmax(pts.logits, -1).max(-1).values
    assert conf.min() < 0.6 < conf.max()  # the example is not degenerate: the thresholds split the rows
    assert pts.saturation.min() < 0.9 < pts.saturation.max()
    assert 0 < int(Confidence(1.2, "entropy", 20).decide_batch(pts).sum()) < len(pts)
    assert 0 < int(GatePolicy(gates, 0.55).decide_batch(pts).sum()) < len(pts)


def test_combined_policies_short_circuit_per_row():
    """AllOf asks its second policy only about the rows the first let through (so the exit head is not
    evaluated for rows a cheap veto already stopped)."""
    seen = []

    class Spy(Saturation):
        def decide_batch(self, points):
            seen.append(len(points))
            return super().decide_batch(points)

    pts = _batch_point()
    first = Compensation(0.6)
    allowed = int(first.decide_batch(pts).sum())
    assert 0 < allowed < len(pts)
    AllOf([first, Spy(0.9)]).decide_batch(pts)
    assert seen == [allowed]


def test_state_gate_never_evaluates_the_exit_head(smol):
    eng = smol.engine
    gate = _random_state_gates(eng.config.hidden_size, [10])[10]
    h_in, h = torch.randn(2, 1, eng.config.hidden_size).unbind(0)
    calls = []
    head_evals = torch.zeros(1, dtype=torch.long)
    point = BatchPoint(1, 10, 30, h, h_in, head=lambda x: calls.append(1) or eng.head(x), ats=torch.tensor([0.8]),
                       head_evals=head_evals)
    GatePolicy({10: gate}, 0.5).decide_batch(point)
    assert calls == [] and int(head_evals[0]) == 0
    # the features equal a float64 computation, and the head features carry the same state columns
    s = gate_scalars_batch(None, h, h_in, torch.tensor([0.8]), 10, 30, "state")
    torch.testing.assert_close(s.double(), _reference_scalars(point, "state"))
    full = gate_scalars_batch(eng.head(h), h, h_in, torch.tensor([0.8]), 10, 30, "head")
    torch.testing.assert_close(full[:, -3:], s)
    point.logits  # noqa: B018 - evaluating the head is counted
    assert calls == [1] and int(head_evals[0]) == 1
    with pytest.raises(InvalidArgumentError, match="unknown gate features"):
        ExitGate(8, features="logits")


@pytest.mark.parametrize("patience", [0, 2])
def test_propagate_calibration_losses_against_the_unmodified_model(smol, smol_ref, patience):
    """PropagateDecoding's losses = (decoded token != the unmodified transformers model's greedy token), decoding
    with the patience rule the certificate is about."""
    from laserlm.training.collect import collect_exit_states
    from laserlm.training.decoding import PropagateDecoding, chunk_sequences, grid_thresholds

    eng = smol.engine
    groups = make_groups(None, eng.num_layers, None)
    tokens = torch.tensor(smol.tokenizer(TEXT)["input_ids"][:49])
    states = collect_exit_states(eng, tokens, groups, seq_len=24, progress=False)
    seqs = chunk_sequences(tokens, states, 24)
    assert [len(s) for s in seqs] == [25, 25]
    gates = _random_state_gates(eng.config.hidden_size, groups.exit_points, bias=0.0)
    dec = PropagateDecoding(eng, groups, {}, gates, None, seqs, states, torch.zeros(len(states)), "agreement",
                            batch=2, progress=False, patience=patience)
    losses, frac = dec(0.5)
    with torch.no_grad():
        ref_top1 = torch.cat([smol_ref(torch.tensor([s[:-1]])).logits[0].argmax(-1) for s in seqs])
    mode = dec.mode(0.5)
    assert mode.patience == patience
    seq_argmax = torch.cat([_sequential(mode, eng, s)[1][:-1] for s in seqs])
    assert torch.equal(losses, (seq_argmax != ref_top1).double())
    assert 0 < frac < 1 and losses.sum() > 0
    assert dec(1.0)[0].sum() == 0  # threshold 1: nobody exits
    # the candidate grid is ordered strict -> loose and starts with "never exit"
    grid = grid_thresholds(torch.rand(4, 1000, generator=torch.Generator().manual_seed(0)))
    assert grid[0] == 1.0 and all(a > b for a, b in zip(grid, grid[1:]))


def test_fixed_sequence_test_stops_at_the_first_failure():
    from laserlm.training.thresholds import binomial_p_value, fixed_sequence_test, resolve_target

    target, method = resolve_target(0.9, None, 0.1, None)
    risks = {1.0: 0, 0.9: 5, 0.8: 30, 0.7: 2}  # 0.8 fails; 0.7 would pass but must never be reached
    seen = []

    def losses_at(lam):
        seen.append(lam)
        x = torch.zeros(100, dtype=torch.float64)
        x[:risks[lam]] = 1
        return x, 0.0

    cal = fixed_sequence_test(list(risks), losses_at, target, 0.1, method)
    assert seen == [1.0, 0.9, 0.8] and cal.threshold == 0.9 and cal.tested == 3
    assert math.isclose(cal.p_value, binomial_p_value(5, 100, 0.1))
    assert math.isclose(cal.p_value, sum(math.comb(100, i) * 0.1 ** i * 0.9 ** (100 - i) for i in range(6)))


def test_laser_file_sets_bridge_and_patience(tmp_path, smol):
    from laserlm.depth import LaserArtifact, save_laser_file

    eng = smol.engine
    groups = make_groups(None, eng.num_layers, None)
    art = LaserArtifact(gates=_random_state_gates(eng.config.hidden_size, groups.exit_points),
                        thresholds={"gate_threshold": 0.9},
                        config={"policy": "gate", "bridge": "propagate", "patience": 0})
    path = save_laser_file(tmp_path / "x.safetensors", eng, art)
    mode = make_mode(f"adaptive:laser={path}", eng)
    assert mode.bridge.name == "propagate" and mode.patience == 0 and supports_batched_score(mode)
    mode = make_mode(f"adaptive:laser={path},bridge=deferred,patience=2", eng)  # explicit options win
    assert mode.bridge.name == "deferred" and mode.patience == 2
    assert make_policy("gate", gate_threshold=0.3, gates=art.gates).threshold == 0.3


def test_eval_scorer_uses_batched_propagate_scoring(smol):
    from laserlm.evaluation.scoring import Scorer

    eng = smol.engine
    spec = "adaptive:policy=confidence,threshold=0.9,patience=0,bridge=propagate"
    fast, slow = Scorer(eng, spec), Scorer(eng, spec, batch=False)
    assert fast.batched and not slow.batched and fast.batch_rows > 1
    ids = smol.tokenizer(TEXT)["input_ids"]
    seqs, starts = [ids[:30], ids[3:21], ids[8:40]], [20, 5, 31]
    for a, b in zip(fast.score(seqs, starts), slow.score(seqs, starts)):
        torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax, b.argmax) and a.greedy == b.greedy
        assert a.layers.tolist() == b.layers.tolist()


def test_damaged_laser_file_is_detected(tmp_path, smol):
    from laserlm.depth import LaserArtifact, load_laser_file, save_laser_file
    from laserlm.errors import CorruptModelError

    eng = smol.engine
    groups = make_groups(None, eng.num_layers, None)
    art = LaserArtifact(gates=_random_state_gates(eng.config.hidden_size, groups.exit_points),
                        thresholds={"gate_threshold": 0.9}, config={"policy": "gate"})
    path = save_laser_file(tmp_path / "x.safetensors", eng, art)
    assert load_laser_file(path, eng).gates  # intact: loads
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # flip bits inside the tensor data (the header is at the start)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match="checksum"):
        load_laser_file(path, eng)
