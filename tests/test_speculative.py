"""Self-speculative decoding (issue #6): lossless greedy output, exact sampling distribution, KV rollback.

References are independent of the speculative code path:
- greedy text: ``model.generate(do_sample=False)`` of an unmodified transformers model (``smol_ref`` or
  a deep copy of the tiny model);
- sampling: the full model's exact distribution of tokens 1..4, enumerated over all prefixes of a
  16-token vocabulary with plain batched forwards, compared in a chi-square goodness-of-fit test at
  significance ALPHA = 1e-3 (the p-value is the chi-square survival function, computed with
  ``torch.special.gammaincc``; the same test must *reject* the draft-only distribution, which shows it
  can fail);
- the KV cache: the cache full-depth decoding of the same tokens holds.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import chi2_sf
from laserlm.errors import InvalidArgumentError
from laserlm.runtime import Engine
from laserlm.mode_table import make_mode
from laserlm.runtime.loop import generate_tokens
from laserlm.runtime.sampling import SamplingParams, probabilities
from laserlm.speculative import SpeculativeDecoding

ALPHA = 1e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role",
    "<chat>",
]
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread (and share the 2-core machine better)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_model(layers: int = 4, vocab: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=layers, max_position_embeddings=128,
                      initializer_range=0.3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with the transformers model and its own cache (EOS does not stop it)."""
    out = []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one.
    Returns (p-value, degrees of freedom)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if (obs[exp == 0] > 0).any():
        return 0.0, 0
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return chi2_sf(float(stat), df), df


def test_chi2_pvalue_reference_values():
    # chi-square critical values: df=1 at 3.841 -> p=0.05; df=3 at 11.345 -> p=0.01
    p1 = float(torch.special.gammaincc(torch.tensor(0.5, dtype=torch.float64), torch.tensor(3.841 / 2)))
    p3 = float(torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), torch.tensor(11.345 / 2)))
    assert abs(p1 - 0.05) < 1e-3 and abs(p3 - 0.01) < 1e-4


def full_cache_of(engine: Engine, prompt: torch.Tensor, generated: list[int]) -> list[tuple]:
    """K/V that full-depth decoding holds after generating ``generated`` (the last token not yet fed)."""
    engine.reset()
    engine.prefill(prompt.unsqueeze(0))
    for tok in generated[:-1]:
        engine.decode_step(torch.tensor([tok]))
    n = engine.position
    return [(engine.cache.k[i][:, :, :n].clone(), engine.cache.v[i][:, :, :n].clone())
            for i in range(engine.num_layers)]


def snapshot(cache) -> list[tuple]:
    """The committed K/V of a request's cache (``run.request.cache``)."""
    n = cache.length
    return [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(cache.k, cache.v)]


def assert_cache_equal(got, want):
    assert len(got) == len(want)
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got, want)):
        assert gk.shape == wk.shape, f"layer {i}: cache length {gk.shape[2]} != {wk.shape[2]}"
        for g, w, what in ((gk, wk, "K"), (gv, wv, "V")):
            err = (g - w).abs().max().item()
            assert err <= 1e-5 * max(w.abs().max().item(), 1.0), f"layer {i} {what}: max abs diff {err:.3g}"


# -- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("speculative:k=0", "k (drafted tokens per cycle) must be an integer in [1, 64], got 0"),
    ("speculative:k=four", "must be an integer, got 'four'"),
    ("speculative:draft_layers=0", "draft_layers must be an integer in [1, 3] for this 4-layer model"),
    ("speculative:draft_layers=4", "draft_layers must be an integer in [1, 3]"),
    ("speculative:threshold=1.5", "threshold (draft confidence) must be in [0, 1], got 1.5"),
    ("speculative:threshold=-0.1", "threshold (draft confidence) must be in [0, 1]"),
    ("speculative:reuse=maybe", "reuse must be true/false"),
    ("speculative:depth=3", "unknown speculative option(s) depth; known: draft_layers, k, threshold"),
])
def test_bad_options(spec, message):
    engine = Engine(tiny_model(), max_seq_len=32)
    with pytest.raises(InvalidArgumentError) as err:
        make_mode(spec, engine)
    assert message in str(err.value)


