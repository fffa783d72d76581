"""The seed's training-guidance options in the training loops: cross-layer gradient normalisation and adaptive
clipping (:class:`laserlm.training.train.GradientControl`), checked against float64 computations."""

from __future__ import annotations

import torch

from laserlm.training.train import ADAPTIVE_CLIP_RANGE, GradientControl


def _params(grads):
    ps = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    return ps


def test_cross_layer_norm_gives_every_exit_the_mean_norm_and_keeps_directions():
    g = torch.Generator().manual_seed(0)
    raw = [[torch.randn(5, 3, generator=g) * 0.1, torch.randn(4, generator=g) * 0.1],
           [torch.randn(7, generator=g) * 3.0]]
    groups = [_params(r) for r in raw]
    norms = [torch.cat([t.double().flatten() for t in r]).norm() for r in raw]
    mean = sum(norms) / 2
    total = GradientControl(groups, grad_clip=1e9, cross_layer_norm=True)()
    for r, grp, n in zip(raw, groups, norms):
        got = torch.cat([p.grad.double().flatten() for p in grp])
        want = torch.cat([t.double().flatten() for t in r]) * (mean / n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert abs(total - float((2 * mean ** 2).sqrt())) < 1e-4  # the returned norm is after the equalising


def test_clipping_fixed_and_adaptive():
    lo, hi = ADAPTIVE_CLIP_RANGE
    big = _params([torch.full((4,), 10.0)])  # norm 20
    assert abs(GradientControl([big], grad_clip=0.5)() - 20.0) < 1e-4
    assert abs(float(big[0].grad.double().norm()) - 0.5) < 1e-5
    ctl = GradientControl([_params([torch.zeros(1)])], grad_clip=1.0, adaptive_clip=True)
    assert ctl.clip_value() == hi  # no history yet: the top of the range
    ctl.history = [5.0] * 50
    assert ctl.clip_value() == hi  # large norms: capped at 1.0
    ctl.history = [0.01] * 50
    assert ctl.clip_value() == lo  # tiny norms: never below 0.2
    ctl.history = [0.3 + 0.01 * i for i in range(100)]
    assert abs(ctl.clip_value() - 0.4) < 1e-9  # the 10th percentile of the last 100 norms
    ctl.history = [9.0] * 500 + [0.3 + 0.01 * i for i in range(100)]
    assert abs(ctl.clip_value() - 0.4) < 1e-9  # only the recent window counts
    ps = _params([torch.full((4,), 10.0)])
    ctl.groups, ctl.params = [ps], ps
    ctl()
    assert abs(float(ps[0].grad.double().norm()) - 0.4) < 1e-5
