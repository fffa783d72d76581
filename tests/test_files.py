"""Artifact files (laserlm.models.files): written atomically with the user's umask, identified by SHA-256; cache
entries (laserlm.models.cache) built once under a lock; the CPU identity that keys per-machine entries."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

from laserlm.models.files import file_sha256, write_safetensors


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = write_safetensors({"a": torch.arange(3)}, tmp_path / "x.safetensors", {"k": "v"})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode  # safetensors alone writes 0o600 whatever the umask
    assert torch.equal(load_file(path)["a"], torch.arange(3)) and sorted(p.name for p in tmp_path.iterdir()) == [
        "x.safetensors"]
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_safetensors({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type for a non-contiguous tensor
        write_safetensors({"a": torch.zeros(4, 4).t()}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


# -- cache entries (laserlm.models.cache): one lock, one atomic write ----------------------------------------
def _entry_value(entry):
    return entry.get("v") if isinstance(entry, dict) else None


def test_cached_json_entry_builds_each_key_once_and_loses_no_entry(tmp_path):
    """Eight threads want four entries of one file at the same moment: each entry is built once (the others wait and
    reuse it), and the file ends with all four (an unlocked read-modify-write loses entries)."""
    import json
    import threading
    import time

    from laserlm.models.cache import cached_json_entry

    path, built, got = tmp_path / "entries.json", [], []

    def want(key):
        def build():
            built.append(key)
            time.sleep(0.05)  # long enough for the other threads to read the file meanwhile
            return {"v": key}
        got.append(cached_json_entry(path, key, build, _entry_value))

    threads = [threading.Thread(target=want, args=(f"k{i % 4}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built) == ["k0", "k1", "k2", "k3"]
    assert sorted(got) == sorted([(f"k{i}", False) for i in range(4)] + [(f"k{i}", True) for i in range(4)])
    assert json.loads(path.read_text()) == {f"k{i}": {"v": f"k{i}"} for i in range(4)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entries.json", "entries.json.lock"]  # no temporary left


def test_cached_json_entry_rebuilds_damage_and_keeps_nothing_where_it_cannot_write(tmp_path):
    import json

    from laserlm.models.cache import cached_json_entry

    path = tmp_path / "entries.json"
    for damaged in ("{not json", "[1, 2]", b"\xff\xfe", json.dumps({"k": {"v": None}, "other": {"v": 1}})):
        path.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
        assert cached_json_entry(path, "k", lambda: {"v": 7}, _entry_value) == (7, False)
        kept = json.loads(path.read_text())
        assert kept["k"] == {"v": 7} and kept.get("other", {"v": 1}) == {"v": 1}  # other entries survive
    assert cached_json_entry(path, "k", lambda: {"v": 8}, _entry_value) == (7, True)
    assert cached_json_entry(path, "k", lambda: {"v": 8}, _entry_value, refresh=True) == (8, False)
    with pytest.raises(ValueError, match="not valid"):
        cached_json_entry(path, "bad", lambda: {"w": 1}, _entry_value)
    assert "bad" not in json.loads(path.read_text())
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert cached_json_entry(blocked / "entries.json", "k", lambda: {"v": 3}, _entry_value) == (3, False)


def test_cpu_identity_reads_proc_cpuinfo_and_tells_cpus_of_one_name_apart(monkeypatch):
    import re

    from laserlm import cpuinfo

    if os.path.exists("/proc/cpuinfo"):
        first = open("/proc/cpuinfo", encoding="utf-8").read().split("\n\n")[0]
        name = re.search(r"^model name\s*:\s*(.*)$", first, re.M)
        if name is not None:
            assert cpuinfo.cpu_name() == name.group(1).strip()
        family = re.search(r"^cpu family\s*:\s*(\S+)", first, re.M)
        if family is not None:
            assert f"family {family.group(1)} model " in cpuinfo.cpu_identity()
    zen3 = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "flags": "avx2"}
    zen4 = {**zen3, "model": "17", "flags": "avx2 avx512f"}
    monkeypatch.setattr(cpuinfo, "cpu_fields", lambda: zen3)
    a = (cpuinfo.cpu_name(), cpuinfo.cpu_identity(), cpuinfo.cpu_flags())
    monkeypatch.setattr(cpuinfo, "cpu_fields", lambda: zen4)
    b = (cpuinfo.cpu_name(), cpuinfo.cpu_identity(), cpuinfo.cpu_flags())
    assert a[0] == b[0] == "AMD EPYC" and a[1] == "AMD EPYC family 25 model 1" and a[1] != b[1]
    assert (a[2], b[2]) == ("avx2", "avx2 avx512f")


def test_a_read_only_cache_still_serves_its_stored_entries(tmp_path, monkeypatch):
    """Where the lock file cannot be made (a read-only cache), a valid stored entry is still used, not measured
    again; a missing one is built and not kept."""
    import json

    from laserlm.models import cache

    path = tmp_path / "entries.json"
    path.write_text(json.dumps({"k": {"v": 1}}))

    def no_lock(_path):
        raise PermissionError("read-only")

    monkeypatch.setattr(cache, "build_lock", no_lock)
    assert cache.cached_json_entry(path, "k", lambda: pytest.fail("built again"), _entry_value) == (1, True)
    assert cache.cached_json_entry(path, "new", lambda: {"v": 2}, _entry_value) == (2, False)
    assert json.loads(path.read_text()) == {"k": {"v": 1}}  # nothing written without the lock


def test_writes_read_the_umask_without_changing_it(tmp_path, monkeypatch):
    """A write reads the umask from /proc (Linux) instead of swapping it: a swap lets a file another thread creates
    meanwhile get umask 0, and two writers swapping at once can leave the process at 0."""
    from laserlm.models import files

    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status")
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(files.os, "umask", lambda *_: pytest.fail("the umask was swapped"))
        path = files.write_json_atomic({"a": 1}, tmp_path / "x.json")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640 and path.read_text() == '{\n  "a": 1\n}'
