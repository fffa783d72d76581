"""laserlm bench: a tiny real run produces the table, JSON and PNG; statistics and errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

import laserlm.bench.cli as bench_cli
from laserlm.bench.measure import GEN_PROMPT, Samples, mean_std, percentile, summarize
from laserlm.bench.report import plot, quality_metric
from laserlm.cli import main
from laserlm.errors import InvalidArgumentError
from laserlm.mode_table import register_mode
from laserlm.runtime.modes import FullDepth


class _Broken(FullDepth):
    name = "test_bench_broken"

    def prefill(self, engine, request):
        raise RuntimeError("kernel not built for this CPU")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


register_mode("test_bench_broken", lambda engine, **o: _Broken())


def test_tiny_bench_run_writes_table_json_png(smol, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "load_from_args", lambda args: smol)
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "--reps", "2", "--warmup", "0", "-p", "8", "-n", "3", "--json", str(js),
                 "--plot", str(png), "--no-progress", "--no-llamacpp"]) == 0
    out = capsys.readouterr().out
    assert "| full |" in out and "| transformers generate (sdpa) |" in out and "pp8 t/s" in out
    doc = json.loads(js.read_text())
    rows = {r["config"]: r for r in doc["rows"]}
    full, hf = rows["full"], rows["transformers generate (sdpa)"]
    raw = doc["raw"]["full"]
    assert len(raw["pp"]) == 2 and len(raw["tg"]) == 2 and len(raw["ttft"]) == 2 and len(raw["itl"]) == 2 * 2
    assert all(v > 0 for v in raw["pp"] + raw["tg"]) and full["tg3"] > 0 and hf["tg3"] > 0
    assert full["itl_p99_ms"] >= full["itl_p50_ms"] > 0
    assert full["layers_per_token"] == smol.engine.num_layers
    e = smol.engine
    a = e.adapter
    per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4  # K and V, float32
    # the generation run's prompt, tokenized independently with the tokenizer's own chat template
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": GEN_PROMPT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
    assert raw["kv_used_bytes"] == per_token * (len(prompt) + 3)
    assert full["kv_alloc_mib"] * 2**20 == pytest.approx(per_token * (len(prompt) + 3))  # the request's own cache
    # transformers' dynamic cache holds the prompt and all generated tokens but the last one
    assert hf["kv_used_mib"] * 2**20 == pytest.approx(per_token * (len(prompt) + 3 - 1))
    assert full["peak_rss_mib"] > 100
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_helpers():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    mean, std = mean_std(xs)  # by hand: mean 3, sample variance (4+1+0+1+4)/4 = 2.5
    assert mean == 3.0 and std == pytest.approx(math.sqrt(2.5), rel=1e-12)
    assert mean_std([7.0]) == (7.0, 0.0) and all(math.isnan(v) for v in mean_std([]))
    assert percentile(xs, 50) == 3.0 and percentile(xs, 99) == 5.0 and percentile(xs, 0) == 1.0
    t = torch.arange(1, 101, dtype=torch.float64).tolist()
    assert percentile(t, 99) == 99.0 and percentile(t, 50) == 50.0


def test_summary_row_from_known_samples():
    """The row of hand-made samples equals values computed by hand (ms, tokens/s, nearest-rank percentiles)."""
    s = Samples(pp=[10.0, 20.0], tg=[1.0, 3.0], ttft=[0.1, 0.3], itl=[0.04, 0.01, 0.03, 0.02], layers=[30.0, 10.0])
    row = summarize("x", s, 8, 3)
    assert row["pp8"] == 15.0 and row["pp8_std"] == pytest.approx(math.sqrt(50.0))  # (25 + 25) / 1
    assert row["tg3"] == 2.0 and row["tg3_std"] == pytest.approx(math.sqrt(2.0))
    assert row["ttft_ms"] == pytest.approx(200.0) and row["tpot_ms"] == pytest.approx(25.0)
    assert row["itl_p50_ms"] == pytest.approx(20.0) and row["itl_p99_ms"] == pytest.approx(40.0)  # ranks 2 and 4 of 4
    assert row["layers_per_token"] == 20.0 and row["reps"] == 2


def test_quality_vs_speed_plot(tmp_path):
    rows = [{"config": c, "tg_tokens_per_s": v, "tg_std": 0.1, "pp_tokens_per_s": 10 * v, "pp_std": 1.0}
            for c, v in (("full", 20.0), ("adaptive:x=1", 30.0))]
    doc = {"results": {"wikitext": {"full": {"perplexity": 20.0}, "adaptive:x=1": {"perplexity": 24.0}}}}
    assert quality_metric(doc)[1] == {"full": 20.0, "adaptive:x=1": 24.0}
    plot(rows, str(tmp_path / "q.png"), "t", 512, 128, quality=doc)
    plot(rows, str(tmp_path / "bars.png"), "t", 512, 128)
    assert (tmp_path / "q.png").stat().st_size > 1000 and (tmp_path / "bars.png").stat().st_size > 1000
    with pytest.raises(InvalidArgumentError, match="not a `laserlm eval --json` document"):
        quality_metric({"rows": []})


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps must be >= 1"),
    (["--tests", "pp,foo"], "unknown test(s) foo"),
    (["--n-gen", "1"], "--n-gen must be >= 2"),
    (["--configs", "full;nosuch:a=1,b=2"], "unknown mode 'nosuch'"),
    (["--quality", "/nonexistent.json"], "cannot read --quality file"),
])
def test_bench_bad_input(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("laserlm: error:") and message in err and "\n" not in err


def test_bench_unrunnable_configuration(smol, monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "load_from_args", lambda args: smol)
    assert main(["bench", "--config", "test_bench_broken", "--reps", "1", "-p", "4", "-n", "2", "--no-hf"]) == 2
    err = capsys.readouterr().err
    assert "configuration 'test_bench_broken' cannot run on this model: RuntimeError: kernel not built" in err
