"""The backbone stage (issue 33): LoRA against float64 hand computations, resume equal to an uninterrupted run, the
seed's settings each taking effect, the delta file bound to its base model, and a merged-then-packed adapted model
against the float merged model."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from laserlm.errors import CorruptModelError, InvalidArgumentError
from laserlm.models.delta import merge_delta, read_delta, save_delta
from laserlm.models.weights_hash import compute_weights_sha256
from laserlm.training.backbone import (BackboneConfig, _LayerTaps, default_exit_points, dropout_rates, exit_weights,
                                       evaluate_exits, reference_outputs, tail_kl, teacher_topk, topk_kl,
                                       train_backbone)
from laserlm.training.lora import LoRALinear, apply_lora, lora_factors, merge_factors, unwrap_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(seed=0, layers=4, vocab=64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=layers, max_position_embeddings=128,
                      initializer_range=0.3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def records(n=8, t=16, vocab=64, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


IDENTITY = {"name": "tiny", "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 64}


# -- LoRA ---------------------------------------------------------------------------------------------------------
def test_lora_starts_as_the_original_and_a_step_changes_only_its_layers():
    """B = 0 at start: outputs equal the original; one SGD step moves only the wrapped factors, and the merged
    weight equals W + (alpha / r) B A computed by hand in float64."""
    model, ref = tiny(), tiny()
    ids = records(2, 12)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    mods = apply_lora(model, rank=2, alpha=4.0, targets=("q_proj", "down_proj"), layers=[1])
    assert sorted(mods) == ["layers.1.down_proj", "layers.1.q_proj"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    params = [p for m in mods.values() for p in (m.lora_A, m.lora_B)]
    assert all(p.requires_grad for p in params)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    opt = torch.optim.SGD(params, lr=0.5)
    model(ids).logits.logsumexp(-1).mean().backward()
    opt.step()
    for name, m in mods.items():
        assert m.lora_B.abs().sum() > 0, name  # B moved (A's gradient is zero while B = 0)
    factors = lora_factors(mods)
    unwrap_lora(model)
    for k, v in model.state_dict().items():  # the base weights were never touched
        assert torch.equal(v, base[k]), k
    full = {"layers.1.q_proj": "model.layers.1.self_attn.q_proj.weight",
            "layers.1.down_proj": "model.layers.1.mlp.down_proj.weight"}
    want = {}
    for name in full:
        a, b = factors[f"{name}.lora_A"].double().numpy(), factors[f"{name}.lora_B"].double().numpy()
        w = dict(model.named_parameters())[full[name]].detach().double().numpy()
        want[name] = w + (4.0 / 2) * (b @ a)
    merged = merge_factors(model, factors, 4.0 / 2)
    assert sorted(merged) == sorted(want)
    params = dict(model.named_parameters())
    for name, w in want.items():
        got = params[full[name]].detach().double().numpy()
        assert abs(got - w).max() < 1e-6, name
    for k, v in model.state_dict().items():
        if k not in full.values():
            assert torch.equal(v, base[k]), k


def test_lora_forward_equals_the_merged_weight_in_float64():
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 6).double()
    m = LoRALinear(lin, rank=3, alpha=6.0)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(5, 8, dtype=torch.float64)
    w = lin.weight.detach() + 2.0 * (m.lora_B.detach() @ m.lora_A.detach())
    assert torch.allclose(m(x), x @ w.T + lin.bias.detach(), atol=1e-12)


def test_lora_refuses_bad_settings_and_double_wrapping():
    model = tiny()
    for kw in ({"rank": 0}, {"alpha": -1.0}, {"targets": ("qq_proj",)}, {"layers": [9]}):
        with pytest.raises(InvalidArgumentError):
            apply_lora(model, **kw)
    apply_lora(model, rank=2)
    with pytest.raises(InvalidArgumentError, match="already"):
        apply_lora(model, rank=2)


# -- the loss and the seed's settings ------------------------------------------------------------------------------
def test_topk_kl_against_a_float64_computation():
    torch.manual_seed(0)
    h, w = torch.randn(5, 8), torch.randn(40, 8)
    t_ids = torch.stack([torch.randperm(40)[:4] for _ in range(5)])
    t_lp = torch.log_softmax(torch.randn(5, 4), -1)
    got = topk_kl(h, w, None, None, t_ids, t_lp)
    union = sorted(set(t_ids.flatten().tolist()))
    want = 0.0
    for n in range(5):
        logits = {u: float(h[n].double() @ w[u].double()) for u in union}
        lse = math.log(sum(math.exp(v) for v in logits.values()))
        p = torch.softmax(t_lp[n].double(), -1)
        want += sum(float(p[j]) * (math.log(float(p[j])) - (logits[int(t_ids[n, j])] - lse)) for j in range(4))
    assert abs(float(got) - want / 5) < 1e-5


def test_tail_kl_against_a_float64_computation():
    """The tail bucket: the KL over {top-k, rest} with the student's full-vocabulary softmax. Moving the student's
    mass to a token outside the teacher's top-k raises it (the union KL cannot see that move)."""
    torch.manual_seed(1)
    h, w = torch.randn(5, 8), torch.randn(40, 8)
    t_ids = torch.stack([torch.randperm(40)[:4] for _ in range(5)])
    full = torch.log_softmax(torch.randn(5, 40).double() * 2, -1)
    t_lp = full.gather(1, t_ids)                     # full-vocabulary log-probs of the teacher's top-k: sum p < 1
    got = tail_kl(h, w, None, None, t_ids, t_lp)
    want = 0.0
    for n in range(5):
        lq = torch.log_softmax(h[n].double() @ w.double().T, -1)
        p = t_lp[n].exp()
        q = lq[t_ids[n]].exp()
        want += float((p * (p.log() - q.log())).sum())
        pt, qt = 1 - float(p.sum()), 1 - float(q.sum())
        want += pt * (math.log(pt) - math.log(qt))
    assert abs(float(got) - want / 5) < 1e-5
    outside = [i for i in range(40) if i not in set(t_ids[0].tolist())][0]
    w2 = w.clone()
    w2[outside] = h[0] * 3                           # the student's argmax moves off the teacher's top-k
    assert float(tail_kl(h[:1], w2, None, None, t_ids[:1], t_lp[:1])) > float(tail_kl(h[:1], w, None, None, t_ids[:1], t_lp[:1])) + 1


