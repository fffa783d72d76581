"""Artifact files (laserlm.models.files): written atomically with the user's umask, identified by SHA-256."""

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
