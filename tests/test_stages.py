"""The calibrate stage runner: resume manifest, changed settings, corrupt manifest / checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from laserlm.training.stages import ManifestWarning, Stage, StageRunner


def _stages(calls: list, settings: dict, use_c: bool = True):
    """a -> b -> c, each a plain function counting its calls; c owns a cache file."""

    def a(ctx):
        calls.append("a")
        ctx["x"] = torch.tensor([settings["a"]])
        return {"x": ctx["x"]}

    def b(ctx):
        calls.append("b")
        ctx["y"] = ctx["x"] * settings["b"]
        return {"y": ctx["y"]}

    def c(ctx):
        calls.append("c")
        (ctx["work"] / "c.cache").write_text("derived")
        ctx["z"] = ctx["y"] + 1
        return {"z": ctx["z"]}

    def report(ctx):
        calls.append("report")
        ctx["report"] = float(ctx["z"])

    return [Stage("a", a, settings=lambda ctx: settings["a"]),
            Stage("b", b, settings=lambda ctx: settings["b"], after=("a",)),
            Stage("c", c, after=("b",), owns=("c.cache",), when=lambda ctx: use_c),
            Stage("report", report, after=("c",), saves=False)]


def _run(work, calls, settings, resume, **kw):
    ctx = {"work": work}
    runner = StageRunner(work, _stages(calls, settings, **kw), resume=resume)
    runner.run(ctx)
    return runner, ctx


def test_resume_skips_finished_stages(tmp_path):
    calls = []
    settings = {"a": 2.0, "b": 3.0}
    _, ctx = _run(tmp_path, calls, settings, resume=False)
    assert calls == ["a", "b", "c", "report"] and ctx["report"] == 7.0
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert set(doc["stages"]) == {"a", "b", "c"} and doc["version"] == 1
    calls.clear()
    runner, ctx = _run(tmp_path, calls, settings, resume=True)
    assert calls == ["report"] and runner.loaded == ["a", "b", "c"] and ctx["report"] == 7.0
    calls.clear()
    _run(tmp_path, calls, settings, resume=False)  # without resume everything runs again
    assert calls == ["a", "b", "c", "report"]


def test_changed_setting_reruns_the_stage_and_its_readers(tmp_path):
    calls = []
    settings = {"a": 2.0, "b": 3.0}
    _run(tmp_path, calls, settings, resume=False)
    first = json.loads((tmp_path / "manifest.json").read_text())["stages"]
    calls.clear()
    settings["b"] = 5.0
    runner, ctx = _run(tmp_path, calls, settings, resume=True)
    assert calls == ["b", "c", "report"] and runner.loaded == ["a"]
    assert ctx["report"] == 11.0  # 2 * 5 + 1: the new setting took effect
    now = json.loads((tmp_path / "manifest.json").read_text())["stages"]
    assert now["a"] == first["a"] and now["b"]["hash"] != first["b"]["hash"]
    calls.clear()
    _run(tmp_path, calls, settings, resume=True)
    assert calls == ["report"]


def test_owned_cache_is_removed_when_its_stage_reruns(tmp_path):
    calls = []
    settings = {"a": 1.0, "b": 1.0}
    _run(tmp_path, calls, settings, resume=False)
    (tmp_path / "c.cache").write_text("stale")
    _run(tmp_path, calls, settings, resume=True)  # c loaded: its cache stays
    assert (tmp_path / "c.cache").read_text() == "stale"
    settings["a"] = 4.0
    _run(tmp_path, calls, settings, resume=True)  # c reruns: the cache is rebuilt
    assert (tmp_path / "c.cache").read_text() == "derived"


def test_skipped_stage(tmp_path):
    calls = []
    with pytest.raises(KeyError):  # report reads z, which the skipped stage c would have made
        _run(tmp_path, calls, {"a": 1.0, "b": 1.0}, resume=False, use_c=False)
    assert calls == ["a", "b", "report"]
    assert set(json.loads((tmp_path / "manifest.json").read_text())["stages"]) == {"a", "b"}


@pytest.mark.parametrize("text", ["{not json", '{"format": "something else", "version": 1, "stages": {}}',
                                  '{"format": "laserlm-calibrate-manifest", "version": 1, "stages": {"a": 3}}', ""])
def test_corrupt_manifest_warns_and_recomputes(tmp_path, text):
    calls = []
    settings = {"a": 2.0, "b": 3.0}
    _run(tmp_path, calls, settings, resume=False)
    (tmp_path / "manifest.json").write_text(text)
    calls.clear()
    with pytest.warns(ManifestWarning, match="unreadable resume manifest"):
        _, ctx = _run(tmp_path, calls, settings, resume=True)
    assert calls == ["a", "b", "c", "report"] and ctx["report"] == 7.0
    json.loads((tmp_path / "manifest.json").read_text())  # rewritten, valid again


def test_corrupt_checkpoint_warns_and_recomputes_that_stage(tmp_path):
    calls = []
    settings = {"a": 2.0, "b": 3.0}
    _run(tmp_path, calls, settings, resume=False)
    (tmp_path / "b.pt").write_bytes(b"garbage")
    calls.clear()
    with pytest.warns(ManifestWarning, match="cannot load the checkpoint .*b.pt"):
        _, ctx = _run(tmp_path, calls, settings, resume=True)
    assert calls == ["b", "report"] and ctx["report"] == 7.0  # b's hash is unchanged, so c stays loaded


def test_stage_order_is_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown or later"):
        StageRunner(tmp_path, [Stage("b", lambda c: None, after=("a",)), Stage("a", lambda c: None)])
    with pytest.raises(ValueError, match="duplicate"):
        StageRunner(tmp_path, [Stage("a", lambda c: None), Stage("a", lambda c: None)])