def test_min_depth_is_a_quarter_of_the_layers():
    assert default_exit_points(30) == [10, 15, 20, 25]   # ceil(30 / 4) = 8: no exit at 5
    assert default_exit_points(18) == [5, 10, 15]        # ceil(18 / 4) = 5
    assert min(default_exit_points(40)) >= 10


class _Skip(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def test_layer_dropout_schedule_and_skipping():
    """LayerSkip's rates rise exponentially from 0 to p_max, and a dropped layer passes its input on unchanged."""
    r = dropout_rates(5, 0.2)
    assert r[0] == 0 and abs(float(r[-1]) - 0.2) < 1e-12 and bool((r[1:] > r[:-1]).all())
    assert abs(float(r[2]) - 0.2 * (2 ** 0.5 - 1)) < 1e-12
    assert torch.allclose(exit_weights([10, 20, 30]), torch.tensor([1 / 6, 2 / 6, 3 / 6]))
    ids = records(2, 10)

    def exit3(model, keep=None):
        taps = _LayerTaps(model.model.layers, [3])
        taps.keep = keep
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
        taps.remove()
        return taps.out[3]

    keep = torch.ones(4, 2, dtype=torch.bool)
    keep[1, 0] = False  # sequence 0 skips layer index 1
    got = exit3(tiny(), keep)
    skipped = tiny()
    skipped.model.layers[1] = _Skip()
    assert torch.allclose(got[0], exit3(skipped)[0], atol=1e-5)  # layer 1 skipped for sequence 0 ...
    assert torch.allclose(got[1], exit3(tiny())[1], atol=1e-5)    # ... and run for sequence 1
    assert not torch.allclose(got[0], exit3(tiny())[0], atol=1e-3)


def _cfg(**kw):
    base = dict(exit_points=[2, 3], rank=2, alpha=4.0, head_lr=1e-2, seq_len=16, batch=4, max_tokens=64 * 6,
                frozen_tokens=64 * 2, warmup_steps=3, ckpt_every=2, top_k=8, layer_dropout=0.2)
    base.update(kw)
    return BackboneConfig(**base)


def _train(tmp_path, cfg, name="w", evaluate=None, model=None):
    model = model or tiny()
    recs = records(8, 16)
    teacher = teacher_topk(model, recs, 8, progress=False)
    run = train_backbone(model, recs, teacher, cfg, tmp_path / name, progress=False, evaluate=evaluate)
    return model, run


def test_resume_gives_the_weights_of_an_uninterrupted_run(tmp_path):
    _, full = _train(tmp_path, _cfg(), "a")
    _, first = _train(tmp_path, _cfg(max_tokens=64 * 3), "b")   # stops after 3 of 6 steps (a checkpoint at 2)
    assert first.steps == 3
    _, rest = _train(tmp_path, _cfg(), "b")                      # resumes with the larger budget
    assert rest.steps == 6 and rest.finished
    for k in full.factors:
        assert torch.equal(full.factors[k], rest.factors[k]), k
    for k in full.adapters:
        assert torch.equal(full.adapters[k], rest.adapters[k]), k
    _, other = _train(tmp_path, _cfg(seed=1), "b")               # another run key starts over
    assert any(not torch.equal(full.factors[k], other.factors[k]) for k in full.factors)


def test_curriculum_freezes_the_backbone_then_trains_it_at_the_lower_rate(tmp_path):
    """Seed 004: adapters alone first (the factors stay at their start), then the backbone at 0.01x."""
    model, run = _train(tmp_path, _cfg(max_tokens=64 * 2, frozen_tokens=64 * 2), "frozen")
    assert all(float(v.abs().sum()) == 0 for k, v in run.factors.items() if k.endswith("lora_B"))
    assert any(not torch.equal(v, torch.eye(32)) for k, v in run.adapters.items() if k.endswith("weight"))
    _, joint = _train(tmp_path, _cfg(max_tokens=64 * 4, frozen_tokens=64 * 2), "joint")
    assert any(float(v.abs().sum()) > 0 for k, v in joint.factors.items() if k.endswith("lora_B"))
    # the LoRA group's learning rate is the ratio times the adapters' (read from the saved optimizer)
    saved = torch.load(tmp_path / "joint" / "backbone.ckpt.pt")
    lrs = [g["lr"] for g in saved["opt"]["param_groups"]]
    assert lrs[1] == pytest.approx(lrs[0] * 0.01)


def test_warmup_scales_the_first_steps(tmp_path, monkeypatch):
    seen = []
    real = torch.optim.AdamW.step

    def spy(self, *a, **kw):
        seen.append([g["lr"] for g in self.param_groups])
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    _train(tmp_path, _cfg(warmup_steps=4, max_tokens=64 * 5), "warm")
    assert [round(s[0], 6) for s in seen] == [0.0025, 0.005, 0.0075, 0.01, 0.01]


def test_cross_layer_normalisation_and_adaptive_clipping_take_effect(tmp_path, monkeypatch):
    """Seed 000 §4.1-4.2: with normalisation every layer's LoRA gradient has the same norm before clipping, and
    the clip stays inside 0.2-1.0."""
    from laserlm.training import train as train_mod

    norms, clips = [], []
    real = train_mod.GradientControl.__call__

    def spy(self):
        out = real(self)
        clips.append(self.clip_value())
        if len(self.groups) > 2:  # the joint control: adapters + layers
            norms.append([float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                                      for p in g if p.grad is not None])))
                          for g in self.groups])
        return out

    monkeypatch.setattr(train_mod.GradientControl, "__call__", spy)
    _train(tmp_path, _cfg(grad_clip=1e6, adaptive_clip=False), "norm")  # no clip: the normalised norms show
    assert norms and all(max(n) - min(n) < 1e-4 * max(n) for n in norms)
    norms.clear()
    _train(tmp_path, _cfg(grad_clip=1e6, adaptive_clip=False, cross_layer_norm=False), "nonorm")
    assert any(max(n) - min(n) > 0.05 * max(n) for n in norms)
    clips.clear()
    _train(tmp_path, _cfg(), "clip")
    assert clips and all(0.2 <= c <= 1.0 for c in clips)


