"""The Residual Bridge's compensation veto (seed 000 §2.1): the walk runs the next group exactly when the residual
stream's relative change across a group exceeds the threshold; the threshold's choice on exact states against a
direct enumeration; and a calibrated veto stored in the laser file and run from it."""

from __future__ import annotations

import math

import pytest
import torch

from laserlm.depth import make_groups
from laserlm.depth.policies import AllOf, Compensation, ExitPolicy
from laserlm.depth.walk import walk_groups
from laserlm.training.compensation import (choose_compensation, compensation_candidates, exact_state_measure,
                                          relative_change, vetoed)


class Always(ExitPolicy):
    def decide_batch(self, points):
        return torch.ones(len(points), dtype=torch.bool)


def _scripted_walk(changes: list[list[float]], c: float):
    """Walk rows through 4 groups of 2 layers; row r's residual stream changes by ``changes[r][g]`` (relative)
    across group g. Returns the exit layer per row and the groups run."""
    groups = make_groups(2, 8, 2)
    n, d = len(changes), 4
    base = torch.ones(n, d)
    state = {"h": base.clone()}
    ran = []

    def run_group(g, a, b, exited):
        ran.append(g)
        h_in = state["h"]
        step = torch.tensor([row[g] for row in changes]).view(-1, 1) * h_in.norm(dim=-1, keepdim=True) / math.sqrt(d)
        h = h_in + step  # ||h - h_in|| / ||h_in|| == changes[r][g] exactly
        state["h"] = h
        return h_in, h, None

    head = lambda h: torch.zeros(h.shape[0], 3)  # noqa: E731
    res = walk_groups(groups, AllOf([Compensation(c), Always()]), lambda b: head, head, n, run_group)
    return res.exit_layer.tolist(), ran


def test_the_next_group_runs_exactly_when_the_change_exceeds_the_threshold():
    # exit points after layers 2, 4, 6 (groups 0..2); group 3 ends at full depth
    rows = [[0.1, 0.9, 0.9, 0.9],   # small change in group 0: exits at layer 2
            [0.5, 0.15, 0.9, 0.9],  # group 0 over the threshold: compensation runs group 1, exits at 4
            [0.5, 0.5, 0.19, 0.9],  # exits at 6
            [0.5, 0.5, 0.5, 0.01]]  # never under it at an exit point: full depth
    layers, ran = _scripted_walk(rows, 0.2)
    assert layers == [2, 4, 6, 8]
    assert ran == [0, 1, 2, 3]  # a row still running needs every group
    layers, _ = _scripted_walk(rows, 0.55)  # a looser veto: every row exits at its first exit point
    assert layers == [2, 2, 2, 2]
    layers, ran = _scripted_walk([[0.1, 0.9, 0.9, 0.9]], 0.2)
    assert layers == [2] and ran == [0]  # nobody left: the walk stops


def test_relative_change_and_veto_against_float64():
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    h = {0: torch.randn(7, 5, generator=g), 3: torch.randn(7, 5, generator=g), 6: torch.randn(7, 5, generator=g)}
    states = SimpleNamespace(hidden=h, group_start={3: 0, 6: 3})
    got = relative_change(states, [3, 6])
    for i, (e, s) in enumerate(((3, 0), (6, 3))):
        for n in range(7):
            a, b = h[s][n].double(), h[e][n].double()
            assert got[i, n].item() == pytest.approx(float(torch.sqrt(((b - a) ** 2).sum()) / torch.sqrt((a ** 2).sum())))
    probs = torch.rand(2, 7, generator=g)
    v = vetoed(probs, got, float(got.median()))
    assert torch.equal(v == 0, got > got.median()) and torch.equal(v[v > 0], probs[got <= got.median()])


def _enumerate(probs, change, losses, alpha, exits, L, c):
    """Reference for one candidate: walk the thresholds of the grid strict -> loose with a Python loop per position."""
    from laserlm.training.decoding import grid_thresholds

    p = probs.clone()
    if c is not None:
        p[change > c] = 0.0
    best = (1.0, float(L))
    for thr in grid_thresholds(p)[1:]:
        tot, lay = 0.0, 0.0
        for n in range(p.shape[1]):
            k = next((i for i in range(len(exits)) if p[i, n] > thr), None)
            tot += 0.0 if k is None else float(losses[k, n])
            lay += L if k is None else exits[k]
        if tot / p.shape[1] > alpha:
            break
        best = (thr, lay / p.shape[1])
    return best


