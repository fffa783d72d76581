"""The onnxruntime engine: the graphs of a ``laserlm export onnx`` directory behind the engine primitives.

:class:`OnnxEngine` implements what the modes call on :class:`~laserlm.runtime.engine.Engine` — ``begin``,
``run_layers``, ``head``, ``propagate``, ``commit``, ``new_cache`` (and, through
:class:`~laserlm.runtime.engine.EngineCalls`, ``forward`` / ``prefill`` / ``decode_step``) — so the one decode
loop (:mod:`laserlm.runtime.loop`), the evaluator's scorer and the adaptive-depth mode
(:class:`laserlm.depth.adaptive.AdaptiveDepth`, built for this engine by :func:`laserlm.depth.ort.make_adaptive_onnx`)
run on onnxruntime exactly as on PyTorch (seed 004 §3.1: the runtime chooses the exits between exported groups).

- The graphs are per layer group, so ``run_layers(a, b)`` must cover whole exported groups (the adaptive mode
  only asks for group spans); the ``propagate`` bridge of the skipped groups runs their ``bridge_<g>`` graphs.
- :class:`OnnxModel` reads ``manifest.json`` and opens one ``onnxruntime.InferenceSession`` per graph on first use;
  every run checks its inputs against the manifest's declared shapes first (batch, past + new tokens <= max_len).
- :class:`OnnxCache` keeps the K/V of a batch of sequences as numpy arrays ``[B, n_kv, P, head_dim]`` per layer.

Not here (refused where a mode is built): attention kernels (the graphs have dense attention), paged KV pools and
continuous batching, the ``deferred`` and ``none`` bridges, the attention transition score, the complexity
predictor, and modes other than ``full`` and ``adaptive`` (``routed`` among them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..errors import ContextLengthError, CorruptModelError, InvalidArgumentError, ModelNotFoundError
from .engine import EngineCalls
from .options import is_int

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1

_NP = {"float32": np.float32, "int64": np.int64}


def read_manifest(path) -> dict:
    """The manifest of the export directory ``path``, checked for its format and graph files.

    Raises:
        ModelNotFoundError: no such directory.
        CorruptModelError: no ``manifest.json``, unreadable JSON, another format version, missing keys or a
            graph file that is missing.
    """
    d = Path(path)
    if d.is_file():
        raise ModelNotFoundError(f"{d} is a file, not an ONNX export directory (the directory `laserlm export onnx "
                                 "--out DIR` writes)")
    if not d.is_dir():
        raise ModelNotFoundError(f"ONNX export directory not found: {d} (the onnxruntime backend runs the directory "
                                 "that `laserlm export onnx --out DIR` writes, given as --model)")
    f = d / MANIFEST
    if not f.is_file():
        if (d / "model.onnx").is_file():
            raise CorruptModelError(f"{d} holds a whole-model graph (`laserlm export onnx --whole-model`: input_ids, "
                                    "attention_mask -> logits), which runs in onnxruntime directly; laserlm's "
                                    "onnxruntime backend runs the per-group export (without --whole-model)")
        raise CorruptModelError(f"{d} has no {MANIFEST}: not a `laserlm export onnx` directory")
    try:
        m = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"{f}: cannot read the manifest: {exc}") from None
    if not isinstance(m, dict) or m.get("format_version") != MANIFEST_VERSION:
        got = m.get("format_version") if isinstance(m, dict) else None
        raise CorruptModelError(f"{f}: manifest format version {got!r}; this laserlm reads version {MANIFEST_VERSION}")
    problem = _manifest_problem(m)
    if problem:
        raise CorruptModelError(f"{f}: {problem}; export again")
    for name, g in m["graphs"].items():
        if not (d / g["file"]).is_file():
            raise CorruptModelError(f"{d}: graph '{name}' ({g['file']}) is missing; export again")
    return m


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with the entries the engine reads (``None``: nothing): their presence and types."""
    for key, typ in (("model", dict), ("shapes", dict), ("groups", list), ("exits", list), ("graphs", dict)):
        if key not in m:
            return f"the manifest has no '{key}' entry"
        if not isinstance(m[key], typ):
            return f"the manifest's '{key}' entry is a {type(m[key]).__name__}, not a {typ.__name__}"
    if not is_int(m.get("min_depth")):
        return "the manifest's 'min_depth' is not an integer"
    for key in ("num_layers", "hidden_size", "vocab_size", "num_kv_heads", "head_dim"):
        if not is_int(m["model"].get(key)):
            return f"the manifest's model entry has no integer '{key}'"
    shapes = m["shapes"]
    if not is_int(shapes.get("max_len")) or not (isinstance(shapes.get("batch"), list) and len(shapes["batch"]) == 2
                                                 and all(map(is_int, shapes["batch"]))):
        return "the manifest's shapes need an integer 'max_len' and a 'batch' range [min, max]"
    if not all(isinstance(g, dict) and is_int(g.get("start")) and is_int(g.get("stop")) for g in m["groups"]):
        return "every manifest group needs integer 'start' and 'stop'"
    if not all(isinstance(e, dict) and is_int(e.get("layer")) for e in m["exits"]):
        return "every manifest exit needs an integer 'layer'"
    if not all(isinstance(g, dict) and isinstance(g.get("file"), str) and is_int(g.get("bytes", 0))
               for g in m["graphs"].values()):
        return "every manifest graph needs a 'file' name"
    return None