def test_evaluation_measures_against_the_original(tmp_path):
    model = tiny()
    recs = records(4, 16, seed=3)
    orig = reference_outputs(model, recs)
    _, run = _train(tmp_path, _cfg(), "eval", model=model)
    rep = evaluate_exits(model, None, [2, 3], recs, orig)
    assert 0 <= rep["full_agreement"] <= 1 and set(rep["exit_agreement"]) == {2, 3}
    # against a wrong reference, the agreement changes: it is computed against what it is given
    wrong = {"top1": (orig["top1"] + 1) % 64, "nll": orig["nll"]}
    assert evaluate_exits(model, None, [2, 3], recs, wrong)["full_agreement"] < rep["full_agreement"] or \
        rep["full_agreement"] == 0


# -- the delta file ------------------------------------------------------------------------------------------------
def _delta(tmp_path, model, seed=0):
    g = torch.Generator().manual_seed(seed)
    factors = {"layers.1.q_proj.lora_A": torch.randn(2, 32, generator=g),
               "layers.1.q_proj.lora_B": torch.randn(32, 2, generator=g)}
    meta = {"identity": IDENTITY, "weights_sha256": compute_weights_sha256(model), "rank": 2, "alpha": 4.0,
            "targets": ["q_proj"], "exit_points": [2], "report": {}}
    return save_delta(tmp_path / "d.safetensors", factors, {"2.weight": torch.eye(32), "2.bias": torch.zeros(32)},
                      meta), factors


