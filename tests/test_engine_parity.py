"""Engine parity with the unmodified transformers model (issue #2, "What must hold").

The reference is always a *separate* transformers model instance with its own config (the engine
switches its model's attention implementation to laserlm's), run the ordinary transformers way:
``model(ids)`` for the prefill, ``model(token, past_key_values=...)`` with transformers' own cache for
decode steps, and ``model.generate(do_sample=False)`` for greedy text.

Tolerance: ``max |engine - reference| <= 1e-4 * max |reference logit|`` in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from laserlm.runtime import Engine
from laserlm.models.loader import reference_dir

REL_TOL = 1e-4
DECODE_STEPS = 32

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "The three laws of thermodynamics state that",
    "List of prime numbers: 2, 3, 5, 7, 11,",
]
CHAT_MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def assert_close_logits(got: torch.Tensor, ref: torch.Tensor, what: str, rel_tol: float = REL_TOL) -> None:
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    diff = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert diff <= rel_tol * scale, f"{what}: max abs diff {diff:.3g} > {rel_tol} * max|logit| ({scale:.3g})"


@torch.inference_mode()
def check_prefill_and_decode(engine: Engine, ref_model, ids: torch.Tensor, steps: int,
                             rel_tol: float = REL_TOL) -> None:
    """Engine vs reference on a prefill of ``ids [1, T]`` (all positions) and ``steps`` decode steps.

    Both are fed the reference's greedy token at every step.
    """
    engine.reset()
    out = engine.forward(ids, logits="all")
    ref = ref_model(ids, use_cache=True)
    assert_close_logits(out.logits, ref.logits, "prefill", rel_tol)
    assert out.stats.layers_run == [engine.num_layers] * ids.shape[1]
    past = ref.past_key_values
    token = ref.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(steps):
        got = engine.decode_step(token)
        ref = ref_model(token, cache=past, use_cache=True)
        past = ref.past_key_values
        assert_close_logits(got.logits, ref.logits[:, -1:], f"decode step {step}", rel_tol)
        token = ref.logits[:, -1].argmax(-1, keepdim=True)
    assert engine.position == ids.shape[1] + steps


# -- real SmolLM2-135M ---------------------------------------------------------------------------
def test_smollm2_prefill_and_decode_logits(smol, smol_ref):
    tok = smol.tokenizer
    ids = torch.tensor([tok(PROMPTS[2])["input_ids"]])
    check_prefill_and_decode(smol.engine, smol_ref, ids, DECODE_STEPS)
    assert smol_ref.config._attn_implementation == "sdpa"  # the reference stayed unmodified


def _reference_greedy(ref_model, ids: list[int], eos: set[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = ref_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n)
    new = out[0, len(ids):].tolist()
    for i, t in enumerate(new):
        if t in eos:
            return new[:i]
    return new


@pytest.mark.parametrize("prompt", PROMPTS + ["<chat>"])
def test_smollm2_greedy_matches_generate(smol, smol_ref, prompt):
    tok = smol.tokenizer
    n = 64
    if prompt == "<chat>":
        # reference ids built independently of laserlm's encode_prompt: the tokenizer's own chat path
        ref_ids = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
        result = smol.generate(CHAT_MESSAGES[0]["content"], chat=True, max_new_tokens=n)
    else:
        ref_ids = tok(prompt)["input_ids"]
        result = smol.generate(prompt, max_new_tokens=n)
    ref_ids = list(ref_ids)
    assert result.prompt_tokens == len(ref_ids)
    ref_new = _reference_greedy(smol_ref, ref_ids, smol.eos_ids, n)
    assert result.token_ids == ref_new, (
        f"first mismatch at token {next(i for i, (a, b) in enumerate(zip(result.token_ids + [-1], ref_new + [-2])) if a != b)}"
    )
    # same stop condition: EOS iff the reference stopped early
    assert result.finish_reason == ("eos" if len(ref_new) < n else "length")
    assert result.text == tok.decode(ref_new, skip_special_tokens=True)


# -- tiny random configs -------------------------------------------------------------------------
SEQ = 24  # longer than every sliding window below
WINDOW = 8
MAX_SEQ = 64
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)


def _tiny_gemma3(**extra):
    cfg = Gemma3TextConfig(**TINY, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                           **extra)
    return Gemma3ForCausalLM(cfg)


def _tiny_llama():
    return LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=3))


def _tiny_qwen3():
    cfg = Qwen3Config(**TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=2)
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    return Qwen3ForCausalLM(cfg)


def _tiny_mistral():
    return MistralForCausalLM(MistralConfig(**TINY, num_hidden_layers=3, sliding_window=WINDOW))


TINY_MODELS = {
    "gemma3": _tiny_gemma3,
    "gemma3-softcap": lambda: _tiny_gemma3(final_logit_softcapping=2.0),
    "llama": _tiny_llama,
    "qwen3": _tiny_qwen3,
    "mistral": _tiny_mistral,
}


def _engine_and_reference(factory, attn: str = "eager"):
    torch.manual_seed(0)
    model = factory().eval()
    ref = copy.deepcopy(model)  # own config object: the engine's attention switch cannot reach it
    ref.config._attn_implementation = attn
    return Engine(model, max_seq_len=MAX_SEQ), ref


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_random_parity(name):
    engine, ref = _engine_and_reference(TINY_MODELS[name])
    assert ref.config._attn_implementation == "eager" and engine.model.config._attn_implementation == "laserlm"
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    check_prefill_and_decode(engine, ref, ids, 16)


def test_tiny_sliding_window_matters():
    """The sliding mask must change the result here (otherwise the parity test above proves nothing)."""
    engine, ref = _engine_and_reference(_tiny_mistral)
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        windowed = ref(ids).logits
        ref.config.sliding_window = None
        for layer in ref.model.layers:
            layer.self_attn.sliding_window = None
        full = ref(ids).logits
    assert (windowed[:, WINDOW:] - full[:, WINDOW:]).abs().max() > 1e-3
    assert torch.allclose(windowed[:, :WINDOW], full[:, :WINDOW], atol=1e-5)


def test_tiny_gemma3_softcap_active():
    engine, _ = _engine_and_reference(lambda: _tiny_gemma3(final_logit_softcapping=2.0))
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    logits = engine.forward(ids, logits="all", use_cache=False).logits
    assert logits.abs().max() < 2.0


def test_tiny_forward_without_cache_matches_reference():
    """``use_cache=False`` (evaluation path) with a batch of two sequences."""
    engine, ref = _engine_and_reference(_tiny_gemma3)
    ids = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = engine.forward(ids, logits="all", use_cache=False).logits
        want = ref(ids).logits
    assert_close_logits(got, want, "no-cache forward")
    assert engine.position == 0


def test_tiny_chunked_prefill_matches_reference():
    """Prefill in two chunks (the second chunk attends to cached positions through the window)."""
    engine, ref = _engine_and_reference(_tiny_gemma3)
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        engine.reset()
        a = engine.forward(ids[:, :10], logits="all").logits
        b = engine.forward(ids[:, 10:], logits="all").logits
        want = ref(ids).logits
    assert_close_logits(torch.cat([a, b], dim=1), want, "chunked prefill")


# -- fast Llama-family layers (laserlm.runtime.fast_layers) are bit-identical to the modules -------
def _tiny_qwen2():
    cfg = Qwen2Config(**TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=2)
    return Qwen2ForCausalLM(cfg)


@torch.inference_mode()
def _logits_trace(engine: Engine, ids: torch.Tensor, steps: int) -> torch.Tensor:
    engine.reset()
    outs = [engine.forward(ids, logits="all").logits]
    token = outs[0][:, -1].argmax(-1)
    for _ in range(steps):
        outs.append(engine.decode_step(token).logits)
        token = outs[-1][:, -1].argmax(-1)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("factory", [_tiny_llama, _tiny_mistral, _tiny_qwen2], ids=["llama", "mistral", "qwen2"])
def test_fast_layers_bit_identical(factory):
    engine, ref = _engine_and_reference(factory)
    assert all(id(layer) in engine._fast_ok for layer in engine.adapter.layers)
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(4))
    fast = _logits_trace(engine, ids, 8)
    engine.fast_layers = False
    slow = _logits_trace(engine, ids, 8)
    assert torch.equal(fast, slow)
    if factory is _tiny_qwen2:  # not covered by test_tiny_random_parity
        engine.fast_layers = True
        check_prefill_and_decode(engine, ref, ids, 8)


def test_fast_layers_respect_hooks_and_other_families():
    engine, _ = _engine_and_reference(_tiny_llama)
    calls = []
    handle = engine.adapter.layers[1].register_forward_hook(lambda mod, args, out: calls.append(1))
    ids = torch.randint(0, TINY["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        engine.forward(ids, use_cache=False)
    handle.remove()
    assert calls == [1]  # the hooked layer ran through its module
    gemma, _ = _engine_and_reference(_tiny_gemma3)
    qwen3, _ = _engine_and_reference(_tiny_qwen3)
    assert not gemma._fast_ok and not qwen3._fast_ok


def test_smollm2_fast_layers_bit_identical(smol):
    engine = smol.engine
    assert len(engine._fast_ok) == engine.num_layers
    ids = torch.tensor([smol.tokenizer(PROMPTS[3])["input_ids"]])
    try:
        fast = _logits_trace(engine, ids, 4)
        engine.fast_layers = False
        slow = _logits_trace(engine, ids, 4)
    finally:
        engine.fast_layers = True
    assert torch.equal(fast, slow)


# -- real Gemma3-270M (slow) ---------------------------------------------------------------------
@pytest.mark.slow
def test_gemma3_270m_parity():
    from transformers import AutoModelForCausalLM

    import laserlm

    lm = laserlm.load("gemma3-270m", dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(reference_dir(lm.loaded), dtype=torch.float32,
                                               attn_implementation="eager").eval()
    assert lm.engine.model is not ref
    tok = lm.tokenizer
    ids = torch.tensor([tok(PROMPTS[2])["input_ids"]])
    check_prefill_and_decode(lm.engine, ref, ids, DECODE_STEPS)
    for prompt in PROMPTS[:3]:
        ref_ids = tok(prompt)["input_ids"]
        result = lm.generate(prompt, max_new_tokens=32)
        assert result.token_ids == _reference_greedy(ref, ref_ids, lm.eos_ids, 32), prompt
