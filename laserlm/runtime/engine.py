"""The engine: runs the decoder layers itself, one by one, over laserlm's static KV cache.

Modelled on gpt-fast's decoder loop: embed -> layer 0 .. layer L-1 -> final norm -> LM head, with a
preallocated :class:`~laserlm.runtime.kv_cache.KVCache`. The transformers decoder layers are called
unchanged; their attention goes through :mod:`laserlm.runtime.attention`.

Besides the full-depth :meth:`Engine.forward`, the engine exposes the primitives that adaptive-depth
schedulers, bridges and speculative decoding compose: :meth:`Engine.begin` (embed + rotary + open a
cache window at an explicit start position, gpt-fast's ``input_pos``), :meth:`Engine.run_layers`,
:meth:`Engine.head` and :meth:`Engine.commit`. Every forward names the :class:`KVCache` it reads and
writes (a request's own, :meth:`Engine.new_cache`); without one it uses the engine's cache, which backs
the simple :meth:`prefill` / :meth:`decode_step` API. Nothing outside the engine and
:mod:`laserlm.runtime.kv_cache` moves a cache's positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ContextLengthError, InvalidArgumentError
from ..models import kernels
from ..models.adapters import ModelAdapter, get_adapter
from ..models.loader import LoadedModel, load_model
from ..models.quant import KERNEL_MAX_ROWS
from . import attention as attn
from . import fast_layers, packed_layers
from .kv_cache import CacheWindow, KVCache
from .projections import project_kv

DEFAULT_MAX_SEQ_LEN = 4096


@dataclass
class StepStats:
    """Statistics of one engine forward.

    Attributes:
        num_tokens: tokens processed per sequence (T).
        layers_run: decoder layers executed for each of those tokens (list of length T).
        seconds: wall-clock seconds of the forward.
    """

    num_tokens: int
    layers_run: list[int]
    seconds: float
    extra: dict = field(default_factory=dict)


@dataclass
class ForwardOutput:
    """``logits [B, T_out, vocab]`` (float32) for the requested positions, plus stats."""

    logits: torch.Tensor
    stats: StepStats
    hidden: torch.Tensor | None = None


@dataclass
class StepState:
    """State of one forward in progress (between :meth:`Engine.begin` and :meth:`Engine.commit`).

    Attributes:
        positions: ``[T]`` absolute positions of the new tokens (``[B, T]`` for the rows of a
            :class:`~laserlm.runtime.kv_pool.PagedBatch`, each at its own position).
        position_ids: ``[1, T]`` (or ``[B, T]``) the same, as transformers expects.
        rope: rotary ``(cos, sin)`` per layer type, each ``[1, T, head_dim]`` (``[B, T, head_dim]``).
        ctx: the attention context of this forward.
        window: the positions this forward writes in its KV cache (``None``: a stand-alone forward).
    """

    positions: torch.Tensor
    position_ids: torch.Tensor
    rope: dict
    ctx: attn.AttentionContext
    window: CacheWindow | None
    t0: float

    @property
    def use_cache(self) -> bool:
        return self.window is not None

    @property
    def start(self) -> int:
        """Absolute position of the first token of this forward."""
        return int(self.positions[0])


class EngineCalls:
    """The full-depth calls of an engine, written once over its primitives (``begin``, ``run_layers``, ``commit``,
    ``head``, ``num_layers`` and the default ``cache``): :class:`Engine` and the onnxruntime engine
    (:class:`laserlm.runtime.ort_engine.OnnxEngine`) both inherit them."""

    @property
    def position(self) -> int:
        """Number of tokens in the engine's own KV cache."""
        return self.cache.length

    def reset(self, cache=None) -> None:
        """Empty a KV cache (default: the engine's own; start a new sequence)."""
        (cache or self.cache).reset()

    def truncate(self, length: int, cache=None) -> None:
        """Roll a KV cache (default: the engine's own) back to its first ``length`` positions."""
        (cache or self.cache).crop(length)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, logits: str = "last", use_cache: bool = True,
                start: int | None = None, cache: KVCache | None = None) -> ForwardOutput:
        """Full-depth forward of ``input_ids [B, T]`` (or ``[T]``) at ``start`` (default: after the cached
        positions) in ``cache`` (default: the engine's own).

        Args:
            logits: ``"last"`` (logits of the last position only, ``[B, 1, V]``) or ``"all"`` (``[B, T, V]``).
            use_cache: read and extend the KV cache (False: a stand-alone forward from position 0,
                any batch size; used by evaluation).
        """
        if logits not in ("last", "all"):
            raise InvalidArgumentError(f"logits must be 'last' or 'all', got {logits!r}")
        hidden, state = self.begin(input_ids, start=start, cache=cache, use_cache=use_cache)
        hidden = self.run_layers(0, self.num_layers, hidden, state)
        self.commit(state)
        if logits == "last":
            hidden = hidden[:, -1:]
        out = self.head(hidden)
        t = input_ids.shape[-1]
        return ForwardOutput(out, StepStats(t, [self.num_layers] * t, time.perf_counter() - state.t0))

    def prefill(self, input_ids: torch.Tensor, cache=None, start: int = 0) -> ForwardOutput:
        """Process prompt tokens ``[B, T]`` at full depth from position ``start`` of ``cache`` (default: the
        engine's own), which is first cut back to ``start`` positions (``start > 0``: the first positions are
        already there, from a shared prefix or earlier prefill chunks); returns the last position's logits
        ``[B, 1, V]``."""
        cache = self.cache if cache is None else cache
        cache.crop(start)
        return self.forward(input_ids, logits="last", start=start, cache=cache)

    def decode_step(self, token_ids: torch.Tensor, cache: KVCache | None = None) -> ForwardOutput:
        """One decode step after the cached positions: ``token_ids [B]`` or ``[B, 1]`` -> next-token logits
        ``[B, 1, V]``."""
        if token_ids.dim() == 1:
            token_ids = token_ids.unsqueeze(-1)
        return self.forward(token_ids, logits="last", cache=cache)


