"""The engine on the architectures of the 1B–8B models users run, at their real widths (issue 34).

Each model is a reduced-depth variant (2 decoder layers) of the published config (``laserlm.bench.synthetic``):
the real hidden size, head counts and head size, vocabulary, rope settings (``llama3`` scaling, Gemma 3's local and
global bases), biases, q/k norms, sliding windows and tied / untied head, with random weights.

Reference: a separate, unmodified transformers model holding the same weights, run the ordinary transformers way
(``model(ids)`` then ``model(token, past_key_values=...)``), in float32. Tolerance as in test_engine_parity:
``max |engine - reference| <= 1e-4 * max |reference logit|`` over a prompt and 32 decode steps.

The 7B/8B widths need about 12 GB of RAM and a minute each; they run when ``LASERLM_LARGE_TESTS=1``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from laserlm.bench.synthetic import ARCHITECTURES, config, random_model
from laserlm.runtime import Engine
from test_engine_parity import check_prefill_and_decode

LAYERS = 2
DECODE_STEPS = 32
LARGE = {"llama-3.1-8b", "mistral-7b-v0.1"}


def _params(names):
    for name in names:
        marks = [pytest.mark.skipif(os.environ.get("LASERLM_LARGE_TESTS") != "1",
                                    reason="7B/8B widths: set LASERLM_LARGE_TESTS=1")] if name in LARGE else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params(ARCHITECTURES)))
def test_reduced_depth_logits_match_transformers(name):
    ref = random_model(name, layers=LAYERS, seed=0)
    cfg = ref.config
    engine = Engine(copy.deepcopy(ref), max_seq_len=128)
    # a prompt of 40 ids spread over the whole vocabulary (the last rows of a 128k/152k/262k embedding included)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=g)
    ids[0, -1] = cfg.vocab_size - 1
    check_prefill_and_decode(engine, ref, ids, DECODE_STEPS)


def test_configs_are_the_published_ones():
    """A few fields that decide the computation, checked against the values on the models' hub pages, so an edit
    to ARCHITECTURES cannot quietly test a different model."""
    c = config("llama-3.2-1b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 32, 8)
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["factor"] == 32.0
    assert c.tie_word_embeddings and c.vocab_size == 128256
    c = config("llama-3.1-8b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (4096, 14336, 32)
    assert not c.tie_word_embeddings and c.rope_parameters["factor"] == 8.0
    c = config("qwen2.5-1.5b")
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (12, 2, 151936)
    c = config("gemma-3-1b", layers=12)
    assert c.layer_types.count("full_attention") == 2 and c.layer_types[5] == "full_attention"
    assert (c.head_dim, c.num_key_value_heads, c.sliding_window) == (256, 1, 512)
    c = config("mistral-7b-v0.1")
    assert c.sliding_window == 4096 and c.vocab_size == 32000


def test_streamed_checkpoint_loads_in_transformers(tmp_path):
    """write_checkpoint (one module at a time, bf16 shards) loads back through transformers with the published
    shapes and the initialisation's statistics (std 0.02, unit norms), and its stand-in tokenizer, cut to Mistral's
    32,000 ids, still encodes any text into the model's vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laserlm.bench.synthetic import write_checkpoint

    out = write_checkpoint("mistral-7b-v0.1", tmp_path / "m", layers=1, seed=3, dtype=torch.bfloat16,
                           shard_bytes=200 << 20, progress=False)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    sd = loaded.state_dict()
    assert sd["model.embed_tokens.weight"].shape == (32000, 4096)
    w = sd["model.layers.0.mlp.down_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 1e-3 and abs(w.mean().item()) < 1e-4
    assert torch.all(sd["model.norm.weight"] == 1)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Hello world, this is a test of a cut tokenizer: ünïcödé 😀")["input_ids"]
    assert max(ids) < 32000 and tok.decode(ids).endswith("😀")


# -- the same architectures as GGUF files made by llama.cpp's converter -----------------------------------------------
LLAMACPP = os.environ.get("LASERLM_LLAMACPP")  # a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)


@pytest.mark.skipif(not LLAMACPP, reason="needs a llama.cpp source tree: LASERLM_LLAMACPP=PATH (DESIGN.md)")
@pytest.mark.parametrize("name", list(_params(ARCHITECTURES)))
def test_reduced_depth_gguf_loads_natively(name, tmp_path):
    """A 2-layer checkpoint converted to Q8_0 by llama.cpp's own ``convert_hf_to_gguf.py`` opens with native weights
    (packed from the file, no float copy) and its logits equal transformers' on the same file (transformers
    dequantizes it to float32) within 1e-3 of the largest logit, over a prompt and 8 decode steps."""
    from transformers import AutoModelForCausalLM

    import laserlm
    from laserlm.bench.synthetic import convert_to_gguf, write_checkpoint

    hf = write_checkpoint(name, tmp_path / "hf", layers=LAYERS, progress=False)
    gguf = convert_to_gguf(LLAMACPP, hf, tmp_path / "m-Q8_0.gguf", "q8_0")
    lm = laserlm.load(str(gguf), weights="native")
    assert lm.weights == "native"
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152 if ref.config.vocab_size > 49152 else 32000, (1, 24),
                        generator=torch.Generator().manual_seed(2))
    # packed Q8_0 blocks in laserlm's kernels vs transformers' float GEMM over the dequantized matrix
    check_prefill_and_decode(lm.engine, ref, ids, 8, rel_tol=1e-3)
