"""laserlm's OpenAI-compatible server (``laserlm serve``).

- :mod:`laserlm.serve.protocol`: OpenAI request bodies -> validated requests; OpenAI's error JSON.
- :mod:`laserlm.serve.engine`: the engine thread that owns the continuous-batching scheduler.
- :mod:`laserlm.serve.metrics`: Prometheus metrics with vLLM's names under ``laserlm:``.
- :mod:`laserlm.serve.app`: the FastAPI app (routes, streaming, auth, errors).
- :mod:`laserlm.serve.cli`: the ``serve`` subcommand (uvicorn).
- :mod:`laserlm.serve.ray_serve`: N replicas behind Ray Serve.
"""
