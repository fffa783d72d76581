"""Calibration text of the kind bare ``adaptive`` is used on: the model's own full-depth greedy answers to chat
prompts (``CalibrateConfig(source="chat")``, the calibrated adaptive default of a bundled model).

Why. The agreement a laser file certifies is teacher-forced top-1 agreement with the full model's greedy token,
and the certificate only carries over to positions exchangeable with the calibration positions. WikiText-2
positions are not exchangeable with a chat model answering a question: a threshold certified on WikiText-2
gives less agreement on chat answers. Here the
calibration positions are what the guarantee is about: a chat-formatted question (the model's chat template;
plain text for a model without one) followed by the model's own full-depth greedy continuation.

The stream. Questions come from local validation/dev data (:data:`laserlm.defaults.CHAT_PROMPT_SOURCES`: ARC-Easy
and ARC-Challenge dev question stems, PIQA valid goals; never a test split, and never the shipped prompt set of
:func:`laserlm.evaluation.tasks.load_prompts`, which stays held out for checking), interleaved in a fixed seeded
order. Each record is exactly ``seq_len`` tokens: the encoded prompt, then greedy tokens to fill the record
(EOS does not stop it, like ``ignore_eos``), so every calibration chunk of the pipeline is one conversation that
starts at position 0, as in real use. Only the positions that predict a generated token *count* (``counted``):
those are the positions a generated answer is scored on; prompt positions (with a repeated system prompt that is
trivially predictable) would dilute the risk. Heads and gates still train on every position.

Generation runs on the calibration engine at full depth through the continuous-batching scheduler, in batches of
prompts of equal token length (each row is the unbatched greedy output up to float reassociation).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..defaults import CHAT_PROMPT_SOURCES
from ..errors import DataFileError, InvalidArgumentError

CHAT_TEXT_VERSION = 1  # bump when the recipe below changes (it is part of the work directory's cache key)


def _arc(row: dict) -> str | None:
    return (row.get("question") or {}).get("stem")


def _piqa(row: dict) -> str | None:
    goal = (row.get("goal") or "").strip()
    if len(goal.split()) < 3:  # "dresser": not a request
        return None
    return goal if goal.endswith("?") else f"How would you do this? {goal}"


_READERS = {"arc": _arc, "piqa": _piqa}


def chat_questions(root: Path, held_out=()) -> list[str]:
    """The calibration questions under data directory ``root``, interleaved in a fixed seeded order; any question
    in ``held_out`` (the shipped prompt set) is dropped.

    Raises:
        DataFileError: a source file is missing or unreadable.
    """
    held = {q.strip().lower() for q in held_out}
    per_source = []
    for rel in CHAT_PROMPT_SOURCES:
        path = Path(root) / rel
        read = _READERS[rel.split("/")[0]]
        try:
            rows = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except (OSError, ValueError) as exc:
            raise DataFileError(f"chat calibration prompts: cannot read {path} ({exc}); set $LASERLM_DATA to a data "
                                "directory with " + ", ".join(CHAT_PROMPT_SOURCES)) from None
        qs = [q.strip() for q in map(read, rows) if q and q.strip() and q.strip().lower() not in held]
        random.Random(f"{rel}:{CHAT_TEXT_VERSION}").shuffle(qs)
        per_source.append(qs)
    out = []
    for i in range(max(map(len, per_source))):  # round robin over the sources
        out.extend(qs[i] for qs in per_source if i < len(qs))
    return out


def shipped_prompts() -> list[str]:
    """The shipped prompt set (``laserlm/evaluation/prompts.jsonl``, what
    :func:`laserlm.evaluation.tasks.load_prompts` reads), read as package data: tools do not import each other."""
    from importlib import resources  # noqa: PLC0415

    text = resources.files("laserlm.evaluation").joinpath("prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(ln)["prompt"] for ln in text.splitlines() if ln.strip()]


@torch.inference_mode()
def _greedy(engine, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]``: ``n`` full-depth greedy tokens after each row of ``ids [B, P]``, EOS not stopping them, produced
    by the one decode path (:class:`~laserlm.runtime.scheduler.Scheduler`, every row in one batch)."""
    from ..runtime.modes import FullDepth  # noqa: PLC0415
    from ..runtime.sampling import SamplingParams  # noqa: PLC0415
    from ..runtime.scheduler import BatchConfig, Scheduler  # noqa: PLC0415

    b, p = ids.shape
    sched = Scheduler(engine, BatchConfig(kv_budget=f"{b * (p + n + 16)}t", max_batch=b, max_queue=b,
                                          prefill_chunk=max(256, b * p)))
    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    mode = FullDepth()
    rids = [sched.submit(row, params, mode, max_tokens=n) for row in ids]
    sched.run()
    return torch.tensor([sched.get(r).request.output_ids for r in rids], dtype=torch.long)


