"""``laserlm report seeds`` (laserlm.report.seeds) on a tiny random model: every row of both seed tables and the
scenarios is produced, each with our figure or the reason it has none; the figures are what they claim to be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from laserlm.report.seeds import SEED_000, SEED_004, SEED_SCENARIOS, SeedsConfig, format_markdown, run_seeds
from laserlm.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def tiny_lm_and_laser(smol, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from laserlm.api import LaserLM
    from laserlm.models.loader import LoadedModel
    from laserlm.training.gates import GateTrainConfig
    from laserlm.training.pipeline import CalibrateConfig, calibrate
    from laserlm.training.train import HeadTrainConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=smol.tokenizer.vocab_size + 100,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    identity = {"name": "tiny", "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 32,
                "vocab_size": cfg.vocab_size}
    lm = LaserLM(LoadedModel(model, smol.tokenizer, "tiny", Path("."), torch.float32, identity), max_seq_len=4096)
    out = tmp_path_factory.mktemp("seeds") / "tiny.laser.safetensors"
    calibrate(lm, CalibrateConfig(groups="2", seq_len=32, train_tokens=128, gate_tokens=64, calib_tokens=256,
                                  eval_tokens=64, heads=HeadTrainConfig(steps=3, batch_tokens=32),
                                  gates=GateTrainConfig(steps=3), predictor=False, router_prompts=8,
                                  router_prompt_len=8, router_continuation=2, target_agreement=0.3),
              out, progress=False)
    return lm, out


SMALL = dict(glue_limit=4, long_tokens=2048 + 3 * 512, decode_tokens=4, decode_prompts=2, docs=2, doc_tokens=16,
             kv_budget="4MiB", max_batch=2, bandwidth_mib=64, progress=False)


def test_every_row_is_produced(tiny_lm_and_laser):
    lm, laser = tiny_lm_and_laser
    rows = run_seeds(lm, SeedsConfig(laser=str(laser), **SMALL))
    got = {(r.table, r.row.split(" (")[0] if r.table == "seed 004 §4" else r.row) for r in rows}
    for name in SEED_004:
        assert ("seed 004 §4", name) in got
    for name in SEED_000:
        assert ("seed 000 §2.2", name) in got
    for name in SEED_SCENARIOS:
        assert ("seed 004 scenarios", name) in got
    for r in rows:  # a row without our figure says why; none is silently empty
        assert r.ours is not None or r.note, r
        assert r.definition or r.note
    by = {(r.row, r.metric): r for r in rows}
    # the figures are what they claim: seed values copied, ratios of the right quantities
    assert by[("dynamic compute path (exit gates)", "speed (x)")].seed == 1.8
    assert by[("all combined", "speed (x)")].seed == 3.2
    assert by[("latency per token (ms)", "Laser")].baseline == 58.0
    gates_mem = by[("dynamic compute path (exit gates)", "memory saved")]
    assert gates_mem.ours == 0.0  # the propagate bridge keeps every layer's K/V
    routed = by[("dynamic compute path (router)", "memory saved")]
    layers = routed.compute["layers_per_scored_token"]
    assert routed.ours == pytest.approx(1 - layers / 8)
    pool = by[("memory-pool pre-allocation", "memory saved")]
    assert pool.ours == pytest.approx(1 - pool.compute["kv_mib_staged"] / pool.compute["kv_mib_request"], rel=0.01)
    assert 0 < pool.compute["kv_mib_request"] < pool.compute["kv_mib_full"]  # own caches: only what runs
    p99 = by[("P99 latency, memory strategies (ms)", "after")]
    assert p99.ours > 0 and p99.ours_baseline > 0 and "per-request" in p99.definition
    assert 0 <= by[("long-text consistency", "Laser")].ours <= 1
    assert by[("feature decay per 1k tokens past 2,048", "Laser")].ours is not None  # 3 bins past 2048
    talk = by[("dialogue response latency (ms)", "after")]  # over a real HTTP server on 127.0.0.1
    assert "over HTTP" in talk.definition and talk.ours > 0 and talk.ours_baseline == pytest.approx(talk.compute["p50_ms_full"], abs=0.05)
    code = by[("simple code completions: compute", "after")]
    assert 0 < code.ours <= 1
    md = format_markdown(rows, "header")
    assert md.count("| dynamic compute path (exit gates) |") == 3 and "### seed 000 §2.2" in md
    json.dumps([r.to_dict() for r in rows])  # JSON-able


def test_without_a_laser_file_the_rows_say_so(tiny_lm_and_laser):
    lm, _ = tiny_lm_and_laser
    rows = run_seeds(lm, SeedsConfig(laser=None, **{**SMALL, "long_tokens": 600}))
    by = {(r.row, r.metric): r for r in rows}
    for key in (("dynamic compute path (exit gates)", "speed (x)"), ("latency per token (ms)", "Laser"),
                ("long-text consistency", "Laser"), ("simple code completions: compute", "after")):
        assert by[key].ours is None and "no laser file" in by[key].note
    assert by[("memory-pool pre-allocation", "speed (x)")].ours > 0  # needs no laser file
    assert by[("latency per token (ms)", "Laser")].ours_baseline > 0  # full depth is measured


def test_bad_settings_are_refused():
    with pytest.raises(InvalidArgumentError, match="glue task"):
        SeedsConfig(glue_task="cola").validate()
    with pytest.raises(InvalidArgumentError, match="decode tokens"):
        SeedsConfig(decode_tokens=1).validate()
    with pytest.raises(InvalidArgumentError, match="docs must be a positive integer"):
        SeedsConfig(docs=0).validate()


def test_cli_refuses_sparse_flags_before_loading(capsys):
    from laserlm.cli import main

    assert main(["report", "seeds", "--attention", "sparse"]) != 0
    assert "measures dense and block-sparse attention itself" in capsys.readouterr().err
    assert main(["report", "seeds", "--long-tokens", "2"]) != 0
    assert "long tokens must be >= 3" in capsys.readouterr().err
