"""Exit heads, exit gates and the laser file that stores them (the artifact of `laserlm calibrate`).

- :class:`ExitHead`: the base model's final norm + LM head applied at an exit point, optionally after a
  small trainable adapter initialised to the identity (an affine or low-rank "tuned lens", Belrose et al.
  2023; the seed trains such heads on a frozen backbone). Without an adapter it is the untrained "logit
  lens" head.
- :class:`ExitGate`: a tiny classifier predicting "stopping here keeps the full model's token" from the
  normalised hidden state and a few scalars (:func:`gate_scalars_batch`); the seed (004) trains it with focal loss.
- :func:`save_laser_file` / :func:`load_laser_file`: one safetensors file whose metadata holds a JSON config
  (format version, the base model's identity and a weight fingerprint, head/gate layout, thresholds).
  Loading a file made for another model raises :class:`~laserlm.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CorruptModelError, InvalidArgumentError, ModelNotFoundError

FORMAT_VERSION = 1
ADAPTER_KINDS = ("none", "affine", "lowrank")
NUM_GATE_SCALARS = 6  # see gate_scalars_batch
# Gate feature sets: "head" reads the exit head's distribution (one LM-head evaluation per check: on SmolLM2-135M
# that costs about as much as 8 decoder layers); "state" uses only the hidden state, saturation, ATS and depth,
# so a check is one d-vector dot product and the exit head runs only for tokens that exit.
GATE_FEATURES = {"head": 6, "state": 3}


class ExitHead(nn.Module):
    """Exit head = [adapter] + the base model's final norm + LM head (+ Gemma soft cap).

    Args:
        model_adapter: the engine's :class:`~laserlm.models.adapters.ModelAdapter` (norm and LM head are shared
            with the base model and are not part of this module's parameters).
        adapter: ``"none"``, ``"affine"`` (``h -> W h + b``, W = I, b = 0 at init) or ``"lowrank"``
            (``h -> h + U (D h)``, U = 0 at init, rank ``rank``).

    ``forward(hidden [.., d]) -> logits [.., V]`` float32. At initialisation every adapter is the identity,
    so the head equals the base model's head exactly.

    Raises:
        InvalidArgumentError: unknown adapter kind or bad rank.
    """

    def __init__(self, model_adapter, adapter: str = "none", rank: int = 16):
        super().__init__()
        if adapter not in ADAPTER_KINDS:
            raise InvalidArgumentError(f"unknown exit-head adapter '{adapter}'; use one of {', '.join(ADAPTER_KINDS)}")
        object.__setattr__(self, "_base", model_adapter)  # not a submodule: its weights belong to the model
        d = model_adapter.config.hidden_size
        dtype = next(model_adapter.model.parameters()).dtype
        self.kind = adapter
        self.rank = rank
        if adapter == "affine":
            self.proj = nn.Linear(d, d, bias=True, dtype=dtype)
            with torch.no_grad():
                self.proj.weight.copy_(torch.eye(d, dtype=dtype))
                self.proj.bias.zero_()
        elif adapter == "lowrank":
            if not isinstance(rank, int) or not 1 <= rank <= d:
                raise InvalidArgumentError(f"low-rank adapter rank must be in 1-{d}, got {rank!r}")
            self.down = nn.Linear(d, rank, bias=False, dtype=dtype)
            self.up = nn.Linear(rank, d, bias=False, dtype=dtype)
            with torch.no_grad():
                nn.init.normal_(self.down.weight, std=d ** -0.5)
                self.up.weight.zero_()

    def adapt(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the adapter only: ``[.., d] -> [.., d]``."""
        if self.kind == "affine":
            return self.proj(hidden)
        if self.kind == "lowrank":
            return hidden + self.up(self.down(hidden))
        return hidden

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._base.logits(self.adapt(hidden)).float()

    def config_dict(self) -> dict:
        return {"adapter": self.kind, "rank": self.rank}


