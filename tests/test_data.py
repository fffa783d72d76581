"""laserlm.data: the one resolver of data paths (explicit --data, $LASERLM_DATA, the checkout's ../shared/data)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import laserlm
from laserlm import data as data_mod
from laserlm.data import HFDataset, find_data_root, is_test_split, parse_hf, read_text, resolve
from laserlm.errors import DataFileError, InvalidArgumentError, LaserLMError


@pytest.fixture
def no_default(monkeypatch):
    """No data directory configured: no environment variable, no checkout data."""
    monkeypatch.delenv("LASERLM_DATA", raising=False)
    monkeypatch.delenv("LASERLM_DATA_DIR", raising=False)
    monkeypatch.setattr(data_mod, "checkout_data_dir", lambda: None)


@pytest.fixture
def fake_datasets(monkeypatch):
    """A stand-in ``datasets`` module recording load_dataset calls (no network, no cache)."""
    calls = []
    mod = types.ModuleType("datasets")

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "broken":
            raise ConnectionError("no network")
        return [{"text": " = Title = \n"}, {"text": " body line\n"}, {"text": "last"}]

    mod.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", mod)
    real = data_mod.importlib.util.find_spec
    monkeypatch.setattr(data_mod.importlib.util, "find_spec",
                        lambda name, *a: mod if name == "datasets" else real(name, *a))
    return calls


def _tree(root: Path) -> Path:
    (root / "wikitext-2").mkdir(parents=True)
    (root / "wikitext-2" / "valid.txt").write_text("valid text\n")
    return root


def test_explicit_file_is_used_as_is(tmp_path, no_default):
    f = tmp_path / "my.txt"
    f.write_text("x")
    assert resolve(f, "wikitext-2/valid.txt") == f
    assert resolve(str(f)) == f


def test_explicit_directory_looks_up_the_default_file(tmp_path, no_default):
    root = _tree(tmp_path / "d")
    assert resolve(root, "wikitext-2/valid.txt") == root / "wikitext-2" / "valid.txt"
    assert resolve(root) == root
    with pytest.raises(DataFileError, match=r"lambada/x.jsonl.*--data"):
        resolve(root, "lambada/x.jsonl")


def test_explicit_missing_path_names_the_flag(tmp_path, no_default):
    with pytest.raises(DataFileError, match="calibration text not found: .*nope.*--data: no such file"):
        resolve(tmp_path / "nope", "wikitext-2/valid.txt", what="calibration text")


def test_env_var_and_its_alias(tmp_path, monkeypatch, no_default):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    monkeypatch.setenv("LASERLM_DATA_DIR", str(b))
    assert find_data_root() == b
    assert resolve(None, "wikitext-2/valid.txt") == b / "wikitext-2" / "valid.txt"
    monkeypatch.setenv("LASERLM_DATA", str(a))  # the main name wins over the alias
    assert find_data_root() == a
    assert resolve(None, "wikitext-2/valid.txt") == a / "wikitext-2" / "valid.txt"
    with pytest.raises(DataFileError, match=r"\$LASERLM_DATA.*--data"):
        resolve(None, "arc/ARC-Easy-Dev.jsonl")
    monkeypatch.setenv("LASERLM_DATA", str(tmp_path / "missing"))
    with pytest.raises(DataFileError, match="does not exist.*--data"):
        data_mod.data_root()


def test_nothing_configured_is_an_error_naming_flag_and_env(no_default):
    assert find_data_root() is None
    for call in (lambda: resolve(None, "wikitext-2/valid.txt"), data_mod.data_root):
        with pytest.raises(DataFileError) as exc:
            call()
        assert "--data" in str(exc.value) and "LASERLM_DATA" in str(exc.value)
        assert isinstance(exc.value, LaserLMError)


def test_checkout_default_is_derived_from_the_package_location(monkeypatch):
    monkeypatch.delenv("LASERLM_DATA", raising=False)
    monkeypatch.delenv("LASERLM_DATA_DIR", raising=False)
    repo = Path(laserlm.__file__).resolve().parent.parent
    expect = repo.parent / "shared" / "data"
    got = data_mod.checkout_data_dir()
    assert got == (expect if expect.is_dir() and (repo / "pyproject.toml").is_file() else None)
    assert find_data_root() == got


def test_no_machine_paths_in_the_package():
    pkg = Path(laserlm.__file__).resolve().parent
    hits = [f"{p.relative_to(pkg)}:{n}" for p in pkg.rglob("*.py")
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "/work/" in line]
    assert hits == []


def test_hf_spec_syntax():
    assert parse_hf("hf:wikitext:wikitext-2-raw-v1:validation") == HFDataset("wikitext", "wikitext-2-raw-v1",
                                                                             "validation")
    assert parse_hf("hf:org/name::test") == HFDataset("org/name", None, "test")
    assert parse_hf("hf:name") == HFDataset("name")
    assert parse_hf("some/file.txt") is None
    assert str(HFDataset("a", None, "test")) == "hf:a::test"
    for bad in ("hf:", "hf::x", "hf:a:b:c:d"):
        with pytest.raises(InvalidArgumentError, match="hf:NAME"):
            parse_hf(bad)


def test_hf_dataset_through_load_dataset(fake_datasets, no_default):
    src = resolve("hf:wikitext:wikitext-2-raw-v1", "wikitext-2/valid.txt", default_split="validation")
    assert src == HFDataset("wikitext", "wikitext-2-raw-v1", "validation")
    assert read_text(src) == " = Title = \n body line\nlast"
    assert fake_datasets == [("wikitext", "wikitext-2-raw-v1", "validation")]
    assert resolve("hf:x::test", default_split="validation").split == "test"  # a named split is kept
    with pytest.raises(DataFileError, match="cannot load Hugging Face dataset hf:broken::train: ConnectionError"):
        read_text(resolve("hf:broken::train"))
    with pytest.raises(DataFileError, match="no 'label' column"):
        read_text(HFDataset("x", None, "train"), column="label")


def test_hf_dataset_from_a_local_directory(tmp_path, no_default):
    pytest.importorskip("datasets")
    d = tmp_path / "ds"
    d.mkdir()
    (d / "validation.txt").write_text("first line\nsecond line\n")
    (d / "train.txt").write_text("other\n")
    assert read_text(resolve(f"hf:{d}", default_split="validation")) == "first line\nsecond line"


def test_hf_without_datasets_says_so(monkeypatch, no_default):
    real = data_mod.importlib.util.find_spec
    monkeypatch.setattr(data_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(DataFileError, match="'datasets' package is not installed"):
        resolve("hf:wikitext")


def test_test_split_detection():
    assert is_test_split(Path("wiki.test.raw")) and is_test_split(Path("test.txt"))
    assert not is_test_split(Path("latest.txt")) and not is_test_split(Path("valid.txt"))
    assert is_test_split(HFDataset("w", None, "test")) and not is_test_split(HFDataset("w", None, "validation"))


# -- the places that read data ----------------------------------------------------------------------------
class _Tok:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(w) for w in text.split()]}


def test_calibration_text_sources(tmp_path, monkeypatch, fake_datasets, no_default):
    import torch

    from laserlm.training.collect import load_text_tokens

    root = _tree(tmp_path / "d")
    assert load_text_tokens(_Tok(), root).tolist() == [5, 4]  # "valid text"
    monkeypatch.setenv("LASERLM_DATA", str(root))
    assert torch.equal(load_text_tokens(_Tok()), load_text_tokens(_Tok(), root / "wikitext-2" / "valid.txt"))
    assert load_text_tokens(_Tok(), "hf:wikitext:raw").tolist() == [1, 5, 1, 4, 4, 4]
    assert fake_datasets[-1] == ("wikitext", "raw", "validation")
    with pytest.raises(InvalidArgumentError, match="test split"):
        load_text_tokens(_Tok(), "hf:wikitext:raw:test")


def test_eval_task_sources(tmp_path, fake_datasets, no_default):
    from laserlm.evaluation.data import load_task, task_source

    f = tmp_path / "t.txt"
    f.write_text("some text\n")
    assert load_task("wikitext", f) == "some text\n"
    assert load_task("wikitext", "hf:wikitext:wikitext-2-v1") == " = Title = \n body line\nlast"
    assert fake_datasets[-1] == ("wikitext", "wikitext-2-v1", "test")
    items = load_task("lambada", "hf:lambada")  # rows split at their last space, as the jsonl reader does
    assert [(i.context, i.target) for i in items] == [(" = Title =", " \n"), (" body", " line\n"), ("", " last")]
    with pytest.raises(InvalidArgumentError, match="reads local files only"):
        task_source("arc_easy", "hf:ai2_arc")
    with pytest.raises(InvalidArgumentError, match="reads 2 files"):
        task_source("piqa", f)
    (tmp_path / "piqa").mkdir()
    for name in ("valid.jsonl", "valid-labels.lst"):
        (tmp_path / "piqa" / name).write_text("")
    assert task_source("piqa", tmp_path) == (tmp_path / "piqa/valid.jsonl", tmp_path / "piqa/valid-labels.lst")


def test_pruning_and_passkey_sources(tmp_path, monkeypatch, no_default):
    from laserlm.attention.passkey import ESSAYS, filler_text
    from laserlm.depth.pruning import default_calibration_text

    with pytest.raises(DataFileError, match="calib="):
        default_calibration_text()
    with pytest.raises(DataFileError, match="LASERLM_DATA"):
        filler_text("essays")
    root = _tree(tmp_path / "d")
    (root / ESSAYS).mkdir(parents=True)
    (root / ESSAYS / "b.txt").write_text("second")
    (root / ESSAYS / "a.txt").write_text("first")
    monkeypatch.setenv("LASERLM_DATA", str(root))
    assert default_calibration_text() == root / "wikitext-2" / "valid.txt"
    assert filler_text("essays") == "first second"
    assert filler_text("essays", root) == filler_text("essays", root / ESSAYS) == "first second"


# -- CLI ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["eval", "calibrate"])
def test_cli_help_explains_data(cmd, capsys):
    from laserlm.cli import main

    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--data FILE|DIR|hf:NAME[:CONFIG[:SPLIT]]" in out and "$LASERLM_DATA" in out


def test_cli_missing_data_fails_before_loading(tmp_path, capsys, no_default):
    from laserlm.cli import main

    assert main(["calibrate", "-o", str(tmp_path / "a.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("laserlm: error: no calibration text found: pass --data") and "\n" not in err
    assert main(["calibrate", "-o", str(tmp_path / "a.safetensors"), "--data", str(tmp_path / "x.txt")]) == 2
    assert "--data: no such file" in capsys.readouterr().err
    assert main(["eval", "--tasks", "wikitext"]) == 2
    assert "pass --data" in capsys.readouterr().err
    f = tmp_path / "w.txt"
    f.write_text("text")
    assert main(["eval", "--tasks", "wikitext,lambada", "--data", str(f)]) == 2
    assert "reads several (wikitext, lambada)" in capsys.readouterr().err
    assert main(["eval", "--tasks", "wikitext", "--data-dir", str(tmp_path)]) == 2  # the old name still works
    assert "wikitext-2/test.txt" in capsys.readouterr().err
