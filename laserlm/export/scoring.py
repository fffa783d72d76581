"""The onnxruntime export as a backend of ``laserlm eval`` (and of ``laserlm generate --backend onnxruntime``).

:class:`OnnxLM` opens an export directory of :mod:`laserlm.export.onnx` and offers what the evaluator
(:class:`laserlm.evaluation.tasks.Evaluator`) reads of a loaded model: ``tokenizer``, ``generate(...)``,
``describe()``, ``weights``; its :meth:`OnnxLM.scorer` builds an :class:`OnnxScorer`, which has the interface the
evaluator uses on :class:`laserlm.evaluation.scoring.Scorer` (``score``, ``logits``, ``mode``, ``activate``,
``batch_rows``, ``max_seq_len``) and returns the same :class:`~laserlm.runtime.scores.SequenceScore`.

- Full depth: one pass of every group graph over each sequence with the head on the scored positions; up to the
  export's max batch of sequences are right-padded into one call (padding after a row's last token cannot change
  the causal attention of its earlier positions).
- Adaptive depth: teacher-forced like the engine's ``AdaptiveDepth.score``: position 0 is a one-token prefill at
  full depth, every later token one :meth:`~laserlm.export.ort_backend.OnnxDecoder.step` (exit decisions, patience and
  the propagate bridge as in generation); the layers per position are the exit layers.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CorruptModelError, InvalidArgumentError
from ..runtime.scores import SequenceScore, check_score_length, target_scores
from .ort_backend import OnnxCache, OnnxDecoder, OnnxModel, make_onnx_mode


class OnnxScorer:
    """Scores token sequences with one :class:`~laserlm.export.ort_backend.OnnxDecoder` (full or adaptive depth).

    Args:
        decoder: from :func:`~laserlm.export.ort_backend.make_onnx_mode`.

    Attributes:
        mode: the decoder (what :meth:`OnnxLM.generate` takes as ``mode``).
        batch_rows: sequences worth scoring per call (the export's max batch at full depth, 1 adaptive).
        max_seq_len: the export's max length: the longest input :meth:`score` feeds.
    """

    def __init__(self, decoder: OnnxDecoder):
        self.mode = decoder
        self.max_seq_len = decoder.model.max_len
        self.batch_rows = decoder.model.max_batch if decoder.adaptive is None else 1

    def activate(self) -> None:
        """Nothing to install: the graphs have dense attention only (here for the scorer interface)."""

    def logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [T]`` -> ``(logits [T, V] float32, layers [T])``, teacher-forced.

        Raises:
            ContextLengthError: ``T`` above the export's max length.
        """
        dec, n_layers = self.mode, self.mode.model.num_layers
        ids = np.asarray(input_ids, dtype=np.int64).reshape(1, -1)
        if dec.adaptive is None:
            h = dec.full_depth(ids, OnnxCache(dec.model))
            return torch.from_numpy(dec.head(h)[0]), torch.full((ids.shape[1],), float(n_layers))
        state = dec.new_state()
        first = dec.prefill(state, ids[:, :1])
        logits = torch.empty(ids.shape[1], first.shape[-1])
        layers = torch.empty(ids.shape[1])
        logits[0], layers[0] = first, n_layers
        for i in range(1, ids.shape[1]):
            logits[i], info = dec.step(state, int(ids[0, i]))
            layers[i] = info["exit_layer"]
        return logits, layers

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[SequenceScore]:
        """Score the tokens ``seq[start:]`` of each sequence given ``seq[:start]`` (``start >= 1``).

        Raises:
            ContextLengthError: a sequence longer than the export's max length + 1.
        """
        for s in seqs:
            check_score_length(s, self.max_seq_len)
        if self.mode.adaptive is not None:
            out = []
            for ids, start in zip(seqs, starts):
                logits, layers = self.logits(torch.tensor(ids[:-1]))
                out.append(target_scores(logits[start - 1:], torch.tensor(ids[start:]), layers[start - 1:]))
            return out
        n = self.batch_rows
        return [r for i in range(0, len(seqs), n) for r in self._score_full(seqs[i:i + n], starts[i:i + n])]

    def _score_full(self, seqs, starts) -> list[SequenceScore]:
        """At most ``batch_rows`` sequences right-padded into one full-depth pass."""
        dec = self.mode
        lens = [len(s) - 1 for s in seqs]
        ids = np.zeros((len(seqs), max(lens)), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, :lens[i]] = s[:-1]
        first = min(starts) - 1
        h = dec.full_depth(ids, OnnxCache(dec.model, batch=len(seqs)))
        logits = torch.from_numpy(dec.head(np.ascontiguousarray(h[:, first:])))
        out = []
        for i, (s, start) in enumerate(zip(seqs, starts)):
            lg = logits[i, start - 1 - first:lens[i] - first]
            out.append(target_scores(lg, torch.tensor(s[start:]), torch.full((lg.shape[0],),
                                                                              float(dec.model.num_layers))))
        return out


class OnnxLM:
    """An export directory opened for evaluation and generation (the onnxruntime counterpart of
    :class:`laserlm.LaserLM` for what ``eval`` and ``generate`` use).

    Args:
        path: the directory written by ``laserlm export onnx``.
        threads: onnxruntime intra-op threads (default: onnxruntime's).

    Attributes: ``model`` (:class:`~laserlm.export.ort_backend.OnnxModel`), ``tokenizer``, ``eos_ids``,
    ``max_seq_len`` (the export's max length), ``weights`` (the manifest's: ``fp32``, or the blocks of a quantized
    export), ``dtype`` (of the activations: ``float32``), ``threads``.

    Raises:
        ModelNotFoundError / CorruptModelError: no valid export at ``path``, or it has no readable tokenizer.
    """

    dtype = "float32"

    def __init__(self, path, threads: int | None = None):
        self.model = OnnxModel(path, threads=threads)
        self.threads = threads
        self.tokenizer = load_tokenizer(self.model)
        self.eos_ids = set(self.model.manifest["model"].get("eos_token_ids", []))
        self.max_seq_len = self.model.max_len
        self.weights = self.model.manifest.get("weights", "fp32")

    def mode(self, spec="full") -> OnnxDecoder:
        """The decoder of a mode spec (``full`` or ``adaptive[:options]``, :func:`make_onnx_mode`), or ``spec``
        itself when it is a decoder already."""
        return spec if isinstance(spec, OnnxDecoder) else make_onnx_mode(self.model, spec)

    def scorer(self, config: str) -> OnnxScorer:
        """An :class:`OnnxScorer` for a configuration ``MODE_SPEC`` (no ``@ATTENTION`` part).

        Raises:
            InvalidArgumentError: an ``@ATTENTION`` part (the graphs have dense attention only), or a mode the
                backend does not run (:func:`make_onnx_mode`).
        """
        mode, sep, attn = config.partition("@")
        if sep:
            raise InvalidArgumentError(f"the onnxruntime backend has dense attention only: drop '@{attn}' from "
                                       f"configuration '{config}'")
        return OnnxScorer(self.mode(mode))

    def stream(self, prompt, *, chat: bool = False, mode="full", on_token=None, **sampling):
        """Start generating (as :meth:`laserlm.LaserLM.stream`); ``mode`` is a spec or an :class:`OnnxDecoder`.

        Raises:
            InvalidArgumentError: bad sampling values, an empty prompt, a mode the backend does not run.
            ContextLengthError: a prompt longer than the export's max length.
        """
        from ..runtime.generate import Generation, encode_prompt  # noqa: PLC0415
        from ..runtime.sampling import SamplingParams  # noqa: PLC0415

        params = SamplingParams(**sampling).validate()
        source = self.mode(mode).token_source()
        ids = encode_prompt(self.tokenizer, prompt, chat, self.max_seq_len)
        return Generation(self.tokenizer, ids, source, params, self.eos_ids, self.max_seq_len, on_token=on_token)

    def generate(self, prompt, *, chat: bool = False, mode="full", **sampling):
        """Generate to completion; returns a :class:`~laserlm.runtime.generate.GenerationResult`."""
        return self.stream(prompt, chat=chat, mode=mode, **sampling).run()

    def describe(self) -> str:
        """One line: graph weights, layer groups, exit points, laser file, declared shapes."""
        man = self.model.manifest
        laser = (man.get("laser") or {}).get("source")
        return (f"{self.weights} graphs, {self.model.num_layers} layers in groups {man.get('groups_spec')}, "
                f"exit points {[e['layer'] for e in man['exits']]}" + (f", laser file {laser}" if laser else "")
                + f", max len {self.max_seq_len}, max batch {self.model.max_batch}")


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