class OnnxModel:
    """The graphs of one export directory.

    Args:
        path: the directory written by ``laserlm export onnx``.
        threads: onnxruntime intra-op threads (default: onnxruntime's).

    Attributes: ``manifest``, ``path``, ``num_layers``, ``max_len``, ``max_batch``.

    Raises:
        see :func:`read_manifest`; :class:`~laserlm.errors.CorruptModelError` when onnxruntime cannot load a graph.
    """

    def __init__(self, path, threads: int | None = None):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        mdl = self.manifest["model"]
        self.num_layers = mdl["num_layers"]
        self.max_len = self.manifest["shapes"]["max_len"]
        self.max_batch = self.manifest["shapes"]["batch"][1]
        self.threads = threads
        self._sessions = {}

    def session(self, name: str):
        if name not in self._sessions:
            import onnxruntime as ort  # noqa: PLC0415

            opts = ort.SessionOptions()
            if self.threads:
                opts.intra_op_num_threads = self.threads
                opts.inter_op_num_threads = 1
            g = self.manifest["graphs"].get(name)
            if g is None:
                raise CorruptModelError(f"{self.path}: the manifest has no graph '{name}'")
            try:
                self._sessions[name] = ort.InferenceSession(str(self.path / g["file"]), opts,
                                                            providers=["CPUExecutionProvider"])
            except Exception as exc:  # onnxruntime raises its own exception types for bad files
                raise CorruptModelError(f"{self.path / g['file']}: onnxruntime cannot load it: {exc}") from None
        return self._sessions[name]

    def warm(self) -> OnnxModel:
        """Open every graph's session now (otherwise each opens on first use, inside the first token's time)."""
        for name in self.manifest["graphs"]:
            self.session(name)
        return self

    def check_inputs(self, name: str, feeds: dict) -> None:
        """Check ``feeds`` against graph ``name``'s declared inputs and the manifest's bounds.

        Raises:
            InvalidArgumentError: a missing input, a wrong dtype or rank, a fixed dimension that differs, a batch
                above ``max_batch``.
            ContextLengthError: past + new tokens above ``max_len``.
        """
        g = self.manifest["graphs"][name]
        dims: dict = {}
        for spec in g["inputs"]:
            x = feeds.get(spec["name"])
            if x is None:
                raise InvalidArgumentError(f"graph '{name}': input '{spec['name']}' is missing")
            if x.dtype != _NP[spec["dtype"]] or x.ndim != len(spec["shape"]):
                raise InvalidArgumentError(f"graph '{name}': input '{spec['name']}' must be {spec['dtype']} "
                                           f"{spec['shape']}, got {x.dtype} {list(x.shape)}")
            for want, got in zip(spec["shape"], x.shape):
                if isinstance(want, int) and want != got:
                    raise InvalidArgumentError(f"graph '{name}': input '{spec['name']}' must be {spec['shape']}, "
                                               f"got {list(x.shape)}")
                if isinstance(want, str):
                    if dims.setdefault(want, got) != got:
                        raise InvalidArgumentError(f"graph '{name}': axis '{want}' is {dims[want]} in one input and "
                                                   f"{got} in '{spec['name']}'")
        b = dims.get("batch", 1)
        if not 1 <= b <= self.max_batch:
            raise InvalidArgumentError(f"graph '{name}': batch {b} is outside the exported range 1-{self.max_batch} "
                                       "(re-export with a larger --max-batch)")
        t, p = dims.get("new_tokens", 1), dims.get("past", 0)
        if t < 1 or p + t > self.max_len:
            raise ContextLengthError(f"graph '{name}': past {p} + new tokens {t} exceed the exported max length "
                                     f"{self.max_len} (re-export with a larger --max-len)")
        pos = feeds.get("positions")
        if pos is not None and pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.max_len):
            raise ContextLengthError(f"graph '{name}': positions must lie in 0-{self.max_len - 1}, got "
                                     f"{int(pos.min())}-{int(pos.max())}")

    def run(self, name: str, feeds: dict) -> list:
        """Run graph ``name`` on numpy ``feeds`` (checked first, :meth:`check_inputs`); returns its outputs."""
        self.check_inputs(name, feeds)
        return self.session(name).run(None, feeds)

    def graph_bytes(self) -> int:
        return sum(g["bytes"] for g in self.manifest["graphs"].values())