def test_delta_round_trip_merge_and_refusals(tmp_path):
    model = tiny()
    path, factors = _delta(tmp_path, model)
    f, adapters, meta = read_delta(path)
    assert set(f) == set(factors) and set(adapters) == {"2.weight", "2.bias"}
    w0 = model.model.layers[1].self_attn.q_proj.weight.detach().double().clone()
    merge_delta(model, path, IDENTITY)
    a, b = f["layers.1.q_proj.lora_A"].double(), f["layers.1.q_proj.lora_B"].double()
    assert torch.allclose(model.model.layers[1].self_attn.q_proj.weight.double(), w0 + 2.0 * b @ a, atol=1e-5)
    other = tiny(seed=5)  # same shapes, other weights
    with pytest.raises(InvalidArgumentError, match="adapts another model"):
        merge_delta(other, path, IDENTITY)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError):
        read_delta(bad)
    with pytest.raises(InvalidArgumentError, match="not found"):
        read_delta(tmp_path / "missing.safetensors")


# -- on the real model: merged then packed against merged in float -------------------------------------------------
@pytest.fixture(scope="module")
def smol_delta(tmp_path_factory):
    import laserlm

    ref = laserlm.load("smollm2-135m", weights="fp32")
    g = torch.Generator().manual_seed(0)
    factors = {}
    for name, (out, inp) in {"layers.3.q_proj": (576, 576), "layers.3.gate_proj": (1536, 576),
                             "layers.20.down_proj": (576, 1536)}.items():
        factors[f"{name}.lora_A"] = torch.randn(4, inp, generator=g) * inp ** -0.5
        factors[f"{name}.lora_B"] = torch.randn(out, 4, generator=g) * 0.02
    from laserlm.depth.laser_file import model_identity
    from laserlm.models.weights_hash import weights_sha256

    path = tmp_path_factory.mktemp("delta") / "smol.delta.safetensors"
    adapters = {"10.weight": torch.eye(576) + 0.01 * torch.randn(576, 576, generator=g), "10.bias": torch.zeros(576)}
    save_delta(path, factors, adapters, {"identity": model_identity(ref.engine), "weights_sha256": weights_sha256(ref.model),
                                   "rank": 4, "alpha": 8.0, "targets": ["q_proj", "gate_proj", "down_proj"],
                                   "exit_points": [], "report": {}})
    return ref, path