def test_bad_exit_head():
    with pytest.raises(InvalidArgumentError, match="exit_head must be a callable"):
        SpeculativeDecoding(4, draft_layers=2, exit_head="lens.pt")


# -- tiny model: greedy, cache, sampling ---------------------------------------------------------
@pytest.mark.parametrize("draft_layers, k, threshold, reuse", [
    (1, 1, 0.0, True), (2, 3, 0.0, True), (2, 3, 0.0, False), (3, 5, 0.2, True), (1, 4, 0.3, False),
])
def test_tiny_greedy_matches_full(one_thread, draft_layers, k, threshold, reuse):
    model = tiny_model(vocab=64)
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa"
    engine = Engine(model, max_seq_len=64)
    mode = SpeculativeDecoding(4, draft_layers=draft_layers, k=k, threshold=threshold, reuse=reuse)
    prompt = [3, 17, 42, 5]
    n = 40
    run = generate_tokens(engine, mode, torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
    got = [ev.token_id for ev in run]
    assert got == hf_greedy(ref, prompt, n)
    s = run.summary()["speculative"]
    assert s["emitted"] == n - 1 and s["drafted"] > 0 and 0 <= s["accepted"] <= s["drafted"]
    assert run.request.cache.length == len(prompt) + n - 1


@pytest.mark.parametrize("temperature", [1e-38, 1e-300])
def test_underflowing_temperature_in_speculative_sampling_is_greedy(one_thread, temperature):
    """Issue 18 item 3: a temperature that underflows 1/T runs the speculative *sampling* path (draft
    probabilities, acceptance ratio, residual) without NaN and emits the full model's greedy tokens."""
    model = tiny_model(vocab=64)
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa"
    engine = Engine(model, max_seq_len=64)
    mode = SpeculativeDecoding(4, draft_layers=2, k=3, threshold=0.0)
    prompt, n = [3, 17, 42, 5], 30
    params = SamplingParams(max_new_tokens=n, temperature=temperature, seed=0).validate()
    assert not params.greedy
    run = generate_tokens(engine, mode, torch.tensor(prompt), params, n)
    assert [ev.token_id for ev in run] == hf_greedy(ref, prompt, n)
    assert run.request.state.drafted > run.request.state.accepted > 0, "the draft should be both accepted and rejected"


def test_nan_logits_in_speculative_decoding_are_a_clear_error(one_thread):
    """Issue 18 item 6: the speculative loop checks the draft and verify logits like the full-depth loop."""
    from laserlm.errors import NonFiniteLogitsError

    model = tiny_model(vocab=64)
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.fill_(float("nan"))  # full model NaN, 2-layer draft fine
    engine = Engine(model, max_seq_len=64)
    mode = SpeculativeDecoding(4, draft_layers=2, k=3, threshold=0.0)
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_new_tokens=5, temperature=temperature, seed=0)
        with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
            list(generate_tokens(engine, mode, torch.tensor([3, 17, 42, 5]), params, 5))


