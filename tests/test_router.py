"""Seed 004's router (laserlm.depth.router, laserlm.training.router): routes that skip middle layers, the routed
mode against transformers with those layers removed, labels against re-generating, training, and the certified
confidence threshold."""

from __future__ import annotations

import copy

import pytest
import torch

from laserlm.depth.heads import ExitHead
from laserlm.depth.laser_file import LaserArtifact, load_laser_file, save_laser_file
from laserlm.depth.router import DynamicRouter, Route, RoutedDepth
from laserlm.errors import CorruptModelError, InvalidArgumentError
from laserlm.mode_table import make_mode
from laserlm.runtime.engine import Engine
from laserlm.runtime.loop import greedy_ids
from laserlm.training.router import (build_routes, certify_router, collect_router_data, confidence_candidates,
                                     labels_of, middle_layers, route_agreement, route_losses, train_router)
from laserlm.training.thresholds import hoeffding_bentkus_p_value

L = 8


def tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def forced(d, routes, index):
    """A router that picks route ``index`` for every prompt (probability ~1)."""
    r = DynamicRouter(d, routes, confidence=0.5)
    with torch.no_grad():
        r.linear.weight.zero_()
        r.linear.bias.copy_(20.0 * torch.nn.functional.one_hot(torch.tensor(index), len(routes)).float())
    return r


def hf_greedy(model, kept, ids, n):
    """Greedy tokens of the transformers model with every layer outside ``kept`` removed (no cache: the whole
    sequence each step), the independent reference for a route."""
    pruned = copy.deepcopy(model)
    pruned.model.layers = torch.nn.ModuleList([pruned.model.layers[i] for i in kept])
    pruned.config.num_hidden_layers = len(kept)
    if getattr(pruned.config, "layer_types", None):
        pruned.config.layer_types = [pruned.config.layer_types[i] for i in kept]
    seq, out = ids.clone(), []
    with torch.no_grad():
        for _ in range(n):
            t = int(pruned(seq.unsqueeze(0), use_cache=False).logits[0, -1].argmax())
            out.append(t)
            seq = torch.cat([seq, torch.tensor([t])])
    return out


def test_routes_skip_middle_layers_chosen_by_block_influence():
    """The route set has skip routes that drop the lowest-Block-Influence *middle* layers and keep later ones (a
    router whose routes only cap the final layers fails this), cap routes at the exit points, and full depth last."""
    bi = torch.tensor([0.9, 0.5, 0.05, 0.4, 0.01, 0.3, 0.02, 0.001, 0.8, 0.7], dtype=torch.float64)
    routes = build_routes(10, [5], bi)
    assert len(routes[-1].kept) == 10 and routes[-1].exit is None
    skips = [r for r in routes if r.exit is None and len(r.kept) < 10]
    assert skips, "no route skips middle layers"
    for r in skips:
        dropped = r.skipped(10)
        assert all(i in middle_layers(10) for i in dropped)  # never layer 0-1 (first quarter) or the last
        assert r.kept[-1] == 9  # later layers still run: not a cap
        # the dropped ones are the lowest-BI middle layers (layer 7, BI 0.001, is the one before last: allowed)
        lowest = sorted(middle_layers(10), key=lambda i: float(bi[i]))[:len(dropped)]
        assert sorted(dropped) == sorted(lowest)
    assert sorted(len(r.skipped(10)) for r in skips) == [1, 2, 3, 4]  # 10/20/30/40 % of the layers
    assert [r.skipped(10) for r in skips if len(r.kept) == 9] == [[7]]  # 10 %: the single lowest
    assert Route(tuple(range(5)), 5) in routes
    counts = [len(r.kept) for r in routes]
    assert counts == sorted(counts)  # shallow to full


def test_route_checks():
    with pytest.raises(InvalidArgumentError, match="starting at layer 0"):
        Route((1, 2, 3)).check(L)
    with pytest.raises(InvalidArgumentError, match="exit head at 5"):
        Route((0, 1, 2), 5).check(L)
    with pytest.raises(InvalidArgumentError, match="at least one shallower route"):
        DynamicRouter(8, [Route(tuple(range(L)))])
    with pytest.raises(InvalidArgumentError, match="position"):
        DynamicRouter(8, [Route((0,)), Route(tuple(range(L)))], position="middle")