def test_merged_then_packed_matrices_stay_within_the_quantization_bound(smol_delta):
    """native + delta: each adapted matrix is the float64 merge quantized to the original's own format (Q4_1 here):
    every weight within half a quantization step of its block; every other matrix is the file's blocks unchanged."""
    import laserlm

    ref, path = smol_delta
    adapted = laserlm.load("smollm2-135m", weights="native", lora=path)
    plain = laserlm.load("smollm2-135m", weights="native")
    f, _, meta = read_delta(path)
    layers_ref, layers_new, layers_plain = ref.engine.adapter.layers, adapted.engine.adapter.layers, \
        plain.engine.adapter.layers
    w = layers_ref[3].self_attn.q_proj.weight.double() + 2.0 * (f["layers.3.q_proj.lora_B"].double()
                                                                 @ f["layers.3.q_proj.lora_A"].double())
    got = layers_new[3].laserlm_packed.qkv.weight[:576].double()
    blocks = w.view(576, -1, 32)
    lo = blocks.amin(-1)
    step = (blocks.amax(-1) - lo) / 15  # Q4_1: 16 levels between min and max of each block
    err = (got - w).view(576, -1, 32).abs().amax(-1)
    # half a step, plus the float16 rounding of the block's scale (times up to 15 levels) and of its minimum
    assert bool((err <= step / 2 + 15 * step * 2 ** -11 + lo.abs() * 2 ** -11 + 1e-7).all()), \
        float(((err - step / 2) / step).max())
    assert not torch.equal(got, layers_plain[3].laserlm_packed.qkv.weight[:576])
    # k/v rows of layer 3 and all of layer 4 are the file's own blocks
    assert torch.equal(layers_new[3].laserlm_packed.qkv.weight[576:], layers_plain[3].laserlm_packed.qkv.weight[576:])
    assert torch.equal(layers_new[4].laserlm_packed.gate_up.weight, layers_plain[4].laserlm_packed.gate_up.weight)
    assert adapted.loaded.identity["lora"] == meta["tensors_sha256"]
    # the float merged model and the packed one agree on the next token as closely as the base model's two formats
    ids = adapted.tokenizer("The capital of France is Paris, and the capital of Germany is", return_tensors="pt")[
        "input_ids"]
    fl = laserlm.load("smollm2-135m", weights="fp32", lora=path)
    a = adapted.engine.forward(ids, logits="all", use_cache=False).logits[0].argmax(-1)
    b = fl.engine.forward(ids, logits="all", use_cache=False).logits[0].argmax(-1)
    assert float((a == b).float().mean()) >= 0.8


