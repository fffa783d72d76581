"""The lm-evaluation-harness adapter: generation runs with the configuration's attention kernel, and the
model is reachable by name from lm-eval's command line."""

from __future__ import annotations

import pytest

from laserlm.attention.kernel import configure

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# aggressive block-sparse attention (threshold 0 keeps only the sink and local blocks) that really runs on a
# ~60-token prompt: 8-token blocks, every layer sparse, no minimum block count
SPARSE = "sparse:threshold=0,block_size=8,dense_layers=0,min_blocks=2"
PROMPT = ("The history of the old harbour town begins with a small fishing village on the river, where boats "
          "brought salt, wool and timber from the hills. Over three centuries the village grew into a market "
          "town with a stone bridge, a guild hall and a cathedral. The most important building in the town is")


class FakeInstance:
    def __init__(self, *args):
        self.args = args


def test_generate_until_runs_with_the_configurations_sparse_kernel(smol):
    """A ``full@sparse`` harness generates with its own sparse kernel even when a dense kernel is installed
    on the engine: the text equals generation with that kernel installed by hand (the independent
    reference), the kernel's sparse paths ran, and the engine's kernel is restored afterwards."""
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    eng = smol.engine
    gen = {"until": ["\n\n"], "max_gen_toks": 12}
    n_prompt = len(smol.tokenizer(PROMPT)["input_ids"])
    assert n_prompt >= 4 * 8, "prompt too short for the sparse path"
    try:
        configure(eng, SPARSE)
        want_sparse = smol.generate(PROMPT, max_new_tokens=12, stop=["\n\n"]).text
        configure(eng, "dense")
        want_dense = smol.generate(PROMPT, max_new_tokens=12, stop=["\n\n"]).text
        assert want_sparse != want_dense, "this sparse setting no longer changes the output; pick a harsher one"

        h = LaserLMHarness(smol, mode=f"full@{SPARSE}")
        kernel = h.scorer.kernel
        assert eng.kernel is None  # a dense kernel is installed before generating
        got = h.generate_until([FakeInstance(PROMPT, gen)])[0]
        assert eng.kernel is None  # the engine is left as it was
        sparse_layers = [v for k, v in kernel.totals.items() if v.get("prefill_calls", 0) > 0]
        assert len(sparse_layers) == eng.num_layers  # every layer ran the sparse prefill path
        assert kernel.summary()["density"] < 1.0
        assert got == want_sparse
    finally:
        configure(eng, "dense")
        eng.reset()
