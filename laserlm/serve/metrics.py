"""Prometheus metrics of the server (``GET /metrics``), with vLLM's names under a ``laserlm:`` prefix.

| metric | kind | meaning |
|---|---|---|
| ``laserlm:num_requests_running`` / ``_waiting`` | gauge | requests in the running batch / the queue |
| ``laserlm:kv_cache_usage_perc`` | gauge | fraction of KV pool pages holding K/V (0-1) |
| ``laserlm:kv_cache_reserved_perc`` | gauge | fraction of pages reserved by admitted requests (0-1) |
| ``laserlm:kv_cache_peak_usage_perc`` | gauge | the highest ``kv_cache_usage_perc`` seen since start |
| ``laserlm:kv_cache_capacity_bytes`` | gauge | bytes of the preallocated pool (all K/V lives there) |
| ``laserlm:prompt_tokens_total`` / ``generation_tokens_total`` | counter | tokens of finished requests |
| ``laserlm:request_success_total{finished_reason}`` | counter | finished requests (stop, length, abort) |
| ``laserlm:request_errors_total{status,type,code}`` | counter | requests answered with an error: HTTP status, OpenAI error type, laserlm's code |
| ``laserlm:time_to_first_token_seconds`` | histogram | TTFT (submit to first token, queue included) |
| ``laserlm:time_per_output_token_seconds`` | histogram | TPOT: (end - first token) / (tokens - 1), per request |
| ``laserlm:inter_token_latency_seconds`` | histogram | ITL: time between two streamed tokens |
| ``laserlm:e2e_request_latency_seconds`` | histogram | submit to finish |
| ``laserlm:layers_per_token`` | histogram | decoder layers run per generated token (adaptive depth < L) |
| ``laserlm:spec_decode_num_draft_tokens_total`` / ``_accepted_tokens_total`` | counter | speculative drafts |

Each app has its own :class:`prometheus_client.CollectorRegistry`, so several servers in one process (tests)
do not share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)


class ServerMetrics:
    """The server's metrics (see the module docstring). ``num_layers`` sets the layers-per-token buckets."""

    def __init__(self, num_layers: int):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("laserlm:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("laserlm:num_requests_waiting", "Requests waiting for KV pages or a batch slot.",
                             registry=r)
        self.kv_usage = Gauge("laserlm:kv_cache_usage_perc", "Fraction of KV pool pages in use (0-1).", registry=r)
        self.kv_reserved = Gauge("laserlm:kv_cache_reserved_perc",
                                 "Fraction of KV pool pages reserved by admitted requests (0-1).", registry=r)
        self.kv_bytes = Gauge("laserlm:kv_cache_capacity_bytes", "Bytes of KV memory allocated now: the pool's "
                              "arena (the budget; less while a staged pool has not grown to it), or the running "
                              "requests' own caches under per-request allocation.",
                              registry=r)
        self.kv_peak = Gauge("laserlm:kv_cache_peak_usage_perc", "Highest KV pool usage seen (0-1).", registry=r)
        self.prompt_tokens = Counter("laserlm:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("laserlm:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.success = Counter("laserlm:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.errors = Counter("laserlm:request_errors", "Requests answered with an error, by HTTP status, OpenAI "
                              "error type and code.", ["status", "type", "code"], registry=r)
        self.ttft = Histogram("laserlm:time_to_first_token_seconds", "Time to first token (queue included).",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("laserlm:time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("laserlm:inter_token_latency_seconds", "Time between two streamed tokens.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("laserlm:e2e_request_latency_seconds", "Submit to finish.", buckets=LATENCY_BUCKETS,
                             registry=r)
        layer_buckets = tuple(sorted({max(1, round(num_layers * f)) for f in (0.25, 0.5, 0.75, 0.9, 1.0)}))
        self.layers = Histogram("laserlm:layers_per_token", "Decoder layers run per generated token.",
                                buckets=layer_buckets, registry=r)
        self.draft_tokens = Counter("laserlm:spec_decode_num_draft_tokens", "Speculative draft tokens.", registry=r)
        self.accepted_tokens = Counter("laserlm:spec_decode_num_accepted_tokens",
                                       "Speculative draft tokens accepted.", registry=r)
        self._peak = 0.0

    def count_error(self, err) -> None:
        """Count one error answer (an :class:`~laserlm.serve.protocol.APIError`)."""
        self.errors.labels(status=str(err.status), type=err.type or "", code=err.code or "").inc()

    def update_pool(self, scheduler) -> None:
        """Set the gauges from the scheduler (called by the engine thread after every step)."""
        pool = scheduler.pool
        # per-request allocation holds no pages: each running request's own cache is its reservation's worth
        used = (pool.reserved if pool.prealloc == "request" else pool.used_pages) / max(pool.num_pages, 1)
        self._peak = max(self._peak, used)
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(used)
        self.kv_reserved.set(pool.reserved / max(pool.num_pages, 1))
        self.kv_peak.set(self._peak)
        self.kv_bytes.set(scheduler.kv_bytes)

    def observe_request(self, prompt_tokens: int, generated: int, finished_reason: str, ttft: float | None,
                        itl: list[float], e2e: float, layers: list[float], draft_n: int, accepted_n: int) -> None:
        """Record one finished request (times in seconds)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.success.labels(finished_reason=finished_reason).inc()
        if ttft is not None and ttft == ttft:
            self.ttft.observe(ttft)
        for s in itl:
            self.itl.observe(s)
        if len(itl) > 0:
            self.tpot.observe(sum(itl) / len(itl))
        self.e2e.observe(e2e)
        for n in layers:
            self.layers.observe(n)
        if draft_n:
            self.draft_tokens.inc(draft_n)
            self.accepted_tokens.inc(accepted_n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