def test_laser_file_of_an_adapted_model_needs_its_delta(smol_delta, tmp_path):
    import laserlm
    from laserlm.depth.heads import ExitHead
    from laserlm.depth.laser_file import LaserArtifact, delta_file_of, load_laser_file, read_metadata, save_laser_file

    _, path = smol_delta
    adapted = laserlm.load("smollm2-135m", weights="fp32", lora=path)
    art = LaserArtifact(heads={10: ExitHead(adapted.engine.adapter)}, gates={}, thresholds={}, config={})
    out = save_laser_file(tmp_path / "a.laser.safetensors", adapted, art)
    meta, _ = read_metadata(out)
    assert delta_file_of(meta, out).resolve() == path.resolve()
    # calibration's exit heads start from the adapters the delta trained with the backbone
    from laserlm.training.pipeline import CalibrateConfig, _new_heads

    heads = _new_heads({"cfg": CalibrateConfig(), "engine": adapted.engine, "exits": [10, 15]})
    f, adapters, _ = read_delta(path)
    assert torch.equal(heads["10"].proj.weight, adapters["10.weight"])
    assert torch.equal(heads["15"].proj.weight, torch.eye(576))  # no adapter for 15 in this delta: identity
    load_laser_file(out, adapted)  # the model it was made on
    plain = laserlm.load("smollm2-135m", weights="fp32")
    with pytest.raises(InvalidArgumentError, match="adapted by the delta"):
        load_laser_file(out, plain)
    # the CLI's --laser finds the delta the file names; --lora wins; a moved delta is a clear error
    from argparse import Namespace

    from laserlm.cli_common import lora_from_args

    assert lora_from_args(Namespace(lora=None, laser=str(out))).resolve() == path.resolve()
    assert lora_from_args(Namespace(lora=str(path), laser=None)) == str(path)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / out.name).write_bytes(out.read_bytes())
    with pytest.raises(InvalidArgumentError, match="which is missing"):
        lora_from_args(Namespace(lora=None, laser=str(moved / out.name)))
    with pytest.raises(InvalidArgumentError, match="no such file"):
        lora_from_args(Namespace(lora=str(tmp_path / "nope.safetensors"), laser=None))


def test_calibration_of_an_adapted_model_certifies_against_the_original(tmp_path):
    """A delta strong enough that the adapted model's own full depth disagrees with the original: the certificate is
    about the original's tokens, so even full depth cannot certify 0.99 (against its own tokens it would, trivially),
    and the summary reports how far the adapted model is from the original."""
    import laserlm
    from laserlm.depth.laser_file import model_identity
    from laserlm.models.weights_hash import weights_sha256
    from laserlm.training.gates import GateTrainConfig
    from laserlm.training.pipeline import CalibrateConfig, calibrate
    from laserlm.training.train import HeadTrainConfig

    base = laserlm.load("smollm2-135m", weights="fp32")
    g = torch.Generator().manual_seed(1)
    factors = {}
    for i in (26, 27, 28, 29):
        factors[f"layers.{i}.down_proj.lora_A"] = torch.randn(4, 1536, generator=g) * 1536 ** -0.5
        factors[f"layers.{i}.down_proj.lora_B"] = torch.randn(576, 4, generator=g) * 0.5
    path = save_delta(tmp_path / "strong.safetensors", factors, {}, {
        "identity": model_identity(base.engine), "weights_sha256": weights_sha256(base.model), "rank": 4,
        "alpha": 8.0, "targets": ["down_proj"], "exit_points": [], "report": {}})
    lm = laserlm.load("smollm2-135m", weights="fp32", lora=path)
    cfg = CalibrateConfig(seq_len=32, train_tokens=128, gate_tokens=64, calib_tokens=256, eval_tokens=128,
                          heads=HeadTrainConfig(steps=2, batch_tokens=32), gates=GateTrainConfig(steps=2),
                          predictor=False, router_prompts=0, target_agreement=0.99)
    s = calibrate(lm, cfg, tmp_path / "a.laser.safetensors", progress=False)
    held = s["held_out"]
    assert held["reference"] == "original model (no delta)"
    assert held["adapted_full_depth_agreement"] < 0.9
    assert s["calibration"]["threshold"] is None  # full depth itself misses 0.99 against the original
    assert held["agreement"] == pytest.approx(held["adapted_full_depth_agreement"], abs=1e-4)
    with pytest.raises(InvalidArgumentError, match="deferred"):
        calibrate(lm, CalibrateConfig(seq_len=32, train_tokens=128, gate_tokens=64, calib_tokens=256,
                                      eval_tokens=128, bridge="deferred"), tmp_path / "b.laser.safetensors",
                  progress=False)