def _choose_exact(probs, change, losses, alpha, exits, L):
    grid, measure = exact_state_measure(probs, change, losses, exits, L)
    return choose_compensation(compensation_candidates(change), grid, measure, alpha, L)


def test_choose_compensation_against_enumeration():
    """Exits that change a lot are the wrong ones here: vetoing them lets a looser gate threshold pass, so a veto
    wins; with the loss unrelated to the change, no veto saves layers and 'off' is kept."""
    g = torch.Generator().manual_seed(3)
    E, N, L, exits = 2, 400, 8, [4, 6]
    probs = torch.rand(E, N, generator=g)
    change = torch.rand(E, N, generator=g)
    risky = (change > 0.8).double()  # the exit disagrees when the change is large
    rep = _choose_exact(probs, change, risky, 0.02, exits, L)
    assert rep["threshold"] is not None and rep["threshold"] <= 0.81
    by_c = {r["threshold"]: r for r in rep["candidates"]}
    assert list(by_c)[0] is None and len(by_c) == 7  # off first, then the quantiles, loosest first
    for c, r in by_c.items():
        thr, layers = _enumerate(probs, change, risky, 0.02, exits, L, c)
        assert r["gate_threshold"] == pytest.approx(thr) and r["mean_layers"] == pytest.approx(layers, abs=1e-4)
    assert by_c[rep["threshold"]]["mean_layers"] < by_c[None]["mean_layers"]
    random_loss = (torch.rand(E, N, generator=g) < 0.05).double()
    rep = _choose_exact(probs, change, random_loss, 0.01, exits, L)
    by_c = {r["threshold"]: r for r in rep["candidates"]}
    best = min(r["mean_layers"] for r in rep["candidates"])
    assert (rep["threshold"] is None) == (by_c[None]["mean_layers"] == best)


def test_calibrated_compensation_is_stored_and_run_from_the_laser_file(smol, tmp_path):
    from laserlm.depth import make_adaptive
    from laserlm.depth.laser_file import load_laser_file
    from laserlm.training.gates import GateTrainConfig
    from laserlm.training.pipeline import CalibrateConfig, calibrate
    from laserlm.training.train import HeadTrainConfig

    from test_calibration import _tiny_lm

    lm = _tiny_lm(smol)
    cfg = CalibrateConfig(groups="2", seq_len=32, train_tokens=128, gate_tokens=128, calib_tokens=256,
                          eval_tokens=64, heads=HeadTrainConfig(steps=5, batch_tokens=32),
                          gates=GateTrainConfig(steps=5), router_prompts=0, predictor=False, target_agreement=0.5,
                          compensation=0.3)
    out = tmp_path / "c.safetensors"
    s = calibrate(lm, cfg, out, progress=False)
    art = load_laser_file(out, lm.engine)
    assert art.thresholds["compensation"] == 0.3 and s["compensation"]["threshold"] == 0.3
    mode = make_adaptive(lm.engine, laser=str(out))
    assert "change<=0.3" in mode.policy.describe() and "gate" in mode.policy.describe()
    assert "change<=0.3" in make_adaptive(lm.engine, laser=str(out), policy="gate").policy.describe()  # its own policy
    assert "change<=" not in make_adaptive(lm.engine, laser=str(out), policy="confidence").policy.describe()
    cfg.compensation = "auto"
    s2 = calibrate(lm, cfg, tmp_path / "d.safetensors", resume=True, progress=False, work_dir=tmp_path / "c.safetensors.work")
    rep = s2["compensation"]
    assert rep["chosen_on"] == "gate split (propagate decoding)" and rep["candidates"][0]["threshold"] is None
    assert (tmp_path / "c.safetensors.work" / "propagate_gate.pt").is_file()  # owned by the outputs stage
    art2 = load_laser_file(tmp_path / "d.safetensors", lm.engine)
    assert art2.thresholds.get("compensation") == rep["threshold"]
    for bad in ("sometimes", 1e-12, "inf"):
        with pytest.raises(Exception, match="compensation must be"):
            CalibrateConfig(compensation=bad).validate()
