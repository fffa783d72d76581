"""Readers for the local evaluation data sets (WikiText-2, LAMBADA, HellaSwag, ARC, PIQA).

Each reader turns one file format into plain items; the prompt formats follow EleutherAI's
lm-evaluation-harness task definitions (``lm_eval/tasks/{lambada,hellaswag,arc,piqa}``):

| task       | file(s)                                   | context                          | continuation(s)      |
|------------|-------------------------------------------|----------------------------------|----------------------|
| lambada    | ``lambada/lambada_test.jsonl`` (OpenAI)   | text without its last word       | ``" " + last word``  |
| hellaswag  | ``hellaswag/hellaswag_val_full.txt.bz2``  | ``"{activity}: {ctx}"``          | ``" " + ending`` x4  |
| arc_easy   | ``arc/ARC-Easy-Test.jsonl``               | ``"Question: {stem}\\nAnswer:"`` | ``" " + choice``     |
| piqa       | ``piqa/valid.jsonl`` + ``valid-labels.lst`` | ``"Question: {goal}\\nAnswer:"`` | ``" " + sol1/sol2``  |
| sst2, rte, mrpc, qnli | ``glue/{SST-2,RTE,MRPC,QNLI}/dev.tsv`` | lm-eval's ``glue/<task>`` prompt (:data:`GLUE`) | ``" " + label word`` |

The data source (``laserlm eval --data``) is resolved by :mod:`laserlm.data`: a data directory holding
the files above (default ``$LASERLM_DATA``, or ``../shared/data`` next to a source checkout), one task's
file, or a Hugging Face dataset ``hf:NAME[:CONFIG[:SPLIT]]`` (default split ``test``) for the tasks that
read a ``text`` column: ``wikitext`` (e.g. ``hf:wikitext:wikitext-2-v1``) and ``lambada`` (e.g.
``hf:EleutherAI/lambada_openai:default``), and for the GLUE tasks (default split ``validation``: GLUE's test labels
are hidden), e.g. ``hf:nyu-mll/glue:rte``.

GLUE (zero-shot, as lm-eval's ``glue`` tasks: no few-shot examples): the dev TSVs as GLUE distributes them (a
header row; RTE/QNLI labels ``entailment`` / ``not_entailment``, MRPC's ``Quality`` / ``#1 String`` /
``#2 String`` columns) or the ``nyu-mll/glue`` dataset's rows; ``gold`` is GLUE's integer label, which indexes the
task's choices.
"""

from __future__ import annotations

import bz2
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..data import HFDataset, data_root, read_rows, read_text, resolve
from ..errors import DataFileError, InvalidArgumentError

__all__ = ["DataFileError", "ChoiceItem", "LambadaItem", "TASK_FILES", "HF_TASKS", "default_data_dir",
           "task_source", "task_paths", "load_task", "read_wikitext", "read_lambada", "read_hellaswag", "read_arc",
           "read_piqa", "read_glue", "GLUE"]


@dataclass
class ChoiceItem:
    """One multiple-choice item: score ``context + " " + choices[i]`` for every ``i`` (lm-eval's default
    ``target_delimiter``); ``gold`` is the answer index. ``acc_norm`` divides by ``len(choices[i])``."""

    context: str
    choices: list[str]
    gold: int
    id: str = ""


@dataclass
class LambadaItem:
    """One LAMBADA passage split into ``context`` and the target ``" " + last word``."""

    context: str
    target: str


# task name -> path(s) relative to the data directory
TASK_FILES = {
    "wikitext": ("wikitext-2/test.txt",),
    "lambada": ("lambada/lambada_test.jsonl",),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt.bz2",),
    "arc_easy": ("arc/ARC-Easy-Test.jsonl",),
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "longtext": ("gutenberg/1400-0.txt",),  # one long document (laserlm.evaluation.longtext)
    "sst2": ("glue/SST-2/dev.tsv",),
    "rte": ("glue/RTE/dev.tsv",),
    "mrpc": ("glue/MRPC/dev.tsv",),
    "qnli": ("glue/QNLI/dev.tsv",),
}

