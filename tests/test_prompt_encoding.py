"""Prompt encoding (issue 18 item 5, transformers #37686 / OpenRLHF #393): a rendered chat prompt passed as
plain text already starts with the BOS text; laserlm must feed exactly one BOS, the ids of tokenizing the
template in one step (transformers' ``apply_chat_template(..., tokenize=True)``), in ``generate``,
``stream``, eval prompts and the lm-eval adapter.

SmolLM2's tokenizer adds no BOS, so the fast tests load it with ``add_bos_token=True`` (its BOS is
``<|im_start|>``, which every rendered SmolLM2 chat prompt starts with); the slow test replays the report
on the real Gemma3-270M (BOS ``<bos>``, added by default).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from laserlm.evaluation.scoring import encode_pair
from laserlm.models.loader import reference_dir

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def bos_smol(smol, monkeypatch):
    """The session's SmolLM2 with a tokenizer that adds its BOS (``<|im_start|>``) like Llama/Gemma do."""
    tok = AutoTokenizer.from_pretrained(smol.loaded.path, add_bos_token=True)
    assert tok("hi")["input_ids"][:1] == [tok.bos_token_id]
    monkeypatch.setattr(smol, "tokenizer", tok)
    return smol


def _one_step_ids(tok) -> list[int]:
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_rendered_chat_prompt_gets_one_bos(bos_smol):
    tok = bos_smol.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    want = _one_step_ids(tok)
    assert tok(rendered)["input_ids"][:2] == [tok.bos_token_id] * 2, "the tokenizer no longer doubles the BOS"
    assert want[:2] != [tok.bos_token_id] * 2
    assert bos_smol.stream(rendered, max_new_tokens=4).prompt_ids.tolist() == want
    chat = bos_smol.generate(MESSAGES, max_new_tokens=6)
    assert bos_smol.generate(rendered, max_new_tokens=6).token_ids == chat.token_ids
    ids, start = encode_pair(tok, rendered, "Paris")  # lm-eval moves the trailing "\n" to the continuation
    assert ids[:start] == tok(rendered.rstrip(), add_special_tokens=False)["input_ids"] and ids[1] != ids[0]


def test_encode_text_adds_bos_only_when_missing(bos_smol):
    from laserlm.runtime.generate import encode_text

    tok = bos_smol.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert encode_text(tok, rendered) == _one_step_ids(tok)
    plain = tok("Hello there", add_special_tokens=False)["input_ids"]
    assert encode_text(tok, "Hello there") == [tok.bos_token_id] + plain


def test_rendered_chat_prompt_in_lmeval_generate_until(bos_smol):
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    class Req:
        def __init__(self, *args):
            self.args = args

    tok = bos_smol.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    out = LaserLMHarness(bos_smol).generate_until([Req(rendered, {"until": ["\n"], "max_gen_toks": 6})])[0]
    assert out == bos_smol.generate(MESSAGES, max_new_tokens=6, stop=["\n"]).text


def test_tokenizer_without_bos_is_unchanged(smol):
    from laserlm.runtime.generate import encode_text

    tok = smol.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert encode_text(tok, rendered) == tok(rendered)["input_ids"]
    assert encode_text(tok, "Hello") == tok("Hello")["input_ids"]


@pytest.mark.slow
def test_gemma3_rendered_chat_prompt_one_bos_and_same_output():
    """The report's replay: Gemma3's rendered turn format passed to ``stream`` as plain text."""
    import laserlm

    lm = laserlm.load("gemma3-270m", dtype="float32")
    tok = lm.tokenizer
    rendered = "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    want = tok(rendered, add_special_tokens=False)["input_ids"]  # the template tokenized in one step
    assert want[:2] == [2, 105] and tok(rendered)["input_ids"][:3] == [2, 2, 105]
    g = lm.stream(rendered, max_new_tokens=8)
    assert g.prompt_ids.tolist() == want
    got = g.run().token_ids
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference_dir(lm.loaded), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # an unmodified transformers copy, greedy on the one-BOS ids
        ref = model.generate(torch.tensor([want]), attention_mask=torch.ones(1, len(want), dtype=torch.long),
                                       max_new_tokens=8, do_sample=False)[0, len(want):].tolist()
    assert got == ref[:len(got)] and got
    assert encode_pair(tok, rendered, "Paris")[0][:2] == [2, 105]
