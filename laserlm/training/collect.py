"""Collect hidden states at the exit points once from the frozen model (then reuse them every epoch).

The engine primitives run the model segment by segment (``Engine.begin`` -> ``run_layers`` between
exit points), teacher-forced on fixed-length chunks of local text without the KV cache
(``use_cache=False``), so each exit point's hidden state is exactly what adaptive decoding sees when
every earlier layer ran. The full model's final hidden state is kept too (its next-token distribution
is recomputed with ``Engine.head`` when needed instead of storing ``[N, vocab]`` logits).

Text must come from validation/dev splits (WikiText-2 ``valid.txt`` by default); test splits are
refused so that reported numbers stay unseen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import HFDataset, is_test_split, read_text
from ..data import resolve as resolve_data
from ..errors import DataFileError, InvalidArgumentError

DEFAULT_TEXT = "wikitext-2/valid.txt"  # under the data directory (see laserlm.data)


def load_text_tokens(tokenizer, path: str | Path | None = None, max_tokens: int | None = None,
                     allow_test: bool = False) -> torch.Tensor:
    """Tokenize calibration text into one ``[N]`` int64 stream (no special tokens).

    Args:
        path: a text file, a data directory (its ``wikitext-2/valid.txt``) or ``hf:NAME[:CONFIG[:SPLIT]]``
            (default split ``validation``); ``None``: the default data directory (see :mod:`laserlm.data`).

    Raises:
        DataFileError: the text is not found (the message names ``--data``) or cannot be read.
        InvalidArgumentError: a test split (file name containing ``test``, or split ``test``) without
            ``allow_test``, or a text with no tokens.
    """
    source = resolve_data(path, DEFAULT_TEXT, what="calibration text", default_split="validation")
    name = source.split if isinstance(source, HFDataset) else source.name
    if is_test_split(source) and not allow_test:  # test.txt, wiki.test.raw; not latest.txt
        raise InvalidArgumentError(f"{name} looks like a test split; calibrate on valid/dev text only "
                                   "(test splits are kept for reporting)")
    if isinstance(source, Path) and source.is_dir():
        raise DataFileError(f"--data {source}: a directory; pass a text file")
    text = read_text(source, errors="replace")
    path = source
    if max_tokens is not None:
        text = text[: max(max_tokens * 8, 4096)]  # ~4-5 characters per token: avoid tokenizing everything
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if not ids:
        raise InvalidArgumentError(f"{path} contains no tokens")
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class ExitStates:
    """Hidden states of ``N`` token positions at every exit point.

    Attributes:
        exit_points: exit points as the number of decoder layers run (``10`` = after layers 0..9).
        hidden: ``layer count -> [N, d]`` residual-stream hidden states (before the final norm) at every
            exit point and at the start of every exit point's layer group (``0`` = embeddings).
        group_start: ``exit_point -> layer count`` where the group ending at that exit point starts
            (its hidden state is the group's input, used by the saturation feature).
        final_hidden: ``[N, d]`` output of the last decoder layer.
        full_top1: ``[N]`` full-model greedy next token.
        labels: ``[N]`` the actual next token of the text.
        chunk: ``[N]`` index of the chunk each position came from (splits are made by chunk).
        ats: ``[N]`` attention transition score at decoder layer ``ats_layer`` (head-mean cosine of a
            position's attention distribution with the previous position's; 0 at a chunk's first
            position, like :func:`laserlm.depth.heads.gate_scalars_batch` when it is absent), or ``None``.
        ats_layer: the decoder layer index the ATS was measured at.
        own_top1: ``[N]`` the model's own full-depth greedy token when ``full_top1`` is another model's (the
            original a delta adapted, :func:`reference_top1`: certificates are about the model the user chose);
            ``None`` when ``full_top1`` is the model's own.
    """

    exit_points: list[int]
    hidden: dict[int, torch.Tensor]
    group_start: dict[int, int]
    final_hidden: torch.Tensor
    full_top1: torch.Tensor
    labels: torch.Tensor
    chunk: torch.Tensor
    ats: torch.Tensor | None = None
    ats_layer: int | None = None
    own_top1: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.full_top1.shape[0]

    def select(self, mask: torch.Tensor) -> ExitStates:
        """Positions where ``mask [N]`` is True (or indices ``[M]``)."""
        return ExitStates(list(self.exit_points), {e: h[mask] for e, h in self.hidden.items()},
                          dict(self.group_start), self.final_hidden[mask], self.full_top1[mask],
                          self.labels[mask], self.chunk[mask],
                          self.ats[mask] if self.ats is not None else None, self.ats_layer,
                          self.own_top1[mask] if self.own_top1 is not None else None)

    def split_chunks(self, fractions: list[float]) -> list[ExitStates]:
        """Split by whole chunks, in order (contiguous text), into parts of the given fractions."""
        n_chunks = int(self.chunk.max()) + 1 if len(self) else 0
        bounds, acc = [], 0.0
        for f in fractions:
            acc += f
            bounds.append(round(acc * n_chunks))
        parts, lo = [], 0
        for hi in bounds:
            parts.append(self.select((self.chunk >= lo) & (self.chunk < hi)))
            lo = hi
        return parts

    def state_dict(self) -> dict[str, torch.Tensor]:
        d = {"final_hidden": self.final_hidden, "full_top1": self.full_top1, "labels": self.labels,
             "chunk": self.chunk, "exit_points": torch.tensor(self.exit_points),
             "group_start": torch.tensor([self.group_start[e] for e in self.exit_points])}
        d.update({f"hidden.{e}": h for e, h in self.hidden.items()})
        if self.ats is not None:
            d["ats"] = self.ats
            d["ats_layer"] = torch.tensor(self.ats_layer)
        if self.own_top1 is not None:
            d["own_top1"] = self.own_top1
        return d

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> ExitStates:
        exits = [int(x) for x in d["exit_points"].tolist()]
        starts = dict(zip(exits, (int(x) for x in d["group_start"].tolist())))
        hidden = {int(k.split(".")[1]): v for k, v in d.items() if k.startswith("hidden.")}
        return cls(exits, hidden, starts, d["final_hidden"], d["full_top1"], d["labels"], d["chunk"],
                   d.get("ats"), int(d["ats_layer"]) if "ats_layer" in d else None, d.get("own_top1"))


def attention_transition_score(probs: torch.Tensor) -> torch.Tensor:
    """ATS of each query: cosine between its attention distribution and the previous query's.

    Args:
        probs: ``[H, T, S]`` attention probabilities of one sequence (causal, keys = positions).

    Returns:
        ``[T]`` head-mean cosine similarity; position 0 gets 0.0 (no previous token: "absent"). Seed:
        < 0.7 means the context shifted and the token should go deeper.
    """
    cur, prev = probs[:, 1:], probs[:, :-1]
    cos = torch.nn.functional.cosine_similarity(cur, prev, dim=-1).mean(0)
    return torch.cat([torch.zeros(1, dtype=cos.dtype), cos])


@torch.inference_mode()
def collect_exit_states(engine, token_ids: torch.Tensor, groups, seq_len: int = 256,
                        ats_layer: int | None = None, progress: bool = True,
                        dtype=torch.float32) -> ExitStates:
    """Run the frozen model over ``token_ids [N]`` in chunks of ``seq_len`` and keep exit-point states.

    Args:
        engine: a :class:`~laserlm.runtime.engine.Engine`.
        token_ids: ``[N]`` int64 token stream.
        groups: :class:`laserlm.depth.groups.LayerGroups` (its ``exit_points`` are collected, plus the
            start of each exit point's group).
        seq_len: positions per chunk; each chunk of ``seq_len + 1`` tokens gives ``seq_len`` positions
            (inputs ``0..seq_len-1``, next tokens ``1..seq_len``); chunks do not overlap.
        ats_layer: decoder layer whose attention transition score to record (``None``: no ATS).

    Raises:
        InvalidArgumentError: no exit points, a ``seq_len`` below 2 or above the engine's context, an
            ``ats_layer`` out of range, or fewer than ``seq_len + 1`` tokens.
    """
    n_layers = engine.num_layers
    exit_points = list(groups.exit_points)
    check_exit_points(exit_points, n_layers)
    starts = {e: groups.bounds[groups.group_ending_at(e)][0] for e in exit_points}
    if seq_len < 2 or seq_len > engine.max_seq_len:
        raise InvalidArgumentError(f"seq_len must be in 2..{engine.max_seq_len}, got {seq_len}")
    if ats_layer is not None and not 0 <= ats_layer < n_layers:
        raise InvalidArgumentError(f"ATS layer must be in 0..{n_layers - 1}, got {ats_layer}")
    n_chunks = (token_ids.shape[0] - 1) // seq_len
    if n_chunks < 1:
        raise InvalidArgumentError(f"need at least {seq_len + 1} tokens of text, got {token_ids.shape[0]}")
    keep = sorted(set(exit_points) | set(starts.values()))
    hidden = {k: [] for k in keep}
    ats, finals, top1, labels, chunk = [], [], [], [], []
    bounds = [k for k in keep if k > 0] + [n_layers]
    for c in tqdm(range(n_chunks), desc="collect hidden states", unit="chunk", disable=not progress):
        ids = token_ids[c * seq_len: (c + 1) * seq_len + 1]
        h, state = engine.begin(ids[:-1].unsqueeze(0), use_cache=False)
        if ats_layer is not None:
            state.ctx.want_probs = frozenset([ats_layer])
        if 0 in hidden:
            hidden[0].append(h[0].to(dtype))
        start = 0
        for b in bounds:
            h = engine.run_layers(start, b, h, state)
            start = b
            if b < n_layers:
                hidden[b].append(h[0].to(dtype))
        finals.append(h[0].to(dtype))
        top1.append(engine.head(h)[0].argmax(-1))
        labels.append(ids[1:])
        chunk.append(torch.full((seq_len,), c, dtype=torch.long))
        if ats_layer is not None:
            ats.append(attention_transition_score(state.ctx.probs.pop(ats_layer)[0]).float())
    return ExitStates(exit_points, {k: torch.cat(v) for k, v in hidden.items()}, starts, torch.cat(finals),
                      torch.cat(top1), torch.cat(labels), torch.cat(chunk),
                      torch.cat(ats) if ats_layer is not None else None, ats_layer)


@torch.inference_mode()
def reference_top1(engine, token_ids: torch.Tensor, seq_len: int, progress: bool = True) -> torch.Tensor:
    """``[n_chunks * seq_len]`` full-depth greedy tokens of ``engine`` (the *original* model) on the chunks that
    :func:`collect_exit_states` makes of ``token_ids`` (same chunking, same positions)."""
    n_chunks = (token_ids.shape[0] - 1) // seq_len
    out = []
    for c in tqdm(range(n_chunks), desc="original model's tokens", unit="chunk", disable=not progress):
        ids = token_ids[c * seq_len: (c + 1) * seq_len]
        out.append(engine.forward(ids.unsqueeze(0), logits="all", use_cache=False).logits[0].argmax(-1))
    return torch.cat(out)


def check_exit_points(exit_points: list[int], num_layers: int) -> None:
    """Raise :class:`InvalidArgumentError` unless exit points are strictly increasing in ``1..L-1``."""
    if not exit_points:
        raise InvalidArgumentError("at least one exit point is required")
    if any(not isinstance(e, int) or e < 1 or e >= num_layers for e in exit_points):
        raise InvalidArgumentError(f"exit points must be layer counts in 1..{num_layers - 1}, got {exit_points}")
    if any(b <= a for a, b in zip(exit_points, exit_points[1:])):
        raise InvalidArgumentError(f"exit points must be strictly increasing, got {exit_points}")