# GLUE task -> (columns, prompt, choices): lm-eval's lm_eval/tasks/glue/<task>/default.yaml (doc_to_text,
# doc_to_choice); the label indexes the choices.
GLUE = {
    "sst2": (("sentence",), "{sentence}\nQuestion: Is this sentence positive or negative?\nAnswer:",
             ("negative", "positive")),
    "rte": (("sentence1", "sentence2"), "{sentence1}\nQuestion: {sentence2} True or False?\nAnswer:",
            ("True", "False")),
    "mrpc": (("sentence1", "sentence2"),
             "Sentence 1: {sentence1}\nSentence 2: {sentence2}\nQuestion: Do both sentences mean the same thing?"
             "\nAnswer:", ("no", "yes")),
    "qnli": (("question", "sentence"), "{question}\n{sentence}\nQuestion: Does this response answer the question?"
             "\nAnswer:", ("yes", "no")),
}
_GLUE_TSV_NAMES = {"#1 String": "sentence1", "#2 String": "sentence2", "Quality": "label"}  # MRPC's own header
_GLUE_LABELS = {"entailment": 0, "not_entailment": 1}

HF_TASKS = ("wikitext", "lambada", *GLUE)  # tasks that can read a Hugging Face dataset


def default_data_dir() -> Path:
    """The default data directory (``$LASERLM_DATA``, its alias ``$LASERLM_DATA_DIR``, or the checkout's
    ``../shared/data``; see :func:`laserlm.data.data_root`).

    Raises:
        DataFileError: none is configured (the message names ``--data``).
    """
    return data_root()


def task_source(task: str, data: str | Path | None = None) -> tuple[Path, ...] | HFDataset:
    """Where ``task`` reads its data: its file path(s), or a Hugging Face dataset (split ``test`` unless
    named).

    Args:
        data: a data directory (the task's files under it, see :data:`TASK_FILES`), the task's file itself,
            ``hf:NAME[:CONFIG[:SPLIT]]`` (wikitext and lambada only), or ``None`` for the default directory.

    Raises:
        InvalidArgumentError: unknown task, a dataset for a task that cannot read one, or one file for
            piqa (which reads two).
        DataFileError: a file is missing (the message names it and ``--data``).
    """
    if task not in TASK_FILES:
        raise InvalidArgumentError(f"unknown task '{task}'; available tasks: {', '.join(TASK_FILES)}")
    rels = TASK_FILES[task]
    what = f"data file for task '{task}'"
    src = resolve(data, rels[0], what=what, default_split="validation" if task in GLUE else "test")
    if isinstance(src, HFDataset):
        if task not in HF_TASKS:
            raise InvalidArgumentError(f"--data {src}: task '{task}' reads local files only (Hugging Face datasets "
                                       f"work for {', '.join(HF_TASKS)}); pass its file or a data directory")
        return src
    if len(rels) == 1:
        return (src,)
    if data is not None and Path(data).is_file():
        raise InvalidArgumentError(f"--data {data}: task '{task}' reads {len(rels)} files ({', '.join(rels)}); "
                                   "pass the data directory that holds them")
    return (src, *(resolve(data, rel, what=what) for rel in rels[1:]))


def task_paths(task: str, data_dir: str | Path | None = None) -> tuple[Path, ...]:
    """Paths of the local files ``task`` reads (see :func:`task_source`).

    Raises:
        InvalidArgumentError: unknown task, or ``data_dir`` is a Hugging Face dataset.
        DataFileError: a file is missing (the message names it).
    """
    src = task_source(task, data_dir)
    if isinstance(src, HFDataset):
        raise InvalidArgumentError(f"{src} is a Hugging Face dataset, not local files")
    return src


def _read_text(path: Path) -> str:
    return read_text(path)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataFileError(f"{path}:{n}: not a JSON line ({exc.msg})") from exc
    return rows


