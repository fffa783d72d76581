"""The tensor table of a GGUF file, read fast: names, types, shapes and memory-mapped data, without the metadata values.

Used by packing (``--weights native``), :mod:`laserlm.models.gguf_native` and the loader's early check of a file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CorruptModelError


class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.GGUFReader`` describes it: ``shape`` in ggml order (``[K, N]`` for a
    matrix), ``data`` a read-only memory map shaped like the reader's (``[N, row_bytes]`` uint8 for block types,
    ``[N, K]`` for F32/F16)."""

    __slots__ = ("name", "tensor_type", "shape", "n_elements", "n_bytes", "data", "offset")

    def __init__(self, name, tensor_type, shape, n_elements, n_bytes, data, offset=0):
        self.name, self.tensor_type, self.shape = name, tensor_type, shape
        self.n_elements, self.n_bytes, self.data = n_elements, n_bytes, data
        self.offset = offset  # bytes from the start of the file


class GGUFTensors:
    """The tensor table of a GGUF file (v2/v3), read without parsing the metadata values.

    ``gguf.GGUFReader`` builds an array view per metadata string: on Gemma 3's 262k-token vocabulary that is ~10 s
    and ~700 MB per open, every time the file is opened. This reads the header, skips the metadata values (keeping
    only ``general.architecture`` and ``general.alignment``), reads the tensor infos, and memory-maps the data; it is
    what packing, the size estimates and the weights hash read. Format: ggml's ``docs/gguf.md``.

    Raises:
        CorruptModelError: not a GGUF file, an unknown version or value type, or a table past the file's end.
    """

    _SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def __init__(self, path):
        import struct  # noqa: PLC0415

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415

        self.path = Path(path)
        mm = np.memmap(self.path, mode="r")
        buf = memoryview(mm)
        pos = 0

        def take(fmt):
            nonlocal pos
            vals = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return vals if len(vals) > 1 else vals[0]

        def string() -> bytes:
            nonlocal pos
            n = take("Q")
            out = bytes(buf[pos:pos + n])
            pos += n
            return out

        def skip(vtype):
            nonlocal pos
            if vtype in self._SCALARS:
                pos += self._SCALARS[vtype]
            elif vtype == 8:
                n = take("Q")  # (not `pos += take(...)`: that adds to pos as it was before take moved it)
                pos += n
            elif vtype == 9:
                itype, count = take("IQ")
                if itype in self._SCALARS:
                    pos += count * self._SCALARS[itype]  # take() has returned: pos is current
                else:
                    for _ in range(count):
                        skip(itype)
            else:
                raise CorruptModelError(f"cannot read GGUF file {self.path}: unknown value type {vtype}")

        try:
            if bytes(buf[:4]) != b"GGUF":
                raise CorruptModelError(f"{self.path} is not a GGUF file")
            pos = 4
            version, n_tensors, n_kv = take("IQQ")
            if version not in (2, 3):
                raise CorruptModelError(f"cannot read GGUF file {self.path}: version {version} is not supported "
                                        "(2 and 3 are)")
            self.arch, alignment = "", 32
            for _ in range(n_kv):
                key, vtype = string(), take("I")
                if key == b"general.architecture" and vtype == 8:
                    self.arch = string().decode()
                elif key == b"general.alignment" and vtype == 4:
                    alignment = take("I")
                else:
                    skip(vtype)
            infos = []
            for _ in range(n_tensors):
                name = string().decode()
                dims = [take("Q") for _ in range(take("I"))]
                infos.append((name, dims, GGMLQuantizationType(take("I")), take("Q")))
            start = -(-pos // alignment) * alignment
            self.tensors = []
            for name, dims, ttype, offset in infos:
                n_el = int(np.prod(dims))
                block, size = GGML_QUANT_SIZES[ttype]
                nbytes = n_el // block * size
                lo = start + offset
                if lo + nbytes > len(mm):
                    raise CorruptModelError(f"cannot read GGUF file {self.path}: tensor {name} runs past the end "
                                            "of the file (truncated?)")
                raw = mm[lo:lo + nbytes]
                rows = list(reversed(dims))
                if ttype == GGMLQuantizationType.F32:
                    data = raw.view(np.float32).reshape(rows)
                elif ttype == GGMLQuantizationType.F16:
                    data = raw.view(np.float16).reshape(rows)
                else:
                    data = raw.reshape(rows[:-1] + [dims[0] // block * size])
                self.tensors.append(GGUFTensor(name, ttype, np.array(dims), n_el, nbytes, data, lo))
        except (struct.error, ValueError, KeyError) as exc:
            raise CorruptModelError(f"cannot read GGUF file {self.path}: damaged header or truncated file "
                                    f"({type(exc).__name__}: {exc})") from exc
        self.by_name = {t.name: t for t in self.tensors}
        self._map = mm

    def release(self, tensor: GGUFTensor) -> None:
        """Drop ``tensor``'s pages of the memory-mapped file from this process's resident memory
        (``madvise(MADV_DONTNEED)``; a later read maps them again from the file). Packing calls it after converting
        each tensor, so a load's peak RSS does not hold the file's pages on top of the packed copy: without it an 8B
        Q4_K_M file (4.6 GiB) stayed resident beside its 5.6 GB of packed weights."""
        import mmap  # noqa: PLC0415

        m = getattr(self._map, "_mmap", None)
        if m is None or not hasattr(m, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return  # not Linux/macOS: nothing to do
        lo = tensor.offset // mmap.PAGESIZE * mmap.PAGESIZE
        m.madvise(mmap.MADV_DONTNEED, lo, tensor.offset + tensor.n_bytes - lo)
