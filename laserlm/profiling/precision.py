"""Run a model in float16 and bfloat16 beside float32 on the same tokens and report, per dtype (seed 004 §5.3):

- per decoder layer: the largest ``|x|`` of its output against the dtype's largest finite value, NaN / inf
  counts, and the relative error of its output against float32 (``||y - y32|| / ||y32||`` over all positions);
- per attention head: the relative error of the head's attention output (the input of ``o_proj``, one slice of
  ``head_dim`` per head) against float32;
- the most sensitive layers and heads (largest errors) and the perplexity of the tokens (teacher-forced) in each
  dtype.

These "raw" runs switch the float16 guard off (:class:`~laserlm.runtime.ranges.Float16Guard` ``mode="off"``) to show
what the dtype itself does; float16 is then also run guarded (as ``--dtype float16`` runs), which reports its
perplexity and the layers that fell back to float32.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import torch

from ..errors import InvalidArgumentError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _capture(engine):
    """Forward hooks storing every decoder layer's output and every ``o_proj`` input (float32 copies)."""
    outs, heads, handles = {}, {}, []
    for i, layer in enumerate(engine.adapter.layers):
        def hook(m, a, o, i=i):
            outs[i] = (o[0] if isinstance(o, tuple) else o).detach().float()

        def pre(m, a, i=i):
            heads[i] = a[0].detach().float()

        handles.append(layer.register_forward_hook(hook))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(pre))
    return outs, heads, handles