def read_wikitext(path: str | Path) -> str:
    """The WikiText-2 file exactly as stored (tokenized text with ``<unk>``, ``@-@``, `` = Heading = `` lines).

    No detokenization: the whole file is one string, newlines kept, as in the Hugging Face
    perplexity guide (which joins ``wikitext-2-raw-v1`` lines with ``"\\n\\n"``; this file is the
    tokenized ``wikitext-2-v1`` variant, so numbers are not comparable with raw-text perplexities).
    """
    text = _read_text(Path(path))
    if not text.strip():
        raise DataFileError(f"{path} is empty")
    return text


def read_lambada(path: str | Path) -> list[LambadaItem]:
    """OpenAI LAMBADA jsonl ``{"text": ...}`` -> items; target = ``" " + last space-separated word``
    (lm-eval ``lambada_openai``)."""
    items = []
    for row in _read_jsonl(Path(path)):
        if "text" not in row:
            raise DataFileError(f"{path}: row without a 'text' field")
        context, _, word = row["text"].rpartition(" ")
        items.append(LambadaItem(context, " " + word))
    return items


def _capitalize_last_fragment(ctx: str) -> str:
    """Upper-case the first letter of the trailing sentence fragment when it starts lowercase.

    lm-eval builds the HellaSwag context as ``ctx_a + " " + ctx_b.capitalize()``; the llama.cpp text
    file stores ``ctx_a + " " + ctx_b`` with ``ctx_b`` (the unfinished last sentence) as written, usually
    lowercase. Capitalising the fragment after the last sentence end restores lm-eval's text in the
    common case (approximation: ``ctx_b`` boundaries are not stored in this format).
    """
    m = re.search(r"(?:^|[.!?]\s+|:\s+)([^.!?]*)$", ctx)
    if not m or not m.group(1):
        return ctx
    i = m.start(1)
    if ctx[i].islower():
        return ctx[:i] + ctx[i].upper() + ctx[i + 1:]
    return ctx