def confidence_scalars(logits: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` -> ``[N, 3]``: top-1 probability, top-2 margin, entropy / ln V (CALM measures)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top = p.topk(2, dim=-1).values
    ent = -(p * logp).sum(-1) / math.log(logits.shape[-1])
    return torch.stack([top[:, 0], top[:, 0] - top[:, 1], ent], dim=-1)


def gate_scalars_batch(logits: torch.Tensor | None, hidden: torch.Tensor, hidden_in: torch.Tensor,
                       ats: torch.Tensor | None, layer: int, num_layers: int, features: str = "head") -> torch.Tensor:
    """Scalar features of ``N`` tokens at an exit point for exit gates, float32: ``head`` ``[N, 6]``: top-1
    probability, top-2 margin, entropy / ln V, saturation, ATS (0 when absent), layer / L; ``state`` ``[N, 3]``:
    saturation, ATS, layer / L (no exit-head evaluation).

    Args:
        logits: ``[N, V]`` exit-head logits (unused, may be ``None``, for ``state`` features).
        hidden, hidden_in: ``[N, d]`` hidden state leaving / entering the exit point's layer group.
        ats: ``[N]`` attention transition scores (``None``: absent, 0).
        layer: the exit point (layers run); ``num_layers``: L.
        features: ``head`` or ``state`` (see :data:`GATE_FEATURES`).
    """
    n = hidden.shape[0]
    sat = torch.nn.functional.cosine_similarity(hidden_in.float(), hidden.float(), dim=-1)
    a = torch.nan_to_num(ats.float(), nan=0.0) if ats is not None else torch.zeros(n)  # NaN: no previous token
    pos = torch.full((n,), layer / num_layers)
    state = torch.stack([sat, a, pos], dim=-1)
    if features == "state":
        return state
    return torch.cat([confidence_scalars(logits), state], dim=-1)


class ExitGate(nn.Module):
    """Linear exit gate: ``logit = w . [rmsnorm(h), scalars] + b``; ``sigmoid(logit)`` = P(exit keeps the token).

    Args:
        hidden_size: d.
        num_scalars: length of :func:`gate_scalars_batch` for ``features`` (6 for ``head``, 3 for ``state``).
        uses_ats: whether the gate was trained with the ATS feature (the scheduler then measures it).
        features: ``"head"`` (exit-head confidence features; every check evaluates the exit head) or ``"state"``
            (hidden-state features only; cheap checks). See :data:`GATE_FEATURES`.

    ``forward(hidden [N, d], scalars [N, S]) -> logits [N]`` float32 (train with focal loss on these).
    """

    def __init__(self, hidden_size: int, num_scalars: int | None = None, uses_ats: bool = False,
                 features: str = "head"):
        super().__init__()
        if features not in GATE_FEATURES:
            raise InvalidArgumentError(f"unknown gate features '{features}'; use one of {', '.join(GATE_FEATURES)}")
        self.hidden_size = hidden_size
        self.num_scalars = GATE_FEATURES[features] if num_scalars is None else num_scalars
        self.uses_ats = uses_ats
        self.features = features
        self.linear = nn.Linear(hidden_size + self.num_scalars, 1)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.fill_(-4.0)  # starts as "do not exit"

    def forward(self, hidden: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.linear(torch.cat([h, scalars.float()], dim=-1)).squeeze(-1)

    def config_dict(self) -> dict:
        return {"kind": "linear", "num_scalars": self.num_scalars, "uses_ats": self.uses_ats,
                "features": self.features}


@dataclass
class LaserArtifact:
    """What a laser file holds.

    Attributes:
        heads: ``exit layer -> ExitHead``.
        gates: ``exit layer -> ExitGate``.
        thresholds: free-form calibrated settings (e.g. ``{"confidence": 0.93}``, per-layer values).
        config: extra JSON-able settings (groups, policy, min depth, calibration report ...).
        identity: the base model identity the file was made for.
    """

    heads: dict = field(default_factory=dict)
    gates: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    identity: dict = field(default_factory=dict)


def model_identity(engine) -> dict:
    """Identity of the engine's model: the loader's identity fields plus the architecture numbers."""
    cfg = engine.config
    ident = dict(engine.loaded.identity) if getattr(engine, "loaded", None) is not None else {}
    ident.update({"model_type": getattr(cfg, "model_type", None), "num_hidden_layers": cfg.num_hidden_layers,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size})
    return ident


def model_fingerprint(engine, n: int = 32) -> list[float]:
    """``n`` embedding weights at fixed strided indices (float): tells models with equal shapes apart,
    tolerant to dtype rounding."""
    w = engine.adapter.embed_tokens.weight.detach().reshape(-1)
    idx = torch.linspace(0, w.numel() - 1, n, dtype=torch.float64).long()
    return [float(x) for x in w[idx].float()]


def check_identity(config: dict, engine, path: str = "laser file") -> None:
    """Raise InvalidArgumentError when ``config`` (a laser file's) was made for another model."""
    mine = model_identity(engine)
    theirs = config.get("identity", {})
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    diff = [k for k in keys if theirs.get(k) != mine.get(k)]
    fp = config.get("fingerprint")
    if not diff and fp is not None:
        ours = torch.tensor(model_fingerprint(engine, len(fp)))
        if not torch.allclose(ours, torch.tensor(fp, dtype=torch.float32), rtol=2e-2, atol=2e-3):
            diff = ["weights"]
    if diff:
        made = theirs.get("name") or theirs.get("model_type", "?")
        raise InvalidArgumentError(
            f"{path} was made for another model ({made}: " +
            ", ".join(f"{k}={theirs.get(k)!r}" for k in keys) +
            f"); this model is {mine.get('name', mine.get('model_type'))} (" +
            ", ".join(f"{k}={mine.get(k)!r}" for k in keys) + ")" +
            (": the weights differ" if diff == ["weights"] else ""))


def tensors_digest(tensors: dict) -> str:
    """sha256 over a laser file's tensors (names, dtypes, shapes and bytes, in name order): detects damaged data."""
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_laser_file(path, engine, artifact: LaserArtifact) -> Path:
    """Write ``artifact`` for ``engine``'s model to ``path`` (one safetensors file, JSON config in metadata)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    tensors = {}
    for layer, head in artifact.heads.items():
        for k, v in head.state_dict().items():
            tensors[f"heads.{int(layer)}.{k}"] = v.detach().contiguous().cpu()
    for layer, gate in artifact.gates.items():
        for k, v in gate.state_dict().items():
            tensors[f"gates.{int(layer)}.{k}"] = v.detach().contiguous().cpu()
    config = {
        "format_version": FORMAT_VERSION,
        "identity": model_identity(engine),
        "fingerprint": model_fingerprint(engine),
        "heads": {str(int(k)): h.config_dict() for k, h in artifact.heads.items()},
        "gates": {str(int(k)): g.config_dict() for k, g in artifact.gates.items()},
        "thresholds": artifact.thresholds,
        "config": artifact.config,
        "tensors_sha256": tensors_digest(tensors),
    }
    path = Path(path)
    save_file(tensors, str(path), metadata={"laserlm": json.dumps(config)})
    return path


def load_laser_file(path, engine) -> LaserArtifact:
    """Read a laser file for ``engine``'s model.

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a laser file, truncated, unreadable or a newer format version.
        InvalidArgumentError: the file was made for another model.
    """
    from safetensors import safe_open  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"laser file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several error types for bad files
        raise CorruptModelError(f"cannot read laser file {path}: {exc}") from None
    if "laserlm" not in meta:
        raise CorruptModelError(f"{path} is not a laser file (no laserlm metadata)")
    try:
        config = json.loads(meta["laserlm"])
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path}: bad laserlm metadata: {exc}") from None
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise CorruptModelError(f"{path} has laser file format version {version!r}; this laserlm reads version "
                                f"{FORMAT_VERSION}")
    want = config.get("tensors_sha256")
    if want is not None and tensors_digest(tensors) != want:
        raise CorruptModelError(f"{path}: tensor data is damaged (checksum mismatch); recalibrate or copy it again")
    check_identity(config, engine, str(path))
    art = LaserArtifact(thresholds=config.get("thresholds", {}), config=config.get("config", {}),
                        identity=config.get("identity", {}))
    d = engine.config.hidden_size
    try:
        for key, hc in config.get("heads", {}).items():
            head = ExitHead(engine.adapter, hc.get("adapter", "none"), hc.get("rank", 16))
            head.load_state_dict({k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"heads.{key}.")})
            art.heads[int(key)] = head
        for key, gc in config.get("gates", {}).items():
            gate = ExitGate(d, gc.get("num_scalars"), gc.get("uses_ats", False), gc.get("features", "head"))
            gate.load_state_dict({k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"gates.{key}.")})
            art.gates[int(key)] = gate
    except (RuntimeError, KeyError) as exc:
        raise CorruptModelError(f"{path}: tensors do not match its config: {exc}") from None
    return art