class Engine(EngineCalls):
    """Full-depth inference engine over a loaded model.

    Args:
        model: a :class:`~laserlm.models.loader.LoadedModel` or a transformers causal LM.
        max_seq_len: context size of the KV cache in tokens (default ``min(4096, max_position_embeddings)``).
        batch_size: sequences decoded together (default 1).

    Raises:
        UnsupportedArchitectureError: the model has no adapter.
        InvalidArgumentError: non-positive ``max_seq_len`` or one above the model's position limit.
    """

    def __init__(self, model, max_seq_len: int | None = None, batch_size: int = 1):
        self.loaded = model if isinstance(model, LoadedModel) else None
        hf_model = model.model if isinstance(model, LoadedModel) else model
        self.tokenizer = model.tokenizer if isinstance(model, LoadedModel) else None
        self.adapter: ModelAdapter = get_adapter(hf_model)
        hf_model.config._attn_implementation = attn.register()
        cfg = hf_model.config
        limit = getattr(cfg, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
        if max_seq_len is None:
            max_seq_len = min(DEFAULT_MAX_SEQ_LEN, limit)
        if not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise InvalidArgumentError(f"context size must be a positive integer, got {max_seq_len!r}")
        if max_seq_len > limit:
            raise InvalidArgumentError(f"context size {max_seq_len} exceeds the model's limit of {limit} positions")
        self.max_seq_len = max_seq_len
        self.dtype = next(hf_model.parameters()).dtype
        a = self.adapter
        self.cache = self.new_cache(max_seq_len, batch_size)
        # state shared by the requests of this engine, owned here so that modes stay stateless configs: key ->
        # object (e.g. the speculative mode's suffix cache of earlier requests' tokens)
        self.shared: dict = {}
        self._rope_tables = None
        self.kernel = None  # optional attention kernel (block-sparse attention), see attention.py
        # Llama-family layers run through fast_layers.fast_layer (bit-identical, less dispatch overhead);
        # set engine.fast_layers = False to always call the transformers layers
        self.fast_layers = True
        self._fast_ok = {id(layer) for layer in a.layers if fast_layers.supports_fast_path(layer)}
        # layers whose matrices were packed (--weights int4/int8/native) run through packed_layers
        # packed layers run as one compiled call per layer for a few tokens when no attention hook is needed;
        # False: always the PyTorch ops of packed_layers (same matrices, for tests and debugging)
        self.native_layers = True
        self._stack = None  # NativeStack of the packed layers, built on first use
        self._packed = {i for i, layer in enumerate(a.layers) if getattr(layer, "laserlm_packed", None) is not None}
        self.weights = getattr(self.loaded, "weights", None) or ("bf16" if self.dtype == torch.bfloat16 else "fp32")
        # float16 overflows in these models: every layer is guarded (float32 fallback per layer, norms in float32)
        self.precision_guard = None
        if self.dtype == torch.float16:
            from .ranges import Float16Guard  # noqa: PLC0415

            self.precision_guard = Float16Guard(self).install()
            self.weights = "fp16"

    @classmethod
    def from_pretrained(cls, name: str, dtype: str = "float32", max_seq_len: int | None = None,
                        batch_size: int = 1) -> Engine:
        """Load ``name`` (see :func:`laserlm.models.loader.load_model`) and build an engine on it."""
        return cls(load_model(name, dtype=dtype), max_seq_len=max_seq_len, batch_size=batch_size)

    # -- properties ------------------------------------------------------------------------------
    @property
    def model(self):
        return self.adapter.model

    @property
    def config(self):
        return self.adapter.config

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def fast_rows(self) -> int | None:
        """The most new tokens one forward can hold on the compiled kernel of packed weights
        (:data:`laserlm.models.quant.KERNEL_MAX_ROWS`); longer forwards take the prefill path (a dequantized GEMM,
        several times the cost of a kernel step). ``None``: no packed layers (float weights: no such step)."""
        return KERNEL_MAX_ROWS if self._packed else None

    def new_cache(self, max_len: int | None = None, batch_size: int = 1) -> KVCache:
        """A KV cache for one request (``max_len`` positions, default the engine's context size).

        Raises:
            ContextLengthError: ``max_len`` above the engine's context size.
        """
        max_len = self.max_seq_len if max_len is None else int(max_len)
        if max_len > self.max_seq_len:
            raise ContextLengthError(f"{max_len} positions exceed the context size {self.max_seq_len}")
        a = self.adapter
        return KVCache(a.num_layers, batch_size, a.num_kv_heads, a.head_dim, max(1, max_len), self.dtype)

    # -- primitives ------------------------------------------------------------------------------
    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        if self._rope_tables is None:
            all_pos = torch.arange(self.max_seq_len).unsqueeze(0)
            probe = torch.zeros(1, 1, 1, dtype=self.dtype)
            self._rope_tables = {t: (c[0], s[0]) for t, (c, s) in self.adapter.rope(probe, all_pos).items()}
        if positions.dim() == 2:  # rows at their own positions: [B, T, head_dim]
            return {t: (c[positions], s[positions]) for t, (c, s) in self._rope_tables.items()}
        start, end = int(positions[0]), int(positions[-1]) + 1
        return {t: (c[start:end].unsqueeze(0), s[start:end].unsqueeze(0)) for t, (c, s) in self._rope_tables.items()}

    def begin(self, input_ids: torch.Tensor, start: int | None = None, cache: KVCache | None = None,
              use_cache: bool = True) -> tuple[torch.Tensor, StepState]:
        """Start a forward over ``input_ids [B, T]`` at positions ``start .. start+T-1``: embed, rotary,
        open the write window in ``cache``.

        Args:
            start: absolute position of the first token (default: the end of ``cache``); at most the
                cache's length (a forward may rewrite positions, never leave a hole).
            cache: the KV cache read and written (default: the engine's own): a
                :class:`~laserlm.runtime.kv_cache.KVCache`, a request's
                :class:`~laserlm.runtime.kv_pool.PagedCache`, or a :class:`~laserlm.runtime.kv_pool.PagedBatch`
                (several requests, one row each, every row appended at its own length; ``start`` must be None).
            use_cache: False: a stand-alone forward from position 0 that reads and writes no cache (any batch).

        Returns ``(hidden [B, T, d], state)``.

        Raises:
            ContextLengthError: the tokens do not fit in the cache's context.
            InvalidArgumentError: empty input, a batch size the cache was not built for, a bad ``start``.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        b, t = input_ids.shape
        if t == 0:
            raise InvalidArgumentError("empty input: at least one token is required")
        window = None
        if use_cache:
            cache = self.cache if cache is None else cache
            if b != cache.batch_size:
                raise InvalidArgumentError(f"batch of {b} sequences but the KV cache holds {cache.batch_size}")
            window = cache.window(None if start is None else int(start), t)
            positions = window.positions  # [T], or [B, T] for the rows of a paged batch
        else:
            if t > self.max_seq_len:
                raise ContextLengthError(f"{t} tokens exceed the context size {self.max_seq_len}")
            positions = torch.arange(t)
        hidden = self.adapter.embed(input_ids)
        ctx = attn.AttentionContext(q_positions=positions, kv_offset=0, kernel=self.kernel)
        state = StepState(positions=positions, position_ids=positions if positions.dim() == 2 else positions.unsqueeze(0),
                          rope=self._rope(hidden, positions), ctx=ctx, window=window, t0=time.perf_counter())
        return hidden, state

    def run_layer(self, i: int, hidden: torch.Tensor, state: StepState) -> torch.Tensor:
        """Run decoder layer ``i`` on ``hidden [B, T, d]`` (writes its K/V to the cache)."""
        return self.run_layers(i, i + 1, hidden, state)

    def run_layers(self, start: int, stop: int, hidden: torch.Tensor, state: StepState) -> torch.Tensor:
        """Run decoder layers ``start .. stop-1``; ``hidden [B, T, d]`` in and out."""
        layers, types, cache = self.adapter.layers, self.adapter.layer_types, state.window
        fast = self._fast_ok if self.fast_layers and not fast_layers.hooks_active() else None
        stack = self._native_stack() if fast is not None and self.native_layers and self._packed else None
        with attn.attention_context(state.ctx):
            i = start
            while i < stop:
                if stack is not None:
                    out, j = packed_layers.native_stack_run(stack, layers, i, stop, hidden, state.rope, types, cache,
                                                            lambda k: k in self._packed and not (
                                                                layers[k]._forward_hooks or layers[k]._forward_pre_hooks))
                    if out is not None:
                        hidden, i = out, j
                        continue
                layer = layers[i]
                if fast is not None and not (layer._forward_hooks or layer._forward_pre_hooks) and (
                        id(layer) in fast or i in self._packed):
                    cos, sin = state.rope[types[i]]
                    if i in self._packed:
                        hidden = packed_layers.packed_layer(layer, hidden, cos, sin, cache, self.native_layers)
                    else:
                        hidden = fast_layers.fast_layer(layer, hidden, cos, sin, cache)
                else:
                    hidden = layer(hidden, attention_mask=None, position_ids=state.position_ids, cache=cache,
                                   position_embeddings=state.rope[types[i]])
                i += 1
        return hidden

    def _native_stack(self):
        """The engine's :class:`~laserlm.runtime.packed_layers.NativeStack` (``None`` without compiled kernels)."""
        if self._stack is None:
            ops = kernels.ops()
            self._stack = packed_layers.NativeStack(ops) if ops is not None and hasattr(ops, "LayerStack") else False
        return self._stack or None

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[B, T, d] -> [B, T, vocab]`` float32 logits."""
        return self.adapter.logits(hidden).float()

    def propagate(self, state: StepState, layer: int, hidden: torch.Tensor) -> None:
        """The ``propagate`` bridge (CALM's state propagation): write the K/V of layers ``layer .. L-1`` at this
        forward's positions as each layer's own projection of the exit state ``hidden [B, T, d]``, so later tokens
        attend to them as to computed K/V (:mod:`laserlm.depth.bridge`)."""
        a = self.adapter
        for j in range(layer, a.num_layers):
            cos, sin = state.rope[a.layer_types[j]]
            k, v = project_kv(a.layers[j], hidden, cos, sin)
            state.window.cache.write(j, state.start, k, v)

    def commit(self, state: StepState) -> None:
        """Make the positions of this forward part of its cache."""
        if state.window is not None:
            state.window.cache.commit(state.window)
