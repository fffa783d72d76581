"""The dtypes laserlm offers for weights and activations: ``float32`` and ``bfloat16``.

``float16`` is refused, by the Python API and the CLI with the same message (issue 18 item 6, vLLM #17364):
its range (max 65504) is too small for these models' residual streams. Gemma3-270M's reaches ``inf`` at
decoder layer 7, then NaN, and greedy decoding emitted token id 0 until ``max_new_tokens``. Until a
precision-safe float16 path exists, the only honest answer is to refuse it up front; the generation loop
also refuses NaN/inf logits (:class:`~laserlm.errors.NonFiniteLogitsError`) whatever the cause.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError

OFFERED_DTYPES = ("float32", "bfloat16")


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def dtype_error_message(dtype) -> str:
    """The one-line refusal of ``dtype`` (a name or a ``torch.dtype``), shared by the API and the CLI."""
    name = _name(dtype)
    why = " (float16 overflows to inf/NaN in these models)" if name in ("float16", "half") else ""
    return f"unsupported dtype '{name}'; choose one of {', '.join(OFFERED_DTYPES)}{why}"


def check_offered_dtype(dtype) -> str:
    """Return the name of ``dtype`` (``"float32"``, ``"bfloat16"``, or the ``torch.dtype`` of one of them).

    Raises:
        InvalidArgumentError: any other dtype, ``float16`` included (:func:`dtype_error_message`).
    """
    name = _name(dtype)
    if name not in OFFERED_DTYPES:
        raise InvalidArgumentError(dtype_error_message(dtype))
    return name
