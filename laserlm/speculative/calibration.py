"""Automatic choice of draft depth, draft length and confidence threshold for self-speculative decoding.

Method (a cost model in the spirit of Leviathan et al. 2023, section 3.4, "expected walltime
improvement", with measured instead of assumed costs):

1. **Text.** A few prompts from *validation* data only (WikiText-2 ``valid.txt`` continuations; an
   ARC-Easy dev question through the chat template when the tokenizer has one).
2. **Greedy traces.** Decode ``gen_tokens`` tokens per prompt at full depth, then run one teacher-forced
   forward over prompt + continuation keeping the hidden state after every candidate draft depth ``N``.
   Because greedy speculative output *is* the full model's greedy output, the draft at a position
   sees exactly this prefix whenever it matters (after the last accepted token), so the exit head's
   argmax ``== `` the next greedy token tells whether that draft would be accepted, and its max
   probability is the confidence the adaptive draft length would see.
3. **Costs.** Time one decoder layer on 1 token and on ``m+1`` tokens (the verify), and the exit head,
   in this engine on this machine (median of a few repeats).
4. **Simulation.** Replay the speculative cycles on every trace for every ``(N, K, threshold)``:
   predicted speed-up = (emitted tokens x full-depth cost per token) / (draft + verify cost).

The search table is returned (and reported in the generation stats under ``calibration``). The
prediction assumes greedy acceptance; sampling acceptance is usually higher (partial agreement counts).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import InvalidArgumentError
from ..runtime.loop import greedy_ids
from ..runtime.modes import FullDepth

DATA_DIR: Path | None = None  # None: the data directory of laserlm.data ($LASERLM_DATA or the checkout's)
THRESHOLDS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9)
KS = (1, 2, 3, 4, 6, 8)


def calibration_prompts(tokenizer, n_text: int = 3, prompt_tokens: int = 48) -> list[list[int]]:
    """Prompt token ids from validation splits: WikiText-2 valid paragraphs (cut to ``prompt_tokens``)
    and, if the tokenizer has a chat template, one ARC-Easy dev question as a chat prompt.

    Raises:
        InvalidArgumentError: no ``wikitext-2/valid.txt`` under the data directory (``$LASERLM_DATA``, see
            :mod:`laserlm.data`).
    """
    from ..data import ENV_VAR, find_data_root  # noqa: PLC0415

    root = DATA_DIR if DATA_DIR is not None else find_data_root()
    wiki = root / "wikitext-2" / "valid.txt" if root is not None else None
    if wiki is None or not wiki.is_file():
        where = f"at {wiki}" if wiki is not None else "(no data directory configured)"
        raise InvalidArgumentError(f"auto calibration needs WikiText-2 valid text {where} "
                                   f"(set ${ENV_VAR} to a data directory) or give draft_layers/k/threshold explicitly")
    paragraphs = [line.strip() for line in wiki.read_text(encoding="utf-8").splitlines()
                  if len(line.split()) > 80 and not line.strip().startswith("=")]
    step = max(1, len(paragraphs) // n_text)
    prompts = [tokenizer(p)["input_ids"][:prompt_tokens] for p in paragraphs[::step][:n_text]]
    arc = root / "arc" / "ARC-Easy-Dev.jsonl"
    if getattr(tokenizer, "chat_template", None) and arc.is_file():
        q = json.loads(arc.read_text(encoding="utf-8").splitlines()[0])["question"]
        text = q["stem"] + "\n" + "\n".join(f"{c['label']}. {c['text']}" for c in q["choices"])
        msgs = [{"role": "user", "content": text + "\nExplain your answer."}]
        chat = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return [list(p) for p in prompts]


@torch.inference_mode()
def greedy_traces(engine, prompts, gen_tokens: int, depths, exit_head, on_prompt=None) -> list[dict]:
    """Per prompt: ``agree [len(depths), G]`` (bool) and ``conf [len(depths), G]`` of the exit head
    after each candidate depth on the full model's own greedy continuation of ``G`` tokens.
    ``on_prompt()`` (optional) is called after each prompt (progress)."""
    head = exit_head or engine.head
    traces = []
    for ids in prompts:
        toks = greedy_ids(engine, FullDepth(), torch.tensor(ids), gen_tokens)
        seq = torch.tensor([ids + toks])
        h, state = engine.begin(seq, use_cache=False)
        p0 = len(ids) - 1  # position whose prediction is the first generated token
        agree, conf, prev = [], [], 0
        for d in depths:
            h = engine.run_layers(prev, d, h, state)
            prev = d
            logits = head(h[:, p0:p0 + gen_tokens]).float()[0]
            agree.append(logits.argmax(-1) == torch.tensor(toks))
            conf.append(torch.softmax(logits, -1).amax(-1))
        traces.append({"agree": torch.stack(agree), "conf": torch.stack(conf)})
        if on_prompt is not None:
            on_prompt()
    return traces


@torch.inference_mode()
def measure_costs(engine, max_verify: int, exit_head, repeats: int = 3) -> dict:
    """Seconds of one decoder layer on ``t`` tokens (``layer[t]`` for t = 1..max_verify) and of the exit
    head on one token, measured on a 64-token context (minimum of ``repeats``: the least-disturbed run on a shared machine)."""
    head = exit_head or engine.head
    cache = engine.new_cache(64 + max_verify)  # a scratch cache: no engine state is touched
    engine.prefill(torch.zeros(1, 64, dtype=torch.long), cache=cache)
    layer, L = {}, engine.num_layers
    for t in range(1, max_verify + 1):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            h, state = engine.begin(torch.zeros(1, t, dtype=torch.long), start=64, cache=cache)
            engine.run_layers(0, L, h, state)
            times.append(time.perf_counter() - t0)
            engine.truncate(64, cache=cache)
        layer[t] = min(times) / L
    h = torch.zeros(1, 1, engine.config.hidden_size, dtype=engine.dtype)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        head(h)
        times.append(time.perf_counter() - t0)
    return {"layer_s": layer, "head_s": min(times)}


def fit_verify_cost(engine, widths=(1, 2, 3, 5, 9, 17), repeats: int = 3, context: int = 64) -> dict:
    """Measure the relative cost ``c(w)`` of a full-depth forward over ``w`` positions (``c(1) = 1``) in this
    engine on this machine and fit the lookup drafts' cost model ``c(w) = 1 + b + a log2(w)`` (``w >= 2``) by
    least squares (``a, b`` clipped to ``[0, 16]``). Medians of ``repeats`` runs after a ``context``-token prompt
    in a scratch cache.

    Returns ``{"verify_cost": a, "verify_base": b, "measured": {w: c(w)}}`` (the speculative mode interpolates
    ``measured``; the fit summarises it, and is poor where the curve is linear in ``w``, e.g. packed weights).
    """
    import math  # noqa: PLC0415
    import statistics  # noqa: PLC0415

    cache = engine.new_cache(context + max(widths) + 1)
    with torch.inference_mode():
        engine.prefill(torch.zeros(1, context, dtype=torch.long), cache=cache)
        secs = {}
        for w in widths:
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                h, state = engine.begin(torch.zeros(1, w, dtype=torch.long), start=context, cache=cache)
                h = engine.run_layers(0, engine.num_layers, h, state)
                engine.commit(state)
                engine.head(h)
                times.append(time.perf_counter() - t0)
                engine.truncate(context, cache=cache)
            secs[w] = statistics.median(times[1:])
    rel = {w: secs[w] / secs[widths[0]] for w in widths}
    pts = [(math.log2(w), rel[w] - 1.0) for w in widths if w >= 2]
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    a = sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else 0.0
    a = min(max(a, 0.0), 16.0)
    b = min(max(my - a * mx, 0.0), 16.0)
    return {"verify_cost": round(a, 4), "verify_base": round(b, 4), "measured": {w: round(v, 3) for w, v in rel.items()}}


def verify_table_key(engine) -> str:
    """What a packed verify table depends on: this CPU, the kernel variant and build, torch's version and threads, and
    the model's shapes and matrix formats (not its values). A sha256 hex string."""
    import hashlib  # noqa: PLC0415
    from collections import Counter  # noqa: PLC0415

    from ..cpuinfo import cpu_identity  # noqa: PLC0415
    from ..models import kernels  # noqa: PLC0415
    from ..models.quant import FORMAT_NAMES  # noqa: PLC0415

    cfg = engine.config
    shapes = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "vocab_size", "tie_word_embeddings")}
    formats = Counter(FORMAT_NAMES.get(getattr(m, "fmt", None), type(m).__name__)
                      for m in engine.model.modules() if hasattr(m, "qweight"))
    ops = kernels.ops()
    key = {"cpu": cpu_identity(), "isa": ops.kernel_isa() if ops is not None else None,
           "kernel_build": Path(getattr(ops, "__file__", "") or "").parent.name, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "shapes": shapes, "formats": sorted(formats.items()),
           "weights": engine.weights, "dtype": str(engine.dtype), "fast_rows": engine.fast_rows}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def verify_costs_path() -> Path:
    """The file of measured verify tables: ``$LASERLM_VERIFY_COSTS``, else ``<laserlm cache>/verify_costs.json``.
    Delete it (or the entry) to measure again."""
    import os  # noqa: PLC0415

    from ..models.cache import cache_root  # noqa: PLC0415

    given = os.environ.get("LASERLM_VERIFY_COSTS", "").strip()
    return Path(given) if given else cache_root() / "verify_costs.json"


