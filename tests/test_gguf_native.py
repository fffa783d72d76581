"""Opening a GGUF file with native weights without a float copy (laserlm.models.gguf_native).

The files are the bundled GGUFs cut to their first two layers (the real vocabularies, tokenizers, tensor types and
rope settings), written with gguf-py's own writer. References: the old path (transformers' dequantized float model,
then packed), transformers' float model for the weights hash, and gguf-py's reader for the tensor table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laserlm.errors import CorruptModelError, InvalidArgumentError
from laserlm.models import gguf_file, gguf_native
from laserlm.models.registry import BUNDLED

LAYERS = 2


def cut_gguf(src, dst, layers: int = LAYERS):
    """``src`` with only blocks ``0..layers-1`` (and ``<arch>.block_count = layers``), every other field and tensor
    copied as stored."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch=arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        value = layers if name == f"{arch}.block_count" else f.contents()
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape,
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def cut(request, tmp_path_factory):
    try:
        src = BUNDLED[request.param].locate()
    except Exception as exc:  # noqa: BLE001 - gemma3 is an optional extra
        pytest.skip(f"{request.param} not installed: {exc}")
    d = tmp_path_factory.mktemp(request.param)
    return cut_gguf(src, d / f"{request.param}-2l.gguf")


@pytest.fixture(scope="module")
def cache(cut):
    """A cache of the cut file's own (its tokenizer conversion is the slow part: made once per file)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LASERLM_CACHE", str(cut.parent / "cache"))
        yield cut.parent / "cache"


def test_tensor_table_equals_gguf_reader(cut):
    from gguf import GGUFReader

    ours, ref = gguf_file.GGUFTensors(cut), GGUFReader(str(cut))
    assert ours.arch == ref.fields["general.architecture"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape) and a.n_bytes == b.n_bytes
        assert a.data.shape == b.data.shape and np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_damaged_tensor_table_is_a_clear_error(cut, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(cut.read_bytes()[: cut.stat().st_size // 3])  # tensors run past the end
    with pytest.raises(CorruptModelError, match="past the end|damaged"):
        gguf_file.GGUFTensors(bad)
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CorruptModelError):
        gguf_file.GGUFTensors(bad)


def test_native_load_makes_no_float_copy_of_a_packed_matrix(cut, cache, monkeypatch):
    """Structural: no float tensor torch makes during the load, and no array gguf-py dequantizes, has a packed
    matrix's shape or more than one conversion chunk's weights; the parameters stay on meta until packed; no float
    copy is written."""
    from gguf import quants
    from torch.utils._python_dispatch import TorchDispatchMode

    from laserlm.models.loader import load_model

    table = gguf_file.GGUFTensors(cut)
    packed = {(int(t.shape[1]), int(t.shape[0])) for t in table.tensors if len(t.shape) == 2}
    forbidden = packed | {(k, n) for n, k in packed}
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.is_floating_point() and not o.is_meta:
                    seen.append(("torch", func.__name__, tuple(o.shape)))
            return out

    real = quants.dequantize

    def dequantize(data, qtype):
        out = real(data, qtype)
        seen.append(("gguf", "dequantize", tuple(out.shape)))
        return out

    monkeypatch.setattr(quants, "dequantize", dequantize)
    materialized = []
    from laserlm.models import packing  # load_native imports pack_model at call time: patch it there

    real_pack = packing.pack_model

    def pack(model, *a, **k):
        materialized.extend(n for n, p in model.named_parameters() if gguf_native._is_packed(n) and not p.is_meta)
        return real_pack(model, *a, **k)

    monkeypatch.setattr(packing, "pack_model", pack)
    from laserlm.models.loader import convert_gguf

    for f in list(cache.rglob("packed-*")) + list(cache.rglob("model.safetensors")):
        f.unlink()  # pack from the file, not from a cache another test wrote
    convert_gguf(cut, progress=False, float_copy=False)  # config + tokenizer from the metadata (no tensor is read)
    with Record():
        lm = load_model(str(cut), weights="native")
    assert materialized == [], f"packed matrices were materialized before packing: {materialized[:3]}"
    from laserlm.models.quant import CONVERT_WEIGHTS

    bad = [s for s in seen if s[2] in forbidden or (len(s[2]) == 2 and s[2][0] * s[2][1] > CONVERT_WEIGHTS)]
    assert not bad, f"float tensors of a packed matrix's size were made: {bad[:5]}"
    assert not (lm.path / "model.safetensors").exists()
    assert not [n for n, p in lm.model.named_parameters() if p.is_meta]


def test_native_load_equals_the_float_path_and_hashes_alike(cut, cache):
    """Logits equal the old path (transformers' float copy, then packed from the same file) bit for bit, and the
    streaming weights hash equals the float model's."""
    from laserlm.models.loader import gguf_source_of, load_model
    from laserlm.models.packing import pack_model
    from laserlm.models.weights_hash import compute_weights_sha256, weights_sha256

    lm = load_model(str(cut), weights="native")
    ref = load_model(str(cut), weights="fp32")
    assert weights_sha256(lm.model) == compute_weights_sha256(ref.model)
    pack_model(ref.model, "native", gguf_path=gguf_source_of(ref.path))
    ids = torch.tensor([lm.tokenizer("The capital of France is a city with")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, ref.model(ids).logits)
    again = load_model(str(cut), weights="native")  # from the packed cache
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, ref.model(ids).logits)


def test_k_quants_kept_natively_on_request(cut, cache, monkeypatch):
    """``LASERLM_KQUANTS=native`` keeps the file's Q4_K and Q6_K tensors (Gemma3's) as they are, in a packed cache of
    its own: its logits are closer to transformers' float model (which dequantizes them exactly) than the default
    conversions (Q4_1 with fp16 scales, Q8_0), and equal again when read back from the cache."""
    from gguf import GGMLQuantizationType as T

    from types import SimpleNamespace

    from laserlm.defaults import _model_key
    from laserlm.models.gguf_file import GGUFTensors
    from laserlm.models.loader import load_model, packed_cache_path

    if not {T.Q4_K, T.Q6_K} <= {t.tensor_type for t in GGUFTensors(cut).tensors}:
        pytest.skip("no Q4_K and Q6_K tensors in this file")
    ref = load_model(str(cut), weights="fp32")
    default = load_model(str(cut), weights="native")
    monkeypatch.setenv("LASERLM_KQUANTS", "native")
    kept = load_model(str(cut), weights="native")
    assert {"Q4_K", "Q6_K"} <= set(kept.pack_report.formats) and not {"Q4_K", "Q6_K"} & set(default.pack_report.formats)
    assert packed_cache_path(kept.path, "native").name.startswith("packed-native-kquants-")
    native = SimpleNamespace(loaded=kept, weights="native", dtype=torch.float32)
    with_kept = _model_key(native)  # a default certified on the conversions is not reused on the kept matrices
    assert with_kept["kquants"] == "native" and with_kept != _without_env(monkeypatch, lambda: _model_key(native))
    ids = torch.tensor([kept.tokenizer("The capital of France is a city with")["input_ids"]])
    with torch.no_grad():
        r, d, k = ref.model(ids).logits, default.model(ids).logits, kept.model(ids).logits
        assert (k - r).norm() < (d - r).norm()
        again = load_model(str(cut), weights="native")
        assert again.pack_report.cached and torch.equal(again.model(ids).logits, k)
        monkeypatch.delenv("LASERLM_KQUANTS")
        back = load_model(str(cut), weights="native")  # the default's own cache, untouched by the kept one
        assert back.pack_report.cached and back.pack_report.formats == default.pack_report.formats
        assert torch.equal(back.model(ids).logits, d)


def _without_env(monkeypatch, f):
    """``f()`` with ``LASERLM_KQUANTS`` unset, then set back to ``native``."""
    monkeypatch.delenv("LASERLM_KQUANTS")
    try:
        return f()
    finally:
        monkeypatch.setenv("LASERLM_KQUANTS", "native")


def test_keeping_k_quants_makes_a_cache_of_its_own_only_for_files_that_hold_them(cut, cache, monkeypatch):
    """Under ``LASERLM_KQUANTS=native`` a file without Q4_K / Q6_K tensors (SmolLM2's) packs exactly as by default,
    so it keeps the default's packed cache instead of writing a duplicate; Gemma3's file gets a cache of its own."""
    from gguf import GGMLQuantizationType as T

    from laserlm.models.gguf_file import GGUFTensors
    from laserlm.models.loader import convert_gguf, packed_cache_path

    holds = bool({T.Q4_K, T.Q6_K} & {t.tensor_type for t in GGUFTensors(cut).tensors})
    where = convert_gguf(cut, progress=False, float_copy=False)
    monkeypatch.delenv("LASERLM_KQUANTS", raising=False)
    default = {w: packed_cache_path(where, w) for w in ("native", "int8")}
    monkeypatch.setenv("LASERLM_KQUANTS", "native")
    kept = {w: packed_cache_path(where, w) for w in ("native", "int8")}
    assert (kept["native"] != default["native"]) is holds and ("-kquants" in kept["native"].name) is holds
    assert kept["int8"] == default["int8"]


def test_too_large_for_memory_is_refused_before_allocation(cut, cache, monkeypatch):
    from laserlm.models.loader import load_model

    monkeypatch.setattr(gguf_native, "memory_available_bytes", lambda: 1 << 20)
    monkeypatch.setattr(gguf_native, "build_meta_model", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(InvalidArgumentError, match="GiB, but this machine has 0.0 GiB"):
        load_model(str(cut), weights="native")
    for f in cache.rglob("model.safetensors"):
        f.unlink()  # a float copy another test made
    with pytest.raises(InvalidArgumentError, match="--weights native"):
        load_model(str(cut), weights="fp32")


def _resident_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_released_tensor_pages_leave_resident_memory(cut):
    """Packing releases each converted tensor's pages of the mapped file, so a load does not hold the file resident
    beside its packed copy (an 8B Q4_K_M file is 4.6 GiB): after reading the largest tensor its pages are resident,
    after release they are not."""
    table = gguf_file.GGUFTensors(cut)
    t = max(table.tensors, key=lambda x: x.n_bytes)
    assert t.n_bytes > 4 << 20
    before = _resident_kib(cut.resolve())
    float(np.asarray(t.data).sum(dtype=np.uint64))  # touch every page
    touched = _resident_kib(cut.resolve())
    assert touched - before > t.n_bytes // 1024 // 2
    table.release(t)
    assert _resident_kib(cut.resolve()) - before < 64  # at most the pages shared with the neighbours