@pytest.mark.parametrize("temperature, reuse", [(0.0, True), (0.0, False), (1.0, True), (1.0, False)])
def test_kv_cache_after_rejection_equals_full_depth(one_thread, temperature, reuse):
    """After a cycle that rejected a draft, the cache holds exactly what full-depth decoding holds."""
    engine = Engine(tiny_model(vocab=64), max_seq_len=64)
    mode = SpeculativeDecoding(4, draft_layers=2, k=4, reuse=reuse)
    prompt = torch.tensor([3, 17, 42, 5])
    params = SamplingParams(max_new_tokens=30, temperature=temperature, seed=1)
    run = generate_tokens(engine, mode, prompt, params, 30)
    tokens, checked = [], 0
    for ev in run:
        tokens.append(ev.token_id)
        if ev.info.get("kind") == "correction" and checked < 3:  # last token of a rejecting cycle
            assert run.request.cache.length == len(prompt) + len(tokens) - 1
            got = snapshot(run.request.cache)
            assert_cache_equal(got, full_cache_of(Engine(engine.model, max_seq_len=64), prompt, tokens))
            checked += 1
    assert checked > 0, "no rejection happened: the test checked nothing"
    assert_cache_equal(snapshot(run.request.cache), full_cache_of(Engine(engine.model, max_seq_len=64), prompt, tokens))


def exact_marginals(engine: Engine, prompt: list[int], params: SamplingParams, depth: int, layers: int):
    """Exact distributions of tokens 1..depth when every token is drawn from the filtered
    distribution of the first ``layers`` layers + LM head (``layers = L``: the full model)."""
    vocab = engine.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)  # over all prefixes of generated tokens, lexicographic
    seqs = torch.tensor([prompt])
    marginals = []
    with torch.inference_mode():
        for _ in range(depth):
            h, st = engine.begin(seqs, use_cache=False)
            h = engine.run_layers(0, layers, h, st)
            p = probabilities(engine.head(h)[:, -1], params).double()  # [prefixes, V]
            joint = (joint[:, None] * p).reshape(-1)
            marginals.append(joint.view(-1, vocab).sum(0))
            seqs = torch.cat([seqs.repeat_interleave(vocab, 0),
                              torch.arange(vocab).repeat(seqs.shape[0])[:, None]], dim=1)
    return marginals


def mixed_marginals(engine, prompt, params, depth, draft_layers):
    """Token 1 from the full model, tokens 2.. from the draft only (speculation that accepts every
    draft): the distribution a broken acceptance rule would produce."""
    vocab = engine.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    seqs = torch.tensor([prompt])
    marginals = []
    with torch.inference_mode():
        for step in range(depth):
            h, st = engine.begin(seqs, use_cache=False)
            h = engine.run_layers(0, engine.num_layers if step == 0 else draft_layers, h, st)
            p = probabilities(engine.head(h)[:, -1], params).double()
            joint = (joint[:, None] * p).reshape(-1)
            marginals.append(joint.view(-1, vocab).sum(0))
            seqs = torch.cat([seqs.repeat_interleave(vocab, 0),
                              torch.arange(vocab).repeat(seqs.shape[0])[:, None]], dim=1)
    return marginals


@pytest.mark.parametrize("sampling, threshold, reuse", [
    (dict(temperature=1.0), 0.0, True),
    (dict(temperature=0.8, top_k=10, top_p=0.9), 0.2, False),
])
def test_sampling_distribution_matches_full_model(one_thread, sampling, threshold, reuse):
    """Tokens 2-4 are drafted (k=3) and accepted/rejected by the speculative rule; their empirical
    distribution must match the full model's exact one (chi-square, ALPHA), and must not match the
    draft-only distribution."""
    engine = Engine(tiny_model(vocab=16), max_seq_len=16)
    prompt, depth, samples = [1, 5, 7], 4, 1200
    mode = SpeculativeDecoding(4, draft_layers=2, k=3, threshold=threshold, reuse=reuse)
    counts = torch.zeros(depth, 16)
    drafted = accepted = 0
    for seed in range(samples):
        params = SamplingParams(max_new_tokens=depth, seed=seed, **sampling)
        run = generate_tokens(engine, mode, torch.tensor(prompt), params, depth)
        for pos, ev in enumerate(run):
            counts[pos, ev.token_id] += 1
        drafted += run.request.state.drafted
        accepted += run.request.state.accepted
    assert 0.2 < accepted / drafted < 0.9, "draft and full model should disagree often and agree often"
    params = SamplingParams(**sampling)
    exact = exact_marginals(engine, prompt, params, depth, engine.num_layers)
    broken = mixed_marginals(engine, prompt, params, depth, 2)
    for pos in range(depth):
        pval, df = chi2_pvalue(counts[pos], exact[pos])
        assert pval > ALPHA, f"token {pos + 1}: chi-square p={pval:.2g} (df={df}) rejects the full model's distribution"
    worst = min(chi2_pvalue(counts[pos], broken[pos])[0] for pos in range(1, depth))
    assert worst < ALPHA, "the test cannot tell the draft's distribution from the full model's"


