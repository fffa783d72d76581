"""Train a draft head (:mod:`laserlm.speculative.draft_head`) on the frozen model: collect its last-layer features
once, pick the draft vocabulary, then train the draft layer with EAGLE's loss; resumable per epoch.

Data: the model's own greedy answers to chat questions from dev/validation splits
(:func:`laserlm.training.chat_text.chat_token_stream`, never the shipped prompts or a test split) plus records of
calibration text (WikiText-2 valid by default), each record ``seq_len`` tokens from position 0.

Vocabulary (FR-Spec): the ``k`` tokens the target itself predicts most often (argmax of its logits) over the
training positions; ties by token id.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import InvalidArgumentError
from ..models.delta import tensors_sha256
from ..models.files import write_torch_atomic
from ..speculative.draft_head import CE_WEIGHT, DraftHead, DraftHeadConfig, DraftModel, check_vocab
from ..runtime.options import is_int

NOISE = 0.1  # EAGLE §3.3: uniform noise U(-0.1, 0.1) on the input features (here in units of the feature scale)


@torch.inference_mode()
def collect_features(engine, records: torch.Tensor, batch: int = 8, progress: bool = True):
    """``records [R, S]`` -> ``(features [R, S, d] float32, target argmax [R, S] int64)``: the full model's last
    layer (pre-norm) at every position, teacher-forced without the KV cache, and its greedy next token."""
    feats, top = [], []
    for i in tqdm(range(0, records.shape[0], batch), desc="draft head: target features", unit="batch",
                  disable=not progress):
        ids = records[i:i + batch]
        h, st = engine.begin(ids, use_cache=False)
        h = engine.run_layers(0, engine.num_layers, h, st).float()
        feats.append(h)
        top.append(torch.cat([engine.head(h[:, j:j + 64]).argmax(-1) for j in range(0, h.shape[1], 64)], 1))
    return torch.cat(feats), torch.cat(top)


def model_key(engine) -> dict:
    """What a cached record or feature depends on besides the data: the weights' identity, format and dtype."""
    from ..models.weights_hash import weights_sha256  # noqa: PLC0415

    return {"weights_sha256": weights_sha256(engine.model), "weights": engine.weights, "dtype": str(engine.dtype)}


def _cached(path: Path | None, key: dict, make):
    """``make()``'s value, stored at ``path`` with ``key`` and read back while the key is equal (a different or
    unreadable file is rebuilt and overwritten); ``path=None``: no cache."""
    if path is not None and path.is_file():
        try:
            saved = torch.load(path, weights_only=True)
            if saved.get("key") == key:
                return saved["value"]
        except Exception:  # noqa: BLE001 (a damaged cache is rebuilt, never trusted)
            pass
    value = make()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_torch_atomic({"key": key, "value": value}, path)
    return value


