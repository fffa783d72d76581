"""Random-weight checkpoints with the exact configs of the 1B–8B models users run.

Speed and memory do not depend on the values of the weights, and correctness against transformers can be checked on
random weights of the real architecture, so these stand in for the real checkpoints where no model hub is reachable.

``ARCHITECTURES`` holds each model's ``config.json`` fields as published on the Hugging Face hub (the ones that
change the computation: sizes, head counts, vocabulary, rope settings, biases, norms, sliding windows, tied heads).
:func:`write_checkpoint` writes a Hugging Face directory (``config.json``, sharded safetensors, a tokenizer) one
tensor at a time, so an 8B checkpoint is written in a few hundred MB of RAM.

**Weight scale.** Every tensor is initialised by the model class's own ``_init_weights`` (transformers): linear and
embedding weights ~ N(0, ``initializer_range``² = 0.02²), biases 0, norm weights at their identity value (1, or 0
for Gemma's ``1 + w`` norms). With unit-RMS inputs after each norm, a projection's outputs have standard deviation
0.02·√hidden ≈ 0.9–1.3 for hidden sizes 1152–4096: the activations stay in a realistic range (no overflow in
fp16/bf16, no all-zero blocks for the quantizers), while the logits are near-uniform (random weights say nothing
about exits or agreement).

**Tokenizer.** No real tokenizer of these models is available here. Llama, Qwen and Mistral checkpoints get the
bundled SmolLM2 tokenizer (49,152 tokens, a BPE that llama.cpp's converter knows as ``smollm``); the model keeps its
real vocabulary size (ids above the tokenizer's are never produced by it, and llama.cpp pads them as
``[PAD<i>]``). Gemma checkpoints get the bundled Gemma 3 tokenizer (the same 262,144-token vocabulary).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..errors import InvalidArgumentError

_LLAMA3_ROPE_1B = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}

#: hub id -> config.json fields (Hugging Face hub, the base models' published configs)
ARCHITECTURES: dict[str, dict] = {
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B: llama3 rope scaling, GQA 32:8, tied head, 128k vocabulary
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_1B, rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001, initializer_range=0.02),
    "llama-3.2-3b": dict(  # meta-llama/Llama-3.2-3B: GQA 24:8, head_dim 128, tied head
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_1B, rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001, initializer_range=0.02),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B: llama3 rope (factor 8), GQA 32:8, untied head
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE_1B, factor=8.0), rms_norm_eps=1e-5, hidden_act="silu",
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02),
    "qwen2.5-1.5b": dict(  # Qwen/Qwen2.5-1.5B: q/k/v biases, GQA 12:2 (6:1), tied head, 152k vocabulary
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        use_sliding_window=False, sliding_window=131072, max_window_layers=28, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151643, initializer_range=0.02),
    "qwen3-1.7b": dict(  # Qwen/Qwen3-1.7B-Base: q/k RMSNorm, GQA 16:8, head_dim 128, tied head
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False, use_sliding_window=False, max_window_layers=28, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151643, initializer_range=0.02),
    "gemma-3-1b": dict(  # google/gemma-3-1b-pt: MQA 4:1, head_dim 256, 5 sliding (512) : 1 global, q/k norms
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.02),
    "mistral-7b-v0.1": dict(  # mistralai/Mistral-7B-v0.1: sliding window 4096, GQA 32:8, untied, 32k vocabulary
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096, rms_norm_eps=1e-5,
        hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02),
}


def config(name: str, layers: int | None = None):
    """The transformers config of ``name`` (a key of :data:`ARCHITECTURES`), with ``layers`` decoder layers when
    given (a reduced-depth variant: every other field, sizes and rope included, as published).

    Raises:
        InvalidArgumentError: an unknown name or a non-positive layer count.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    if name not in ARCHITECTURES:
        raise InvalidArgumentError(f"unknown architecture '{name}'; choose one of {', '.join(ARCHITECTURES)}")
    fields = dict(ARCHITECTURES[name])
    if layers is not None:
        if layers < 1:
            raise InvalidArgumentError(f"layers must be >= 1, got {layers}")
        fields["num_hidden_layers"] = layers
    if fields["model_type"] == "gemma3_text":  # the 5:1 local/global pattern, cut to the kept layers
        pattern = fields["sliding_window_pattern"]
        fields["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(fields["num_hidden_layers"])]
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def random_model(name: str, layers: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The transformers model of ``name`` (optionally ``layers`` deep) with random weights at the class's own
    initialisation (see the module docstring), in ``dtype``; held whole in memory (for tests on reduced depths)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(name, layers), dtype=dtype).eval()


def _tensors(cfg, seed: int, dtype: torch.dtype):
    """Yield ``(state-dict name, tensor)`` of a random model of ``cfg``, one module at a time: the model is built on
    the meta device and each leaf module is materialised, initialised by ``_init_weights`` and released."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen_seed = seed
    for mod_name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        if cfg.tie_word_embeddings and module is model.get_output_embeddings():
            continue  # tied: the embedding's tensor is the head
        torch.manual_seed(gen_seed)
        gen_seed += 1
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)
        for p_name, p in module.named_parameters(recurse=False):
            yield (f"{mod_name}.{p_name}" if mod_name else p_name), p.detach().to(dtype).contiguous()
        module.to_empty(device="meta", recurse=False)


def write_checkpoint(name: str, out: str | Path, layers: int | None = None, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 2 << 30, progress: bool = True) -> Path:
    """Write a Hugging Face checkpoint of ``name`` with random weights to ``out`` (created; must not exist).

    Files: ``config.json``, ``generation_config.json``, ``model-0000i-of-0000n.safetensors`` shards of at most
    ``shard_bytes`` with ``model.safetensors.index.json``, and the tokenizer (module docstring). Peak memory is about
    one shard plus the largest tensor in float32.

    Raises:
        InvalidArgumentError: an unknown name, or ``out`` exists.
    """
    from safetensors.torch import save_file  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415
    from transformers import GenerationConfig  # noqa: PLC0415

    out = Path(out)
    cfg = config(name, layers)
    if out.exists():
        raise InvalidArgumentError(f"{out} exists; pass a new directory")
    tmp = out.parent / f"{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg.dtype = dtype
    cfg.save_pretrained(tmp)
    GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
    _tokenizer(cfg).save_pretrained(tmp)
    if cfg.model_type.startswith("gemma"):
        _write_sentencepiece_model(tmp / "tokenizer.model")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    weight_map: dict[str, int] = {}
    total = 0
    names = []

    def flush():
        i = len(names)
        names.append(f"model-{i:05d}.safetensors")
        save_file(shards[-1], tmp / names[-1], metadata={"format": "pt"})
        shards[-1] = {}

    bar = tqdm(desc=f"writing {name}", unit="tensor", disable=not progress)
    for key, t in _tensors(cfg, seed, dtype):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][key] = t
        weight_map[key] = len(names)
        size += nbytes
        total += nbytes
        bar.update(1)
    flush()
    bar.close()
    n = len(names)
    final = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old, new in zip(names, final):
        (tmp / old).rename(tmp / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "laserlm_synthetic.json").write_text(json.dumps(
        {"architecture": name, "layers": cfg.num_hidden_layers, "seed": seed, "dtype": str(dtype),
         "weights": "random, the model class's _init_weights (laserlm.bench.synthetic)"}, indent=2))
    tmp.rename(out)
    return out


def _tokenizer(cfg):
    """The stand-in tokenizer for ``cfg`` (module docstring), from the bundled models' GGUF metadata."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from ..models.loader import resolve  # noqa: PLC0415

    bundled = "gemma3-270m" if cfg.model_type.startswith("gemma") else "smollm2-135m"
    tok = AutoTokenizer.from_pretrained(resolve(bundled, progress=False, float_copy=False))
    if len(tok) > cfg.vocab_size:
        tok = _truncated_bpe(tok, cfg.vocab_size)
    return tok


def _write_sentencepiece_model(path: Path) -> None:
    """``tokenizer.model`` of the bundled Gemma 3 GGUF's vocabulary (pieces, scores and token types as stored; a
    BPE SentencePiece model with byte fallback), for llama.cpp's converter, which reads a Gemma vocabulary from it
    (``_set_vocab_sentencepiece``)."""
    from gguf import GGUFReader  # noqa: PLC0415
    from sentencepiece import sentencepiece_model_pb2 as spm  # noqa: PLC0415

    from ..models.registry import BUNDLED  # noqa: PLC0415

    r = GGUFReader(str(BUNDLED["gemma3-270m"].locate()))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    scores = r.fields["tokenizer.ggml.scores"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()  # llama.cpp's token types are SentencePiece's enum
    m = spm.ModelProto()
    m.trainer_spec.model_type = spm.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(tokens)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    for piece, score, kind in zip(tokens, scores, types):
        m.pieces.add(piece=piece, score=float(score), type=int(kind))
    path.write_bytes(m.SerializeToString())


def _truncated_bpe(tok, vocab_size: int):
    """``tok`` (a byte-level BPE) cut to its first ``vocab_size`` ids: the merges whose parts and result all stay
    below ``vocab_size`` are kept, so it still encodes any text (Mistral's 32,000-token vocabulary)."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise InvalidArgumentError(f"cannot cut a {model.get('type')} tokenizer to {vocab_size} tokens")
    vocab = {t: i for t, i in model["vocab"].items() if i < vocab_size}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model["vocab"], model["merges"] = vocab, merges
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < vocab_size]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token=tok.bos_token, eos_token=tok.eos_token,
                                   unk_token=tok.unk_token, pad_token=tok.pad_token)
    fast.chat_template = tok.chat_template
    return fast


#: llama.cpp pre-tokenizer name a stand-in tokenizer is converted as, by model type (module docstring)
_PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3": "qwen2"}

_CONVERT = """
import runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # a stand-in tokenizer llama.cpp's hash table does not list
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_to_gguf(llama_cpp: str | Path, checkpoint: str | Path, outfile: str | Path, outtype: str = "bf16",
                    quiet: bool = False) -> Path:
    """Convert a :func:`write_checkpoint` directory to GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (from the
    source tree ``llama_cpp``, with its own gguf-py). ``outtype``: the converter's (``bf16``, ``f16``, ``q8_0``...).

    A stand-in tokenizer's pre-tokenizer hash is not in llama.cpp's table when the model type makes transformers
    apply its own split pattern (Qwen's); it is then declared as that family's pre-tokenizer (``qwen2``), which is
    the pattern transformers applied. The weights are converted unchanged.

    Raises:
        subprocess.CalledProcessError: the converter failed (its stderr is in the exception when ``quiet``).
    """
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    model_type = json.loads((Path(checkpoint) / "config.json").read_text())["model_type"]
    cmd = [sys.executable, "-c", _CONVERT, str(Path(llama_cpp).resolve()), _PRE_TOKENIZER.get(model_type, "smollm"),
           str(checkpoint), "--outtype", outtype, "--outfile", str(outfile)]
    subprocess.run(cmd, check=True, capture_output=quiet, text=True)
    return Path(outfile)