def is_export_dir(path) -> bool:
    """Whether ``path`` is a directory holding an ONNX export's ``manifest.json``."""
    try:
        return (Path(path) / MANIFEST).is_file()
    except (TypeError, OSError):
        return False


class OnnxCache:
    """K/V of a batch of sequences: ``k[j]``, ``v[j]`` ``[B, n_kv, P, head_dim]`` float32 per layer, the first
    ``length`` positions committed (the cache interface of :class:`~laserlm.runtime.kv_cache.KVCache` that the
    modes use: ``length``, ``batch_size``, ``max_len``, ``crop``, ``reset``)."""

    def __init__(self, model: OnnxModel, batch: int = 1, max_len: int | None = None):
        m = model.manifest["model"]
        empty = np.zeros((batch, m["num_kv_heads"], 0, m["head_dim"]), dtype=np.float32)
        self.k = [empty] * m["num_layers"]
        self.v = [empty] * m["num_layers"]
        self.length = 0
        self.batch_size = batch
        self.max_len = model.max_len if max_len is None else max_len

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Layer ``layer``'s K/V of positions ``start ..``: ``k``, ``v`` ``[B, n_kv, T, head_dim]`` (the positions from
        ``start`` on are replaced)."""
        self.k[layer] = np.concatenate([self.k[layer][:, :, :start], k], axis=2)
        self.v[layer] = np.concatenate([self.v[layer][:, :, :start], v], axis=2)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions.

        Raises:
            ContextLengthError: ``length`` above the cached positions.
        """
        if not 0 <= int(length) <= self.length:
            raise ContextLengthError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = int(length)
        self.k = [x[:, :, :self.length] for x in self.k]
        self.v = [x[:, :, :self.length] for x in self.v]

    def reset(self) -> None:
        self.crop(0)

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V of ``max_len`` positions (what the cache holds when full; its arrays grow as positions
        are written), as :attr:`laserlm.runtime.kv_cache.KVCache.nbytes` counts its preallocated tensors."""
        b, n_kv, _, hd = self.k[0].shape
        return 2 * len(self.k) * b * n_kv * hd * self.max_len * self.k[0].itemsize


@dataclass
class OnnxStep:
    """One forward in progress on an :class:`OnnxEngine` (between ``begin`` and ``commit``).

    Attributes: ``positions`` ``[T]`` torch (absolute), ``feed_positions`` ``[B, T]`` int64 (the graphs' input),
    ``cache`` (the request's, or a scratch one for a stand-alone forward), ``start``, ``use_cache``, ``t0``.
    """

    positions: torch.Tensor
    feed_positions: np.ndarray
    cache: OnnxCache
    start: int
    use_cache: bool
    t0: float
    ctx: object = None  # the attention context of the PyTorch engine: none here (no attention hooks)


def _np(hidden: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(hidden.detach().to(torch.float32).numpy())


class OnnxEngine(EngineCalls):
    """The engine primitives over an :class:`OnnxModel` (see the module docstring).

    Attributes: ``onnx`` (the model), ``num_layers``, ``max_seq_len`` (the export's max length), ``bounds`` (the
    exported layer groups ``[(start, stop)]``), ``exit_adapter`` (exit layer -> adapter graph name), ``config``
    (``vocab_size``, ``hidden_size``), ``weights`` (the manifest's: ``fp32`` or the blocks of a quantized export),
    ``dtype`` (of the activations: float32), ``cache`` (the engine's own), ``shared``, ``kernel`` (always ``None``).
    """

    fast_rows = None
    kernel = None

    def __init__(self, model: OnnxModel):
        self.onnx = model
        man, m = model.manifest, model.manifest["model"]
        self.num_layers = m["num_layers"]
        self.max_seq_len = model.max_len
        self.max_batch = model.max_batch
        self.bounds = [(g["start"], g["stop"]) for g in man["groups"]]
        # exit layer -> adapter graph, for the exits with a trained head (the others use the model's head)
        self.exit_adapter = {e["layer"]: e["adapter"] for e in man["exits"] if e.get("adapter")}
        self.config = SimpleNamespace(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                                      num_hidden_layers=m["num_layers"])
        self.weights = man.get("weights", "fp32")
        self.dtype = torch.float32
        self.shared: dict = {}
        self.cache = self.new_cache()

    def describe(self) -> str:
        """One line: graph weights, layer groups, exit points, laser file, declared shapes."""
        man = self.onnx.manifest
        laser = (man.get("laser") or {}).get("source")
        return (f"onnxruntime, {self.weights} graphs, {self.num_layers} layers in groups {man.get('groups_spec')}, "
                f"exit points {[e['layer'] for e in man['exits']]}" + (f", laser file {laser}" if laser else "")
                + f", max len {self.max_seq_len}, max batch {self.onnx.max_batch}")

    def new_cache(self, max_len: int | None = None, batch_size: int = 1) -> OnnxCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` positions (default: the export's max length).

        Raises:
            ContextLengthError: ``max_len`` above the export's max length.
        """
        max_len = self.max_seq_len if max_len is None else int(max_len)
        if max_len > self.max_seq_len:
            raise ContextLengthError(f"{max_len} positions exceed the exported max length {self.max_seq_len} "
                                     "(re-export with a larger --max-len)")
        return OnnxCache(self.onnx, batch_size, max(1, max_len))

    # -- primitives ------------------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, start: int | None = None, cache: OnnxCache | None = None,
              use_cache: bool = True) -> tuple[torch.Tensor, OnnxStep]:
        """Embed ``input_ids [B, T]`` at positions ``start .. start+T-1`` of ``cache`` (default: its end; the engine's
        own cache by default); ``use_cache=False``: a stand-alone forward from position 0 in a scratch cache.
        Returns ``(hidden [B, T, d] float32, state)``.

        Raises:
            ContextLengthError: the tokens do not fit the cache or the export's max length.
            InvalidArgumentError: empty input, a batch the cache was not made for, a start after the cache's end.
        """
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        b, t = ids.shape
        if t == 0:
            raise InvalidArgumentError("empty input: at least one token is required")
        if use_cache:
            cache = self.cache if cache is None else cache
            if b != cache.batch_size:
                raise InvalidArgumentError(f"batch of {b} sequences but the KV cache holds {cache.batch_size}")
            start = cache.length if start is None else int(start)
            if not 0 <= start <= cache.length:
                raise InvalidArgumentError(f"start {start} is outside the cached positions 0-{cache.length}")
            if start + t < cache.length:  # KVCache keeps the later positions; these arrays are rewritten from start
                raise InvalidArgumentError(f"a forward at {start} of {t} tokens would drop cached positions "
                                           f"{start + t}-{cache.length - 1}: crop the cache first")
            if start + t > cache.max_len:
                raise ContextLengthError(f"{start} cached + {t} new tokens exceed the cache's {cache.max_len} positions")
        else:
            cache, start = OnnxCache(self.onnx, b, t), 0
        pos = np.arange(start, start + t, dtype=np.int64)
        hidden = self.onnx.run("embed", {"input_ids": np.ascontiguousarray(ids.numpy().astype(np.int64))})[0]
        state = OnnxStep(torch.from_numpy(pos), np.ascontiguousarray(np.broadcast_to(pos, (b, t))), cache, start,
                         use_cache, time.perf_counter())
        return torch.from_numpy(hidden), state

    def _groups(self, a: int, b: int) -> list[int]:
        """The exported groups that exactly cover layers ``a .. b-1``.

        Raises:
            InvalidArgumentError: ``a``/``b`` are not group boundaries.
        """
        gs = [g for g, (s, e) in enumerate(self.bounds) if a <= s and e <= b]
        if not gs or self.bounds[gs[0]][0] != a or self.bounds[gs[-1]][1] != b:
            raise InvalidArgumentError(f"layers {a}-{b - 1} are not whole exported layer groups "
                                       f"{self.bounds}: the onnxruntime engine runs whole groups")
        return gs

    def run_layers(self, start: int, stop: int, hidden: torch.Tensor, state: OnnxStep) -> torch.Tensor:
        """Run the exported groups covering layers ``start .. stop-1`` on ``hidden [B, T, d]``; their K/V go to the
        forward's cache."""
        h = _np(hidden)
        for g in self._groups(start, stop):
            a, b = self.bounds[g]
            feeds = {"hidden": h, "positions": state.feed_positions}
            for j in range(a, b):
                feeds[f"past_k_{j}"] = state.cache.k[j][:, :, :state.start]
                feeds[f"past_v_{j}"] = state.cache.v[j][:, :, :state.start]
            out = self.onnx.run(f"group_{g}", feeds)
            for i, j in enumerate(range(a, b)):
                state.cache.write(j, state.start, out[1 + 2 * i], out[2 + 2 * i])
            h = out[0]
        return torch.from_numpy(h)

    def _graph3d(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """Graph ``name`` (``hidden [B, T, d]`` in, one output ``[B, T, *]``) on ``hidden [..., d]`` of any leading
        shape (the exit walk passes ``[m, d]``)."""
        lead = hidden.shape[:-1]
        x = _np(hidden.reshape(1, -1, hidden.shape[-1]) if hidden.dim() != 3 else hidden)
        out = torch.from_numpy(self.onnx.run(name, {"hidden": x})[0])
        return out.reshape(*lead, out.shape[-1])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[..., d] -> [..., vocab]`` float32 logits."""
        return self._graph3d("head", hidden)

    def exit_head(self, layer: int):
        """``fn(hidden [..., d]) -> logits [..., V]``: the exported exit head at ``layer`` (its affine adapter graph,
        then the model's norm + LM head)."""
        adapter = self.exit_adapter[layer]
        return lambda hidden: self.head(self._graph3d(adapter, hidden))

    def propagate(self, state: OnnxStep, layer: int, hidden: torch.Tensor) -> None:
        """The ``propagate`` bridge: the K/V of layers ``layer .. L-1`` projected from the exit state ``hidden``, by
        the exported ``bridge_<g>`` graphs of the groups from ``layer`` on.

        Raises:
            InvalidArgumentError: ``layer`` is not a group boundary, or a group has no bridge graph.
        """
        h = _np(hidden)
        for g in self._groups(layer, self.num_layers):
            if f"bridge_{g}" not in self.onnx.manifest["graphs"]:
                raise InvalidArgumentError(f"group {g} has no exported bridge graph; re-export with these groups")
            a, b = self.bounds[g]
            out = self.onnx.run(f"bridge_{g}", {"hidden": h, "positions": state.feed_positions})
            for i, j in enumerate(range(a, b)):
                state.cache.write(j, state.start, out[2 * i], out[2 * i + 1])

    def commit(self, state: OnnxStep) -> None:
        """Make the positions of this forward part of its cache."""
        if state.use_cache:
            state.cache.length = state.start + int(state.positions.shape[0])


def load_tokenizer(model: OnnxModel):
    """The tokenizer saved in an export directory (``tokenizer/``).

    Raises:
        CorruptModelError: the export has none or it cannot be read.
    """
    sub = model.manifest.get("tokenizer")
    if not sub or not (model.path / sub).is_dir():
        raise CorruptModelError(f"{model.path} has no tokenizer/ directory; export again with `laserlm export onnx`")
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(str(model.path / sub))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{model.path / sub}: cannot load the tokenizer: {exc}") from None
