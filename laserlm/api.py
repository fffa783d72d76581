"""The Python API: ``laserlm.load(name)`` returns a :class:`LaserLM` with ``generate`` and ``stream``.

Example::

    import laserlm
    lm = laserlm.load("smollm2-135m")
    print(lm.generate("The capital of France is", max_new_tokens=20).text)
    for piece in lm.stream("Tell me a joke", chat=True, temperature=0.7, seed=0):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

from typing import Callable

from .models.loader import LoadedModel, load_model
from .modes import make_mode
from .runtime.engine import Engine
from .runtime.generate import Generation, GenerationResult, encode_prompt, eos_token_ids
from .runtime.loop import generate_tokens
from .runtime.sampling import SamplingParams


class LaserLM:
    """A loaded model with its engine.

    Attributes:
        loaded: the :class:`~laserlm.models.loader.LoadedModel` (transformers model + tokenizer).
        engine: the :class:`~laserlm.runtime.engine.Engine` (layer loop + KV cache).
    """

    def __init__(self, loaded: LoadedModel, max_seq_len: int | None = None, attention=None,
                 **attention_options):
        self.loaded = loaded
        self.engine = Engine(loaded, max_seq_len=max_seq_len)
        self.tokenizer = loaded.tokenizer
        self.eos_ids = eos_token_ids(loaded.model, loaded.tokenizer)
        self._modes: dict[str, object] = {}  # spec -> built mode (laser files read, auto-tuning run once)
        if attention is not None or attention_options:
            self.set_attention(attention or "sparse", **attention_options)

    def set_attention(self, attention="dense", **options):
        """Choose the attention kernel: ``"dense"`` (SDPA) or ``"sparse[:key=value,...]"`` (block-sparse,
        see :func:`laserlm.attention.parse_attention`; ``options`` such as ``threshold``, ``block_size``,
        ``dense_layers`` override the spec). Works with every decoding mode. Returns the kernel or ``None``.

        Raises:
            InvalidArgumentError: unknown attention or bad sparse settings.
        """
        from .attention import configure  # noqa: PLC0415

        return configure(self.engine, attention, **options)

    @property
    def model(self):
        return self.loaded.model

    @property
    def weights(self) -> str:
        """The weight format in use (``fp32``, ``bf16``, ``int8``, ``int4`` or ``native``)."""
        return self.engine.weights

    def describe(self) -> str:
        """One line: weight format (with the block formats of packed weights) and activation dtype."""
        dtype = str(self.engine.dtype).replace("torch.", "")
        rep = self.loaded.pack_report
        if rep is None:
            return f"weights {self.weights}, activations {dtype}"
        fmts = ", ".join(f"{k} x{v}" for k, v in sorted(rep.formats.items()))
        return f"weights {self.weights} ({fmts}; {rep.nbytes / 2**20:.1f} MiB), activations {dtype}"

    def resolve_spec(self, config: str, progress: bool = True) -> str:
        """The spec that runs for ``config`` (``MODE_SPEC[@ATTENTION]``): unchanged, except that a spec naming no
        exit rule (bare ``adaptive``) or no draft settings (bare ``speculative``) becomes the calibrated default
        of a bundled model, read from the cache or built once there by the installed builder (see
        :mod:`laserlm.defaults` for the exact rule; the ``laserlm`` command installs the builder).

        Raises:
            InvalidArgumentError: a bare ``adaptive`` / ``speculative`` on a model that is not bundled (the message
                says how to calibrate and which explicit thresholds to pass); a bare ``adaptive`` whose artifact is
                not built yet while no builder is installed (the message says how to build it).
            DataFileError: a first build finds no calibration text.
        """
        from .defaults import resolve_spec  # noqa: PLC0415

        return resolve_spec(self, config, progress=progress)

    def mode(self, spec="full"):
        """The decoding mode of a spec string such as ``"full"`` (see :mod:`laserlm.runtime.modes`), or a mode
        object unchanged. The spec goes through :meth:`resolve_spec` first (bare ``adaptive`` / ``speculative``
        take the calibrated default on bundled models and are refused on others). Modes are stateless, so each
        spec is built once per :class:`LaserLM` and reused: a laser file is read and checked once,
        ``speculative:auto=1`` searches once.

        Raises:
            InvalidArgumentError: unknown mode, bad options, or a bare ``adaptive`` / ``speculative`` on a model
                that is not bundled.
        """
        if not isinstance(spec, str):
            return spec
        key = spec.strip()
        if key not in self._modes:
            self._modes[key] = make_mode(self.resolve_spec(key), self.engine)
        return self._modes[key]

    def _token_source(self, mode) -> Callable:
        m = self.mode(mode)
        return lambda ids, params, n: generate_tokens(self.engine, m, ids, params, n)

    def stream(self, prompt, *, chat: bool = False, mode: str = "full", on_token: Callable | None = None,
               **sampling) -> Generation:
        """Start generating; iterate the returned :class:`Generation` for text pieces, then read ``.result``.

        Args:
            prompt: text, or a list of chat messages.
            chat: apply the model's chat template.
            mode: decoding mode spec (``"full"``, ``"adaptive:..."``, ``"speculative:..."``) or a mode object.
            **sampling: fields of :class:`~laserlm.runtime.sampling.SamplingParams`
                (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``).

        A string prompt is encoded with the tokenizer's special tokens, but a BOS the text already starts
        with (a rendered chat prompt) is not added a second time.

        Raises:
            InvalidArgumentError: bad sampling values or empty prompt.
            ContextLengthError: prompt longer than the context.
            NonFiniteLogitsError: while iterating, when the model's logits contain NaN or +inf.
        """
        params = SamplingParams(**sampling).validate()
        source = self._token_source(mode)
        ids = encode_prompt(self.tokenizer, prompt, chat, self.engine.max_seq_len)
        return Generation(self.tokenizer, ids, source, params, self.eos_ids,
                          self.engine.max_seq_len, on_token=on_token)

    def generate(self, prompt, *, chat: bool = False, mode: str = "full", **sampling) -> GenerationResult:
        """Generate to completion; returns a :class:`~laserlm.runtime.generate.GenerationResult`."""
        return self.stream(prompt, chat=chat, mode=mode, **sampling).run()


def load(name: str = "smollm2-135m", dtype: str | None = None, max_seq_len: int | None = None,
         attention=None, weights: str = "auto", **attention_options) -> LaserLM:
    """Load a model by bundled name, ``.gguf`` file, local directory or cached hub id.

    ``weights``: ``"auto"`` (default: ``native`` for a GGUF file when ``dtype`` is not given, else dense
    float weights in ``dtype``), ``"fp32"`` (the exact reference, logits equal to transformers'),
    ``"bf16"``, ``"int8"``, ``"int4"`` or ``"native"`` (see :mod:`laserlm.models.quant`). ``dtype``:
    ``"float32"`` (default) or ``"bfloat16"`` activations.

    ``attention``: ``None``/``"dense"`` or ``"sparse[:key=value,...]"``; ``attention_options`` (e.g.
    ``threshold=0.5, block_size=64, dense_layers=2``) configure block-sparse attention
    (:func:`laserlm.attention.parse_attention`).

    ``dtype``: ``"float32"`` (default) or ``"bfloat16"``; ``"float16"`` is refused with the CLI's message
    (it overflows in these models, :mod:`laserlm.models.dtypes`).

    Raises:
        ModelNotFoundError, CorruptModelError, UnsupportedArchitectureError,
        InvalidArgumentError (bad dtype, float16 included, or attention options).
    """
    return LaserLM(load_model(name, dtype=dtype, weights=weights), max_seq_len=max_seq_len, attention=attention,
                   **attention_options)
