"""Helpers shared by several test modules (pytest fixtures stay in ``conftest.py``)."""

from __future__ import annotations

import torch

from laserlm.cli import main


class FakeInstance:
    """Stands in for an lm-eval ``Instance``: the adapter reads only ``.args``."""

    def __init__(self, *args):
        self.args = args


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def run_cli(capsys, argv, allow_notice: bool = False, empty_stdout: bool = False) -> str:
    """Run the CLI; assert exit status 2, no traceback and a single ``laserlm: error:`` line on stderr (after
    dropping ``laserlm: converting`` notices when ``allow_notice``), and nothing on stdout when
    ``empty_stdout``; return that line."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.strip().splitlines() if ln.strip()]
    assert rc == 2, f"exit status {rc}, stderr: {captured.err}"
    assert "Traceback" not in captured.err
    if allow_notice:  # a GGUF conversion announces itself before the parser fails
        lines = [ln for ln in lines if not ln.startswith("laserlm: converting")]
    assert len(lines) == 1, f"expected one line, got: {captured.err!r}"
    assert lines[0].startswith("laserlm: error: ")
    if empty_stdout:
        assert captured.out == ""
    return lines[0]