MIN_VERIFY_COST, MAX_VERIFY_COST = 0.5, 64.0  # a cached c(w) outside this range is damage, not a measurement


def _valid_table(table, widths: tuple[int, ...]) -> dict | None:
    """``{w: c(w)}`` with integer widths, exactly ``widths`` (which start at 1), ``c(1) = 1`` and every cost finite in
    ``[MIN_VERIFY_COST, MAX_VERIFY_COST]``; else ``None``."""
    import math  # noqa: PLC0415

    if not isinstance(table, dict):
        return None
    try:
        out = {int(w): float(c) for w, c in table.items()}
    except (TypeError, ValueError):
        return None
    if tuple(sorted(out)) != widths or out[1] != 1.0:
        return None
    if not all(math.isfinite(c) and MIN_VERIFY_COST <= c <= MAX_VERIFY_COST for c in out.values()):
        return None
    return out


def machine_verify_table(engine, refresh: bool = False) -> dict:
    """The verify cost table ``{w: c(w)}`` of a packed-weights engine measured on this machine
    (:func:`fit_verify_cost` over the widths the compiled kernel takes, up to ``engine.fast_rows``), kept in
    :func:`verify_costs_path` under :func:`verify_table_key` so a machine, model and thread count pay the
    measurement (about a second on smollm2-135m) once. The measured costs are made non-decreasing in ``w`` (a wider
    step never costs less; timing noise can say otherwise). ``refresh``: measure again and replace the entry. An
    entry that is not a valid table for these widths is measured again. The file is read, measured into and written
    under one lock (:func:`~laserlm.models.cache.cached_json_entry`): processes that start at the same moment measure
    once, and none loses another's entry. A file that cannot be read or written is ignored (the table is then
    measured every time).

    Why not the kernel variant's fixed table: one variant prices a verify differently per CPU (AVX-512 on Zen 4,
    which splits 512-bit operations in two, costs 1.65 plain steps at 4 positions where Zen 5 costs 1.33), and a
    policy that believes a verify cheaper than it is drafts too long.

    Returns ``{"measured": {w: c(w)}, "source": "measured on this machine" | "... (cached)"}``.
    """
    from ..models.cache import cached_json_entry  # noqa: PLC0415
    from .policy import packed_verify_table  # noqa: PLC0415

    widths = tuple(w for w in packed_verify_table() if w <= engine.fast_rows)

    def measure() -> dict:
        measured = fit_verify_cost(engine, widths=widths, repeats=5)["measured"]
        table, top = {}, 1.0
        for w in widths:
            top = max(top, min(float(measured[w]), MAX_VERIFY_COST))
            table[w] = round(top, 3)
        return {"measured": table, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def valid(entry) -> dict | None:
        return _valid_table(entry.get("measured"), widths) if isinstance(entry, dict) else None

    try:
        path = verify_costs_path()
    except OSError:  # the cache directory cannot be made: measure, keep nothing
        return {"measured": valid(measure()), "source": "measured on this machine"}
    table, cached = cached_json_entry(path, verify_table_key(engine), measure, valid, refresh=refresh)
    return {"measured": table, "source": "measured on this machine" + (" (cached)" if cached else "")}


def simulate(agree, conf, n_draft: int, n_layers: int, k: int, threshold: float, costs: dict,
             reuse: bool = True) -> dict:
    """Replay greedy speculative cycles over one trace (``agree``/``conf`` ``[G]`` at depth ``n_draft``);
    returns emitted tokens, drafted, accepted, cycles and modelled seconds."""
    layer, head_s = costs["layer_s"], costs["head_s"]
    g = agree.shape[0]
    t = 0
    out = {"emitted": 0, "drafted": 0, "accepted": 0, "cycles": 0, "seconds": 0.0}
    agree, conf = agree.tolist(), conf.tolist()
    while t < g:
        m = 0
        while m < k and t + m < g - 1 and conf[t + m] >= threshold:
            m += 1
        a = 0
        while a < m and agree[t + a]:
            a += 1
        heads = m + (1 if m < k else 0)  # the step that stopped on low confidence also ran the head
        steps = m + 1 if reuse else max(m, heads)
        verify_layers = n_layers - n_draft if reuse else n_layers
        out["seconds"] += steps * n_draft * layer[1] + heads * head_s + verify_layers * layer[m + 1] + head_s
        out["emitted"] += a + 1
        out["drafted"] += m
        out["accepted"] += a
        out["cycles"] += 1
        t += a + 1
    return out


def _progress_bar(n_prompts: int, progress: bool, announce: bool = True):
    """Announce the search on stderr (one line, unless ``announce`` is False: the caller said what runs) and return a
    tqdm bar over its steps: one greedy trace per prompt, the cost measurement, the simulated search. The bar only
    draws on a terminal."""
    if progress and announce:
        print("laserlm: speculative auto: searching draft depth/K/threshold on validation text "
              "(about a minute; runs on every load, fix draft_layers/k/threshold to skip it) ...",
              file=sys.stderr, flush=True)
    return tqdm(total=n_prompts + 2, desc="speculative auto", unit="step", leave=False, dynamic_ncols=True,
                disable=None if progress else True)


def calibrate(engine, exit_head=None, reuse: bool = True, draft_layers: int | None = None, k: int | None = None,
              threshold: float | None = None, gen_tokens: int = 40, n_text: int = 3, progress: bool = True,
              announce: bool = True) -> dict:
    """Search draft depth / K / threshold (those not fixed) by simulated speed-up; see module docstring.

    ``progress``: print a one-line notice to stderr when the search starts and show a tqdm bar (on a terminal).

    Returns ``{"chosen": {...}, "search": [rows best first, at most 12], "costs": {...}, "seconds": s,
    "data": ..., "tokens": n}``; every row has ``draft_layers, k, threshold, acceptance_rate,
    mean_accepted_length, predicted_speedup``.
    """
    t_start = time.perf_counter()
    n_layers = engine.num_layers
    tok = engine.tokenizer
    if tok is None:
        raise InvalidArgumentError("auto calibration needs the model's tokenizer (load the model with laserlm.load)")
    depths = [draft_layers] if draft_layers else sorted(set(range(2, n_layers - 1, max(1, n_layers // 10)))
                                                         | {max(1, n_layers - 2)})
    ks = [k] if k else list(KS)
    thresholds = [threshold] if threshold is not None else list(THRESHOLDS)
    prompts = calibration_prompts(tok, n_text=n_text)
    bar = _progress_bar(len(prompts), progress, announce)
    traces = greedy_traces(engine, prompts, gen_tokens, depths, exit_head, on_prompt=bar.update)
    costs = measure_costs(engine, max(ks) + 1, exit_head)
    bar.update()
    full_cost = n_layers * costs["layer_s"][1] + costs["head_s"]
    rows = []
    for di, d in enumerate(depths):
        for kk in ks:
            for thr in thresholds:
                tot = {"emitted": 0, "drafted": 0, "accepted": 0, "cycles": 0, "seconds": 0.0}
                for tr in traces:
                    r = simulate(tr["agree"][di], tr["conf"][di], d, n_layers, kk, thr, costs, reuse)
                    for key in tot:
                        tot[key] += r[key]
                rows.append({"draft_layers": d, "k": kk, "threshold": thr,
                             "acceptance_rate": round(tot["accepted"] / max(tot["drafted"], 1), 3),
                             "mean_accepted_length": round(tot["emitted"] / max(tot["cycles"], 1), 3),
                             "predicted_speedup": round(tot["emitted"] * full_cost / tot["seconds"], 3)})
    bar.update()
    bar.close()
    rows.sort(key=lambda r: -r["predicted_speedup"])
    top1 = [float(tr["agree"][di].float().mean()) for di in range(len(depths)) for tr in traces]
    best = rows[0]
    note = ("predicted to beat full depth" if best["predicted_speedup"] > 1 else
            "no setting is predicted to beat full depth on this model/machine (the draft's top-1 agreement "
            "with the full model is too low for its cost); the least-slow setting is used")
    return {
        "chosen": best,
        "note": note,
        "search": rows[:12],
        "searched": len(rows),
        "top1_agreement_by_depth": {d: round(sum(top1[i * len(traces):(i + 1) * len(traces)]) / len(traces), 3)
                                    for i, d in enumerate(depths)},
        "costs": {"layer_1tok_ms": round(costs["layer_s"][1] * 1e3, 3),
                  "layer_ms_by_tokens": {t: round(v * 1e3, 3) for t, v in costs["layer_s"].items()},
                  "exit_head_ms": round(costs["head_s"] * 1e3, 3)},
        "data": "wikitext-2 valid" + (" + arc-easy dev (chat)" if len(prompts) > n_text else ""),
        "tokens": len(prompts) * gen_tokens,
        "seconds": round(time.perf_counter() - t_start, 2),
    }
