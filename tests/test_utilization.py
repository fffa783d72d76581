"""Bench utilization: bytes read per decode token against a count from the model config, and the bandwidth
probe's sanity."""

from __future__ import annotations

import pytest
import torch

from laserlm.bench.utilization import bytes_per_token, read_bandwidth, utilization
from laserlm.errors import InvalidArgumentError


def test_bytes_per_token_counts_float_weights_and_kv():
    from transformers import LlamaConfig, LlamaForCausalLM

    from laserlm.runtime.engine import Engine

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)
    eng = Engine(LlamaForCausalLM(cfg).eval(), max_seq_len=64)
    d, ff, kvd = 64, 128, 2 * 16
    per_layer = 4 * (d * d * 2 + 2 * d * kvd + 3 * d * ff + 2 * d)  # q,o + k,v + mlp + 2 norms, fp32
    b = bytes_per_token(eng, layers_per_token=3.0, context=10)
    assert b["weights"] == pytest.approx(3.0 * per_layer + 4 * 128 * d)
    assert b["kv"] == pytest.approx(3.0 * 2 * kvd * 4 * 10)
    assert b["total"] == pytest.approx(b["weights"] + b["kv"])
    assert utilization(1e6, 20.0, 4e7) == pytest.approx(0.5)


def test_read_bandwidth_is_bytes_over_the_best_rep(monkeypatch):
    """With a clock that reports the untimed pass and three reps of 0.5, 0.25 and 0.4 s, 64 MiB read gives
    64 MiB / 0.25 s exactly: the best rep, the whole tensor's bytes, the warm-up pass not timed."""
    import laserlm.bench.utilization as U

    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.4])
    monkeypatch.setattr(U.time, "perf_counter", lambda: next(ticks))
    assert read_bandwidth(mib=64, reps=3) == 64 * 2**20 / 0.25
    with pytest.raises(InvalidArgumentError):
        read_bandwidth(mib=8)
