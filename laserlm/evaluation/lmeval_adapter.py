"""An lm-evaluation-harness model over a laserlm decoding mode (optional extra: ``pip install 'laserlm[lmeval]'``).

Implements lm-eval's three request types (lm-eval 0.4 ``LM`` API):

- ``loglikelihood((context, continuation))`` -> ``(sum log p(continuation | context), is_greedy)``,
  tokenized like ``HFLM._encode_pair`` (:func:`~laserlm.evaluation.scoring.encode_pair`);
- ``loglikelihood_rolling((text,))`` -> sum log p(text), every token scored exactly once, in lm-eval's
  rolling windows of the context size (``get_rolling_token_windows(..., context_len=1)`` +
  ``make_disjoint_window``, :func:`~laserlm.evaluation.tasks.rolling_windows`): the first window
  conditioned on the BOS (or EOS) token, each later one on the tokens before it;
- ``generate_until((context, gen_kwargs))`` -> text, greedy unless ``do_sample``/``temperature`` ask
  otherwise, stopped at the ``until`` strings.

All three run the configuration's decoding mode with its attention kernel (``mode="full@sparse:..."``
installs block-sparse attention for the call and restores the engine's kernel afterwards for generation).

Usage::

    import lm_eval, laserlm
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness
    model = LaserLMHarness(laserlm.load("smollm2-135m"), mode="full")
    lm_eval.simple_evaluate(model=model, tasks=["lambada_openai"])

From the command line, ``laserlm-lm-eval`` is lm-eval's own CLI (same arguments as ``lm_eval``) with the
model registered as ``laserlm``::

    laserlm-lm-eval --model laserlm --model_args model=smollm2-135m,mode=full --tasks lambada_openai

The model is declared in the ``lm_eval.models`` entry-point group (``pyproject.toml``), but lm-eval 0.4.13
looks models up only in its registry, filled by imports, and scans no entry points: plain
``lm_eval --model laserlm`` cannot find it there. ``laserlm-lm-eval`` registers that group's models
(:func:`register_entry_point_models`) and then runs ``lm_eval``'s CLI. In ``--model_args`` (split at
commas) write the mode's option commas as ``;``.
"""

from __future__ import annotations

from ..errors import LaserLMError
from .scoring import Scorer, encode_pair
from .tasks import rolling_windows

try:  # the harness is optional; without it the class still works on request-like objects
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model as _register
except ImportError:  # pragma: no cover - depends on the environment
    _Base, _register = object, None


def _args(req):
    return req.args if hasattr(req, "args") else tuple(req)


class LaserLMHarness(_Base):
    """lm-eval ``LM`` over one laserlm model and decoding mode.

    Args:
        lm: a loaded :class:`laserlm.LaserLM`, or None to load ``model`` / ``dtype``.
        mode: decoding mode spec (``"full"``, ``"adaptive:..."``; with lm-eval's ``--model_args`` string,
            whose commas split arguments, write option commas as ``;``).
        max_gen_toks: default generation length for ``generate_until``.
    """

    def __init__(self, lm=None, model: str = "smollm2-135m", dtype: str = "float32", mode: str = "full",
                 max_gen_toks: int = 256, batch_size=1, **_ignored):
        if _Base is not object:
            super().__init__()
        if lm is None:
            import laserlm  # noqa: PLC0415

            lm = laserlm.load(model, dtype=dtype)
        self.lm = lm
        self.mode_spec = mode.replace(";", ",")
        resolve = getattr(lm, "resolve_spec", None)  # bare adaptive/speculative -> calibrated default
        self.scorer = Scorer(lm.engine, resolve(self.mode_spec) if resolve else self.mode_spec)
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        kwargs = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv.strip()) if arg_string else {}
        return cls(**kwargs)

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.lm.tokenizer, "name_or_path", "laserlm").replace("/", "__")

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = _args(req)[:2]
            ids, start = encode_pair(self.lm.tokenizer, context, continuation)
            excess = len(ids) - (self.lm.engine.max_seq_len + 1)
            if excess > 0:  # keep the most recent tokens, as lm-eval's left truncation does
                ids, start = ids[excess:], max(1, start - excess)
            r = self.scorer.score([ids], [start])[0]
            out.append((r.logprob, r.greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Summed log-probability of each text, every token scored once in lm-eval's rolling windows of the
        engine's context size (see the module docstring). An empty text scores 0.0."""
        tok = self.lm.tokenizer
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        out = []
        for req in requests:
            text = _args(req)[0]
            ids = [prefix] + tok(text, add_special_tokens=False)["input_ids"]
            wins = rolling_windows(len(ids) - 1, self.lm.engine.max_seq_len)
            total, rows = 0.0, self.scorer.batch_rows
            for i in range(0, len(wins), rows):
                part = wins[i:i + rows]
                total += sum(r.logprob for r in self.scorer.score([ids[b:e] for b, e, _ in part],
                                                                   [f - b for b, _, f in part]))
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = _args(req)[:2]
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            n = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            if not context:
                raise LaserLMError("generate_until needs a non-empty context")
            saved = self.lm.engine.kernel
            try:  # generate with this configuration's attention kernel (``@sparse...``), as scoring does
                self.scorer.activate()
                res = self.lm.generate(context, mode=self.scorer.mode, max_new_tokens=n, temperature=temperature,
                                       stop=until, seed=kwargs.get("seed"))
            finally:
                self.lm.engine.kernel = saved
            out.append(res.text)
        return out


ENTRY_POINT_GROUP = "lm_eval.models"


def register_entry_point_models() -> list[str]:
    """Register every model that an installed package declares in the ``lm_eval.models`` entry-point group
    (laserlm's own: ``laserlm = "laserlm.evaluation.lmeval_adapter:LaserLMHarness"``) in lm-eval's model
    registry, lazily (the registry loads an entry point when the name is first asked for). lm-eval 0.4.13
    has no entry-point discovery of its own, so :func:`main` does this before handing over to its CLI.
    Names lm-eval already knows keep their registration. Returns the names registered."""
    from importlib.metadata import entry_points  # noqa: PLC0415

    import lm_eval.models  # noqa: F401, PLC0415  (lm-eval's own names first; get_model skips them otherwise)
    from lm_eval.api.registry import model_registry  # noqa: PLC0415

    added = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in model_registry:
            model_registry.register(ep.name, target=ep)
            added.append(ep.name)
    return added


def main() -> None:
    """The ``laserlm-lm-eval`` command: lm-eval's own command line (same arguments as ``lm_eval``), with the
    models of the ``lm_eval.models`` entry-point group registered first, so that
    ``laserlm-lm-eval --model laserlm --model_args model=smollm2-135m,mode=full --tasks ...`` works."""
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    register_entry_point_models()
    cli_evaluate()


if _register is not None:
    _register("laserlm")(LaserLMHarness)

__all__ = ["ENTRY_POINT_GROUP", "LaserLMHarness", "main", "register_entry_point_models"]
