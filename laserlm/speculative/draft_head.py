"""A trained draft head on the frozen model (EAGLE-style) with a reduced-vocabulary LM head.

Sources: EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", §3: the
draft predicts the target's next *feature*, the last hidden state before the final norm, from the current feature
and the embedding of the token sampled after it, with one decoder layer; loss = feature regression (smooth L1) +
0.1 x cross-entropy of the tokens) and FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language
Models via Frequency-Ranked Speculative Sampling": the draft's LM head covers only the ``k`` most frequent tokens).

Shapes (``d`` the target's hidden size, ``k`` the draft vocabulary):

- input at position ``t``: ``f_t [d]`` (the target's last-layer hidden state, pre-norm) and ``e(x_{t+1}) [d]``
  (the target's own input embedding of the token that followed ``t``), each divided by its RMS scale over the
  training data (``feature_scale``, ``embed_scale``: Gemma's features are ~100x Llama's);
- ``fc``: ``[2d] -> [d]``; one pre-norm decoder layer (grouped-query attention with the target's heads and rotary
  base over the draft's own K/V of earlier positions; SwiGLU MLP of ``intermediate_size``) -> ``f^_{t+1} [d]``
  (times ``feature_scale``);
- logits ``[k]`` = the target's final norm, then the target's LM-head rows of the ``k`` draft tokens (frozen, not
  stored in the head file: taken from the model at load), then the target's logit soft cap. A token outside the
  ``k`` is never drafted.

Loss (EAGLE §3.2 with FR-Spec's vocabulary): ``SmoothL1(f^/s, f/s) + 0.1 * CE(q_k(f^), p_k(f))`` where ``p_k`` is
the target's own next-token distribution restricted to the draft vocabulary and renormalised (computed from the true
feature with the same frozen rows, so no logits are stored), ``q_k`` the draft's.

The head file is safetensors with metadata ``"laserlm_draft_head"`` (config, the model identity and weights hash of
:mod:`laserlm.depth.laser_file`, a tensor checksum); :func:`load_draft_head` refuses a file made for other weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CorruptModelError, InvalidArgumentError, ModelNotFoundError
from ..models.files import write_safetensors
from ..runtime.options import is_int

FORMAT = "laserlm-draft-head"
FORMAT_VERSION = 1
CE_WEIGHT = 0.1  # EAGLE §3.2
MAX_PENDING = 256  # true pairs kept for the draft layer's next call (older ones are dropped: a gap in its K/V)


@dataclass
class DraftHeadConfig:
    """Sizes of a draft head (module docstring); ``vocab`` = ``k``."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    vocab: int
    feature_scale: float = 1.0
    embed_scale: float = 1.0

    @classmethod
    def for_engine(cls, engine, vocab: int, intermediate_size: int | None = None) -> "DraftHeadConfig":
        cfg, ad = engine.config, engine.adapter
        rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        if isinstance(rope, dict):  # per layer type (gemma3): the global layers' base
            rope = rope.get("full_attention", next(iter(rope.values()))).get("rope_theta")
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=ad.num_kv_heads,
                   head_dim=ad.head_dim, intermediate_size=intermediate_size or 2 * cfg.hidden_size,
                   rope_theta=float(rope or 10000.0), rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
                   vocab=int(vocab))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_tables(pos: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, hd]`` of positions ``pos [T]`` for the frequencies ``inv [hd/2]``."""
    ang = pos.float()[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split convention) of ``x [B, H, T, hd]``."""
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DraftHead(nn.Module):
    """The draft layer (module docstring). Its trainable parameters are ``fc``, the decoder layer and its norms;
    the target's final norm, LM-head rows and embedding are not parameters of it (see :class:`DraftModel`)."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        d, h, kv, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.cfg = cfg
        self.fc = nn.Linear(2 * d, d)
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.q = nn.Linear(d, h * hd, bias=False)
        self.k = nn.Linear(d, kv * hd, bias=False)
        self.v = nn.Linear(d, kv * hd, bias=False)
        self.o = nn.Linear(h * hd, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)
        self.out_norm = nn.Parameter(torch.ones(d))
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd),
                             persistent=False)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, pos: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``feats, embeds [B, T, d]`` (unscaled), positions ``pos [T]``, ``past`` = the draft's K/V of earlier
        positions ``([B, kv, P, hd], [B, kv, P, hd])`` or ``None`` -> ``(next features [B, T, d], (k, v) of these
        T positions)``. Causal over ``past`` + the ``T`` positions."""
        c = self.cfg
        b, t, _ = feats.shape
        x = self.fc(torch.cat([embeds / c.embed_scale, feats / c.feature_scale], -1))
        a = _rms(x, self.attn_norm, c.rms_eps)
        cos, sin = _rope_tables(pos, self.inv_freq)
        q = _rope(self.q(a).view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = _rope(self.k(a).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = self.v(a).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        kk, vv = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if t == 1:  # one query sees every key: no mask
            att = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
        else:
            p_len = kk.shape[2] - t
            mask = torch.ones(t, p_len + t, dtype=torch.bool).tril(p_len)
            att = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        m = _rms(x, self.mlp_norm, c.rms_eps)
        x = x + self.down(F.silu(self.gate(m)) * self.up(m))
        return _rms(x, self.out_norm, c.rms_eps) * c.feature_scale, (k, v)


class DraftModel:
    """A :class:`DraftHead` bound to a target engine: the target's embedding, final norm and the LM-head rows of the
    draft vocabulary ``vocab_ids [k]`` (a ``[k, d]`` float32 copy, dequantized from packed weights)."""

    def __init__(self, engine, head: DraftHead, vocab_ids: torch.Tensor):
        ad = engine.adapter
        self.engine, self.head = engine, head.eval()
        self.vocab_ids = vocab_ids.long()
        with torch.no_grad():
            w = ad.lm_head.weight
            self.rows = w[self.vocab_ids].float().contiguous()  # [k, d]
        self.norm = ad.norm
        self.softcap = ad.final_logit_softcapping
        self.in_vocab = torch.zeros(engine.config.vocab_size, dtype=torch.bool)
        self.in_vocab[self.vocab_ids] = True
        self.infer, self.infer_rows = self.head, None  # what drafting runs (set by quantize)

    def quantize(self) -> "DraftModel":
        """Draft with Q8_0 copies of the head's matrices and of the vocabulary rows (laserlm's block kernels: a
        quarter of the float32 bytes a drafted token reads); a no-op without the compiled kernels or for matrices
        whose input width is not a multiple of 32. Training keeps the float head. Returns ``self``."""
        import copy  # noqa: PLC0415

        from ..models import kernels  # noqa: PLC0415
        from ..models.quant import QK, Q8_0, QuantLinear, quantize_q8_0  # noqa: PLC0415

        if kernels.ops() is None:
            return self

        def q(lin):
            if lin.in_features % QK:
                return lin
            return QuantLinear(quantize_q8_0(lin.weight.detach().float()), Q8_0, lin.in_features,
                               None if lin.bias is None else lin.bias.detach().float())

        infer = copy.deepcopy(self.head)
        for name in ("fc", "q", "k", "v", "o", "gate", "up", "down"):
            setattr(infer, name, q(getattr(infer, name)))
        self.infer = infer.eval()
        if self.rows.shape[1] % QK == 0:
            self.infer_rows = QuantLinear(quantize_q8_0(self.rows), Q8_0, self.rows.shape[1])
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` -> the target's input embeddings ``[B, T, d]`` float32."""
        return self.engine.adapter.embed(ids).float()

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """``feats [.., d]`` -> draft logits ``[.., k]`` over the draft vocabulary (float32)."""
        x = self.norm(feats).float()
        out = F.linear(x, self.rows) if self.infer_rows is None else self.infer_rows(x)
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


# -- the file --------------------------------------------------------------------------------------------------------
def save_draft_head(path, engine, head: DraftHead, vocab_ids: torch.Tensor, report: dict | None = None) -> Path:
    """Write ``head`` (bfloat16: half the bytes; drafting runs Q8_0 copies anyway) and ``vocab_ids`` for ``engine``'s model to ``path`` (atomically: :func:`~laserlm.models.files.write_safetensors`).

    Raises:
        InvalidArgumentError: the parent directory does not exist.
    """
    from ..depth.laser_file import model_identity, tensors_digest  # noqa: PLC0415
    from ..models.weights_hash import weights_sha256  # noqa: PLC0415

    path = Path(path)
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"output directory does not exist: {path.parent}")
    tensors = {f"head.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int64).contiguous()
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": asdict(head.cfg),
            "identity": model_identity(engine), "weights_sha256": weights_sha256(engine.model),
            "tensors_sha256": tensors_digest(tensors), "report": report or {}}
    return write_safetensors(tensors, path, {"laserlm_draft_head": json.dumps(meta)})


def load_draft_head(path, engine) -> tuple[DraftModel, dict]:
    """``(draft model bound to engine, metadata)`` from a draft head file.

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a draft head file, another format version, damaged tensors or a config that does not
            match its tensors.
        InvalidArgumentError: the file was made for another model (architecture or weights hash).
    """
    from safetensors import safe_open  # noqa: PLC0415

    from ..depth.laser_file import check_identity, tensors_digest  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"draft head file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("laserlm_draft_head")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(raw) if raw else None
    except Exception as exc:  # safetensors raises several error types for bad files
        raise CorruptModelError(f"cannot read draft head file {path}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptModelError(f"{path} is not a laserlm draft head file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CorruptModelError(f"{path} has draft head format version {meta.get('format_version')!r}; this laserlm "
                                f"reads version {FORMAT_VERSION}")
    if tensors_digest(tensors) != meta.get("tensors_sha256"):
        raise CorruptModelError(f"{path}: tensor data is damaged (checksum mismatch)")
    check_identity(meta, engine, f"draft head {path}")
    try:
        cfg = DraftHeadConfig(**meta["config"])
        head = DraftHead(cfg)
        head.load_state_dict({k[5:]: v.float() for k, v in tensors.items() if k.startswith("head.")})
        vocab_ids = tensors["vocab_ids"]
        if (vocab_ids.numel() != cfg.vocab or int(vocab_ids.max()) >= engine.config.vocab_size
                or int(vocab_ids.min()) < 0):
            raise ValueError("vocab_ids do not match the config / the model's vocabulary")
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CorruptModelError(f"{path}: draft head does not match its config: {exc}") from None
    return DraftModel(engine, head, vocab_ids).quantize(), meta


def shipped_heads() -> list[str]:
    """Names of the bundled models laserlm ships a draft head for."""
    from importlib import resources  # noqa: PLC0415

    d = resources.files("laserlm.speculative").joinpath("heads")
    return sorted(p.name[:-len(".safetensors")] for p in d.iterdir() if p.name.endswith(".safetensors")) \
        if d.is_dir() else []


def shipped_head_path(engine) -> Path | None:
    """The draft head shipped with laserlm for a bundled model (``laserlm/speculative/heads/<name>.safetensors``),
    or ``None``."""
    from importlib import resources  # noqa: PLC0415

    name = (getattr(getattr(engine, "loaded", None), "identity", None) or {}).get("name")
    if not name:
        return None
    p = Path(str(resources.files("laserlm.speculative").joinpath("heads", f"{name}.safetensors")))
    return p if p.is_file() else None


# -- per-request drafting ----------------------------------------------------------------------------------------------
class HeadState:
    """A request's draft-head state: the draft's K/V of the positions it has consumed (``[1, kv, P, hd]`` each,
    extended by concatenation) and the *pending* pairs, true target features ``[n, d]`` with the tokens that
    followed them, not yet fed to the draft layer. ``pending is None``: the feature of the last position is unknown
    (after a plain batched step), so the head cannot draft until a cycle of this request's own gives one."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0  # consumed positions (the draft K/V hold positions < length, gaps allowed)
        self.pending_feats: torch.Tensor | None = None  # [n, d]
        self.pending_toks: list[int] = []
        self.pending_pos = 0  # position of the first pending pair

    def add(self, feats: torch.Tensor, toks: list[int], pos: int) -> None:
        """Append true pairs (features ``[n, d]`` at positions ``pos..pos+n-1`` and the tokens after them)."""
        if self.pending_feats is None or self.pending_pos + len(self.pending_toks) != pos:
            self.pending_feats, self.pending_toks, self.pending_pos = feats, list(toks), pos
        else:
            self.pending_feats = torch.cat([self.pending_feats, feats])
            self.pending_toks += list(toks)
        drop = len(self.pending_toks) - MAX_PENDING
        if drop > 0:  # a long prompt or a run of cycles without the head: the draft keeps the recent context only
            self.pending_feats, self.pending_toks = self.pending_feats[drop:], self.pending_toks[drop:]
            self.pending_pos += drop

    def lost(self) -> None:
        self.pending_feats, self.pending_toks = None, []

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k[:, :, :self.length], k], 2), torch.cat([self.v[:, :, :self.length], v], 2)
        self.length = self.k.shape[2]

    def truncate(self, length: int) -> None:
        if self.k is not None and length < self.length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
            self.length = length

    def past(self):
        return None if self.k is None else (self.k, self.v)


@torch.inference_mode()
def draft_chain(dm: DraftModel, st: HeadState, m: int, threshold: float, sample=None):
    """Draft up to ``m`` tokens after the request's last pending pair (its token is the last emitted one).

    The pending pairs run through the draft layer first (one call of ``n`` rows), then one row per drafted token
    with the draft's own predicted feature. The draft K/V of the drafted positions are removed again before
    returning (the next cycle replaces them with true features), so ``st`` keeps only true positions.

    Args:
        threshold: stop when the draft's max probability (over its vocabulary) falls below it (EAGLE-2's
            confidence as the acceptance proxy).
        sample: ``None`` for greedy (argmax), else ``logits_k [k] -> (token id, q [V] full-vocabulary
            probabilities)``.

    Returns:
        ``(drafts, q_probs or None)``.
    """
    n = len(st.pending_toks)
    feats = st.pending_feats.unsqueeze(0)
    toks = torch.tensor([st.pending_toks])
    pos = torch.arange(st.pending_pos, st.pending_pos + n)
    if st.length > st.pending_pos:
        st.truncate(st.pending_pos)
    out, (k, v) = dm.infer(feats, dm.embed(toks), pos, st.past())
    st._append(k, v)
    st.pending_feats, st.pending_toks, st.pending_pos = None, [], st.pending_pos + n
    base = st.length
    f = out[:, -1:]
    drafts, q_probs = [], ([] if sample is not None else None)
    for j in range(m):
        lg = dm.logits(f[0, -1])
        if threshold > 0 and float(torch.softmax(lg, -1).max()) < threshold:
            break
        if sample is None:
            tok = int(dm.vocab_ids[int(lg.argmax())])
        else:
            tok, q = sample(lg)
            q_probs.append(q)
        drafts.append(tok)
        if j + 1 == m:
            break
        f, (k, v) = dm.infer(f, dm.embed(torch.tensor([[tok]])), torch.tensor([base + j]), st.past())
        st._append(k, v)
    st.truncate(base)
    return drafts, q_probs


def param_bytes(head: DraftHead, vocab: int) -> int:
    """Bytes one drafted token would read with the float32 head (parameters + the ``[k, d]`` rows); the Q8_0 copies
    that drafting runs (:meth:`DraftModel.quantize`) read about 34/128 of it."""
    return 4 * (sum(p.numel() for p in head.parameters()) + vocab * head.cfg.hidden_size)


def check_vocab(k) -> int:
    """Raises InvalidArgumentError: the draft vocabulary is not an integer in [16, 2**20]."""
    if not is_int(k) or not 16 <= k <= 1 << 20:
        raise InvalidArgumentError(f"draft vocabulary size must be an integer in [16, {1 << 20}], got {k!r}")
    return k


__all__ = ["CE_WEIGHT", "DraftHead", "DraftHeadConfig", "DraftModel", "HeadState", "check_vocab", "draft_chain",
           "load_draft_head", "param_bytes", "save_draft_head", "shipped_head_path"]
