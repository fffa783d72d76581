"""Calibrated defaults for mode specs that name no exit or draft rule (``adaptive``, ``speculative``).

Untrained exit heads are poor on small models: on smollm2-135m a bare ``adaptive`` (confidence 0.9 on the raw
LM head, patience 3) exits after ~21 of 30 layers and turns "The weather today is" into
``" 2022-  20, 2,   2, and, ..."``. A default must not silently produce that, so the user-facing entry points
(:meth:`laserlm.LaserLM.mode` and everything built on it: ``generate`` / ``stream``, ``laserlm generate``,
``laserlm eval`` / ``laserlm bench`` configurations, the lm-eval adapter) pass every spec through
:func:`resolve_spec` first. :func:`laserlm.runtime.modes.make_mode` stays the primitive that builds exactly
what a spec says.

The rule
--------
**adaptive.** A spec *names its exit rule* when it has any of :data:`ADAPTIVE_RULE_OPTIONS` (``laser``,
``policy``, ``threshold``, ``gate_threshold``, ``saturation_threshold``, ``ats_threshold``); it then runs as
written. Otherwise (``adaptive``, or only the options of :data:`ADAPTIVE_PASS_THROUGH`: ``bridge``,
``patience``, ``score``):

- on a **bundled** model (:data:`laserlm.models.registry.BUNDLED`, loaded by its bundled name) it becomes
  ``adaptive:laser=<cached artifact>[,those options]``: the artifact is what
  ``laserlm calibrate --source chat --seq-len 128`` writes at otherwise default settings (target agreement 0.99
  with probability >= 0.9, ``propagate`` bridge, patience 0; recipe :data:`ADAPTIVE_RECIPE`), built once into
  ``<cache>/defaults/`` (:func:`adaptive_artifact_path`, keyed by model, GGUF file, weight format, dtype, the
  recipe or calibration settings, the calibration text and the laser-file format) and reused afterwards. The
  build announces itself in one line on stderr, shows the calibration's progress bars, and resumes from its work
  directory when interrupted;
- its calibration text is the model's own full-depth greedy answers to chat-formatted questions from dev/valid
  files (:data:`CHAT_PROMPT_SOURCES`: ARC-Easy/Challenge dev, PIQA valid; never the shipped prompt set, which is
  held out for checking), one 128-token conversation per chunk, and only the answer positions count
  (:mod:`laserlm.training.chat_text`). Why: the certificate is about teacher-forced agreement with the full
  model's greedy tokens and holds for positions exchangeable with the calibration positions. A threshold
  certified on WikiText-2 gives less agreement on chat answers. A statistical certificate still holds only with probability >= 0.9 over the calibration text, and a check on a
  few hundred positions (16 prompts x 32 tokens) has its own sampling noise;
- on any other model it raises :class:`~laserlm.errors.InvalidArgumentError` naming the two ways out: calibrate
  (``laserlm calibrate --model M --output F`` then ``--mode adaptive:laser=F``) or explicit thresholds
  (``adaptive:policy=confidence,threshold=0.99``).

The other adaptive options (``groups``, ``min_depth``, ``measure``, ``combine``, ``compensation``, ``ats_layer``)
only shape an untrained exit rule, and the calibrated artifact fixes its own groups: without an exit rule they
are refused with the same two ways out.

**speculative.** Lossless, so a bad default costs speed, not quality: the built-in defaults (draft with the
first half of the layers, k=4, no confidence threshold) are slower than full depth on the bundled models. A spec names
its draft rule when it has any of :data:`SPECULATIVE_RULE_OPTIONS` (``draft_layers``, ``k``, ``threshold``,
``auto``, ``laser``, ``draft``). Otherwise (``speculative`` or ``speculative:reuse=...``):

- on a bundled model it becomes ``speculative:draft_layers=N,k=K,threshold=T``: the settings
  ``speculative:auto=1`` picks (:mod:`laserlm.speculative.calibration`: greedy traces on validation
  text and per-layer costs measured on this machine, about a minute), searched once and cached in
  ``<cache>/defaults/`` keyed by model, weights, dtype, the CPU's model name, the thread count and the data;
- on other models it is refused, naming ``speculative:auto=1`` and explicit ``draft_layers/k/threshold``.

Layering: this module sits in the API layer beside :mod:`laserlm.api` (below the tools), so it cannot call
calibration itself. Building the adaptive artifact is :func:`laserlm.training.defaults.build_adaptive_default`
(tool level); the ``laserlm`` command installs it with :func:`set_adaptive_builder` before any subcommand runs
(``generate``, ``eval``, ``bench`` build on first use). Without a builder (plain Python API) a missing artifact
is an :class:`~laserlm.errors.InvalidArgumentError` that says how to build it; a built one is reused either way.
The speculative search lives in :mod:`laserlm.speculative` (below this layer), so it runs from here.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from .errors import InvalidArgumentError

ADAPTIVE_RULE_OPTIONS = ("laser", "policy", "threshold", "gate_threshold", "saturation_threshold", "ats_threshold")
ADAPTIVE_PASS_THROUGH = ("bridge", "patience", "score")
SPECULATIVE_RULE_OPTIONS = ("draft_layers", "k", "threshold", "auto", "laser", "draft")
SPECULATIVE_PASS_THROUGH = ("reuse",)
DEFAULTS_DIR = "defaults"  # under the cache root (laserlm.models.loader.cache_root)
ADAPTIVE_FILE = "adaptive.laser.safetensors"
SPECULATIVE_FILE = "speculative.json"
# the minutes a default-size calibration of the chat recipe takes on 2 idle cores (printed before building it)
BUILD_MINUTES = {"smollm2-135m": 22, "gemma3-270m": 40}
# the calibration text of the adaptive default: the model's own greedy answers to chat prompts drawn from these
# dev/valid files under the data directory (laserlm.training.chat_text; the shipped prompts stay held out)
CHAT_PROMPT_SOURCES = ("arc/ARC-Easy-Dev.jsonl", "arc/ARC-Challenge-Dev.jsonl", "piqa/valid.jsonl")
# the default's recipe, part of its cache key (a new recipe rebuilds cached defaults): CalibrateConfig(source="chat",
# seq_len=128) at otherwise default settings, calibrated with float32 many-row products and the predictor
# certified for the propagate bridge
ADAPTIVE_RECIPE = "chat-v2"

__all__ = ["ADAPTIVE_PASS_THROUGH", "ADAPTIVE_RULE_OPTIONS", "SPECULATIVE_PASS_THROUGH", "SPECULATIVE_RULE_OPTIONS",
           "adaptive_artifact_path", "adaptive_default", "bundled_name", "check_before_load",
           "ensure_speculative_settings", "needs_default", "resolve_spec", "set_adaptive_builder",
           "speculative_settings_path"]


# -- which specs take a default --------------------------------------------------------------------------
def needs_default(spec: str) -> str | None:
    """``"adaptive"`` / ``"speculative"`` when the mode spec (without ``@ATTENTION``) names no exit / draft rule
    and so takes the calibrated default; ``None`` for every other spec (it runs as written).

    Raises:
        InvalidArgumentError: a malformed spec; an ``adaptive`` spec without an exit rule but with options that
            only shape an untrained rule (``groups``, ``min_depth``, ...).
    """
    from .runtime.modes import parse_spec  # noqa: PLC0415

    name, opts = parse_spec(spec)
    if name == "adaptive":
        if any(k in opts for k in ADAPTIVE_RULE_OPTIONS):
            return None
        shaping = sorted(k for k in opts if k not in ADAPTIVE_PASS_THROUGH)
        if shaping:
            raise InvalidArgumentError(
                f"mode '{spec}' sets {', '.join(shaping)} but no exit rule; untrained exit heads give poor output, so "
                "name the rule: a calibrated laser file (laser=PATH from `laserlm calibrate`) or explicit thresholds "
                f"(e.g. adaptive:{','.join(f'{k}={opts[k]}' for k in shaping)},policy=confidence,threshold=0.99)")
        return "adaptive"
    if name == "speculative":
        return None if any(k in opts for k in SPECULATIVE_RULE_OPTIONS) else "speculative"
    return None


def bundled_name(engine) -> str | None:
    """The bundled model name (``smollm2-135m``, ``gemma3-270m``) ``engine``'s model was loaded by, else ``None``
    (a local directory, a ``.gguf`` path, a hub id, or a model built in memory)."""
    from .models.registry import BUNDLED  # noqa: PLC0415

    loaded = getattr(engine, "loaded", None)
    name = getattr(loaded, "name", None)
    return name if name in BUNDLED else None


def resolve_spec(lm, config: str, progress: bool = True) -> str:
    """The spec to build for ``config`` (``MODE_SPEC[@ATTENTION]``) on ``lm`` (a :class:`laserlm.LaserLM` or an
    engine): ``config`` itself unless :func:`needs_default` says it takes the calibrated default (module
    docstring), in which case the default is built or read from the cache and the rewritten spec returned.

    Raises:
        InvalidArgumentError: a bare ``adaptive`` / ``speculative`` on a model that is not bundled (the message says
            how to calibrate and which explicit options to pass); see :func:`needs_default`.
        DataFileError: the calibration text for a first build is not found (the message names ``$LASERLM_DATA``).
    """
    if not isinstance(config, str):
        return config
    spec, sep, attn = config.strip().partition("@")
    kind = needs_default(spec)
    if kind is None:
        return config
    engine = getattr(lm, "engine", lm)
    from .runtime.modes import parse_spec  # noqa: PLC0415

    _, opts = parse_spec(spec)
    extra = "".join(f",{k}={v}" for k, v in opts.items())
    model = bundled_name(engine)
    if kind == "adaptive":
        if model is None:
            raise InvalidArgumentError(_refusal_adaptive(engine))
        path = adaptive_default(engine, progress=progress)
        new = f"adaptive:laser={path}{extra}"
    else:
        if model is None:
            raise InvalidArgumentError(_refusal_speculative(engine))
        s = ensure_speculative_settings(engine, progress=progress)
        new = f"speculative:draft_layers={s['draft_layers']},k={s['k']},threshold={s['threshold']}{extra}"
    return new + (sep + attn if sep else "")


def _model_label(engine) -> str:
    loaded = getattr(engine, "loaded", None)
    return str(getattr(loaded, "name", None) or "MODEL")


def _refusal_adaptive(engine) -> str:
    m = _model_label(engine)
    return (f"mode 'adaptive' names no exit rule, and '{m}' is not a bundled model with a calibrated default "
            "(untrained exit heads give poor output). Either calibrate once: "
            f"`laserlm calibrate --model {m} --output F.laser.safetensors`, then use --mode adaptive:laser=F.laser.safetensors "
            "(or --laser F.laser.safetensors); or pass explicit thresholds, e.g. "
            "--mode adaptive:policy=confidence,threshold=0.99")


def _refusal_speculative(engine) -> str:
    m = _model_label(engine)
    return (f"mode 'speculative' names no draft settings, and '{m}' is not a bundled model with a tuned default "
            "(the built-in draft settings can run several times slower than full depth). Either tune them on "
            "validation text: --mode speculative:auto=1 (about a minute per load); or pass them explicitly, e.g. "
            "--mode speculative:draft_layers=N,k=1,threshold=0.8 (or draft with a calibrated exit head: "
            f"`laserlm calibrate --model {m} --output F` then speculative:laser=F)")


# -- cache keys --------------------------------------------------------------------------------------------
def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    from .models.files import file_sha256  # noqa: PLC0415 (torch is imported only when needed)

    return file_sha256(path)[:16]


def _data_key(source) -> str:
    """A stable description of a resolved data source: a file's content hash, a dataset's name."""
    if isinstance(source, Path) and source.is_file():
        return f"file:{source.name}:{_file_digest(source)}"
    return str(source)


def _model_key(engine) -> dict:
    """Model, weight file, weight format and dtype: what a cached default is tied to (and whether K-quant matrices are
    kept, :func:`~laserlm.models.loader.kquants_kept`: a GGUF's Q4_K / Q6_K matrices then hold other values than the
    default conversions)."""
    from .models.loader import kquants_kept  # noqa: PLC0415

    loaded = engine.loaded
    key = {"model": loaded.name, "source": Path(loaded.path).name, "weights": engine.weights,
           "dtype": str(engine.dtype).replace("torch.", ""), "identity": loaded.identity}
    if kquants_kept(loaded.path, engine.weights):
        key["kquants"] = "native"
    return key


def _entry_dir(engine, kind: str, key: dict) -> Path:
    from .models.loader import cache_root  # noqa: PLC0415

    dtype = str(engine.dtype).replace("torch.", "")
    return cache_root() / DEFAULTS_DIR / f"{engine.loaded.name}-{engine.weights}-{dtype}-{kind}-{_digest(key)}"


def _laser_format_version():
    from .depth.laser_file import FORMAT_VERSION  # noqa: PLC0415

    return FORMAT_VERSION


def calibration_data_key(data=None, source: str = "chat") -> str:
    """The calibration text as part of a cache key. ``source="chat"`` (the default's): the content hashes of the
    prompt files :data:`CHAT_PROMPT_SOURCES` under the data directory ``data`` (``None``: the default one);
    ``source="text"``: the text ``data`` (``None``: WikiText-2 valid), a file's content hash or a dataset's name.

    Raises:
        DataFileError: the text / prompt files are not found (the message names ``$LASERLM_DATA``).
    """
    from .data import resolve  # noqa: PLC0415

    what = "calibration text for the calibrated adaptive default"
    if source == "chat":
        return "chat:" + ",".join(_data_key(resolve(data, rel, what=what)) for rel in CHAT_PROMPT_SOURCES)
    return _data_key(resolve(data, "wikitext-2/valid.txt", what=what, default_split="validation"))


def adaptive_artifact_path(engine, settings: dict | None = None, data=None) -> Path:
    """Where the calibrated adaptive artifact of ``engine``'s model is cached (it need not exist yet): keyed by the
    model, its GGUF file, weight format, dtype, the calibration ``settings`` (``None``: the default's recipe
    :data:`ADAPTIVE_RECIPE`; a dict: :meth:`~laserlm.training.pipeline.CalibrateConfig.to_dict` of other
    settings), the calibration text (:func:`calibration_data_key`) and the laser-file format.

    Raises:
        DataFileError: the calibration text is not found.
    """
    source = "chat" if settings is None else settings.get("source", "text")
    key = {**_model_key(engine), "calibrate": ADAPTIVE_RECIPE if settings is None else settings,
           "data": calibration_data_key(data, source), "laser_format": _laser_format_version()}
    return _entry_dir(engine, "adaptive", key) / ADAPTIVE_FILE


_ADAPTIVE_BUILDER = None  # callable(engine, progress) -> Path; installed by the laserlm command


def set_adaptive_builder(builder) -> None:
    """Install ``builder(engine, progress=...) -> Path`` (normally
    :func:`laserlm.training.defaults.build_adaptive_default`) that builds the calibrated adaptive artifact when the
    cache has none; ``None`` removes it."""
    global _ADAPTIVE_BUILDER
    _ADAPTIVE_BUILDER = builder


def adaptive_default(engine, progress: bool = True) -> Path:
    """The calibrated adaptive artifact of ``engine``'s bundled model: built by the installed builder (which returns at
    once when the cache has it), else read from the cache.

    Raises:
        InvalidArgumentError: no builder is installed and the cache has no artifact (the message says how to build it).
        DataFileError: the calibration text is not found.
    """
    if _ADAPTIVE_BUILDER is not None:
        return Path(_ADAPTIVE_BUILDER(engine, progress=progress))
    path = adaptive_artifact_path(engine)
    if path.is_file():
        return path
    name = engine.loaded.name
    raise InvalidArgumentError(
        f"mode 'adaptive' on {name} uses its calibrated artifact, which is not built yet. Build it once (~"
        f"{BUILD_MINUTES.get(name, 10)} min): `laserlm generate --model {name} --mode adaptive \"hello\"` on the "
        "command line, or laserlm.training.defaults.build_adaptive_default(lm.engine) in Python; or pass laser=PATH "
        "or explicit thresholds (adaptive:policy=confidence,threshold=0.99)")


# -- speculative ---------------------------------------------------------------------------------------------
def speculative_settings_path(engine) -> Path:
    """Where the tuned draft settings of ``engine``'s model are cached (keyed by model, weights, dtype, the CPU's name,
    family and model numbers, torch threads and the validation data); it need not exist yet.

    Raises:
        InvalidArgumentError: no validation data (WikiText-2 valid) under the data directory.
    """
    import torch  # noqa: PLC0415

    from .cpuinfo import cpu_identity  # noqa: PLC0415
    from .data import find_data_root  # noqa: PLC0415

    root = find_data_root()
    wiki = root / "wikitext-2" / "valid.txt" if root is not None else None
    if wiki is None or not wiki.is_file():
        from .data import ENV_VAR  # noqa: PLC0415

        raise InvalidArgumentError(f"the tuned speculative default needs WikiText-2 valid text (set ${ENV_VAR} to a "
                                   "data directory), or pass draft settings: speculative:draft_layers=N,k=1,threshold=0.8")
    key = {**_model_key(engine), "cpu": cpu_identity(), "threads": torch.get_num_threads(), "data": _data_key(wiki)}
    return _entry_dir(engine, "speculative", key) / SPECULATIVE_FILE


def ensure_speculative_settings(engine, progress: bool = True) -> dict:
    """``{"draft_layers", "k", "threshold", ...}``: the draft settings ``speculative:auto=1`` picks for
    ``engine``'s model on this machine, searched once (one notice line and a progress bar on stderr) and cached.

    Raises:
        InvalidArgumentError: no validation data, or no tokenizer.
    """
    from .models.cache import build_lock  # noqa: PLC0415
    from .models.files import write_json_atomic  # noqa: PLC0415

    engine = getattr(engine, "engine", engine)
    path = speculative_settings_path(engine)
    if not path.is_file():
        with build_lock(path.with_name(path.name + ".lock")):
            if not path.is_file():
                from .speculative.calibration import calibrate  # noqa: PLC0415

                if progress:
                    print(f"laserlm: tuning the speculative draft settings for {engine.loaded.name} once (about a "
                          f"minute) into {path.parent}; later runs reuse them", file=sys.stderr, flush=True)
                report = calibrate(engine, progress=progress, announce=False)  # the line above says what runs
                write_json_atomic(report, path, default=str)
    try:
        chosen = json.loads(path.read_text())["chosen"]
        return {k: chosen[k] for k in ("draft_layers", "k", "threshold")} | {"predicted_speedup":
                                                                              chosen.get("predicted_speedup")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(f"cached speculative settings {path} are unreadable ({exc}); delete the file "
                                   "to search again") from None


def check_before_load(model: str, configs) -> None:
    """Refuse, before a model loads, the configurations that take a calibrated default (:func:`needs_default`)
    when ``model`` (the ``--model`` value) is not a bundled name: the same message as :func:`resolve_spec`.

    Raises:
        InvalidArgumentError: such a configuration for a model that is not bundled; a malformed spec.
    """
    from types import SimpleNamespace  # noqa: PLC0415

    from .models.registry import BUNDLED  # noqa: PLC0415

    if model in BUNDLED:
        return
    fake = SimpleNamespace(loaded=SimpleNamespace(name=model))
    for config in configs:
        kind = needs_default(str(config).partition("@")[0])
        if kind == "adaptive":
            raise InvalidArgumentError(_refusal_adaptive(fake))
        if kind == "speculative":
            raise InvalidArgumentError(_refusal_speculative(fake))