def test_score_is_full_depth():
    """Teacher-forced scores equal the unmodified transformers model's logits (a deep copy, float32), not
    the 1-layer draft's."""
    model = tiny_model(vocab=64)
    ref_model = copy.deepcopy(model)  # own config object: the engine's attention switch cannot reach it
    engine = Engine(model, max_seq_len=64)
    ids = torch.tensor([3, 17, 42, 5, 9, 11])
    out = make_mode("speculative:draft_layers=1,k=2", engine).score(engine, ids)
    with torch.inference_mode():
        ref = ref_model(ids[None]).logits[0].float()
    assert out.logits.dtype == torch.float32 and out.logits.shape == ref.shape
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)
    assert out.layers.tolist() == [4.0] * 6


# -- real SmolLM2-135M ---------------------------------------------------------------------------
class PerturbedLens(torch.nn.Module):
    """Stand-in for a calibrated exit head: identity-initialised affine adapter + random perturbation,
    then the model's final norm + LM head."""

    def __init__(self, engine, scale: float = 0.05, seed: int = 0):
        super().__init__()
        d = engine.config.hidden_size
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.eye(d) + scale * torch.randn(d, d, generator=g) / d ** 0.5
        self.bias = scale * torch.randn(d, generator=g)
        self.engine = engine

    def forward(self, hidden):
        return self.engine.head(hidden @ self.weight.T + self.bias)


def _prompt_ids(smol, prompt):
    tok = smol.tokenizer
    if prompt == "<chat>":
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        return list(ids)
    return list(tok(prompt)["input_ids"])


_REF_CACHE: dict = {}


def _reference(smol, smol_ref, prompt, n):
    key = (prompt, n)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = hf_greedy(smol_ref, _prompt_ids(smol, prompt), n)
    return _REF_CACHE[key]


def _check_real_greedy(smol, smol_ref, prompt, n, draft_layers, k, threshold=0.0, reuse=True, lens=False):
    engine = smol.engine
    head = PerturbedLens(engine) if lens else None
    mode = SpeculativeDecoding(engine.num_layers, draft_layers=draft_layers, k=k, threshold=threshold,
                               reuse=reuse, exit_head=head)
    ids = _prompt_ids(smol, prompt)
    run = generate_tokens(engine, mode, torch.tensor(ids), SamplingParams(max_new_tokens=n, ignore_eos=True), n)
    got = [ev.token_id for ev in run]
    want = _reference(smol, smol_ref, prompt, n)
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"first mismatch at token {mismatch} ({draft_layers=}, {k=}, {threshold=}, {reuse=}, {lens=})"
    return run


FAST_CASES = [  # (prompt index, draft_layers, k, threshold, reuse, lens): every prompt, several N and K
    (0, 15, 4, 0.0, True, False),
    (1, 8, 2, 0.0, False, False),
    (2, 24, 6, 0.5, True, False),
    (3, 20, 3, 0.0, True, True),
    (4, 27, 5, 0.3, False, True),
]


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: f"p{c[0]}-N{c[1]}-K{c[2]}")
def test_smollm2_greedy_identical_to_full_depth(smol, smol_ref, case):
    i, n_draft, k, thr, reuse, lens = case
    run = _check_real_greedy(smol, smol_ref, PROMPTS[i], 20, n_draft, k, thr, reuse, lens)
    assert run.request.state.drafted > 0