def pick_vocab(top: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """The ``k`` most frequent ids of ``top`` (ties: smaller id first), padded with the smallest unused ids when
    fewer than ``k`` distinct ids occur -> ``[k]`` int64, sorted."""
    counts = torch.bincount(top.reshape(-1), minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True).tolist()  # stable: ties keep the smaller id first
    return torch.tensor(sorted(order[:k]), dtype=torch.long)


def _scale(x: torch.Tensor) -> float:
    return float(x.float().pow(2).mean().sqrt().clamp_min(1e-6))


def train_draft_head(engine, records: torch.Tensor, vocab: int = 4096, epochs: int = 8, lr: float = 1e-3,
                     batch: int = 8, intermediate_size: int | None = None, work_dir: str | Path | None = None,
                     max_minutes: float | None = None, seed: int = 0, progress: bool = True):
    """Train a draft head on ``records [R, S]`` (token ids) of ``engine``'s frozen model.

    Optimiser: AdamW (weight decay 0), ``lr`` with 5 % linear warm-up and cosine decay to 10 %, gradient norm
    clipped at 1.0; records shuffled per epoch (and the feature noise drawn) by a generator seeded with ``1000 * seed + epoch``.

    Args:
        work_dir: a directory for ``draft_head.ckpt`` (written after every epoch). A checkpoint there with the
            same settings is resumed from its next epoch, and ends at the same weights as an uninterrupted run.
        max_minutes: stop after the epoch during which this many minutes have passed (the checkpoint then
            resumes the rest).

    Returns:
        ``(DraftModel, report)``; ``report["finished"]`` is False when ``max_minutes`` stopped it early.

    Raises:
        InvalidArgumentError: bad sizes, fewer than 2 records or records shorter than 8 tokens.
    """
    check_vocab(vocab)
    if records.dim() != 2 or records.shape[0] < 2 or records.shape[1] < 8:
        raise InvalidArgumentError(f"draft head training needs at least 2 records of >= 8 tokens, got shape "
                                   f"{tuple(records.shape)}")
    for name, v in (("epochs", epochs), ("batch", batch)):
        if not is_int(v) or v < 1:
            raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
    if not (isinstance(lr, (int, float)) and 0 < lr < 1):
        raise InvalidArgumentError(f"lr must be in (0, 1), got {lr!r}")
    t0 = time.perf_counter()
    feats, top = _cached(None if work_dir is None else Path(work_dir) / "features.pt",
                         {"records": tensors_sha256({"records": records})} | model_key(engine),
                         lambda: collect_features(engine, records, progress=progress))
    vocab = min(vocab, engine.config.vocab_size)
    vocab_ids = pick_vocab(top, vocab, engine.config.vocab_size)
    with torch.inference_mode():
        embeds = engine.adapter.embed(records).float()
    cfg = DraftHeadConfig.for_engine(engine, vocab, intermediate_size)
    cfg.feature_scale, cfg.embed_scale = _scale(feats), _scale(embeds)
    feats, embeds = feats.clone(), embeds.clone()  # leave inference mode
    collect_s = time.perf_counter() - t0
    torch.manual_seed(seed)
    head = DraftHead(cfg)
    dm = DraftModel(engine, head, vocab_ids)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    r = records.shape[0]
    steps_per_epoch = math.ceil(r / batch)
    total = steps_per_epoch * epochs
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total))))))
    settings = {"vocab": vocab, "epochs": epochs, "lr": lr, "batch": batch, "seed": seed, "records": list(records.shape),
                "config": asdict(cfg), "records_sum": int(records.sum())}
    ckpt = Path(work_dir) / "draft_head.ckpt" if work_dir is not None else None
    start_epoch, history = 0, []
    if ckpt is not None and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        if saved.get("settings") == settings:
            head.load_state_dict(saved["head"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            start_epoch, history = saved["epoch"], saved["history"]
    pos = torch.arange(records.shape[1] - 1)
    rows = dm.rows
    finished = True
    bar = tqdm(total=total, initial=start_epoch * steps_per_epoch, desc="draft head: train", unit="step",
               disable=not progress)
    for epoch in range(start_epoch, epochs):
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(r, generator=g)
        tot = {"loss": 0.0, "reg": 0.0, "ce": 0.0, "top1": 0.0, "n": 0}
        head.train()
        for i in range(0, r, batch):
            idx = order[i:i + batch]
            f_in, f_out, e_in = feats[idx, :-1], feats[idx, 1:], embeds[idx, 1:]
            f_in = f_in + (torch.rand(f_in.shape, generator=g) * 2 - 1) * NOISE * cfg.feature_scale
            pred, _ = head(f_in, e_in, pos)
            reg = F.smooth_l1_loss(pred / cfg.feature_scale, f_out / cfg.feature_scale)
            with torch.no_grad():
                p = torch.softmax(_logits(dm, f_out, rows), -1)
            logq = torch.log_softmax(_logits(dm, pred, rows), -1)
            ce = -(p * logq).sum(-1).mean()
            loss = reg + CE_WEIGHT * ce
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            n = idx.numel()
            tot["loss"] += loss.item() * n
            tot["reg"] += reg.item() * n
            tot["ce"] += ce.item() * n
            tot["top1"] += float((logq.argmax(-1) == p.argmax(-1)).float().mean()) * n
            tot["n"] += n
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        history.append({k: round(v / tot["n"], 5) for k, v in tot.items() if k != "n"} | {"epoch": epoch + 1})
        if ckpt is not None:
            write_torch_atomic({"settings": settings, "head": head.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "epoch": epoch + 1, "history": history}, ckpt)
        if max_minutes is not None and epoch + 1 < epochs and time.perf_counter() - t0 > 60 * max_minutes:
            finished = False
            break
    bar.close()
    head.eval()
    report = {"records": list(records.shape), "tokens": int(records.numel()), "vocab": vocab,
              "vocab_coverage": round(float(dm.in_vocab[top.reshape(-1)].float().mean()), 4),
              "epochs": epochs, "lr": lr, "batch": batch, "history": history, "finished": finished,
              "collect_s": round(collect_s, 1), "seconds": round(time.perf_counter() - t0, 1),
              "params": sum(p.numel() for p in head.parameters()), "intermediate_size": cfg.intermediate_size}
    return DraftModel(engine, head, vocab_ids), report


def _logits(dm: DraftModel, feats: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits with gradients through ``feats`` (the target's norm is frozen: no parameter grads)."""
    out = F.linear(dm.norm(feats).float(), rows)
    if dm.softcap is not None:
        out = torch.tanh(out / dm.softcap) * dm.softcap
    return out


TEMPLATES = ("Write a short poem about {t}.", "Give me three tips about {t}.", "Tell me a short story about {t}.",
             "Explain {t} to a child.", "What are the pros and cons of {t}?", "Describe {t} in a few sentences.",
             "Write a friendly email to a colleague about {t}.", "What should a beginner know about {t}?",
             "Give me a fun fact about {t}.", "Write a haiku about {t}.", "How can I get better at {t}?",
             "List five ideas related to {t}.", "Why do people enjoy {t}?", "Summarise the history of {t}.",
             "Write a short dialogue between two friends about {t}.", "What questions should I ask about {t}?",
             "Suggest a weekend plan involving {t}.", "Write a product description for {t}.",
             "What are common mistakes with {t}?", "Compare {t} with something similar.",
             "Explain how {t} works, step by step.", "Write the opening paragraph of a story about {t}.",
             "What are three surprising facts about {t}?", "Write a short blog post about {t}.",
             "Give me a simple explanation of {t} for a busy adult.",
             "What is the most important thing to remember about {t}?", "Write a riddle whose answer is {t}.",
             "Plan a one-hour lesson on {t}.", "Describe a typical day for someone who loves {t}.",
             "Write a persuasive paragraph about {t}.")
TOPICS = ("gardening", "the moon", "coffee", "a lost dog", "volcanoes", "learning French", "chess", "rainy days",
          "bicycles", "the ocean", "robots", "baking bread", "friendship", "mountains", "a small town", "jazz music",
          "saving money", "penguins", "the internet", "winter", "camping", "painting", "trains", "honey bees",
          "running a marathon", "time management", "a haunted house", "dinosaurs", "public speaking", "recycling",
          "a birthday surprise", "the desert", "video games", "photography", "pirates", "healthy breakfast",
          "electric cars", "a job interview", "the solar system", "knitting", "libraries", "a thunderstorm",
          "learning to swim", "city parks", "owls", "pizza", "yoga", "writing a novel", "a road trip", "castles",
          "the human heart", "clouds", "an old lighthouse", "soccer", "meditation", "rivers", "a bakery",
          "space travel", "autumn leaves", "programming", "elephants", "moving house", "tea ceremonies", "islands",
          "volleyball", "the Roman empire", "sourdough", "houseplants", "octopuses", "the printing press",
          "board games", "climate change", "a village market", "sailing", "glaciers", "the violin", "first aid",
          "spreadsheets", "ancient Egypt", "a night train", "origami", "fireflies", "budget travel",
          "the stock market", "carpentry", "whales", "the moon landing", "poetry", "wolves", "hot air balloons",
          "a science fair", "bridges", "the Olympic games", "a cozy cafe", "tigers", "coral reefs", "street food",
          "a school play", "kites", "earthquakes", "the ancient Greeks", "sushi", "comic books", "mushrooms",
          "a snowy cabin", "cybersecurity", "tennis", "a music festival", "the post office", "dolphins",
          "chocolate", "a broken phone", "learning guitar", "the Arctic", "a street musician", "rock climbing",
          "a talking parrot", "mathematics", "folk tales", "the water cycle", "a treasure map", "skateboarding",
          "a family dinner", "wind turbines", "ice cream", "the brain")
INSTRUCTIONS_VERSION = 2  # bump when TEMPLATES or TOPICS change (it seeds the order and keys the records cache)


def instruction_prompts() -> list[str]:
    """Open-ended requests of the kind people send a chat model (templates x topics, written for training draft
    heads; disjoint from the lookup-draft benchmark's chat prompts), in a fixed shuffled order."""
    import random  # noqa: PLC0415

    out = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    random.Random(f"instructions:{INSTRUCTIONS_VERSION}").shuffle(out)
    return out


def training_records(engine, chat_records: int, text_records: int, seq_len: int, data=None, progress: bool = True,
                     instruction_records: int = 0, work_dir: str | Path | None = None):
    """``[chat_records + instruction_records + text_records, seq_len]`` token records (module docstring) and a report.
    With ``work_dir``, each part (chat answers, instruction answers, text) is kept there as ``records_<part>.pt``
    and reused by a run with the same size, data and model (generating the answers is most of the data's cost, and
    an interrupted run keeps the parts it finished).

    Raises:
        DataFileError: a data file is missing (the message names ``--data``).
        InvalidArgumentError: not enough text or questions for the sizes asked.
    """
    from .chat_text import CHAT_TEXT_VERSION  # noqa: PLC0415

    if not (chat_records or instruction_records or text_records):
        raise InvalidArgumentError("draft head training needs chat, instruction or text records (all are 0)")
    base = {"seq_len": seq_len, "data": str(data), "versions": [CHAT_TEXT_VERSION, INSTRUCTIONS_VERSION]}
    base |= model_key(engine)
    parts, report = [], {"seq_len": seq_len}
    for name, n in (("chat", chat_records), ("instructions", instruction_records), ("text", text_records)):
        if n:
            path = None if work_dir is None else Path(work_dir) / f"records_{name}.pt"
            toks, rep = _cached(path, base | {"part": name, "records": n},
                                lambda: _make_part(engine, name, n, seq_len, data, progress))
            parts.append(toks.view(-1, seq_len))
            report[name] = rep
    return torch.cat(parts), report


def _make_part(engine, name: str, n: int, seq_len: int, data, progress: bool) -> tuple[torch.Tensor, dict]:
    """``(tokens [n * seq_len], report)`` of one part of :func:`training_records`."""
    from ..data import data_root  # noqa: PLC0415
    from .chat_text import chat_token_stream  # noqa: PLC0415
    from .collect import load_text_tokens  # noqa: PLC0415

    if name == "text":
        text = load_text_tokens(engine.tokenizer, data, max_tokens=n * seq_len)
        if text.numel() < n * seq_len:
            raise InvalidArgumentError(f"calibration text has {text.numel()} tokens, fewer than {n} records of "
                                       f"{seq_len}")
        return text[:n * seq_len], {"records": n}
    if name == "chat":
        root = Path(data) if data is not None and Path(data).is_dir() else data_root()
        toks, _, rep = chat_token_stream(engine, n, seq_len, root, progress=progress)
    else:
        root = Path(data) if data is not None and Path(data).is_dir() else None
        toks, _, rep = chat_token_stream(engine, n, seq_len, root, progress=progress, questions=instruction_prompts())
    return toks, rep


__all__ = ["collect_features", "pick_vocab", "train_draft_head", "training_records"]
