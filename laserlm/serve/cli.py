"""``laserlm serve``: the OpenAI-compatible server (uvicorn), or N replicas behind Ray Serve (``--replicas``)."""

from __future__ import annotations

import argparse
import os
import sys

from ..cli_common import add_batch_args, add_mode_args, add_model_args
from ..errors import LaserLMError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over the OpenAI API (completions, chat, streaming, /metrics)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API with continuous batching over a paged KV "
                    "pool.\n\nEndpoints: POST /v1/completions, POST /v1/chat/completions (\"stream\": true for "
                    "server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).\nA request may "
                    "name a decoding mode in its \"mode\" field: the --mode spec or one given with --allow-mode.\n\n"
                    "Example:\n  laserlm serve --model smollm2-135m --port 8000\n  curl localhost:8000/v1/completions "
                    "-H 'Content-Type: application/json' \\\n    -d '{\"model\": \"smollm2-135m\", \"prompt\": "
                    "\"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}'")
    add_model_args(p)
    add_mode_args(p)
    p.add_argument("--laser", default=None, metavar="PATH",
                   help="calibration artifact from `laserlm calibrate` for the default mode (as `generate --laser`)")
    p.add_argument("--allow-mode", action="append", default=[], metavar="SPEC",
                   help="a further mode spec requests may ask for in their \"mode\" field (repeatable; every "
                        "allowed mode is built at startup)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 requests (default: $LASERLM_API_KEY, else none)")
    g = add_batch_args(p, queue_help="requests waiting at most; more get HTTP 429")
    g.add_argument("--default-max-tokens", type=int, default=512,
                   help="chat requests without max_tokens generate at most this many tokens (default: %(default)s)")
    h = p.add_argument_group("HTTP limits and shutdown")
    h.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                   help="largest request body read; larger gets HTTP 413 (default: %(default)s = 4 MiB)")
    h.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds running requests may go on before they end with an error "
                        "(streams get an error event and [DONE]); new requests get 503 (default: %(default)s)")
    h.add_argument("--docs", action="store_true",
                   help="serve FastAPI's /docs and /openapi.json (off by default)")
    r = p.add_argument_group("scale-out")
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N replicas behind Ray Serve on a local Ray cluster (or RAY_ADDRESS) instead of one "
                        "uvicorn process")
    r.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(func=cmd_serve)


def settings_from_args(args):
    from .app import ServerSettings  # noqa: PLC0415

    if args.attention != "dense":
        raise LaserLMError("the server runs dense attention (block-sparse attention does not run on the paged KV "
                           "pool yet)")
    for name in ("port",):
        v = getattr(args, name)
        if not 0 < v < 65536:
            raise LaserLMError(f"--port must be in 1-65535, got {v}")
    if args.default_max_tokens < 1:
        raise LaserLMError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.max_body_bytes < 1024:
        raise LaserLMError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if not args.shutdown_timeout >= 0:
        raise LaserLMError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.replicas is not None and args.replicas < 1:
        raise LaserLMError(f"--replicas must be >= 1, got {args.replicas}")
    from ..cli_common import lora_from_args  # noqa: PLC0415

    lora = lora_from_args(args)  # --lora, or the delta a --laser file was calibrated with
    return ServerSettings(
        model=args.model, lora=None if lora is None else str(lora), served_model_name=args.served_model_name, mode=args.mode, allowed_modes=args.allow_mode,
        laser=args.laser, weights=args.weights, prefill_dtype=args.prefill_dtype, dtype=args.dtype, ctx_size=args.ctx_size, threads=args.threads,
        kv_budget=args.kv_budget, max_batch=args.max_batch, max_queue=args.max_queue, page_size=args.page_size,
        prefill_chunk=args.prefill_chunk, eviction=args.eviction, prefix_cache=not args.no_prefix_cache,
        kv_prealloc=args.kv_prealloc,
        kv_groups=args.kv_groups,
        api_key=args.api_key or os.environ.get("LASERLM_API_KEY") or None,
        default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout, docs=args.docs)


def cmd_serve(args) -> int:
    settings = settings_from_args(args)
    from ..defaults import check_before_load  # noqa: PLC0415
    from ..runtime.scheduler import BatchConfig  # noqa: PLC0415

    BatchConfig(kv_budget=settings.kv_budget, **settings.batch_options()).validate()  # before the model loads
    check_before_load(settings.model, settings.mode_specs())
    if args.replicas is not None:
        from .ray_serve import run_replicas  # noqa: PLC0415

        return run_replicas(settings, args.replicas, host=args.host, port=args.port, num_cpus=args.replica_cpus)
    from .app import build_app  # noqa: PLC0415

    app = build_app(settings)
    state = app.state.laserlm
    print(f"laserlm: serving {settings.name} ({state.lm.describe()}; modes: {', '.join(state.modes)}; KV pool "
          f"{state.engine.scheduler.pool.describe()}) on http://{args.host}:{args.port}/v1", file=sys.stderr,
          flush=True)
    run_draining(app, settings.shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def run_draining(app, shutdown_timeout: float, **uvicorn_kwargs) -> None:
    """Run ``app`` on uvicorn; an exit signal first drains it (:meth:`~laserlm.serve.app.ServerState.drain`).

    uvicorn then stops accepting connections and waits ``timeout_graceful_shutdown`` for open ones; the app ends
    what still runs ``shutdown_timeout`` seconds after the signal, so each client gets ``[DONE]`` or an error before
    the engine stops (uvicorn's own grace is 5 s longer, the time to send those)."""
    import uvicorn  # noqa: PLC0415

    state = app.state.laserlm

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.drain()
            super().handle_exit(sig, frame)

    DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + 5, **uvicorn_kwargs)).run()
