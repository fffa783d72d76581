"""Errors raised by laserlm.

Every error a user can cause derives from :class:`LaserLMError`; the CLI prints its message on one
line and exits with status 2, never a traceback. Errors about argument values also derive from
:class:`ValueError` so that library users can catch them the usual way.
"""


class LaserLMError(Exception):
    """Base class of all user-facing laserlm errors."""


class ModelNotFoundError(LaserLMError, FileNotFoundError):
    """An unknown bundled model name, or a path that does not exist."""


class DataFileError(LaserLMError, FileNotFoundError):
    """A data file (evaluation or calibration text, a data directory, a Hugging Face dataset) is missing or
    cannot be read or parsed; the message names the flag or environment variable that chooses it."""


class CorruptModelError(LaserLMError):
    """A model or artifact file exists but cannot be read."""


class UnsupportedArchitectureError(LaserLMError):
    """The model's architecture has no laserlm adapter."""


class ContextLengthError(LaserLMError, ValueError):
    """A prompt (or prompt plus requested tokens) longer than the engine's context."""


class InvalidArgumentError(LaserLMError, ValueError):
    """An out-of-range or inconsistent argument (sampling values, thresholds, groups, ...)."""


class NonFiniteLogitsError(LaserLMError):
    """The model produced NaN or infinite logits (overflowing activations, e.g. float16, or damaged weights).

    Raised by the generation loop before a token is picked, since every token drawn from such logits would be
    garbage (the argmax of all-NaN logits is token 0)."""


class PoolFullError(LaserLMError):
    """The KV memory pool cannot take a request: it could never fit the budget, or the waiting queue is full.

    The message names the budget (``--kv-budget``) and what to change. Requests already admitted are never
    dropped for lack of pages (admission reserves their pages)."""


class QueueFullError(PoolFullError):
    """The waiting queue is at its bound (``max_queue``): the request would fit, but not now. A server answers
    it with 429 (retry later), unlike a request that could never fit the budget (400)."""


class PrecisionError(LaserLMError):
    """A reduced-precision forward would overflow (the message names the decoder layer); see
    :mod:`laserlm.runtime.ranges`."""
