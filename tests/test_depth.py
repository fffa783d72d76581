"""Adaptive depth (laserlm.depth): exactness without exits, deferred/propagate bridges against independent
references, patience rule and min depth on scripted sequences, baselines, and clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from laserlm.depth import (AdaptiveDepth, Confidence, ExitHead, LaserArtifact, Never, block_influence,
                           load_laser_file, make_groups, make_policy, save_laser_file)
from laserlm.depth.policies import ExitPolicy
from laserlm.errors import InvalidArgumentError
from laserlm.runtime.engine import Engine
from laserlm.mode_table import make_mode
from laserlm.runtime.loop import generate_tokens

PROMPT = "The quick brown fox jumps over the lazy dog. It was a sunny day and"


# -- helpers -----------------------------------------------------------------------------------------
class ScriptedExit(ExitPolicy):
    """Exit at group ``target`` (set before each step); records the groups it was asked at."""

    def __init__(self):
        self.target = None
        self.calls = []

    def decide_batch(self, points):
        self.calls.append(points.group)
        return torch.full((len(points),), points.group == self.target)


class ScriptedConfidence(ExitPolicy):
    """A fake confidence policy: ``conf[group]`` for the current token (set before each step) vs a threshold."""

    def __init__(self, threshold=0.8):
        self.threshold = threshold
        self.conf = {}
        self.calls = []

    def decide_batch(self, points):
        self.calls.append(points.group)
        return torch.full((len(points),), self.conf.get(points.group, 0.0) > self.threshold)


def tiny_llama(seed=0, layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3(seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                           sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                           query_pre_attn_scalar=16)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights so that the q/k norms matter
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.normal_(0, 0.5)
            layer.input_layernorm.weight.normal_(0, 0.5)
    return model


def prompt_ids(smol, n=None):
    ids = torch.tensor(smol.tokenizer(PROMPT)["input_ids"])
    return ids if n is None else ids[:n]


class CaptureCache:
    """Stands in for a transformers Cache: records the K/V an attention module writes."""

    def update(self, k, v, layer_idx, *args, **kwargs):
        self.k, self.v = k, v
        return k, v


def reference_kv(layer, hidden, cos, sin):
    """K/V from the unmodified transformers attention module of ``layer`` applied to ``hidden`` entering it."""
    cap = CaptureCache()
    layer.self_attn(hidden_states=layer.input_layernorm(hidden), position_embeddings=(cos, sin),
                    attention_mask=None, cache=cap)
    return cap.k, cap.v


# -- exactness without exits -----------------------------------------------------------------------
@pytest.mark.parametrize("bridge", ["propagate", "deferred", "none"])
def test_never_exit_reproduces_full_depth_exactly(smol, bridge):
    eng = smol.engine
    ids = prompt_ids(smol)
    prompt, cont = ids[:8], ids[8:14]
    # full depth: prefill + decode steps
    eng.reset()
    ref = [eng.prefill(prompt.unsqueeze(0)).logits[0, -1]]
    for t in cont:
        ref.append(eng.decode_step(t.view(1)).logits[0, -1])
    ref_cache = [k[:, :, :len(ids)].clone() for k in eng.cache.k]
    mode = make_mode(f"adaptive:threshold=1.0,bridge={bridge},patience=3", eng)  # max prob never exceeds 1
    rs = mode.new_state(eng)
    got = [mode.prefill_logits(eng, rs, eng.cache, prompt)]
    for t in cont:
        logits, info = mode.decode(eng, rs, eng.cache, int(t))
        assert info["exit_layer"] == eng.num_layers and info["head_evals"] > 0
        got.append(logits)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    for a, b in zip(ref_cache, eng.cache.k):
        assert torch.equal(a, b[:, :, :len(ids)])


def test_never_exit_generation_matches_transformers(smol, smol_ref):
    full = smol.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    res = smol.generate(PROMPT, mode="adaptive:policy=never", max_new_tokens=6, ignore_eos=True)
    assert res.token_ids == full.token_ids
    st = res.stats()
    assert st["exit_layer_histogram"] == {"30": 6}
    # independent reference: transformers greedy generate
    ids = prompt_ids(smol).unsqueeze(0)
    out = smol_ref.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert res.token_ids == out[0, ids.shape[1]:].tolist()


# -- deferred bridge -------------------------------------------------------------------------------
def test_deferred_bridge_makes_the_cache_exact(smol):
    eng = smol.engine
    ids = prompt_ids(smol)
    n0 = 6
    L = eng.num_layers
    # groups of 5, min depth 8 -> exit points after 10 (g1), 15 (g2), 20 (g3), 25 (g4)
    # token script: exit g3; exit g1 before the pending layer; full (joins at 10); exit g2; exit g3 after
    # joining at 15; full (joins at 20); exit g4; full
    script = [3, 1, None, 2, 3, None, 4, None]
    toks = ids[n0:n0 + len(script)]
    n = n0 + len(script)
    eng.reset()
    ref_logits = [eng.prefill(ids[:n0].unsqueeze(0)).logits[0, -1]]
    for t in toks:
        ref_logits.append(eng.decode_step(t.view(1)).logits[0, -1])
    ref_k = [k[:, :, :n].clone() for k in eng.cache.k]
    ref_v = [v[:, :, :n].clone() for v in eng.cache.v]

    policy = ScriptedExit()
    mode = AdaptiveDepth(eng, make_groups(5, L, 8), policy, "deferred", patience=0)
    rs = mode.new_state(eng)
    mode.prefill_logits(eng, rs, eng.cache, ids[:n0])
    for i, (t, target) in enumerate(zip(toks, script)):
        policy.target = target
        logits, info = mode.decode(eng, rs, eng.cache, int(t))
        assert info["exit_layer"] == (L if target is None else 5 * (target + 1))
        if target is None:  # this token ran to full depth on an exact cache: its logits are full depth's
            torch.testing.assert_close(logits, ref_logits[i + 1], atol=2e-4, rtol=1e-4)
            assert rs.pending is None
            assert info["deferred_layers"] > 0
    assert eng.cache.length == n
    for j in range(L):  # every position is complete (the last token ran full depth)
        torch.testing.assert_close(eng.cache.k[j][:, :, :n], ref_k[j], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(eng.cache.v[j][:, :, :n], ref_v[j], atol=2e-4, rtol=1e-4)


# -- propagate bridge ------------------------------------------------------------------------------
def test_propagate_writes_projected_kv_real_model(smol, smol_ref):
    eng = smol.engine
    ids = prompt_ids(smol, 10)
    L = eng.num_layers
    policy = ScriptedExit()
    mode = AdaptiveDepth(eng, make_groups(5, L, 8), policy, "propagate", patience=0)
    rs = mode.new_state(eng)
    mode.prefill_logits(eng, rs, eng.cache, ids[:-1])
    policy.target = 1  # exit after 10 layers
    _, info = mode.decode(eng, rs, eng.cache, int(ids[-1]))
    assert info["exit_layer"] == 10 and info["bridge_layers"] == L - 10
    # independent reference: the transformers model's hidden state after 10 layers at the last position
    with torch.no_grad():
        hs = smol_ref(ids.unsqueeze(0), output_hidden_states=True).hidden_states
        h = hs[10][:, -1:]
        pos = torch.tensor([[ids.shape[0] - 1]])
        cos, sin = smol_ref.model.rotary_emb(h, pos)
        p = ids.shape[0] - 1
        for j in (10, 17, L - 1):
            k, v = reference_kv(smol_ref.model.layers[j], h, cos, sin)
            torch.testing.assert_close(eng.cache.k[j][:, :, p:p + 1], k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(eng.cache.v[j][:, :, p:p + 1], v, atol=1e-4, rtol=1e-4)
        # layers the token ran are its real K/V (from its own forward): layer 3
        k, _ = reference_kv(smol_ref.model.layers[3], hs[3][:, -1:], cos, sin)
        torch.testing.assert_close(eng.cache.k[3][:, :, p:p + 1], k, atol=1e-4, rtol=1e-4)


def test_propagate_gemma3_qk_norm_and_two_rotary_tables():
    model = tiny_gemma3()
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa"
    eng = Engine(model, max_seq_len=64)
    L = eng.num_layers
    ids = torch.randint(0, 128, (12,))
    policy = ScriptedExit()
    mode = AdaptiveDepth(eng, make_groups(2, L, 2), policy, "propagate", patience=0)
    rs = mode.new_state(eng)
    mode.prefill_logits(eng, rs, eng.cache, ids[:-1])
    policy.target = 0  # exit after 2 layers; layers 2 (global), 3, 4 (sliding), 5 (global) are bridged
    mode.decode(eng, rs, eng.cache, int(ids[-1]))
    p = ids.shape[0] - 1
    with torch.no_grad():
        hs = ref(ids.unsqueeze(0), output_hidden_states=True).hidden_states
        h = hs[2][:, -1:]
        pos = torch.tensor([[p]])
        for j in range(2, L):
            lt = ref.config.layer_types[j]
            cos, sin = ref.model.rotary_emb(h, pos, lt)
            k, v = reference_kv(ref.model.layers[j], h, cos, sin)
            torch.testing.assert_close(eng.cache.k[j][:, :, p:p + 1], k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(eng.cache.v[j][:, :, p:p + 1], v, atol=1e-5, rtol=1e-5)
    # both rotary tables really differ at this position (the test would catch a wrong table)
    c_local, _ = ref.model.rotary_emb(h, pos, "sliding_attention")
    c_global, _ = ref.model.rotary_emb(h, pos, "full_attention")
    assert not torch.allclose(c_local, c_global)


def test_none_bridge_masks_skipped_slots():
    model = tiny_llama()
    eng = Engine(model, max_seq_len=64)
    L = eng.num_layers
    ids = torch.randint(0, 128, (8,))
    policy = ScriptedExit()
    mode = AdaptiveDepth(eng, make_groups(2, L, 2), policy, "none", patience=0)
    rs = mode.new_state(eng)
    mode.prefill_logits(eng, rs, eng.cache, ids[:5])
    policy.target = 1  # token at position 5 exits after 4 layers
    mode.decode(eng, rs, eng.cache, int(ids[5]))
    policy.target = None
    logits, _ = mode.decode(eng, rs, eng.cache, int(ids[6]))
    valid = rs.valid
    assert sorted(valid) == [4, 5, 6, 7] and not valid[4][5] and valid[4][4] and valid[4][6]
    # reference: position 6 computed by the transformers model with position 5 removed from layers >= 4
    with torch.no_grad():
        ref = copy.deepcopy(model)
        ref.config._attn_implementation = "eager"
        mask = torch.ones(7, 7).tril().bool()
        m_hole = mask.clone()
        m_hole[6, 5] = False
        h = ref.model.embed_tokens(ids[:7].unsqueeze(0))
        cos, sin = ref.model.rotary_emb(h, torch.arange(7).unsqueeze(0))
        hole = h
        for j, layer in enumerate(ref.model.layers):
            m = m_hole if j >= 4 else mask
            hole = layer(hole, attention_mask=torch.where(m, 0.0, float("-inf"))[None, None],
                         position_embeddings=(cos, sin))
        expect = ref.lm_head(ref.model.norm(hole[:, -1]))[0]
    torch.testing.assert_close(logits, expect, atol=1e-4, rtol=1e-4)


# -- patience rule and min depth -------------------------------------------------------------------
def test_patience_rule_scripted_confidence():
    eng = Engine(tiny_llama(layers=30), max_seq_len=64)
    L = eng.num_layers
    policy = ScriptedConfidence(threshold=0.8)
    mode = AdaptiveDepth(eng, make_groups(5, L, 5), policy, "propagate", patience=3)
    rs = mode.new_state(eng)
    mode.prefill_logits(eng, rs, eng.cache, torch.tensor([1, 2, 3]))
    hi = 0.9
    # token confidences per group (groups 0..4 can exit: ends 5..25)
    script = [
        ({2: hi, 3: hi}, [0, 1, 2], 15),        # exits at g2 (streak 1)
        ({2: hi}, [0, 1, 2], 15),               # streak 2
        ({0: 0.5, 2: hi}, [0, 1, 2], 15),       # streak 3 -> lock at g2
        ({0: hi, 1: hi, 2: hi}, [2], 15),       # locked: g0/g1 not checked although confident; exit at g2
        ({2: 0.1, 3: hi}, [2], L),              # fails at g2: full depth, no further checks
        ({0: hi}, [0], 5),                      # checks resume at every exit point
        ({1: hi}, [0, 1], 10),
    ]
    for i, (conf, checked, exit_layer) in enumerate(script):
        policy.conf, policy.calls = conf, []
        _, info = mode.decode(eng, rs, eng.cache, 5 + i)
        assert policy.calls == checked, (i, policy.calls)
        assert info["exit_layer"] == exit_layer, i
        assert info["patience"] == (i in (3, 4))


def test_min_depth_and_patience_zero():
    eng = Engine(tiny_llama(layers=30), max_seq_len=64)
    L = eng.num_layers
    policy = ScriptedConfidence(threshold=0.8)
    mode = AdaptiveDepth(eng, make_groups(5, L, 12), policy, "propagate", patience=0)
    rs = mode.new_state(eng)
    mode.prefill_logits(eng, rs, eng.cache, torch.tensor([1, 2]))
    for i in range(5):
        policy.conf, policy.calls = {g: 0.99 for g in range(6)}, []
        _, info = mode.decode(eng, rs, eng.cache, 3 + i)
        assert policy.calls == [2] and info["exit_layer"] == 15  # ends 5 and 10 are below min depth 12
    assert rs.patience.locked is None
    # default min depth: a quarter of the layers (ceil) -> 8 for 30 layers
    assert make_groups(None, 30).min_depth == 8 and make_groups(None, 30).exit_points == [10, 15, 20, 25]


def test_confidence_measures_against_direct_computation():
    from laserlm.depth.policies import BatchPoint

    torch.manual_seed(0)
    logits = torch.randn(50, dtype=torch.float64) * 3
    p = torch.softmax(logits, -1)
    pt = BatchPoint(0, 5, 10, torch.randn(1, 8), torch.randn(1, 8), head=lambda h: logits.float().view(1, -1))
    srt = torch.sort(p, descending=True).values
    ent = float(-(p * p.log()).sum())  # float64 references
    for measure, value, exit_above in (("max", float(srt[0]), True), ("margin", float(srt[0] - srt[1]), True),
                                       ("entropy", ent, False)):
        below, above = Confidence(value - 1e-3, measure, 50), Confidence(value + 1e-3, measure, 50)
        assert bool(below.decide_batch(pt)[0]) == exit_above and bool(above.decide_batch(pt)[0]) != exit_above


# -- baselines -------------------------------------------------------------------------------------
def test_early_exit_and_block_influence_against_transformers(smol, smol_ref):
    eng = smol.engine
    ids = prompt_ids(smol, 12)
    with torch.no_grad():
        hs = smol_ref(ids.unsqueeze(0), output_hidden_states=True).hidden_states
        expect = smol_ref.lm_head(smol_ref.model.norm(hs[20]))[0]
    out = make_mode("early-exit:layer=20", eng).score(eng, ids)
    torch.testing.assert_close(out.logits, expect, atol=1e-4, rtol=1e-4)
    assert out.layers.tolist() == [20.0] * 12
    bi = block_influence(eng, ids)
    for i in (0, 7, 28):
        cos = torch.nn.functional.cosine_similarity(hs[i][0].double(), hs[i + 1][0].double(), dim=-1).mean()
        assert abs(float(bi[i]) - (1 - float(cos))) < 1e-5


def test_static_pruning_matches_transformers_without_the_layers():
    model = tiny_llama(layers=8)
    eng = Engine(model, max_seq_len=64)
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa"
    drop = [2, 5, 6]
    ref.model.layers = torch.nn.ModuleList([m for i, m in enumerate(ref.model.layers) if i not in drop])
    ref.config.num_hidden_layers = len(ref.model.layers)
    for new_idx, layer in enumerate(ref.model.layers):  # the reference's own cache is indexed per kept layer
        layer.self_attn.layer_idx = new_idx
    if getattr(ref.config, "layer_types", None):
        ref.config.layer_types = ref.config.layer_types[:len(ref.model.layers)]
    ids = torch.randint(0, 128, (10,))
    mode = make_mode("static:drop=2/5/6", eng)
    with torch.no_grad():
        expect = ref(ids.unsqueeze(0), use_cache=False).logits[0]
    torch.testing.assert_close(mode.score(eng, ids).logits, expect, atol=1e-4, rtol=1e-4)
    # generation uses the same subset: greedy tokens equal the truncated transformers model's
    from laserlm.runtime.sampling import SamplingParams

    toks = [ev.token_id for ev in generate_tokens(eng, mode, ids, SamplingParams(max_new_tokens=4), 4)]
    with torch.no_grad():
        out = ref.generate(ids.unsqueeze(0), max_new_tokens=4, do_sample=False, min_new_tokens=4, pad_token_id=0)
    assert toks == out[0, 10:].tolist()


# -- exit heads and laser files --------------------------------------------------------------------
def test_exit_head_identity_init_and_laser_file_round_trip(tmp_path):
    eng = Engine(tiny_llama(), max_seq_len=32)
    h = torch.randn(3, 64)
    for kind in ("none", "affine", "lowrank"):
        head = ExitHead(eng.adapter, kind, rank=4)
        torch.testing.assert_close(head(h), eng.head(h), atol=1e-5, rtol=1e-5)
    head = ExitHead(eng.adapter, "affine")
    with torch.no_grad():
        head.proj.bias.normal_()
    path = save_laser_file(tmp_path / "x.laser", eng, LaserArtifact(heads={4: head}, thresholds={"threshold": 0.7}))
    art = load_laser_file(path, eng)
    torch.testing.assert_close(art.heads[4](h), head(h))
    mode = make_mode(f"adaptive:laser={path},groups=2,min_depth=2", eng)
    assert mode.heads[4] is not None and mode.policy.threshold == 0.7
    # another model with the same shapes but other weights, and one with other shapes
    with pytest.raises(InvalidArgumentError, match="made for another model.*weights differ"):
        load_laser_file(path, Engine(tiny_llama(seed=1), max_seq_len=32))
    with pytest.raises(InvalidArgumentError, match="made for another model"):
        make_mode(f"adaptive:laser={path}", Engine(tiny_llama(layers=6), max_seq_len=32))


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("5-4/5-7", "empty layer group"),
    ("0-4/3-7", "overlap"),
    ("0-3/4-9", "out of range"),
    ("0-2/4-7", "belong to no layer group"),
    ("0", "positive integer"),
    ("3/3/8", "strictly increasing"),
    ("2/12", "out of range"),
    ("abc", "bad layer groups"),
])
def test_invalid_groups(spec, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_groups(spec, 8)
    with pytest.raises(InvalidArgumentError, match="min depth"):
        make_groups(2, 8, min_depth=9)


@pytest.mark.parametrize("spec, message", [
    ("adaptive:threshold=1.5", r"confidence threshold \(max\) 1.5 is out of range"),
    ("adaptive:threshold=-0.1", "out of range"),
    ("adaptive:policy=saturation,threshold=2", "saturation threshold 2.0 is out of range"),
    ("adaptive:policy=confidence+ats,ats_threshold=1.2", "attention transition threshold"),
    ("adaptive:measure=entropy,threshold=99", "out of range"),
    ("adaptive:bridge=magic", "unknown bridge 'magic'"),
    ("adaptive:policy=wishful", "unknown exit policy 'wishful'"),
    ("adaptive:policy=gate", "needs trained exit gates"),
    ("adaptive:gate_threshold=0.0001", r"gate_threshold=0.0001 set a policy that policy=confidence does not run"),
    ("adaptive:saturation_threshold=0.01,threshold=0.9", "e.g. policy=saturation"),
    ("adaptive:policy=confidence+gate,ats_threshold=0.5", "policy=confidence\\+gate does not run"),
    ("adaptive:patience=-1", "patience"),
    ("adaptive:threshold=high", "must be a number"),
    ("adaptive:colour=red", "unknown option"),
    ("adaptive:groups=0-3/2-7", "overlap"),
    ("adaptive:policy=ats,ats_layer=6", "ats_layer"),
    ("early-exit:layer=9", "exit layer must be in 1-8"),
    ("early-exit", "needs layer=N"),
    ("static:drop=1/99", "out of range"),
    ("static", "needs layers=K"),
])
def test_bad_mode_specs(spec, message):
    eng = Engine(tiny_llama(), max_seq_len=32)
    with pytest.raises(InvalidArgumentError, match=message):
        make_mode(spec, eng)


def test_laser_file_errors(tmp_path):
    from laserlm.errors import CorruptModelError, ModelNotFoundError

    eng = Engine(tiny_llama(), max_seq_len=32)
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_laser_file(tmp_path / "missing.laser", eng)
    bad = tmp_path / "bad.laser"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(CorruptModelError, match="cannot read laser file"):
        load_laser_file(bad, eng)
    good = save_laser_file(tmp_path / "g.laser", eng, LaserArtifact())
    trunc = tmp_path / "t.laser"
    trunc.write_bytes(good.read_bytes()[:40])
    with pytest.raises(CorruptModelError):
        load_laser_file(trunc, eng)


def test_policy_composition():
    pol = make_policy("confidence+saturation", threshold=0.5, saturation_threshold=0.9, combine="any")
    assert "|" in pol.describe()
    assert make_policy("never").describe() == "never"
    assert isinstance(make_policy("never"), Never)


def test_deferred_replay_score_equals_token_by_token_decode(smol):
    eng = smol.engine
    ids = prompt_ids(smol)[:16]
    spec = "adaptive:policy=confidence+ats,threshold=0.7,ats_threshold=0.5,bridge=deferred,patience=2"
    dec = make_mode(spec + ",score=decode", eng).score(eng, ids)
    rep = make_mode(spec, eng).score(eng, ids)  # replay is the default for the deferred bridge
    assert dec.layers.tolist() == rep.layers.tolist()
    assert (dec.layers < eng.num_layers).any() and (dec.layers == eng.num_layers).sum() > 1  # both kinds occur
    torch.testing.assert_close(dec.logits, rep.logits, atol=2e-4, rtol=1e-4)
