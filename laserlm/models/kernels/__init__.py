"""Build and load laserlm's block-quantized CPU kernels (``quant.cpp``) once per machine.

The C++ source (``quant.cpp`` and the matrix kernels it includes, ``qgemm.h``) is compiled with ``torch.utils.cpp_extension`` for the host CPU (``-march=native``) the
first time a quantized model is used, and cached under ``<laserlm cache>/kernels/<key>`` where the key
hashes the source, the torch version and the CPU flags, so a moved cache never runs code built for
another processor. Compilation needs a C++ compiler and ninja (about a minute on 2 cores); when it is
not possible, :func:`ops` returns ``None`` and callers use the pure-PyTorch reference path
(:mod:`laserlm.models.quant`), which is exact but slow, after one warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

from ...cpuinfo import cpu_flags as _cpu_flags  # the module name the tests replace

_SOURCE = Path(__file__).with_name("quant.cpp")
_HEADERS = (Path(__file__).with_name("qgemm.h"),)  # included by quant.cpp
_lock = threading.Lock()
_ops = None
_tried = False
_error: str | None = None


def build_key() -> str:
    """Hash of the kernel source, torch version and CPU flags (names the build directory)."""
    raw = b"".join(p.read_bytes() for p in (_SOURCE, *_HEADERS)) + torch.__version__.encode() + _cpu_flags().encode() + sys.version.encode()
    return hashlib.sha1(raw).hexdigest()[:16]


def _build():
    from torch.utils import cpp_extension  # noqa: PLC0415

    from ..cache import cache_root  # noqa: PLC0415

    build_dir = cache_root() / "kernels" / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja may come from the virtualenv's bin folder, which is not on PATH when the venv is not activated
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # -fopenmp makes at::parallel_for use torch's own OpenMP runtime (libgomp.so.1 is already loaded by torch,
    # so the loader reuses it: one thread pool, no oversubscription)
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
    return cpp_extension.load_inline(
        name="laserlm_quant",
        cpp_sources=[_SOURCE.read_text()],
        functions=None,  # quant.cpp has its own PYBIND11_MODULE (functions and the LayerStack class)
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(_SOURCE.parent)],
        build_directory=str(build_dir),
        verbose=False,
    )


@functools.lru_cache(maxsize=1)
def hardware_bf16_gemm() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware for PyTorch (oneDNN), so that a bfloat16 GEMM beats
    float32:

    - the AMX-BF16 tile unit (Intel Xeon 4th generation and later), with the kernel's permission to use it granted
      (``torch._C._cpu._init_amx``; a VM may not grant it). A bfloat16 GEMM there runs several times faster
      than float32;
    - AVX512-BF16 (``vdpbf16ps``; e.g. AMD Zen 4, Intel Cooper Lake): about twice float32 on prefill shapes.

    CPUs with neither (AVX2 only) return False: oneDNN then emulates bfloat16, slower than float32."""
    flags = _cpu_flags().split()
    if "amx_bf16" in flags:
        try:
            if bool(torch._C._cpu._init_amx()):
                return True
        except (AttributeError, RuntimeError):
            pass
    return "avx512_bf16" in flags


ISA_NAMES = ("avx512", "avx2", "scalar")


def _check_isa_env() -> None:
    """Normalise ``LASERLM_KERNEL_ISA`` (case, blanks) before the compiled module reads it at import.

    Raises:
        InvalidArgumentError: a value other than avx512, avx2 or scalar (the C++ module would abort the process).
    """
    raw = os.environ.get("LASERLM_KERNEL_ISA")
    if raw is None or not raw.strip():
        return
    value = raw.strip().lower()
    if value not in ISA_NAMES:
        from ...errors import InvalidArgumentError  # noqa: PLC0415

        raise InvalidArgumentError(f"LASERLM_KERNEL_ISA={raw!r} is not a kernel variant; use one of "
                                   f"{', '.join(ISA_NAMES)} (or unset it for the best this CPU runs)")
    os.environ["LASERLM_KERNEL_ISA"] = value


def ops():
    """The compiled kernel module (``qmatmul``, ``dequantize``, ``decode_layer``, ``has_avx2`` and the ``LayerStack``
    class), or ``None`` if it cannot be built.

    Set ``LASERLM_NO_KERNELS=1`` to force the PyTorch reference path (with a warning).
    """
    global _ops, _tried, _error
    if _tried:
        return _ops
    with _lock:
        if _tried:
            return _ops
        _check_isa_env()
        if os.environ.get("LASERLM_NO_KERNELS", "").strip().lower() in ("1", "true", "yes", "on"):
            _error = "LASERLM_NO_KERNELS is set"
            warnings.warn("laserlm: LASERLM_NO_KERNELS is set: quantized weights run on the slow PyTorch reference "
                          "path", RuntimeWarning, stacklevel=2)
        elif (prebuilt := _load_prebuilt()) is not None:
            _ops = prebuilt
        else:
            try:
                print("laserlm: building the quantized CPU kernels for this machine (once, about a minute) ...",
                      file=sys.stderr)
                _ops = _build()
            except Exception as exc:  # compiler missing, ninja missing, build error
                _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
                warnings.warn(f"laserlm: cannot build the quantized CPU kernels ({_error}); quantized weights run "
                              "on the slow PyTorch reference path", RuntimeWarning, stacklevel=2)
        _tried = True
    return _ops


def _load_prebuilt():
    """The already compiled module of this source/torch/CPU, imported directly (no build lock, so a read-only
    cache works), or ``None``."""
    import importlib.util  # noqa: PLC0415

    from ..cache import cache_root  # noqa: PLC0415

    d = cache_root() / "kernels" / build_key()
    so = next(iter(sorted(d.glob("laserlm_quant*.so"))), None) if d.is_dir() else None
    if so is None:
        return None
    try:
        spec = importlib.util.spec_from_file_location("laserlm_quant", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod if mod.has_avx2() in (True, False) else None
    except Exception:  # noqa: BLE001 - a broken file is rebuilt
        return None


def unavailable_reason() -> str | None:
    """Why :func:`ops` returned ``None`` (after it was called), else ``None``."""
    return _error
