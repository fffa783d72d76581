"""CLI leftovers from the newcomer review: conflicting sparse flags, unwritable output files and ``--chat``
on a model without a chat template fail *before* the model loads, with one clear line (exit 2); the
speculative auto search announces itself on stderr.

"Before the model loads" is checked by replacing :func:`laserlm.api.load` with a function that fails the
test, so these cases take milliseconds and cannot pass by loading a model and erroring later.
"""

from __future__ import annotations

import functools
import json

import pytest

from helpers import run_cli
from laserlm.cli import build_parser
from laserlm.cli_common import attention_kwargs, check_output_path
from laserlm.errors import InvalidArgumentError
from laserlm.models.loader import chat_template_available


@pytest.fixture()
def no_model_load(monkeypatch):
    """Fail the test if the CLI gets as far as loading a model."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad argument was reported")

    monkeypatch.setattr("laserlm.api.load", load)


SPARSE_BOTH = ["--attention", "sparse", "--sparse-threshold", "0.5", "--sparse-mass", "0.9"]
COMMANDS = {"generate": ["generate", "hello", "-n", "2"], "eval": ["eval", "--tasks", "wikitext", "--limit", "1"],
            "bench": ["bench", "--reps", "1", "--no-hf", "--no-llamacpp"]}


# -- 1. --sparse-threshold with --sparse-mass ------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_sparse_threshold_and_mass_together_is_an_error(capsys, no_model_load, command):
    line = run_cli(capsys, COMMANDS[command] + SPARSE_BOTH)
    assert "--sparse-threshold" in line and "--sparse-mass" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_sparse_rule_flags_at_parser_level(command):
    args = build_parser().parse_args(COMMANDS[command] + SPARSE_BOTH)
    with pytest.raises(InvalidArgumentError, match="--sparse-threshold and --sparse-mass"):
        attention_kwargs(args)
    one = build_parser().parse_args(COMMANDS[command] + ["--attention", "sparse", "--sparse-mass", "0.9"])
    assert attention_kwargs(one) == {"attention": "sparse", "rule": "mass", "tau": 0.9}


# -- 2. output files checked up front ---------------------------------------------------------------
@pytest.mark.parametrize("command, flag", [("bench", "--plot"), ("bench", "--json"), ("eval", "--json")])
def test_output_file_in_missing_directory(capsys, no_model_load, tmp_path, command, flag):
    target = tmp_path / "no-such-dir" / "out.file"
    line = run_cli(capsys, COMMANDS[command] + [flag, str(target)])
    assert flag in line and "does not exist" in line and str(target.parent) in line


def test_output_file_that_is_a_directory(capsys, no_model_load, tmp_path):
    line = run_cli(capsys, COMMANDS["bench"] + ["--json", str(tmp_path)])
    assert "--json" in line and "is a directory" in line


def test_check_output_path_accepts_writable_targets(tmp_path):
    for path in (None, "-", str(tmp_path / "new.json"), "relative-file-in-cwd.json"):
        check_output_path(path, "--json")
    assert not (tmp_path / "new.json").exists()  # checking does not create the file


def test_missing_prompts_file_fails_before_the_run(capsys, no_model_load, tmp_path):
    line = run_cli(capsys, ["eval", "--tasks", "agreement", "--prompts", str(tmp_path / "missing.jsonl")])
    assert "cannot read prompt file" in line


# -- 3. --chat on a model without a chat template ---------------------------------------------------
def _model_dir(path, tokenizer_config: dict, files: dict | None = None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def test_chat_without_template_fails_before_loading(capsys, no_model_load, tmp_path):
    d = _model_dir(tmp_path / "base", {"tokenizer_class": "PreTrainedTokenizerFast"})
    line = run_cli(capsys, ["generate", "-m", str(d), "--chat", "hello", "-n", "2"])
    assert "no chat template" in line and "drop --chat" in line


def test_chat_template_detection_agrees_with_transformers(smol, tmp_path):
    """The file-level check gives the same answer as the tokenizer transformers loads from those files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol.loaded.path)
    assert chat_template_available("smollm2-135m") is True
    assert chat_template_available(str(smol.loaded.path)) is bool(smol.tokenizer.chat_template) is True
    tok.save_pretrained(tmp_path / "with")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "without")
    for name in ("with", "without"):
        expected = bool(AutoTokenizer.from_pretrained(tmp_path / name).chat_template)
        assert chat_template_available(str(tmp_path / name)) is expected
    legacy = _model_dir(tmp_path / "legacy", {"chat_template": "{{ messages }}"})
    assert chat_template_available(str(legacy)) is True
    assert chat_template_available("no-such-model-xyz") is None  # unknown: decided after loading


# -- 4. speculative auto announces its search -------------------------------------------------------
def test_speculative_auto_announces_the_search(smol, monkeypatch, capsys, one_torch_thread):
    from laserlm.speculative import calibration as cal
    from laserlm.mode_table import make_mode

    monkeypatch.setattr(cal, "calibrate", functools.partial(cal.calibrate, gen_tokens=3, n_text=1))
    capsys.readouterr()
    mode = make_mode("speculative:draft_layers=auto,k=2,threshold=0.5", smol.engine)
    err = capsys.readouterr().err
    assert mode.calibration is not None
    notices = [ln for ln in err.splitlines() if "speculative auto: searching" in ln]
    assert len(notices) == 1 and notices[0].startswith("laserlm: ")


# -- calibrate output paths and laser options (second newcomer review) ------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda d: str(d), "is a directory"),
    (lambda d: str(d / "r.json"), "report's name"),
    (lambda d: str(d / "missing" / "x.safetensors"), "does not exist"),
])
def test_calibrate_bad_output_fails_before_loading(capsys, no_model_load, tmp_path, make, message):
    line = run_cli(capsys, ["calibrate", "-o", make(tmp_path)])
    assert message in line


def test_calibrate_work_dir_that_is_a_file(capsys, no_model_load, tmp_path):
    (tmp_path / "w").write_text("x")
    line = run_cli(capsys, ["calibrate", "-o", str(tmp_path / "x.safetensors"), "--work-dir", str(tmp_path / "w")])
    assert "not a directory" in line


def test_empty_laser_path_is_an_error(capsys, no_model_load):
    assert "--laser needs the path" in run_cli(capsys, ["generate", "hi", "--laser", ""])