def chat_token_stream(engine, n_records: int, seq_len: int, root: Path, batch: int = 64,
                      progress: bool = True, questions: list[str] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(tokens [n_records * seq_len], counted [n_records * seq_len] bool, report)``: ``n_records`` records of a
    chat prompt and the model's greedy continuation (module docstring). ``counted[i]``: position ``i`` (which
    predicts token ``i + 1``) predicts a generated token.

    Raises:
        InvalidArgumentError: too few usable questions, or ``seq_len`` too short for the prompts.
        DataFileError: a prompt source is missing.
    """
    from ..runtime.generate import encode_prompt  # noqa: PLC0415

    tok = engine.tokenizer
    chat = bool(getattr(tok, "chat_template", None))
    max_prompt = seq_len // 2  # at least half of every record is the model's answer
    buckets: dict[int, list[list[int]]] = {}
    batches: list[list[list[int]]] = []
    n_seen = 0
    held = {p.strip().lower() for p in shipped_prompts()}
    pool = chat_questions(root, held_out=held) if questions is None else [q for q in questions
                                                                         if q.strip().lower() not in held]
    for q in pool:
        ids = encode_prompt(tok, q, chat, engine.max_seq_len).tolist()
        if len(ids) > max_prompt:
            continue
        n_seen += 1
        b = buckets.setdefault(len(ids), [])
        b.append(ids)
        if len(b) == batch:  # equal lengths: one batch without padding
            batches.append(buckets.pop(len(ids)))
            if sum(map(len, batches)) >= n_records:
                break
    rest = sorted(buckets.values(), key=len, reverse=True)
    while sum(map(len, batches)) < n_records and rest:
        batches.append(rest.pop(0))
    if sum(map(len, batches)) < n_records:
        raise InvalidArgumentError(f"chat calibration needs {n_records} prompts of at most {max_prompt} tokens; "
                                   f"the sources give {n_seen} (ask for fewer records, or a longer --seq-len: a prompt may fill at most half of a record)")
    records, counted = [], []
    bar = tqdm(total=n_records, desc="generate chat calibration text", unit="answer", disable=not progress)
    for rows in batches:
        rows = rows[:n_records - len(records)]
        if not rows:
            break
        p = len(rows[0])
        gen = _greedy(engine, torch.tensor(rows), seq_len - p)
        for r, g in zip(rows, gen.tolist()):
            records.append(r + g)
            mask = [False] * seq_len
            for i in range(p - 1, seq_len - 1):  # the last position predicts the next record's first token
                mask[i] = True
            counted.append(mask)
        bar.update(len(rows))
    bar.close()
    tokens = torch.tensor([t for r in records for t in r], dtype=torch.long)
    count = torch.tensor([c for m in counted for c in m], dtype=torch.bool)
    report = {"records": len(records), "seq_len": seq_len, "chat_template": chat,
              "counted_positions": int(count.sum()), "prompt_tokens_mean": round(
                  float(sum(seq_len - sum(m) for m in counted)) / len(counted), 1),
              "sources": list(CHAT_PROMPT_SOURCES), "version": CHAT_TEXT_VERSION}
    return tokens, count, report