def _forward(engine, ids):
    """Teacher-forced logits ``[T, V]`` float32, layer outputs and head outputs of ``ids [T]``."""
    from ..runtime.ranges import RangeMonitor  # noqa: PLC0415

    mon = RangeMonitor(engine)
    outs, heads, handles = _capture(engine)
    try:
        logits = engine.forward(ids.unsqueeze(0), logits="all", use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()
        mon.close()
    return logits, outs, heads, mon.ranges


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp(mean NLL) of ``ids[1:]`` under ``logits[:-1]``; NaN when the logits are not finite."""
    lg = logits[:-1]
    if not bool(torch.isfinite(lg).all()):
        return float("nan")
    return math.exp(float(torch.nn.functional.cross_entropy(lg, ids[1:])))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    d = float((a - b).norm() / b.norm().clamp_min(1e-30))
    return d if math.isfinite(d) else float("inf")


def _engine_in(engine32, dtype: torch.dtype, guard_mode: str):
    from ..runtime.engine import Engine  # noqa: PLC0415

    model = copy.deepcopy(engine32.model).to(dtype)
    eng = Engine(model, max_seq_len=engine32.max_seq_len)
    if eng.precision_guard is not None:
        eng.precision_guard.mode = guard_mode
    return eng


def precision_profile(engine32, ids: torch.Tensor, dtypes=("float16", "bfloat16"), top: int = 5) -> dict:
    """Profile ``engine32`` (a float32 :class:`~laserlm.runtime.engine.Engine` on dense weights) on ``ids [T]``.

    Returns a JSON-able dict: ``tokens``, ``float32`` (``ppl``), and per dtype ``raw`` (``ppl``, ``layers``: rows
    ``layer, max_abs, dtype_max, fraction_of_max, nan, inf, rel_error``; ``heads``: rows ``layer, head,
    rel_error``; ``most_sensitive_layers``, ``most_sensitive_heads``) and for float16 ``guarded`` (``ppl``,
    ``fp32_layers``, ``overflows``).

    Raises:
        InvalidArgumentError: an unknown dtype, or an engine that is not float32 dense.
    """
    from ..errors import InvalidArgumentError  # noqa: PLC0415

    if engine32.dtype != torch.float32 or engine32._packed:
        raise InvalidArgumentError("the precision profile needs the float32 dense model (--weights fp32)")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise InvalidArgumentError(f"unknown dtype {bad[0]!r} for the precision profile; use {', '.join(DTYPES)}")
    ids = ids.reshape(-1)
    ref_logits, ref_out, ref_heads, _ = _forward(engine32, ids)
    a = engine32.adapter
    n_heads, hd = engine32.config.num_attention_heads, a.head_dim
    report = {"tokens": int(ids.shape[0]), "float32": {"ppl": perplexity(ref_logits, ids)}}
    for name in dtypes:
        dt = DTYPES[name]
        dmax = float(torch.finfo(dt).max)
        eng = _engine_in(engine32, dt, "off")
        logits, outs, heads, ranges = _forward(eng, ids)
        layers = []
        for i in range(engine32.num_layers):
            r = ranges[i]
            layers.append({"layer": i, "max_abs": r.max_abs, "dtype_max": dmax, "fraction_of_max": r.max_abs / dmax,
                           "nan": r.nan, "inf": r.inf, "rel_error": _rel(outs[i], ref_out[i])})
        head_rows = []
        for i in range(engine32.num_layers):
            x = heads[i].reshape(*heads[i].shape[:-1], n_heads, hd)
            y = ref_heads[i].reshape(*ref_heads[i].shape[:-1], n_heads, hd)
            for h in range(n_heads):
                head_rows.append({"layer": i, "head": h, "rel_error": _rel(x[..., h, :], y[..., h, :])})
        entry = {"raw": {
            "ppl": perplexity(logits, ids), "logits_finite": bool(torch.isfinite(logits).all()),
            "layers": layers, "heads": head_rows,
            "most_sensitive_layers": [r["layer"] for r in sorted(layers, key=lambda r: -r["rel_error"])[:top]],
            "most_sensitive_heads": [(r["layer"], r["head"]) for r in
                                     sorted(head_rows, key=lambda r: -r["rel_error"])[:top]],
            "first_nonfinite_layer": next((r["layer"] for r in layers if r["nan"] or r["inf"]), None)}}
        del eng
        if dt == torch.float16:
            eng = _engine_in(engine32, dt, "fallback")
            lg = eng.forward(ids.unsqueeze(0), logits="all", use_cache=False).logits[0].float()
            g = eng.precision_guard
            entry["guarded"] = {"ppl": perplexity(lg, ids), "fp32_layers": sorted(g.fallback),
                                "fp32_calls": dict(sorted(g.fp32_calls.items())),
                                "overflows": [{"layer": i, "max_abs": m} for i, m in g.events],
                                "limit": g.limit}
            del eng
        report[name] = entry
    return report


def format_report(rep: dict) -> str:
    """A plain-text summary of :func:`precision_profile`'s report."""
    lines = [f"precision profile over {rep['tokens']} tokens; float32 ppl {rep['float32']['ppl']:.3f}"]
    for name in DTYPES:
        if name not in rep:
            continue
        raw = rep[name]["raw"]
        lines.append(f"\n{name} (raw): ppl {raw['ppl']:.3f}, logits finite: {raw['logits_finite']}, first layer with "
                     f"NaN/inf: {raw['first_nonfinite_layer']}")
        lines.append("layer   max|x|   of dtype max    NaN    inf  rel.err vs fp32")
        for r in raw["layers"]:
            lines.append(f"{r['layer']:5d} {r['max_abs']:10.4g} {r['fraction_of_max']:12.3g} {r['nan']:6d} {r['inf']:6d}"
                         f"  {r['rel_error']:.3g}")
        lines.append(f"most sensitive layers: {raw['most_sensitive_layers']}; heads (layer, head): "
                     f"{raw['most_sensitive_heads']}")
        if "guarded" in rep[name]:
            g = rep[name]["guarded"]
            lines.append(f"{name} guarded (as --dtype float16 runs): ppl {g['ppl']:.3f}, layers falling back to "
                         f"float32: {g['fp32_layers']}, float32 calls per layer: {g['fp32_calls']}")
    return "\n".join(lines)


def run_precision_profile(args) -> int:
    """Run the precision profile for ``args.model``; prints the summary (stdout, or stderr with ``--json -``).

    Raises:
        InvalidArgumentError: ``--precision`` missing, bad ``--tokens`` / ``--dtypes``; data and model errors from
            their loaders.
    """
    if not getattr(args, "precision", False):
        raise InvalidArgumentError("`laserlm profile` here runs the precision profile: add --precision")
    if args.tokens < 2:
        raise InvalidArgumentError(f"--tokens must be at least 2, got {args.tokens}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise InvalidArgumentError(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes!r}")
    from .. import data as data_mod  # noqa: PLC0415
    from ..cli_common import apply_threads, check_output_path  # noqa: PLC0415

    if args.json not in (None, "-"):
        check_output_path(args.json, "--json")
    src = data_mod.resolve(args.data, "wikitext-2/test.txt", flag="--data", what="profile text")
    text = data_mod.read_text(src)
    apply_threads(args)
    from ..api import load  # noqa: PLC0415

    lm = load(args.model, dtype="float32", weights="fp32")
    import torch  # noqa: PLC0415

    ids = torch.tensor(lm.tokenizer(text[:args.tokens * 20])["input_ids"][:args.tokens])
    rep = precision_profile(lm.engine, ids, dtypes, top=args.top)
    rep["model"] = args.model
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(rep), file=out)
    if args.json == "-":
        print(json.dumps(rep))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1)
    return 0
