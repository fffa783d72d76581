"""``laserlm calibrate``: train exit heads, gates and the router on a frozen model and calibrate the exit
threshold to a quality target; writes one laser file (see :mod:`laserlm.depth.laser_file`)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import InvalidArgumentError

EPILOG = """\
defaults and sources:
  head stage     Adam LR 1e-3, 250 steps of 128 positions (DESIGN.md tuned-lens anchor; Belrose et al. 2023);
                 above 65,536 tokens of vocabulary, 750 steps of a sampled KL (the teacher's top 32 + tail, 1,024
                 sampled tokens a step; sampled softmax, Jean et al. 2015): --head-vocab
  gate stage     AdamW LR 1e-2, 400 steps, focal loss gamma 2 (Lin et al. 2017; seed 004)
  joint stage    off by default; LR 3e-5 with linear warm-up, clip 1.0, exit-threshold decay 0.95/epoch (seed 004)
  min depth      a quarter of the layers (seed); groups of 5 layers (seed: micro-layer groups)
  gate features  "state": hidden state, saturation, ATS, depth (a check costs a d-vector dot product; the
                 exit head runs only when a token exits); "head" adds the exit head's confidence (better gates,
                 but every check evaluates the LM head: on SmolLM2-135M about 8 decoder layers)
  compensation   off; auto picks the veto's relative-change threshold on the gate split (seed 000 §2.1)
  thresholds     Learn-then-Test fixed-sequence testing, exact binomial p-values (CALM-style), each candidate
                 tested on real propagate decoding of the calibration split (--bridge deferred: on exact states)

example:
  laserlm calibrate -m smollm2-135m --target-agreement 0.99 --delta 0.1 -o smol.laser.safetensors
      (about 6 min on 2 idle cores at the default sizes; writes smol.laser.json, the report, beside it)
  laserlm generate "The capital of France is" --laser smol.laser.safetensors
      (= --mode adaptive:laser=smol.laser.safetensors: the bridge and patience the thresholds were
      calibrated for)

on a CPU shared with other jobs, --threads 1 can be several times faster than oversubscribed threads.