@pytest.mark.parametrize("route", [Route((0, 1, 2, 5, 6, 7)), Route((0, 1, 2, 3), 4)])
def test_routed_mode_equals_transformers_without_the_dropped_layers(route):
    """A request on a skip route (model head) or a cap route (an untrained exit head = the final norm + LM head)
    generates what transformers generates with the other layers removed; the dropped layers never run."""
    model = tiny()
    eng = Engine(model, max_seq_len=64)
    full = Route(tuple(range(L)))
    mode = RoutedDepth(eng, forced(64, [route, full], 0), heads={4: ExitHead(eng.adapter, "none")})
    calls = [0] * L
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(eng.adapter.layers)]
    try:
        ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3))
        got = greedy_ids(eng, mode, ids, 6)
    finally:
        for h in hooks:
            h.remove()
    assert got == hf_greedy(model, route.kept, ids, 6)
    assert all(calls[i] == 0 for i in route.skipped(L)) and all(calls[i] > 0 for i in route.kept)
    # full depth through the same mode is the model itself
    assert greedy_ids(eng, RoutedDepth(eng, forced(64, [route, full], 1), heads=mode.heads), ids, 6) == \
        hf_greedy(model, full.kept, ids, 6)


def test_teacher_forced_route_agreement_equals_regenerating():
    """route_agreement's labels say a route reproduces the continuation exactly when generating on that route does
    (by induction on the tokens), and its layer-1 states are the ones the routed mode reads."""
    model = tiny(1)
    eng = Engine(model, max_seq_len=64)
    routes = [Route((0, 1, 2, 3, 6, 7)), Route((0, 1, 4, 5, 6, 7)), Route((0, 1, 2)), Route(tuple(range(L)))]
    for seed in range(4):
        prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(seed))
        cont = torch.tensor(greedy_ids(eng, RoutedDepth(eng, forced(64, routes, 3)), prompt, 5))
        agree, h1 = route_agreement(eng, {}, routes, prompt, cont)
        assert agree[-1].all()
        for r, route in enumerate(routes[:-1]):
            regenerated = greedy_ids(eng, RoutedDepth(eng, forced(64, routes, r)), prompt, 5)
            assert bool(agree[r].all()) == (regenerated == cont.tolist())
            assert bool(agree[r, 0]) == (regenerated[0] == int(cont[0]))
        with torch.inference_mode():
            h, st = eng.begin(prompt.reshape(1, -1), use_cache=False)
            torch.testing.assert_close(h1, eng.run_layers(0, 1, h, st)[0].float())
    agree = torch.tensor([[[True, False], [True, True], [True, True]], [[False, True], [False, True], [True, True]]])
    assert labels_of(agree).tolist() == [1, 2]
    assert labels_of(agree, 0.5).tolist() == [0, 0]  # at the target level: half the positions suffice


def test_route_agreement_runs_shared_leading_layers_once():
    """Routes that start with the same layers share them: every layer of the deepest shared prefix runs once per prompt,
    and each route runs only its layers after its first dropped one. The labels equal regenerating on each route (a
    cap route through an untrained exit head included)."""
    model = tiny(2)
    eng = Engine(model, max_seq_len=64)
    heads = {4: ExitHead(eng.adapter, "none")}
    routes = [Route((0, 1, 2)), Route((0, 1, 2, 3), 4), Route((0, 1, 2, 3, 6, 7)), Route((0, 1, 4, 5, 6, 7)),
              Route(tuple(range(L)))]
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(12))
    cont = torch.tensor(greedy_ids(eng, RoutedDepth(eng, forced(64, routes, 4), heads=heads), prompt, 5))
    calls = [0] * L
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(eng.adapter.layers)]
    try:
        agree, _ = route_agreement(eng, heads, routes, prompt, cont)
    finally:
        for h in hooks:
            h.remove()
    assert calls == [1, 1, 1, 1, 1, 1, 2, 2]
    first = agree[:-1, 0].tolist()
    assert any(first) and not all(first), first  # the labels below can tell a right route from a wrong one
    for r in range(len(routes) - 1):
        regenerated = greedy_ids(eng, RoutedDepth(eng, forced(64, routes, r), heads=heads), prompt, 5)
        assert bool(agree[r, 0]) == (regenerated[0] == int(cont[0]))
        assert bool(agree[r].all()) == (regenerated == cont.tolist())