def test_smollm2_cache_after_generation_equals_full_depth(smol):
    engine = smol.engine
    ids = torch.tensor(_prompt_ids(smol, PROMPTS[2]))
    mode = SpeculativeDecoding(engine.num_layers, draft_layers=12, k=4)
    run = generate_tokens(engine, mode, ids, SamplingParams(max_new_tokens=16), 16)
    tokens = [ev.token_id for ev in run]
    assert run.request.state.accepted < run.request.state.drafted  # rejections happened (raw LM head at layer 12)
    got = snapshot(run.request.cache)
    assert_cache_equal(got, full_cache_of(engine, ids, tokens))


def test_generate_json_reports_acceptance(capsys):
    from laserlm.cli import main

    rc = main(["generate", "The capital of France is", "-n", "12", "--mode",
               "speculative:draft_layers=20,k=3,threshold=0.2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    s = out["speculative"]
    assert {"acceptance_rate", "mean_accepted_length", "draft_s", "verify_s", "cycles"} <= set(s)
    assert s["draft_layers"] == 20 and s["k"] == 3 and out["generated_tokens"] <= 12
    assert s["emitted"] + 1 >= out["generated_tokens"]
    assert all("accepted" in e or e.get("kind") == "prefill" for e in out["events"])


def test_cli_bad_option_is_one_line_error(capsys):
    from laserlm.cli import main

    rc = main(["generate", "hi", "-n", "2", "--mode", "speculative:k=0"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["laserlm: error: k (drafted tokens per cycle) must be an integer in [1, 64], got 0"]


@pytest.mark.slow
@pytest.mark.parametrize("draft_layers, k, reuse, lens", [
    (8, 2, True, False), (15, 4, True, False), (24, 6, False, False), (20, 4, True, True),
])
def test_smollm2_greedy_128_tokens_all_prompts(smol, smol_ref, draft_layers, k, reuse, lens):
    for prompt in PROMPTS:
        _check_real_greedy(smol, smol_ref, prompt, 128, draft_layers, k, 0.0, reuse, lens)


# -- auto calibration ------------------------------------------------------------------------------
def test_calibration_simulation_matches_real_greedy_run(one_thread):
    """The cost-model replay on a teacher-forced greedy trace predicts the real run's cycles and
    accepted drafts exactly (greedy speculation sees the full model's own prefix)."""
    from laserlm.speculative import calibration as cal

    engine = Engine(tiny_model(vocab=64), max_seq_len=64)
    prompt, n = [3, 17, 42, 5], 30
    costs = {"layer_s": {t: 1.0 for t in range(1, 10)}, "head_s": 1.0}
    (trace,) = cal.greedy_traces(engine, [prompt], n, [2], None)
    for k, thr in ((3, 0.0), (2, 0.2), (5, 0.15)):
        mode = SpeculativeDecoding(4, draft_layers=2, k=k, threshold=thr)
        run = generate_tokens(engine, mode, torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
        list(run)
        sim = cal.simulate(trace["agree"][0, 1:], trace["conf"][0, 1:], 2, 4, k, thr, costs)
        assert (sim["cycles"], sim["accepted"], sim["emitted"]) == (run.request.state.cycles, run.request.state.accepted,
                                                                    run.request.state.emitted)
        assert 0 < run.request.state.accepted < run.request.state.drafted


def test_auto_options_run_a_calibration(smol, monkeypatch):
    import functools

    from laserlm.speculative import calibration as cal

    monkeypatch.setattr(cal, "calibrate", functools.partial(cal.calibrate, gen_tokens=6, n_text=1))
    mode = make_mode("speculative:auto=1,k=2", smol.engine)
    report = mode.calibration
    assert mode.k == 2 and 1 <= mode.draft_layers < smol.engine.num_layers and 0 <= mode.threshold <= 1
    chosen = report["chosen"]
    assert (chosen["draft_layers"], chosen["threshold"]) == (mode.draft_layers, mode.threshold)
    assert report["searched"] == len(report["top1_agreement_by_depth"]) * len(cal.THRESHOLDS)
    assert report["search"][0]["predicted_speedup"] == max(r["predicted_speedup"] for r in report["search"])
    run = generate_tokens(smol.engine, mode, torch.tensor(_prompt_ids(smol, PROMPTS[0])), SamplingParams(max_new_tokens=4), 4)
    list(run)
    assert run.summary()["speculative"]["calibration"] is report


def test_auto_without_data_is_a_clear_error(smol, monkeypatch, tmp_path):
    from laserlm.speculative import calibration as cal

    monkeypatch.setattr(cal, "DATA_DIR", tmp_path)
    with pytest.raises(InvalidArgumentError, match="auto calibration needs WikiText-2 valid text"):
        make_mode("speculative:draft_layers=auto", smol.engine)


# -- laser=PATH: draft with a calibrated exit head from a laser file (issue #6) ----------------------
LASER_EXIT = 16  # exit layer of the test laser file (smollm2 has 30 layers)


def _laser_head(engine, scale: float, seed: int = 0):
    """ExitHead with an identity-initialised affine adapter, then perturbed by ``scale`` * N(0, 1/d)."""
    from laserlm.depth.heads import ExitHead

    head = ExitHead(engine.adapter, "affine")
    d = engine.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.proj.weight.add_(scale * torch.randn(d, d, generator=g) / d ** 0.5)
        head.proj.bias.add_(scale * torch.randn(d, generator=g))
    return head


def _write_laser(engine, path, heads: dict):
    from laserlm.depth.laser_file import LaserArtifact, save_laser_file

    return save_laser_file(path, engine, LaserArtifact(heads=heads))


@pytest.fixture(scope="module")
def laser_files(smol, tmp_path_factory):
    """``{"perturbed", "identity", "two"}`` -> laser files for smollm2 (heads at LASER_EXIT; "two": 8 and 20)."""
    d = tmp_path_factory.mktemp("laser")
    e = smol.engine
    return {"perturbed": _write_laser(e, d / "perturbed.safetensors", {LASER_EXIT: _laser_head(e, 0.5)}),
            "identity": _write_laser(e, d / "identity.safetensors", {LASER_EXIT: _laser_head(e, 0.0)}),
            "two": _write_laser(e, d / "two.safetensors", {8: _laser_head(e, 0.0), 20: _laser_head(e, 0.0)})}


def _draft_trace(smol, spec, prompt, n=20):
    """(tokens, per-cycle (drafted, accepted), mode) of a greedy speculative run."""
    mode = make_mode(spec, smol.engine)
    run = generate_tokens(smol.engine, mode, torch.tensor(_prompt_ids(smol, prompt)),
                      SamplingParams(max_new_tokens=n, ignore_eos=True), n)
    events = list(run)
    cycles = [(ev.info["drafted"], ev.info["accepted"]) for ev in events if ev.info.get("kind") != "prefill"]
    return [ev.token_id for ev in events], cycles, mode


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]], ids=["p0", "p2"])
def test_laser_draft_greedy_identical_to_full_depth(smol, smol_ref, laser_files, prompt):
    from laserlm.depth.heads import ExitHead

    spec = f"speculative:laser={laser_files['perturbed']},draft_layers={LASER_EXIT},k=2"
    tokens, _, mode = _draft_trace(smol, spec, prompt)
    assert isinstance(mode.exit_head, ExitHead) and mode.draft_layers == LASER_EXIT
    assert mode.config()["exit_head"] == f"laser:perturbed.safetensors@{LASER_EXIT}"
    assert tokens == _reference(smol, smol_ref, prompt, 20)


def test_laser_draft_uses_the_files_head(smol, laser_files):
    """Spy on the file's head: it is called once per drafted token on layer-LASER_EXIT hidden states
    [1, 1, d], and its (perturbed) drafts differ from what the raw LM head would draft from the same states."""
    mode = make_mode(f"speculative:laser={laser_files['perturbed']},k=3,draft_layers={LASER_EXIT}", smol.engine)
    calls = []
    hook = mode.exit_head.register_forward_hook(lambda mod, inp, out: calls.append((inp[0].clone(), out.clone())))
    try:
        run = generate_tokens(smol.engine, mode, torch.tensor(_prompt_ids(smol, PROMPTS[2])),
                          SamplingParams(max_new_tokens=8, ignore_eos=True), 8)
        list(run)
    finally:
        hook.remove()
    assert len(calls) == run.request.state.drafted > 0
    assert all(h.shape == (1, 1, smol.engine.config.hidden_size) for h, _ in calls)
    with torch.inference_mode():
        raw = [int(smol.engine.head(h)[0, -1].argmax()) for h, _ in calls]
    ours = [int(out[0, -1].argmax()) for _, out in calls]
    assert sum(a != b for a, b in zip(ours, raw)) >= len(calls) // 4


def test_laser_default_draft_layers_is_the_exit_closest_to_half_depth(smol, laser_files):
    mode = make_mode(f"speculative:laser={laser_files['two']},k=2", smol.engine)
    assert mode.draft_layers == 20  # |20 - 15| < |8 - 15|
    mode = make_mode(f"speculative:laser={laser_files['two']},draft_layers=8", smol.engine)
    assert mode.draft_layers == 8 and mode.exit_head is not None


def test_laser_missing_exit_layer_lists_the_available_ones(smol, laser_files):
    with pytest.raises(InvalidArgumentError, match=r"no exit head at draft_layers=12; its exit layers are: 8, 20$"):
        make_mode(f"speculative:laser={laser_files['two']},draft_layers=12", smol.engine)
    with pytest.raises(InvalidArgumentError, match="draft_layers=auto is not supported with laser="):
        make_mode(f"speculative:laser={laser_files['two']},draft_layers=auto", smol.engine)
    with pytest.raises(InvalidArgumentError, match=r"draft_layers must be an integer in \[1, 29\]"):
        make_mode(f"speculative:laser={laser_files['two']},draft_layers=30", smol.engine)


def test_laser_missing_file_is_a_clear_error(smol, tmp_path):
    from laserlm.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="laser file not found: .*nope.safetensors"):
        make_mode(f"speculative:laser={tmp_path / 'nope.safetensors'}", smol.engine)


def test_laser_file_for_another_model_is_rejected(smol, laser_files, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(laser_files["identity"]), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads(meta["laserlm"])
    config["identity"].update({"name": "gemma3-270m", "model_type": "gemma3_text", "num_hidden_layers": 18})
    other = tmp_path / "other.safetensors"
    save_file(tensors, str(other), metadata={"laserlm": json.dumps(config)})
    with pytest.raises(InvalidArgumentError, match=r"was made for another model \(gemma3-270m: .*num_hidden_layers=18"):
        make_mode(f"speculative:laser={other},draft_layers={LASER_EXIT}", smol.engine)


def test_generate_laser_option_with_speculative_mode(smol, laser_files, capsys, monkeypatch):
    from laserlm import cli

    monkeypatch.setattr(cli, "load_from_args", lambda args: smol)  # the CLI wiring, without a second model load
    rc = cli.main(["generate", "The capital of France is", "-n", "8", "--json", "--laser", str(laser_files["two"]),
               "--mode", "speculative:draft_layers=8,k=2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == f"speculative:draft_layers=8,k=2,laser={laser_files['two']}"
    assert out["speculative"]["exit_head"] == "laser:two.safetensors@8" and out["speculative"]["drafted"] > 0