what the guarantee means: with probability >= 1 - delta over the calibration text, the top-1 agreement with
the full model (per generated position, the stated bridge and patience, this dtype) is >= the target on text
like the calibration text, assuming positions are exchangeable. Tokens of one document are correlated, so
small calibration splits overstate the evidence; the run checks the target on a separate held-out split and
warns when it is missed.
"""


def _probability(name):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not 0 < v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be in (0, 1), got {v}")
        return v
    return parse


def _positive(kind, name, allow_zero=False):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a{'n integer' if kind is int else ' number'}, "
                                             f"got {text!r}") from None
        if v < 0 or (v == 0 and not allow_zero) or v != v:
            raise argparse.ArgumentTypeError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {text}")
        return v
    return parse


def add_parser(subparsers) -> None:
    from ..cli_common import add_model_args  # noqa: PLC0415

    p = subparsers.add_parser(
        "calibrate", help="train exit heads/gates/router and calibrate exit thresholds to a quality target",
        description="Train exit heads (tuned-lens adapters), exit gates and the router on the frozen model, "
                    "then choose the exit threshold so that the quality target holds with probability >= 1-delta.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--output", "-o", required=True, help="artifact path (.safetensors); a .json report is written next to it")
    tgt = p.add_mutually_exclusive_group()
    tgt.add_argument("--target-agreement", type=_probability("--target-agreement"), default=None,
                     help="minimum top-1 agreement with the full model (default 0.99)")
    tgt.add_argument("--max-ppl-increase", type=_positive(float, "--max-ppl-increase"), default=None,
                     help="maximum relative perplexity increase, e.g. 0.05 (asymptotic CLT guarantee)")
    p.add_argument("--delta", type=_probability("--delta"), default=0.1,
                   help="the target holds with probability >= 1 - delta (default: %(default)s)")
    p.add_argument("--p-value", choices=["binomial", "hoeffding_bentkus", "clt"], default=None,
                   help="p-value of the fixed-sequence test (default: binomial for agreement, clt for perplexity)")
    p.add_argument("--data", "--data-dir", dest="data", default=None, metavar="FILE|DIR|hf:NAME[:CONFIG[:SPLIT]]",
                   help="calibration text from a valid/dev split (test splits are refused): a UTF-8 text file, a "
                        "data directory (its wikitext-2/valid.txt), or a Hugging Face dataset with a text column, "
                        "e.g. hf:wikitext:wikitext-2-raw-v1 (split validation unless named; needs the datasets "
                        "package). Default: wikitext-2/valid.txt under $LASERLM_DATA, else ../shared/data next to "
                        "a source checkout")
    p.add_argument("--source", choices=["text", "chat"], default="text",
                   help="text: calibrate on the --data text (default); chat: on the model's own greedy answers to "
                        "chat prompts from ARC/PIQA dev files of the data directory (--data DIR), counting only "
                        "the answer positions (what bare --mode adaptive uses, with --seq-len 128)")
    p.add_argument("--groups", default=None, help="layer groups: size '5', ends '8/16/30' or ranges (default: 5)")
    p.add_argument("--min-depth", type=_positive(int, "--min-depth", True), default=None,
                   help="earliest exit in layers (default: a quarter of the layers)")
    p.add_argument("--seq-len", type=_positive(int, "--seq-len"), default=192, help="positions per chunk (default: 256)")
    for split, default in (("train", 8192), ("gate", 4096), ("calib", 8192), ("eval", 4096)):
        p.add_argument(f"--{split}-tokens", type=_positive(int, f"--{split}-tokens"), default=default,
                       help=f"positions in the {split} split (default: {default})")
    p.add_argument("--adapter", choices=["affine", "lowrank", "none"], default="affine",
                   help="exit-head adapter (default: affine tuned lens)")
    p.add_argument("--rank", type=_positive(int, "--rank"), default=16, help="low-rank adapter rank (default: 16)")
    p.add_argument("--no-ats", action="store_true", help="train gates without the attention transition score")
    p.add_argument("--gate-features", choices=["state", "head"], default="state",
                   help="gate inputs: state (cheap checks, default) or head (adds exit-head confidence)")
    p.add_argument("--bridge", choices=["propagate", "deferred"], default="propagate",
                   help="decoding the thresholds are certified for: propagate (default: real decoding of the "
                        "calibration text; skipped layers only get K/V projections) or deferred (exact states; "
                        "the skipped layers still run, one step later)")
    p.add_argument("--patience", type=_positive(int, "--patience", True), default=0,
                   help="certify the thresholds with the patience rule on (seed 000: after K consecutive tokens exit "
                        "in one group, the next tokens skip the checks before it; a failed check runs full depth); "
                        "propagate only (default: 0, off)")
    p.add_argument("--compensation", default="off", metavar="off|auto|C",
                   help="the Residual Bridge's veto (seed 000): a token may exit only if its residual stream changed "
                        "by at most C (relative) across the group, else the next group runs first; 'auto' picks C "
                        "on the gate split, and the gate threshold is certified with the veto on (default: off)")
    p.add_argument("--head-steps", type=_positive(int, "--head-steps", True), default=None,
                   help="exit-head training steps (default: 250 with the full loss, 750 with the sampled one; see "
                        "--head-vocab)")
    p.add_argument("--head-lr", type=_positive(float, "--head-lr"), default=1e-3,
                   help="exit-head Adam learning rate (default: %(default)s; backbone frozen)")
    p.add_argument("--batch-tokens", type=_positive(int, "--batch-tokens"), default=128,
                   help="positions per head-training step (default: %(default)s)")
    p.add_argument("--head-vocab", choices=["auto", "full", "sampled"], default="auto",
                   help="exit-head loss: full (KL over the whole vocabulary each step), sampled (the teacher's top-k, "
                        "a tail bucket and sampled other tokens: a few thousand LM-head rows a step) or auto "
                        "(sampled above 65,536 tokens; default: %(default)s)")
    p.add_argument("--head-topk", type=_positive(int, "--head-topk"), default=32,
                   help="sampled exit-head loss: the teacher's tokens kept per position (default: %(default)s)")
    p.add_argument("--head-negatives", type=_positive(int, "--head-negatives"), default=1024,
                   help="sampled exit-head loss: other tokens drawn per step (default: %(default)s)")
    p.add_argument("--gate-steps", type=_positive(int, "--gate-steps", True), default=400,
                   help="gate training steps per exit point (default: %(default)s)")
    p.add_argument("--joint-epochs", type=_positive(int, "--joint-epochs", True), default=0,
                   help="optional joint heads+gates stage (default: 0 = off)")
    p.add_argument("--joint-lr", type=_positive(float, "--joint-lr"), default=3e-5,
                   help="joint-stage learning rate (default: %(default)s, seed 004)")
    p.add_argument("--warmup-steps", type=_positive(int, "--warmup-steps", True), default=20,
                   help="joint-stage linear warm-up steps (default: %(default)s)")
    p.add_argument("--grad-clip", type=_positive(float, "--grad-clip"), default=1.0,
                   help="gradient-norm clipping (default: %(default)s, seed 004)")
    p.add_argument("--adaptive-clip", action="store_true",
                   help="head and joint stages: clip at the 10th percentile of the last 100 gradient norms, within "
                        "the seed's 0.2-1.0 (AutoClip; replaces --grad-clip); off by default: no gain found on the bundled models")
    p.add_argument("--cross-layer-norm", action="store_true",
                   help="head and joint stages: give every exit point's modules a gradient of the same norm (the seed's cross-layer "
                        "gradient normalisation); off by default: no gain found on the bundled models")
    p.add_argument("--threshold-decay", type=_probability("--threshold-decay"), default=0.95,
                   help="joint-stage exit-threshold decay per epoch (default: %(default)s, seed 004)")
    p.add_argument("--no-predictor", action="store_true",
                   help="skip the pre-layer complexity predictor (seed 000 §2.1; trained and certified by default, "
                        "used with adaptive:laser=PATH,policy=predictor)")
    p.add_argument("--predictor-steps", type=_positive(int, "--predictor-steps", True), default=300,
                   help="complexity-predictor training steps (full batch; default: %(default)s)")
    p.add_argument("--router-prompts", type=_positive(int, "--router-prompts", True), default=192,
                   help="prompts for seed 004's router (half fit it, 30%% certify its confidence, 20%% check it; "
                        "0 = no router; used with --mode routed:laser=PATH; default: %(default)s)")
    p.add_argument("--router-prompt-len", type=_positive(int, "--router-prompt-len"), default=16,
                   help="tokens per router prompt (default: %(default)s)")
    p.add_argument("--router-continuation", type=_positive(int, "--router-continuation"), default=16,
                   help="full-depth greedy tokens a route must reproduce, per prompt (default: %(default)s)")
    p.add_argument("--router-position", choices=("last", "mean", "first"), default="last",
                   help="which prompt positions' state after layer 1 the router reads: last (default; it has seen the "
                        "prompt, and its certified router saved the most), mean, or first (seed 004's [CLS]-style "
                        "reading, which in a causal decoder sees only the first token)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the stages finished in the work directory whose settings are unchanged (its "
                        "manifest.json records a hash per stage); stages whose settings changed, and the stages "
                        "after them, run again")
    p.add_argument("--work-dir", default=None,
                   help="checkpoint directory (default: <output>.work); with --resume, another target reuses "
                        "the trained modules")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser(
        "train-draft-head", help="train an EAGLE-style draft head for speculative decoding (draft=head)",
        description="Train a draft head (one decoder layer + the target's LM-head rows of the k most frequent "
                    "tokens) on the frozen model's last-layer features, with EAGLE's loss. Data: the model's own "
                    "greedy answers to ARC/PIQA dev questions and to templated open requests, plus WikiText-2 valid "
                    "records. Use it with "
                    "--mode 'speculative:draft=head+ngram,head=PATH'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  laserlm train-draft-head -m smollm2-135m -o smol.head.safetensors\n"
               "  laserlm generate 'Tell me a story.' --mode 'speculative:draft=head+ngram,head=smol.head.safetensors'")
    add_model_args(p)
    p.add_argument("--output", "-o", required=True, help="draft head file (.safetensors)")
    p.add_argument("--data", "--data-dir", dest="data", default=None, metavar="DIR",
                   help="data directory with arc/, piqa/ dev files and wikitext-2/valid.txt (default: $LASERLM_DATA, "
                        "else ../shared/data next to a source checkout)")
    p.add_argument("--chat-records", type=_positive(int, "--chat-records", True), default=256,
                   help="records of a chat question and the model's greedy answer (default: %(default)s)")
    p.add_argument("--instruction-records", type=_positive(int, "--instruction-records", True), default=512,
                   help="records of an open-ended request (templates x topics) and the model's greedy answer "
                        "(default: %(default)s)")
    p.add_argument("--text-records", type=_positive(int, "--text-records", True), default=64,
                   help="records of calibration text (default: %(default)s)")
    p.add_argument("--seq-len", type=_positive(int, "--seq-len"), default=192,
                   help="tokens per record (default: %(default)s)")
    p.add_argument("--vocab", type=_positive(int, "--vocab"), default=4096,
                   help="draft vocabulary: the k tokens the model predicts most often (default: %(default)s)")
    p.add_argument("--intermediate-size", type=_positive(int, "--intermediate-size"), default=None,
                   help="MLP width of the draft layer (default: 2 x hidden size)")
    p.add_argument("--epochs", type=_positive(int, "--epochs"), default=10,
                   help="passes over the records (default: %(default)s)")
    p.add_argument("--lr", type=_positive(float, "--lr"), default=1e-3,
                   help="AdamW learning rate, 5%% warm-up then cosine to 10%% (default: %(default)s)")
    p.add_argument("--batch", type=_positive(int, "--batch"), default=8, help="records per step (default: %(default)s)")
    p.add_argument("--max-minutes", type=_positive(float, "--max-minutes"), default=None,
                   help="stop after the epoch in which this much time has passed (resume later with the same "
                        "--work-dir)")
    p.add_argument("--work-dir", default=None, help="checkpoint directory (default: <output>.work); a checkpoint "
                                                   "there with the same settings is resumed, and the generated "
                                                   "records and target features (records_*.pt, features.pt) "
                                                   "are reused by a run on the same data and model")
    p.add_argument("--keep-data", action="store_true",
                   help="keep records_*.pt and features.pt in --work-dir after a finished run (to train more heads on "
                        "the same data: another --vocab, --epochs or --lr); by default they are deleted")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the training report as JSON")
    p.set_defaults(func=cmd_train_draft_head)

    p = subparsers.add_parser(
        "train-backbone", help="train the backbone (LoRA) so that early exits agree with the full model (a delta file)",
        description="The seed's joint stage (seed 004 §5.1) with LayerSkip's recipe: exit adapters first with the "
                    "backbone frozen, then LoRA factors on every projection at 0.01x the adapters' learning rate, "
                    "with an early-exit KL at every exit point, layer dropout rising with depth, and a KL to the "
                    "original model's full-depth distribution. Writes a delta file bound to the base model "
                    "(--lora PATH merges it at load) and a report with the agreement curve.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="defaults and sources:\n"
               "  LoRA           rank 16, alpha 32 on q/k/v/o/gate/up/down (Hu et al. 2021)\n"
               "  learning rates adapters 1e-3 (tuned-lens anchor), backbone 0.01x (seed 004), linear warm-up "
               "(seed 000)\n"
               "  layer dropout  p_max 0.1, exponential in depth (LayerSkip, Elhoushi et al. 2024)\n"
               "  clipping       adaptive within 0.2-1.0; gradients normalised across layers (seed 000)\n"
               "  data           WikiText-2 valid (its last --eval-records records held out) + the model's greedy "
               "answers to chat questions\n\n"
               "example:\n  laserlm train-backbone -m smollm2-135m -o smol.delta.safetensors --max-minutes 60\n"
               "  laserlm calibrate -m smollm2-135m --lora smol.delta.safetensors -o smol.laser.safetensors")
    add_model_args(p)
    p.add_argument("--output", "-o", required=True, help="delta file (.safetensors); the report goes beside it (.json)")
    p.add_argument("--data", "--data-dir", dest="data", default=None, metavar="DIR",
                   help="data directory (wikitext-2/valid.txt, arc/, piqa/; default: $LASERLM_DATA, else ../shared/data "
                        "next to a source checkout)")
    p.add_argument("--seq-len", type=_positive(int, "--seq-len"), default=128, help="tokens per record (default: %(default)s)")
    p.add_argument("--text-records", type=_positive(int, "--text-records", True), default=None,
                   help="training records of calibration text (default: all of it but the held-out records)")
    p.add_argument("--chat-records", type=_positive(int, "--chat-records", True), default=256,
                   help="records of a chat question and the model's greedy answer (default: %(default)s)")
    p.add_argument("--eval-records", type=_positive(int, "--eval-records"), default=32,
                   help="held-out records (the end of the calibration text) for the agreement curve (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive(int, "--max-tokens"), default=200_000,
                   help="training tokens, the frozen part included (default: %(default)s); raise it and rerun to train on")
    p.add_argument("--max-minutes", type=_positive(float, "--max-minutes"), default=None,
                   help="stop after this much training time (rerun the same command to resume)")
    p.add_argument("--frozen-tokens", type=_positive(int, "--frozen-tokens", True), default=16384,
                   help="first tokens that train the exit adapters alone, backbone frozen (default: %(default)s)")
    p.add_argument("--rank", type=_positive(int, "--rank"), default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--alpha", type=_positive(float, "--alpha"), default=32.0, help="LoRA alpha (default: %(default)s)")
    p.add_argument("--lr", type=_positive(float, "--lr"), default=1e-3,
                   help="exit adapters' learning rate (default: %(default)s)")
    p.add_argument("--backbone-lr-ratio", type=_positive(float, "--backbone-lr-ratio"), default=0.01,
                   help="backbone learning rate / --lr (default: %(default)s, seed 004)")
    p.add_argument("--layer-dropout", type=_positive(float, "--layer-dropout", True), default=0.1,
                   help="LayerSkip's p_max: the last layer's dropout rate (default: %(default)s)")
    p.add_argument("--exit-weight", type=_positive(float, "--exit-weight", True), default=1.0,
                   help="weight of the early-exit KL (default: %(default)s)")
    p.add_argument("--distill-weight", type=_positive(float, "--distill-weight", True), default=1.0,
                   help="weight of the last layer's KL to the original model (default: %(default)s)")
    p.add_argument("--top-k", type=_positive(int, "--top-k"), default=16,
                   help="teacher tokens per position in the KL (default: %(default)s)")
    p.add_argument("--final-kl", choices=["tail", "union"], default="tail",
                   help="last layer's KL: tail (teacher top-k plus a tail bucket, over the full vocabulary) or union "
                        "(renormalised over the batch's teacher tokens; cheaper, lets mass leave unpaid) "
                        "(default: %(default)s)")
    p.add_argument("--batch", type=_positive(int, "--batch"), default=8, help="records per step (default: %(default)s)")
    p.add_argument("--exits", default=None, metavar="E1,E2,...",
                   help="exit points (layers run before each; default: every 5 layers from a quarter of the depth)")
    p.add_argument("--autocast", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="arithmetic of training steps (auto: bfloat16 where this CPU multiplies it natively)")
    p.add_argument("--eval-every", type=_positive(int, "--eval-every", True), default=32768, metavar="TOKENS",
                   help="evaluate the held-out curve every this many training tokens (0: only at the end; default: "
                        "%(default)s)")
    p.add_argument("--work-dir", default=None, help="checkpoint directory (default: <output>.work); a checkpoint "
                                                   "there with the same settings is resumed")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_train_backbone)


def cmd_train_draft_head(args) -> int:
    from pathlib import Path  # noqa: PLC0415

    from ..cli_common import load_from_args  # noqa: PLC0415
    from ..speculative.draft_head import save_draft_head  # noqa: PLC0415
    from .draft_head import train_draft_head, training_records  # noqa: PLC0415

    from ..speculative.draft_head import check_vocab  # noqa: PLC0415

    out = Path(args.output)
    check_output_paths(out, args.work_dir)
    check_vocab(args.vocab)  # fail before the model loads and the answers are generated
    if not 0 < args.lr < 1:
        raise InvalidArgumentError(f"--lr must be in (0, 1), got {args.lr}")
    if args.seq_len < 64:
        raise InvalidArgumentError(f"--seq-len must be at least 64 (a chat prompt may fill at most half of a record), "
                                   f"got {args.seq_len}")
    if args.chat_records + args.instruction_records + args.text_records < 2:
        raise InvalidArgumentError("draft head training needs at least 2 records (--chat-records, "
                                   "--instruction-records, --text-records)")
    work = Path(args.work_dir) if args.work_dir is not None else out.with_name(out.name + ".work")
    lm = load_from_args(args)
    records, data_report = training_records(lm.engine, args.chat_records, args.text_records, args.seq_len, args.data,
                                            progress=not args.quiet, instruction_records=args.instruction_records,
                                            work_dir=work)
    dm, report = train_draft_head(lm.engine, records, vocab=args.vocab, epochs=args.epochs, lr=args.lr,
                                  batch=args.batch, intermediate_size=args.intermediate_size, work_dir=work,
                                  max_minutes=args.max_minutes, seed=args.seed, progress=not args.quiet)
    report["data"] = data_report
    if not report["finished"]:
        print(f"laserlm: stopped after {len(report['history'])} of {args.epochs} epochs (--max-minutes); run the "
              f"same command again to resume from {work}", file=sys.stderr)
        return 0
    save_draft_head(out, lm.engine, dm.head, dm.vocab_ids, report)
    (work / "draft_head.ckpt").unlink(missing_ok=True)  # finished: the checkpoint only served resuming
    kept = sorted(p.name for p in work.iterdir())
    if kept and not args.keep_data:
        for path in [*work.glob("records_*.pt"), work / "features.pt"]:
            path.unlink(missing_ok=True)
        kept = sorted(p.name for p in work.iterdir())
    if not kept:
        work.rmdir()
    elif not args.quiet:
        print(f"kept {', '.join(kept)} in {work} for further runs (--keep-data)", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        last = report["history"][-1]
        print(f"draft head: {report['params']:,} parameters, vocabulary {report['vocab']} (covers "
              f"{report['vocab_coverage']:.1%} of the model's greedy tokens), {report['tokens']:,} training tokens, "
              f"{report['seconds']:.0f} s; last epoch loss {last['loss']:.4f}, top-1 vs target {last['top1']:.3f}")
        print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_train_backbone(args) -> int:
    from .backbone_run import run_train_backbone  # noqa: PLC0415

    check_output_paths(args.output, args.work_dir)
    return run_train_backbone(args)


def config_from_args(args):
    from .gates import GateTrainConfig  # noqa: PLC0415
    from .pipeline import CalibrateConfig  # noqa: PLC0415
    from .predictor import PredictorTrainConfig  # noqa: PLC0415
    from .train import HeadTrainConfig, JointTrainConfig  # noqa: PLC0415

    target = args.target_agreement
    if target is None and args.max_ppl_increase is None:
        target = 0.99
    return CalibrateConfig(
        data=args.data, source=args.source, groups=args.groups, min_depth=args.min_depth, seq_len=args.seq_len,
        train_tokens=args.train_tokens, gate_tokens=args.gate_tokens, calib_tokens=args.calib_tokens,
        eval_tokens=args.eval_tokens, adapter=args.adapter, rank=args.rank, use_ats=not args.no_ats,
        gate_features=args.gate_features, bridge=args.bridge, patience=args.patience, compensation=args.compensation,
        heads=HeadTrainConfig(steps=args.head_steps, batch_tokens=args.batch_tokens, lr=args.head_lr,
                              grad_clip=args.grad_clip, adaptive_clip=args.adaptive_clip,
                              cross_layer_norm=args.cross_layer_norm, seed=args.seed, vocab=args.head_vocab,
                              teacher_topk=args.head_topk, negatives=args.head_negatives),
        gates=GateTrainConfig(steps=args.gate_steps, seed=args.seed),
        predictor=not args.no_predictor,
        predictor_train=PredictorTrainConfig(steps=args.predictor_steps, seed=args.seed),
        joint=JointTrainConfig(epochs=args.joint_epochs, lr=args.joint_lr, warmup_steps=args.warmup_steps,
                               grad_clip=args.grad_clip, adaptive_clip=args.adaptive_clip,
                               cross_layer_norm=args.cross_layer_norm, threshold_decay=args.threshold_decay,
                               seed=args.seed),
        router_prompts=args.router_prompts, router_prompt_len=args.router_prompt_len,
        router_continuation=args.router_continuation, router_position=args.router_position, target_agreement=target, max_ppl_increase=args.max_ppl_increase,
        delta=args.delta, p_value=args.p_value,
    ).validate()


def check_output_paths(out, work_dir=None) -> None:
    """Fail before any work when the artifact, its report or the work directory cannot be written.

    Raises:
        InvalidArgumentError: missing or unwritable parent directory, an output that is a directory or ends in ``.json`` (the
            report's name), or a work directory that is an existing file.
    """
    from pathlib import Path  # noqa: PLC0415

    from ..cli_common import check_output_path  # noqa: PLC0415

    out = Path(out)
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"output directory does not exist: {out.parent}")
    check_output_path(str(out), "--output")  # a directory given as the file, an unwritable directory
    if out.suffix == ".json":
        raise InvalidArgumentError(f"--output {out}: .json is the report's name; use .safetensors for the artifact")
    work = Path(work_dir) if work_dir is not None else out.with_name(out.name + ".work")
    if work.exists() and not work.is_dir():
        raise InvalidArgumentError(f"work directory {work} exists and is not a directory")


def cmd_calibrate(args) -> int:
    from pathlib import Path  # noqa: PLC0415

    from ..cli_common import load_from_args  # noqa: PLC0415
    from .pipeline import calibrate, format_summary  # noqa: PLC0415

    cfg = config_from_args(args)  # fail before the model loads
    if cfg.max_ppl_increase is not None and args.p_value not in (None, "clt"):
        raise InvalidArgumentError("--max-ppl-increase supports only --p-value clt (the NLL is unbounded)")
    out = Path(args.output)
    check_output_paths(out, args.work_dir)
    from ..data import resolve  # noqa: PLC0415
    from .collect import DEFAULT_TEXT  # noqa: PLC0415

    resolve(cfg.data, DEFAULT_TEXT, what="calibration text", default_split="validation")  # missing data: fail now
    lm = load_from_args(args)
    summary = calibrate(lm, cfg, out, resume=args.resume, progress=not args.quiet, work_dir=args.work_dir)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
        print(f"wrote {out} (report: {out.with_suffix('.json')})", file=sys.stderr)
    for w in summary.get("warnings", []):
        print(f"laserlm: warning: {w}", file=sys.stderr)
    if not summary["held_out"]["target_met"]:
        print("laserlm: warning: the held-out split missed the target although the calibration split certified it. "
              "Positions of one document are correlated, so small splits overstate the evidence: use more "
              "--calib-tokens (and --eval-tokens) before trusting this guarantee.", file=sys.stderr)
    return 0
