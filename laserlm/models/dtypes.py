"""The dtypes laserlm offers for weights and activations: ``float32``, ``bfloat16`` and guarded ``float16``.

``float16`` alone is unsafe in these models (vLLM #17364): its range (max 65504) is too small for
their residual streams. Gemma3-270M's reaches ``inf`` at decoder layer 7, then NaN, and greedy decoding emitted
token id 0 until ``max_new_tokens``. So a float16 engine always runs under
:class:`~laserlm.runtime.ranges.Float16Guard` (seed 004 §5.3): norms in float32, and a decoder layer whose
output would overflow float16 is re-run and from then on run in float32 (or refused, naming the layer). The
generation loop also refuses NaN/inf logits (:class:`~laserlm.errors.NonFiniteLogitsError`) whatever the cause.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError

# weight formats (`--weights`) and prefill dtypes (`--prefill-dtype`); here, not in quant.py, so that the CLI parser
# can list them without importing torch
WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8", "int4", "native")
PREFILL_DTYPES = ("auto", "int16", "float32", "bfloat16")

OFFERED_DTYPES = ("float32", "bfloat16", "float16")


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def dtype_error_message(dtype) -> str:
    """The one-line refusal of ``dtype`` (a name or a ``torch.dtype``), shared by the API and the CLI."""
    return f"unsupported dtype '{_name(dtype)}'; choose one of {', '.join(OFFERED_DTYPES)}"


def check_offered_dtype(dtype) -> str:
    """Return the name of ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``, or the ``torch.dtype`` of one).

    Raises:
        InvalidArgumentError: any other dtype (:func:`dtype_error_message`).
    """
    name = _name(dtype)
    if name not in OFFERED_DTYPES:
        raise InvalidArgumentError(dtype_error_message(dtype))
    return name
