"""``laserlm train-backbone``: data, teacher cache, training (:mod:`laserlm.training.backbone`), delta file and report.

Data: WikiText-2 valid cut into records of ``seq_len`` (its last ``eval_records`` records held out for the agreement
curve, never trained on) plus ``chat_records`` records of a chat question and the model's own greedy answer
(:func:`laserlm.training.chat_text.chat_token_stream`). Test splits are refused (:func:`load_text_tokens`).

Work directory (``<output>.work``): ``teacher.pt`` (the original model's top-k on the training records and its outputs
on the held-out records, keyed by the records' digest), ``chat.pt`` (generated chat records), ``backbone.ckpt.pt``
(resume) and ``log.jsonl`` (one line per evaluation).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ..errors import InvalidArgumentError


def _autocast(choice: str) -> str:
    if choice != "auto":
        return choice
    from .train import bf16_matmul_is_faster  # noqa: PLC0415

    return "bfloat16" if bf16_matmul_is_faster() else "float32"


def _parse_exits(text: str | None, num_layers: int) -> list[int]:
    from .backbone import default_exit_points  # noqa: PLC0415

    if text is None:
        return default_exit_points(num_layers)
    try:
        exits = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InvalidArgumentError(f"--exits must be comma-separated layer counts, got {text!r}") from None
    if not exits or exits[0] < 1 or exits[-1] >= num_layers:
        raise InvalidArgumentError(f"--exits must lie in 1-{num_layers - 1}, got {text!r}")
    return exits


def _cached(path: Path, key: str, make):
    if path.is_file():
        try:
            saved = torch.load(path)
            if saved.get("key") == key:
                return saved["value"]
        except Exception:  # noqa: BLE001 - a damaged cache is recomputed
            pass
    value = make()
    torch.save({"key": key, "value": value}, path)
    return value


def build_records(lm, args, work: Path, progress: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(train [R, T], held_out [E, T], report)`` (module docstring)."""
    from ..data import data_root  # noqa: PLC0415
    from .backbone import _records_digest  # noqa: PLC0415
    from .chat_text import chat_token_stream  # noqa: PLC0415
    from .collect import load_text_tokens  # noqa: PLC0415

    T = args.seq_len
    text = load_text_tokens(lm.tokenizer, args.data)
    n = text.numel() // T
    if n < args.eval_records + 1:
        raise InvalidArgumentError(f"the calibration text has {n} records of {T} tokens; {args.eval_records} are held "
                                   "out and at least one must remain for training")
    recs = text[:n * T].view(n, T)
    held = recs[n - args.eval_records:]
    avail = n - args.eval_records
    k = avail if args.text_records is None else args.text_records
    if k > avail:
        raise InvalidArgumentError(f"--text-records {k}: the calibration text has only {avail} records of {T} tokens "
                                   "besides the held-out ones")
    parts = [recs[:k]]
    report = {"seq_len": T, "text_records": k, "eval_records": args.eval_records}
    if args.chat_records:
        root = Path(args.data) if args.data is not None and Path(args.data).is_dir() else data_root()
        key = f"chat:{args.chat_records}:{T}:{_records_digest(held)}"

        def make():
            toks, _, rep = chat_token_stream(lm.engine, args.chat_records, T, root, progress=progress)
            return {"tokens": toks.view(-1, T), "report": rep}

        chat = _cached(work / "chat.pt", key, make)
        parts.append(chat["tokens"])
        report["chat"] = chat["report"]
    if sum(p.shape[0] for p in parts) < 1:
        raise InvalidArgumentError("backbone training needs at least one record (--text-records, --chat-records)")
    return torch.cat(parts), held, report