def test_router_learns_separable_routes():
    """Two clusters of prompts with different routes: the focal loss falls and held-out prompts of each cluster get
    their cluster's route; a router trained on shuffled labels cannot."""
    routes = [Route((0, 1, 2)), Route((0, 1, 2, 3, 5)), Route(tuple(range(L)))]
    g = torch.Generator().manual_seed(1)
    centre = torch.randn(2, 16, generator=g) * 3

    def draw(n):
        x = torch.cat([centre[0] + torch.randn(n, 16, generator=g), centre[1] + torch.randn(n, 16, generator=g)])
        return x, torch.cat([torch.zeros(n, dtype=torch.long), torch.full((n,), 2)])

    x, y = draw(12)
    router = DynamicRouter(16, routes)
    losses = train_router(router, x, y)
    assert losses and losses[-1] < 0.5 * losses[0]
    xt, yt = draw(20)
    with torch.no_grad():
        assert (router(xt).argmax(-1) == yt).float().mean() >= 0.95
    shuffled = DynamicRouter(16, routes)
    train_router(shuffled, x, y[torch.randperm(len(y), generator=g)])
    with torch.no_grad():
        assert (shuffled(xt).argmax(-1) == yt).float().mean() < 0.9


def test_router_is_conservative():
    """Constant labels give the constant router; a route is taken only above the confidence threshold."""
    routes = [Route((0, 1, 2)), Route((0, 1, 2, 3, 5)), Route(tuple(range(L)))]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    router = DynamicRouter(16, routes)
    train_router(router, x, torch.full((8,), 2))
    far = x[:1] + 100 * torch.randn(1, 16, generator=g)  # a prompt unlike any training prompt
    assert router.decide(torch.cat([x, far]), 0.0).tolist() == [2] * 9
    with torch.no_grad():
        router.linear.weight.zero_()
        router.linear.bias.copy_(torch.tensor([1.0, 0.0, 0.0]))  # route 0 most likely, p = 0.58
    assert router.decide(x[:1], 0.9).tolist() == [2] and router.decide(x[:1], 0.5).tolist() == [0]
    assert router.decide(x[:1], 1.0).tolist() == [2]


def test_certified_confidence_against_an_enumeration():
    """certify_router picks the loosest confidence of a fixed sequence (from the fit prompts) whose
    Hoeffding-Bentkus p-value over per-prompt losses (a prompt's share of disagreeing positions on its route;
    full-depth prompts lose 0) is <= delta, as an independent enumeration finds; on a fresh draw from the same
    distribution the agreement meets the target."""
    routes = [Route((0, 1, 2)), Route((0, 1, 2, 3, 5)), Route(tuple(range(L)))]
    g = torch.Generator().manual_seed(4)

    def draw(p):
        feats = torch.randn(p, 4, generator=g)
        # easy prompts (feature 0 high) agree on the shallow route; the others disagree there at 30 % of positions
        easy = feats[:, 0] > 0
        agree = torch.ones(p, 3, 16, dtype=torch.bool)
        agree[:, 0] = torch.where(easy.view(-1, 1), torch.rand(p, 16, generator=g) > 0.002,
                                  torch.rand(p, 16, generator=g) > 0.3)
        agree[:, 1] = torch.rand(p, 16, generator=g) > 0.5
        agree[:, 2] = False  # ignored: the full route is the reference
        return feats, agree

    fit_f, fit_a = draw(400)
    router = DynamicRouter(4, routes)
    train_router(router, fit_f, labels_of(fit_a, 0.95))
    cands = confidence_candidates(router, fit_f)
    feats, agree = draw(600)
    cal = certify_router(router, feats, agree, target_agreement=0.95, delta=0.1, candidates=cands)
    # the enumeration, in float64 like the rule
    with torch.no_grad():
        p, r = torch.softmax(router(feats).double(), -1).max(-1)
    best = None
    for conf in cands:
        d = torch.where(p > conf, r, torch.full_like(r, 2))
        losses = [float((~agree[i, int(d[i])]).double().mean()) if int(d[i]) != 2 else 0.0 for i in range(600)]
        if hoeffding_bentkus_p_value(sum(losses) / 600, 600, 0.05) > 0.1:
            break
        best = conf
    assert cal.threshold == best and router.confidence == best and best is not None and best < 1.0
    assert cal.n == 600 and "router confidence" in cal.guarantee and "prompts" in cal.guarantee
    assert (router.decide(feats) == 0).sum() > 50  # it routes many prompts shallow
    feats2, agree2 = draw(600)
    assert 1 - float(route_losses(router.decide(feats2), agree2).mean()) >= 0.95
    # a target nothing meets: confidence 1.0, every request at full depth
    cal = certify_router(router, feats, agree, target_agreement=0.9999, delta=0.1, candidates=cands)
    assert cal.threshold is None and router.confidence == 1.0 and (router.decide(feats) == 2).all()
    assert "every request runs full depth" in cal.guarantee


