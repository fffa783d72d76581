"""Long-text metrics of `laserlm eval --tasks longtext`: the decay per 1k tokens and the consistency score
against direct computations (numpy least squares, plain means) on a small document."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laserlm.errors import InvalidArgumentError
from laserlm.evaluation.longtext import document_text, long_text_metrics, slope_per_1k

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_slope_and_consistency_match_numpy():
    g = torch.Generator().manual_seed(0)
    n = 3000
    pos = torch.arange(n)
    agree = (torch.rand(n, generator=g) < torch.linspace(0.95, 0.7, n)).double()
    gap = torch.linspace(0.0, 0.3, n).double() + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    m = long_text_metrics(agree, gap, pos, bin_size=1000, long_from=2048)
    slope = np.polyfit(pos.numpy().astype(float), agree.numpy(), 1)[0]
    assert m["agreement_decay_per_1k"] == pytest.approx(-slope * 1000, rel=1e-9)
    assert m["nll_gap_growth_per_1k"] == pytest.approx(np.polyfit(pos.numpy().astype(float), gap.numpy(), 1)[0] * 1000,
                                                       rel=1e-9)
    assert 0.04 < m["agreement_decay_per_1k"] < 0.13  # the generating rate falls 0.25 over 3k positions: 0.083/1k
    assert m["consistency"] == pytest.approx(float(agree[2048:].mean()))
    assert m["consistency_positions"] == n - 2048
    assert [b["start"] for b in m["bins"]] == [0, 1000, 2000]
    assert m["bins"][1]["agreement"] == pytest.approx(float(agree[1000:2000].mean()))
    short = long_text_metrics(agree[:100], gap[:100])
    assert short["consistency"] is None
    with pytest.raises(InvalidArgumentError):
        slope_per_1k(torch.ones(1), torch.zeros(1))


def test_document_text_skips_the_gutenberg_header():
    assert document_text("header\n*** START OF THE BOOK ***\nChapter I") == "Chapter I"
    assert document_text("no header") == "no header"


@torch.inference_mode()
def test_longtext_task_equals_direct_computation(smol, tmp_path):
    """The eval task on a small document vs a direct forward of full depth and of static pruning."""
    from laserlm.evaluation.tasks import EvalSettings, Evaluator

    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40
    doc = tmp_path / "novel.txt"
    doc.write_text("Gutenberg header\n*** START OF THIS EBOOK ***\n" + text)
    ev = Evaluator(smol, ["static:drop=14/17"], EvalSettings(data=str(doc), long_tokens=400, progress=False))
    res = ev.run("longtext")
    ids = torch.tensor(smol.tokenizer(text)["input_ids"][:400])
    eng = smol.engine

    def forward(kept):
        h, st = eng.begin(ids[:-1].unsqueeze(0), use_cache=False)
        for i in kept:
            h = eng.run_layer(i, h, st)
        lg = eng.head(h)[0].double()
        return lg.argmax(-1), torch.nn.functional.cross_entropy(lg, ids[1:], reduction="none")

    L = eng.num_layers
    top_f, nll_f = forward(range(L))
    top_s, nll_s = forward([i for i in range(L) if i not in (14, 17)])
    agree = (top_s == top_f).double().numpy()
    gap = (nll_s - nll_f).numpy()
    x = np.arange(agree.size, dtype=float)
    r = res["static:drop=14/17"]
    assert r["agreement"] == pytest.approx(agree.mean(), abs=2e-3)
    assert r["agreement_decay_per_1k"] == pytest.approx(-np.polyfit(x, agree, 1)[0] * 1000, abs=0.02)
    assert r["nll_gap_growth_per_1k"] == pytest.approx(np.polyfit(x, gap, 1)[0] * 1000, abs=0.02)
    assert r["nll_gap"] == pytest.approx(gap.mean(), abs=1e-3)
    assert r["agreement"] < 1.0  # pruning changed tokens: the comparison means something
    full = res["full"]
    assert full["agreement"] == 1.0 and full["nll_gap"] == 0.0 and full["agreement_decay_per_1k"] == 0.0