def run_train_backbone(args) -> int:
    from ..cli_common import load_from_args  # noqa: PLC0415
    from ..depth.laser_file import model_identity  # noqa: PLC0415
    from ..models.delta import save_delta  # noqa: PLC0415
    from ..models.weights_hash import weights_sha256  # noqa: PLC0415
    from .backbone import (BackboneConfig, _records_digest, evaluate_exits, reference_outputs,  # noqa: PLC0415
                           teacher_topk, train_backbone)
    out = Path(args.output)  # checked by the caller (laserlm.training.cli)
    if args.weights not in ("auto", "fp32"):
        raise InvalidArgumentError(f"train-backbone trains on float32 weights; drop --weights {args.weights} (the delta "
                                   "is merged into any weight format at load)")
    if args.dtype not in (None, "float32"):
        raise InvalidArgumentError("train-backbone runs in float32 (use --autocast bfloat16 for bfloat16 arithmetic)")
    if getattr(args, "lora", None) is not None:
        raise InvalidArgumentError("train-backbone trains a delta for the original model; --lora (training on top of "
                                   "another delta) is not supported: resume the earlier run with a larger --max-tokens")
    if args.backbone_lr_ratio > 1:
        raise InvalidArgumentError(f"--backbone-lr-ratio must be in (0, 1], got {args.backbone_lr_ratio}")
    if not 0 < args.lr < 1:
        raise InvalidArgumentError(f"--lr must be in (0, 1), got {args.lr}")
    if args.layer_dropout >= 1:
        raise InvalidArgumentError(f"--layer-dropout must be < 1, got {args.layer_dropout}")
    progress = not args.quiet
    work = Path(args.work_dir) if args.work_dir is not None else out.with_name(out.name + ".work")
    args.weights = "fp32"
    lm = load_from_args(args)
    model = lm.loaded.model
    L = model.config.num_hidden_layers
    cfg = BackboneConfig(exit_points=_parse_exits(args.exits, L), rank=args.rank, alpha=args.alpha, head_lr=args.lr,
                         backbone_lr_ratio=args.backbone_lr_ratio, frozen_tokens=args.frozen_tokens,
                         layer_dropout=args.layer_dropout, exit_weight=args.exit_weight,
                         distill_weight=args.distill_weight, top_k=args.top_k,
                         final_kl=args.final_kl, seq_len=args.seq_len, batch=args.batch,
                         max_tokens=args.max_tokens, max_minutes=args.max_minutes,
                         eval_every_tokens=args.eval_every, autocast=_autocast(args.autocast), seed=args.seed)
    cfg.validate(L)
    base_sha = weights_sha256(model)
    identity = model_identity(lm.engine)
    work.mkdir(parents=True, exist_ok=True)
    records, held, data_report = build_records(lm, args, work, progress)
    key = f"{_records_digest(records)}:{_records_digest(held)}:{cfg.top_k}:{base_sha}"
    teacher = _cached(work / "teacher.pt", key, lambda: {
        "train": teacher_topk(model, records, cfg.top_k, progress=progress),
        "held": reference_outputs(model, held)})
    log_path = work / "log.jsonl"

    def evaluate(m, adapters, tokens):
        t = time.perf_counter()
        rec = evaluate_exits(m, adapters, cfg.exit_points, held, teacher["held"])
        rec.update(tokens=tokens, eval_seconds=round(time.perf_counter() - t, 1))
        with log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    run = train_backbone(model, records, teacher["train"], cfg, work, progress=progress, evaluate=evaluate)
    last = run.log[-1] if run.log else {}
    report = {"config": cfg.run_key(), "data": data_report, "tokens": run.tokens, "steps": run.steps,
              "seconds_this_run": round(run.seconds, 1), "finished": run.finished, "curve": run.log,
              "threads": torch.get_num_threads(), "base": identity, "weights_sha256": base_sha}
    adapters = {k.replace("proj.", "", 1): v for k, v in run.adapters.items()}
    save_delta(out, run.factors, adapters, {"identity": identity, "weights_sha256": base_sha, "rank": cfg.rank,
                                            "alpha": cfg.alpha, "targets": list(cfg.targets),
                                            "exit_points": cfg.exit_points, "report": report})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        at = last.get("at", {})
        print(f"backbone: {run.tokens:,} training tokens ({'finished' if run.finished else 'stopped by --max-minutes'}); "
              f"held-out full-depth agreement with the original {last.get('full_agreement', float('nan')):.3f}, "
              f"NLL ratio {last.get('nll_ratio', float('nan')):.3f}; exit agreement "
              + ", ".join(f"{e}: {a:.2f}" for e, a in last.get("exit_agreement", {}).items()))
        for target, best in at.items():
            print(f"  at {float(target):.2f} agreement (exact states): " + (
                f"{best['layers_per_token']:.1f} of {L} layers per token (threshold {best['threshold']})"
                if best else "not reached"))
        print(f"wrote {out} (report: {out.with_suffix('.json')})", file=sys.stderr)
        if not run.finished:
            print(f"laserlm: stopped by --max-minutes; run the same command again to resume from {work}",
                  file=sys.stderr)
    return 0
