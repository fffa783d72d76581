"""The one laser-file format (laserlm.depth.laser_file): round trip, identity by weight hash, damaged and old files."""

from __future__ import annotations

import json

import pytest
import torch

from laserlm.depth.heads import ExitGate, ExitHead
from laserlm.depth.laser_file import (DEFAULT_BRIDGE, FORMAT_VERSION, LaserArtifact, load_laser_file,
                                      save_laser_file)
from laserlm.depth.router import DynamicRouter, Route
from laserlm.errors import CorruptModelError, InvalidArgumentError, ModelNotFoundError
from laserlm.models.weights_hash import ATTRIBUTE, compute_weights_sha256, forget_weights_sha256, weights_sha256
from laserlm.runtime.engine import Engine


def tiny(seed=0, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _artifact(d=64):
    torch.manual_seed(1)
    head = ExitHead(Engine(tiny(), max_seq_len=16).adapter, "lowrank", rank=4)
    gate = ExitGate(d, features="state")
    router = DynamicRouter(d, [Route((0, 1), 2), Route((0, 1, 3)), Route((0, 1, 2, 3))], confidence=0.8)
    with torch.no_grad():
        for m in (head, gate, router):
            for p in m.parameters():
                p.add_(torch.randn_like(p))
        router.mean.normal_()
    return LaserArtifact(heads={2: head}, gates={2: gate}, router=router, thresholds={"gate_threshold": 0.7},
                         config={"groups": "2", "policy": "gate"})


def _rewrite(src, dst, edit):
    """Copy laser file ``src`` to ``dst`` with its JSON metadata changed by ``edit(meta)`` (tensors kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()["laserlm"]), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta)
    save_file(tensors, str(dst), metadata={"laserlm": json.dumps(meta)})
    return dst


def test_round_trip_keeps_every_part_and_states_the_bridge(tmp_path):
    eng = Engine(tiny(), max_seq_len=16)
    art = _artifact()
    path = save_laser_file(tmp_path / "a.laser", eng, art, json_copy=True)
    back = load_laser_file(path, eng)
    h, s = torch.randn(3, 64), torch.rand(3, 3)
    with torch.no_grad():
        assert torch.equal(back.heads[2](h), art.heads[2](h))
        assert torch.equal(back.gates[2](h, s), art.gates[2](h, s))
        assert torch.equal(back.router(h), art.router(h))
    assert back.router.routes == art.router.routes and back.router.confidence == 0.8
    assert back.router.position == "last" and back.thresholds == {"gate_threshold": 0.7}
    assert back.config["groups"] == "2" and back.bridge == DEFAULT_BRIDGE == "propagate"
    # the file states no patience: the adaptive mode's default; a stated one (what calibrate certified) is kept
    assert back.path == path and back.mode_spec() == f"adaptive:laser={path},bridge=propagate,patience=3"
    back.config["patience"] = 0
    assert back.mode_spec() == f"adaptive:laser={path},bridge=propagate,patience=0"
    for bad in (None, "two", -1):  # a damaged config is a clear error, not a TypeError
        back.config["patience"] = bad
        with pytest.raises(CorruptModelError, match="patience must be a non-negative integer"):
            back.patience  # noqa: B018
    back.config["patience"] = 0
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["weights_sha256"] == weights_sha256(eng.model)
    assert not (tmp_path / "a.laser.tmp").exists()
    # a stated bridge is kept; a file without a router loads with router None
    path2 = save_laser_file(tmp_path / "b.laser", eng, LaserArtifact(config={"bridge": "deferred"}))
    b = load_laser_file(path2, eng)
    assert b.bridge == "deferred" and b.router is None and b.heads == {} and b.gates == {}
    # a file whose metadata lacks the bridge gets the one default
    path3 = _rewrite(path2, tmp_path / "c.laser", lambda m: m["config"].pop("bridge"))
    assert load_laser_file(path3, eng).bridge == DEFAULT_BRIDGE


def test_another_model_with_equal_shapes_is_refused_by_the_weight_hash(tmp_path):
    eng = Engine(tiny(seed=0), max_seq_len=16)
    path = save_laser_file(tmp_path / "a.laser", eng, LaserArtifact(heads={2: ExitHead(eng.adapter)}))
    other = Engine(tiny(seed=1), max_seq_len=16)
    with pytest.raises(InvalidArgumentError, match=r"made for another model.*weights differ.*laserlm calibrate"):
        load_laser_file(path, other)
    with pytest.raises(InvalidArgumentError, match=r"made for another model.*num_hidden_layers=4.*num_hidden_layers=6"):
        load_laser_file(path, Engine(tiny(layers=6), max_seq_len=16))
    # one changed weight changes the hash (after the memo is dropped)
    twin = Engine(tiny(seed=0), max_seq_len=16)
    assert load_laser_file(path, twin).heads
    with torch.no_grad():
        twin.model.model.layers[3].mlp.down_proj.weight[0, 0] += 1.0
    forget_weights_sha256(twin.model)
    with pytest.raises(InvalidArgumentError, match="weights differ"):
        load_laser_file(path, twin)


def test_weight_hash_is_memoised_dtype_tolerant_and_survives_packing(tmp_path):
    import copy

    from laserlm.models.packing import pack_model

    model = tiny()
    digest = weights_sha256(model)
    assert model.__dict__[ATTRIBUTE] == digest and weights_sha256(model) is digest  # memoised on the object
    assert compute_weights_sha256(copy.deepcopy(model).to(torch.bfloat16)) == digest  # bf16 load = fp32 load
    packed = copy.deepcopy(model)
    forget_weights_sha256(packed)
    pack_model(packed, "int8")
    assert weights_sha256(packed) == digest  # recorded before the float matrices were replaced
    assert compute_weights_sha256(packed) != digest  # what a re-hash of the packed model would see
    # a file made on the float model loads on the packed model and the other way round
    path = save_laser_file(tmp_path / "f.laser", Engine(model, max_seq_len=16), LaserArtifact())
    load_laser_file(path, Engine(packed, max_seq_len=16))


def test_damaged_and_foreign_files_are_clear_errors(tmp_path):
    eng = Engine(tiny(), max_seq_len=16)
    with pytest.raises(ModelNotFoundError, match="laser file not found"):
        load_laser_file(tmp_path / "missing.laser", eng)
    with pytest.raises(ModelNotFoundError, match="got a directory"):
        load_laser_file(tmp_path, eng)
    with pytest.raises(ModelNotFoundError, match="laser file not given"):
        load_laser_file("", eng)
    bad = tmp_path / "bad.laser"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(CorruptModelError, match="cannot read laser file"):
        load_laser_file(bad, eng)
    good = save_laser_file(tmp_path / "good.laser", eng, _artifact())
    data = bytearray(good.read_bytes())
    data[-64:-32] = bytes(32)  # tensor bytes changed, header intact
    damaged = tmp_path / "damaged.laser"
    damaged.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match="damaged"):
        load_laser_file(damaged, eng)
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(CorruptModelError, match="not a laser file"):
        load_laser_file(plain, eng)
    newer = _rewrite(good, tmp_path / "newer.laser", lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(CorruptModelError, match=f"format version {FORMAT_VERSION + 1}; this laserlm reads"):
        load_laser_file(newer, eng)
    mismatch = _rewrite(good, tmp_path / "mismatch.laser", lambda m: m["heads"]["2"].update(rank=8))
    with pytest.raises(CorruptModelError, match="tensors do not match its config"):
        load_laser_file(mismatch, eng)
    with pytest.raises(InvalidArgumentError, match="output directory does not exist"):
        save_laser_file(tmp_path / "no" / "x.laser", eng, LaserArtifact())


def test_old_format_files_are_refused_with_the_way_out(tmp_path):
    """Version 1 files (identity by 32 embedding values) are refused, telling to re-run `laserlm calibrate`."""
    eng = Engine(tiny(), max_seq_len=16)
    good = save_laser_file(tmp_path / "good.laser", eng, LaserArtifact())

    def to_v1(meta):
        meta["format_version"] = 1
        meta["fingerprint"] = [0.0] * 32
        meta.pop("weights_sha256")

    old = _rewrite(good, tmp_path / "old.laser", to_v1)
    with pytest.raises(CorruptModelError, match=r"format version 1, from an older laserlm.*re-run `laserlm calibrate`"):
        load_laser_file(old, eng)
