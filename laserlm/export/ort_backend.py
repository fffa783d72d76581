"""The onnxruntime backend: runs an export of :mod:`laserlm.export.onnx` at full or adaptive depth.

:class:`OnnxModel` reads ``manifest.json`` and opens one ``onnxruntime.InferenceSession`` per graph on first use;
every run checks its inputs against the manifest's declared shapes first (batch, past + new tokens <= max_len).
:class:`OnnxCache` keeps the K/V of one sequence as numpy arrays ``[B, n_kv, P, head_dim]`` per layer.
:class:`OnnxDecoder` is the decode loop: the prompt at full depth, then one token per step; at adaptive depth
the exit decision between the group sessions is made by the same code as the PyTorch engine
(:func:`laserlm.depth.walk.walk_groups` with a :mod:`laserlm.depth.policies` policy built by
:func:`laserlm.depth.adaptive_settings` from the laser file), and the skipped layers get the ``propagate``
bridge's K/V from the ``bridge_<g>`` graphs (seed 004 §3.1: the runtime chooses the exits).

Not supported here (refused with an :class:`~laserlm.errors.InvalidArgumentError`): the ``deferred`` and ``none``
bridges, the attention transition score (its attention probabilities are not graph outputs), the router, and
groups other than the exported ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ContextLengthError, CorruptModelError, InvalidArgumentError, ModelNotFoundError
from .onnx import MANIFEST, MANIFEST_VERSION

_NP = {"float32": np.float32, "int64": np.int64}


def read_manifest(path) -> dict:
    """The manifest of the export directory ``path``, checked for its format and graph files.

    Raises:
        ModelNotFoundError: no such directory.
        CorruptModelError: no ``manifest.json``, unreadable JSON, another format version, missing keys or a
            graph file that is missing.
    """
    d = Path(path)
    if not d.is_dir():
        raise ModelNotFoundError(f"ONNX export directory not found: {d} (make one with `laserlm export onnx`)")
    f = d / MANIFEST
    if not f.is_file():
        raise CorruptModelError(f"{d} has no {MANIFEST}: not a `laserlm export onnx` directory")
    try:
        m = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"{f}: cannot read the manifest: {exc}") from None
    if not isinstance(m, dict) or m.get("format_version") != MANIFEST_VERSION:
        got = m.get("format_version") if isinstance(m, dict) else None
        raise CorruptModelError(f"{f}: manifest format version {got!r}; this laserlm reads version {MANIFEST_VERSION}")
    for key in ("model", "shapes", "groups", "exits", "graphs", "min_depth"):
        if key not in m:
            raise CorruptModelError(f"{f}: the manifest has no '{key}' entry")
    for name, g in m["graphs"].items():
        if not (d / g["file"]).is_file():
            raise CorruptModelError(f"{d}: graph '{name}' ({g['file']}) is missing; export again")
    return m


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


class OnnxCache:
    """K/V of one batch of sequences: ``k[j]``, ``v[j]`` ``[B, n_kv, length, head_dim]`` float32 per layer."""

    def __init__(self, model: OnnxModel, batch: int = 1):
        m = model.manifest["model"]
        empty = np.zeros((batch, m["num_kv_heads"], 0, m["head_dim"]), dtype=np.float32)
        self.k = [empty] * m["num_layers"]
        self.v = [empty] * m["num_layers"]
        self.length = 0

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[layer] = np.concatenate([self.k[layer], k], axis=2)
        self.v[layer] = np.concatenate([self.v[layer], v], axis=2)


class OnnxDecoder:
    """Full-depth or adaptive-depth decoding over an :class:`OnnxModel`.

    Args:
        model: the export.
        adaptive: ``None`` (full depth) or ``(groups, policy, patience, heads)`` from :func:`make_onnx_mode`.
    """

    def __init__(self, model: OnnxModel, adaptive=None):
        self.model = model
        self.adaptive = adaptive
        self.bounds = [(g["start"], g["stop"]) for g in model.manifest["groups"]]
        self.exit_adapter = {e["layer"]: e["adapter"] for e in model.manifest["exits"]}

    # -- graph calls (numpy in and out) ---------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.model.run("embed", {"input_ids": ids})[0]

    def group(self, g: int, hidden: np.ndarray, positions: np.ndarray, cache: OnnxCache) -> np.ndarray:
        """Run layer group ``g``; appends its layers' new K/V to ``cache``; returns the hidden states."""
        a, b = self.bounds[g]
        feeds = {"hidden": hidden, "positions": positions}
        for j in range(a, b):
            feeds[f"past_k_{j}"], feeds[f"past_v_{j}"] = cache.k[j], cache.v[j]
        out = self.model.run(f"group_{g}", feeds)
        for i, j in enumerate(range(a, b)):
            cache.append(j, out[1 + 2 * i], out[2 + 2 * i])
        return out[0]

    def bridge(self, g: int, hidden: np.ndarray, positions: np.ndarray, cache: OnnxCache) -> None:
        """The propagate bridge for the layers of group ``g``: their K/V from the exit state ``hidden``."""
        a, b = self.bounds[g]
        out = self.model.run(f"bridge_{g}", {"hidden": hidden, "positions": positions})
        for i, j in enumerate(range(a, b)):
            cache.append(j, out[2 * i], out[2 * i + 1])

    def head(self, hidden: np.ndarray) -> np.ndarray:
        return self.model.run("head", {"hidden": hidden})[0]

    def head_at(self, layer: int):
        """``fn(hidden [m, d] torch) -> logits [m, V]`` torch float32: the exit head at ``layer``."""
        adapter = self.exit_adapter.get(layer)

        def fn(h: torch.Tensor) -> torch.Tensor:
            x = np.ascontiguousarray(h.numpy()[None])
            if adapter is not None:
                x = self.model.run(adapter, {"hidden": x})[0]
            return torch.from_numpy(self.head(x)[0])

        return fn

    def final_head(self, h: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.head(np.ascontiguousarray(h.numpy()[None]))[0])

    # -- decoding -------------------------------------------------------------------------------------
    def new_state(self):
        from ..depth.walk import PatienceState  # noqa: PLC0415

        return {"cache": OnnxCache(self.model), "patience": PatienceState()}

    def full_depth(self, ids: np.ndarray, cache: OnnxCache) -> np.ndarray:
        """Every layer group over ``ids [B, T]`` int64 at positions ``0..T-1``, K/V into the empty ``cache`` (made
        for batch ``B``); returns the last group's hidden states ``[B, T, d]`` float32 (before the head).

        Raises:
            InvalidArgumentError / ContextLengthError: ``B`` or ``T`` outside the exported shapes
            (:meth:`OnnxModel.check_inputs`).
        """
        positions = np.ascontiguousarray(np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape))
        h = self.embed(ids)
        for g in range(len(self.bounds)):
            h = self.group(g, h, positions, cache)
        cache.length = ids.shape[1]
        return h

    def prefill(self, state, ids) -> torch.Tensor:
        """Prompt ``ids [T]`` at full depth into a fresh cache; returns the last position's logits ``[V]``."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        cache = state["cache"] = OnnxCache(self.model)
        h = self.full_depth(ids, cache)
        return torch.from_numpy(self.head(np.ascontiguousarray(h[:, -1:]))[0, 0])

    def step(self, state, token_id: int) -> tuple[torch.Tensor, dict]:
        """One token after the cached positions; returns ``(logits [V] float32, info)`` with ``exit_layer`` and
        ``exit_group`` (the last group at full depth) and ``bridge_layers``."""
        cache = state["cache"]
        p = cache.length
        positions = np.array([[p]], dtype=np.int64)
        h = self.embed(np.array([[int(token_id)]], dtype=np.int64))
        if self.adaptive is None:
            for g in range(len(self.bounds)):
                h = self.group(g, h, positions, cache)
            cache.length = p + 1
            return torch.from_numpy(self.head(h)[0, 0]), {"exit_layer": self.model.num_layers,
                                                          "exit_group": len(self.bounds) - 1, "bridge_layers": 0}
        from ..depth.walk import update_patience, walk_groups  # noqa: PLC0415

        groups, policy, patience, _ = self.adaptive
        run = {"h": h}

        def run_group(g, a, b, exited):
            h_in = run["h"]
            run["h"] = self.group(g, h_in, positions, cache)
            return torch.from_numpy(h_in[:, 0]), torch.from_numpy(run["h"][:, 0]), None

        pst = state["patience"]
        locked = torch.tensor([-1 if pst.locked is None else pst.locked])
        res = walk_groups(groups, policy, self.head_at, self.final_head, 1, run_group, locked=locked)
        exit_layer = int(res.exit_layer[0])
        bridged = 0
        if bool(res.exited[0]):
            for g in range(int(res.exit_group[0]) + 1, len(self.bounds)):
                self.bridge(g, run["h"], positions, cache)
            bridged = self.model.num_layers - exit_layer
        cache.length = p + 1
        exit_group = int(res.exit_group[0]) if bool(res.exited[0]) else None
        state["patience"] = update_patience(pst, patience, exit_group, bool(res.lock_failed[0]))
        return res.logits[0], {"exit_layer": exit_layer, "exit_group": int(res.exit_group[0]),
                               "bridge_layers": bridged, "head_evals": int(res.head_evals[0])}

    def token_source(self):
        """``fn(prompt_ids [T], params, max_tokens) -> Iterator[TokenEvent]`` for
        :class:`~laserlm.runtime.generate.Generation`."""
        from ..runtime.generate import TokenEvent  # noqa: PLC0415
        from ..runtime.sampling import make_generator, sample  # noqa: PLC0415

        def source(prompt_ids, params, max_tokens):
            if params.penalized or params.constraint is not None:
                from ..errors import InvalidArgumentError  # noqa: PLC0415

                raise InvalidArgumentError("sampling penalties and structured output are not supported by the "
                                           "onnxruntime backend yet")
            gen = None if params.greedy else make_generator(params.seed)
            state = self.new_state()
            t0 = time.perf_counter()
            logits = self.prefill(state, prompt_ids)
            tok = int(sample(logits[None], params, gen)[0])
            yield TokenEvent(tok, float(self.model.num_layers), time.perf_counter() - t0, {"phase": "prefill"})
            for _ in range(max_tokens - 1):
                t0 = time.perf_counter()
                logits, info = self.step(state, tok)
                tok = int(sample(logits[None], params, gen)[0])
                yield TokenEvent(tok, float(info["exit_layer"]), time.perf_counter() - t0,
                                 info if self.adaptive is not None else {})

        return source


def _laser_gates(model: OnnxModel) -> tuple:
    """``(artifact, gates)`` from the export's copy of its laser file, its identity checked against the manifest."""
    from ..depth.heads import ExitGate  # noqa: PLC0415
    from ..depth.laser_file import LaserArtifact, read_metadata  # noqa: PLC0415

    lm = model.manifest.get("laser")
    if not lm:
        return None
    path = model.path / lm["file"]
    meta, tensors = read_metadata(path)
    if meta.get("weights_sha256") != model.manifest["model"]["weights_sha256"]:
        raise InvalidArgumentError(f"{path} was made for another model than the exported one (weight hash differs)")
    d = model.manifest["model"]["hidden_size"]
    gates = {}
    for key, gc in meta.get("gates", {}).items():
        gate = ExitGate(d, gc.get("num_scalars"), gc.get("uses_ats", False), gc.get("features", "head"))
        prefix = f"gates.{key}."
        try:
            gate.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        except (RuntimeError, KeyError) as exc:
            raise CorruptModelError(f"{path}: gate tensors do not match its config: {exc}") from None
        gates[int(key)] = gate
    config = dict(meta.get("config", {}))
    config.setdefault("bridge", "propagate")
    return LaserArtifact(gates=gates, thresholds=meta.get("thresholds", {}), config=config, path=path)