def test_a_certain_router_routes_at_its_certified_confidence():
    """A router whose probability is exactly 1.0 in float32 (the constant router of a single label): the candidate
    just below 1.0 must route every prompt (it did not when probabilities were compared in float32)."""
    routes = [Route((0, 1, 2)), Route(tuple(range(L)))]
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    router = DynamicRouter(4, routes)
    train_router(router, x, torch.zeros(40, dtype=torch.long))
    with torch.no_grad():
        assert float(torch.softmax(router(x), -1)[0, 0]) == 1.0  # float32 saturates
    agree = torch.ones(40, 2, 8, dtype=torch.bool)
    cal = certify_router(router, x, agree, target_agreement=0.9, delta=0.1)
    assert cal.threshold is not None and cal.threshold < 1.0
    assert router.decide(x).tolist() == [0] * 40


def test_router_data_on_a_tiny_model_and_the_laser_file(tmp_path):
    """collect_router_data labels real prompts; the router round-trips through the laser file and runs as
    mode routed; a file with an older router, or none, is a clear error for that mode."""
    model = tiny(2)
    eng = Engine(model, max_seq_len=64)
    routes = [Route((0, 1, 2, 3, 6, 7)), Route((0, 1, 2, 3), 4), Route(tuple(range(L)))]
    heads = {4: ExitHead(eng.adapter, "none")}
    toks = torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(5))
    data = collect_router_data(eng, heads, toks, routes, num_prompts=6, prompt_len=8, continuation=3, progress=False)
    assert data.agree.shape == (6, 3, 3) and data.labels.shape == (6,)
    assert set(data.features) == {"last", "first", "mean"} and data.features["last"].shape == (6, 64)
    router = forced(64, routes, 0)
    path = save_laser_file(tmp_path / "r.laser", eng, LaserArtifact(heads=heads, router=router))
    mode = make_mode(f"routed:laser={path}", eng)
    ids = toks[:9]
    assert greedy_ids(eng, mode, ids, 4) == hf_greedy(model, routes[0].kept, ids, 4)
    assert greedy_ids(eng, make_mode(f"routed:laser={path},confidence=1", eng), ids, 4) == \
        hf_greedy(model, routes[-1].kept, ids, 4)
    with pytest.raises(InvalidArgumentError, match="confidence must be in"):
        make_mode(f"routed:laser={path},confidence=2", eng)
    with pytest.raises(InvalidArgumentError, match="needs laser=PATH"):
        make_mode("routed", eng)
    plain = save_laser_file(tmp_path / "p.laser", eng, LaserArtifact(heads=heads))
    with pytest.raises(InvalidArgumentError, match="has no router"):
        make_mode(f"routed:laser={plain}", eng)
    from safetensors import safe_open
    from safetensors.torch import save_file
    import json

    def rewrite(dst, edit):
        with safe_open(str(path), framework="pt") as f:
            meta, tensors = json.loads(f.metadata()["laserlm"]), {k: f.get_tensor(k) for k in f.keys()}
        edit(meta)
        save_file(tensors, str(dst), metadata={"laserlm": json.dumps(meta)})
        return dst

    old = rewrite(tmp_path / "old.laser", lambda m: m.__setitem__("router", {"exit_points": [4], "layer": 1}))
    assert load_laser_file(old, eng).router is None  # the file still runs adaptive depth
    with pytest.raises(InvalidArgumentError, match="older laserlm"):
        make_mode(f"routed:laser={old}", eng)
    for i, damage in enumerate((lambda m: m["router"]["routes"][0].__setitem__("kept", [3, 4]),
                                lambda m: m["router"].__setitem__("routes", []),
                                lambda m: m["router"].__setitem__("confidence", -3),
                                lambda m: m["router"]["routes"][0].__setitem__("kept", [0, 1.7, 2, 3, 6, 7]),
                                lambda m: m["router"].__setitem__("layer", 2))):
        bad = rewrite(tmp_path / f"bad{i}.laser", damage)
        with pytest.raises(CorruptModelError, match="do not match its config"):
            load_laser_file(bad, eng)