def read_hellaswag(path: str | Path) -> list[ChoiceItem]:
    """llama.cpp HellaSwag text format (6 lines per item: context / gold label / 4 endings), bz2 or plain.

    The file's text is already through the HellaSwag preprocessing (bracket tags removed, double
    spaces collapsed); continuations are ``" " + ending`` (lm-eval ``hellaswag``).
    """
    path = Path(path)
    try:
        raw = bz2.open(path, "rt", encoding="utf-8").read() if path.suffix == ".bz2" else _read_text(path)
    except (OSError, EOFError) as exc:
        raise DataFileError(f"cannot read {path}: {exc}") from exc
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise DataFileError(f"{path}: {len(lines)} lines is not a multiple of 6 (context, label, 4 endings)")
    items = []
    for i in range(0, len(lines), 6):
        ctx, label, *endings = lines[i:i + 6]
        if label.strip() not in {"0", "1", "2", "3"}:
            raise DataFileError(f"{path}:{i + 2}: label must be 0-3, got {label!r}")
        items.append(ChoiceItem(_capitalize_last_fragment(ctx.strip()), [e.strip() for e in endings],
                                int(label), str(i // 6)))
    return items


def read_arc(path: str | Path) -> list[ChoiceItem]:
    """AI2 ARC jsonl -> ``"Question: {stem}\\nAnswer:"`` with ``" " + choice`` continuations (lm-eval ``arc_easy``)."""
    items = []
    for row in _read_jsonl(Path(path)):
        try:
            q = row["question"]
            labels = [c["label"] for c in q["choices"]]
            items.append(ChoiceItem(f"Question: {q['stem']}\nAnswer:", [c["text"] for c in q["choices"]],
                                    labels.index(row["answerKey"]), row.get("id", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataFileError(f"{path}: malformed ARC row {row.get('id', '?')}: {exc!r}") from exc
    return items


def read_piqa(path: str | Path, labels_path: str | Path) -> list[ChoiceItem]:
    """PIQA ``valid.jsonl`` + ``valid-labels.lst`` -> ``"Question: {goal}\\nAnswer:"`` with two solutions (lm-eval ``piqa``)."""
    rows = _read_jsonl(Path(path))
    labels = [ln.strip() for ln in _read_text(Path(labels_path)).splitlines() if ln.strip()]
    if len(rows) != len(labels):
        raise DataFileError(f"{path} has {len(rows)} rows but {labels_path} has {len(labels)} labels")
    items = []
    for n, (row, lab) in enumerate(zip(rows, labels)):
        if lab not in {"0", "1"} or not {"goal", "sol1", "sol2"} <= row.keys():
            raise DataFileError(f"{path}: malformed PIQA row {n + 1}")
        items.append(ChoiceItem(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]],
                                int(lab), str(n)))
    return items


def read_glue(task: str, source: Path | list[dict]) -> list[ChoiceItem]:
    """The items of GLUE task ``task`` (:data:`GLUE`) from its dev TSV or a dataset's rows.

    Raises:
        DataFileError: unreadable file, a missing column, or a label that is not one of the task's (``-1``:
            the hidden labels of GLUE's test split).
    """
    import csv  # noqa: PLC0415

    columns, prompt, choices = GLUE[task]
    name = str(source) if isinstance(source, Path) else f"{task} dataset"
    if isinstance(source, Path):
        text = read_text(source)
        lines = list(csv.reader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
        if not lines:
            raise DataFileError(f"{name} is empty")
        header = [_GLUE_TSV_NAMES.get(h.strip(), h.strip()) for h in lines[0]]
        rows = [dict(zip(header, r)) for r in lines[1:] if r]
    else:
        rows = source
    out = []
    for i, row in enumerate(rows):
        missing = [c for c in (*columns, "label") if row.get(c) is None]
        if missing:
            raise DataFileError(f"{name}: row {i + 1} has no {', '.join(missing)} (columns: {', '.join(row)})")
        label = row["label"]
        label = _GLUE_LABELS.get(label, label) if isinstance(label, str) else label
        try:
            gold = int(label)
        except (TypeError, ValueError):
            gold = -2
        if not 0 <= gold < len(choices):
            hint = " (GLUE's test labels are hidden: use the validation split)" if gold == -1 else ""
            raise DataFileError(f"{name}: row {i + 1} has label {row['label']!r}, not one of 0..{len(choices) - 1}"
                                f"{hint}")
        ctx = prompt.format(**{c: str(row[c]) for c in columns})  # as stored (lm-eval keeps SST-2's trailing blank)
        out.append(ChoiceItem(ctx, list(choices), gold, str(row.get("idx", row.get("index", i)))))
    if not out:
        raise DataFileError(f"{name} has no items")
    return out


def load_task(task: str, data: str | Path | None = None):
    """Read the items of ``task`` (``str`` for wikitext, a list of items otherwise) from ``data`` (see
    :func:`task_source`).

    Raises:
        InvalidArgumentError, DataFileError: as :func:`task_source`, and malformed files or datasets.
    """
    src = task_source(task, data)
    if isinstance(src, HFDataset):
        if task in GLUE:
            return read_glue(task, read_rows(src))
        if task == "wikitext":
            text = read_text(src)
            if not text.strip():
                raise DataFileError(f"{src} has no text")
            return text
        rows = read_rows(src)
        if not rows or "text" not in rows[0]:
            raise DataFileError(f"{src}: LAMBADA rows need a 'text' field")
        return [LambadaItem(c, " " + w) for c, _, w in (r["text"].rpartition(" ") for r in rows)]
    paths = src
    if task == "longtext":
        from .longtext import document_text  # noqa: PLC0415

        return document_text(_read_text(paths[0]))
    if task == "wikitext":
        return read_wikitext(paths[0])
    if task == "lambada":
        return read_lambada(paths[0])
    if task == "hellaswag":
        return read_hellaswag(paths[0])
    if task == "arc_easy":
        return read_arc(paths[0])
    if task in GLUE:
        return read_glue(task, paths[0])
    return read_piqa(*paths)