def make_onnx_mode(model: OnnxModel, spec: str = "full") -> OnnxDecoder:
    """An :class:`OnnxDecoder` for a mode spec: ``full``, or ``adaptive[:options]`` (the export's laser file and
    groups; options as in :class:`laserlm.depth.AdaptiveOptions`, e.g. ``threshold=0.9``, ``patience=0``).

    Raises:
        InvalidArgumentError: another mode, groups or a laser file other than the exported ones, a bridge other
            than ``propagate``, the router, or a policy that needs the attention transition score.
    """
    from ..depth import AdaptiveOptions, adaptive_settings  # noqa: PLC0415
    from ..depth.groups import LayerGroups  # noqa: PLC0415
    from ..runtime.modes import parse_spec  # noqa: PLC0415
    from ..runtime.options import from_spec  # noqa: PLC0415

    name, opts = parse_spec(spec)
    if name == "full" and not opts:
        return OnnxDecoder(model)
    if name != "adaptive":
        raise InvalidArgumentError(f"the onnxruntime backend runs modes 'full' and 'adaptive', not '{name}'")
    o = from_spec(AdaptiveOptions, opts, "adaptive")
    man = model.manifest
    art = _laser_gates(model)
    if o.laser is not None:
        if art is None:
            raise InvalidArgumentError(f"{model.path} was exported without a laser file; re-export with "
                                       f"`laserlm export onnx --laser {o.laser}`")
        from .onnx import _sha256  # noqa: PLC0415

        if _sha256(Path(o.laser)) != _sha256(art.path):
            raise InvalidArgumentError(f"laser file {o.laser} is not the one exported to {model.path}; re-export "
                                       "with it")
    exported = LayerGroups(tuple((g["start"], g["stop"]) for g in man["groups"]), model.num_layers, man["min_depth"])
    if o.groups is not None:
        from ..depth import make_groups  # noqa: PLC0415

        if make_groups(o.groups, model.num_layers).bounds != exported.bounds:
            raise InvalidArgumentError(f"groups={o.groups} differ from the exported layer groups "
                                       f"{exported.describe()}; re-export with --groups {o.groups}")
    o.groups = [b for _, b in exported.bounds]
    if o.min_depth is None:
        o.min_depth = man["min_depth"]
    vocab = man["model"]["vocab_size"]
    groups, policy, bridge, patience, _ = adaptive_settings(o, art, model.num_layers, vocab)
    if bridge != "propagate":
        raise InvalidArgumentError(f"the onnxruntime backend runs the propagate bridge only, not '{bridge}'")
    if o.router:
        raise InvalidArgumentError("the onnxruntime backend does not run the router (router=1)")
    if getattr(policy, "needs_ats", False):
        raise InvalidArgumentError("the onnxruntime backend cannot measure the attention transition score (its "
                                   "attention probabilities are not graph outputs); use a policy without ats (for a laser "
                                   "file: `laserlm calibrate --no-ats`, then export with it)")
    missing = [b for b in groups.exit_points if f"bridge_{groups.group_ending_at(b) + 1}" not in man["graphs"]]
    if missing:
        raise InvalidArgumentError(f"exit points {missing} have no exported bridge graph; re-export with these "
                                   "groups and min depth")
    return OnnxDecoder(model, (groups, policy, patience, None))
