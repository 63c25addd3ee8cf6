"""The server's Prometheus metrics (`GET /metrics`, text format), kept with `prometheus_client`.

    metrics = ServeMetrics()
    metrics.watch(batcher, vlm)            # gauges read the queue when scraped
    app.add_middleware(CountRequests, metrics=metrics)

Each app has its own registry (not the process-wide default), so several servers in one process
(tests, an embedding program) count apart. What is counted:

    vlforge_http_requests_total{route,status}     every HTTP request answered (401s and 404s included)
    vlforge_prompt_tokens_total                   prompt tokens of the generations run (image tokens included)
    vlforge_completion_tokens_total               tokens they generated (cancelled ones' too: the model ran)
    vlforge_generations_total{finish_reason}      stop | length | cancelled | error
    vlforge_queue_length / vlforge_running_requests   requests waiting / generating now
    vlforge_batch_size                            histogram: requests handed to the engine together (a batch
                                                  starting, or a group joining the running one)
    vlforge_request_latency_seconds               histogram: arrival to the last token (finished ones)
    vlforge_time_to_first_token_seconds           histogram: arrival to the first text of the answer
    vlforge_images_shared_total                   images not encoded again: an identical one was in their batch
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

# route labels: the routes' templates, never the raw path (a client sending random paths would
# otherwise make a new time series per path)
ROUTES = ("/v1/chat/completions", "/v1/models", "/health", "/metrics")
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("vlforge_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("vlforge_prompt_tokens", "prompt tokens of the generations run (image tokens "
                                                              "included)", registry=r)
        self.completion_tokens = Counter("vlforge_completion_tokens", "tokens generated", registry=r)
        self.generations = Counter("vlforge_generations", "generations ended, by finish reason", ["finish_reason"],
                                   registry=r)
        self.queue = Gauge("vlforge_queue_length", "requests waiting for a batch", registry=r)
        self.running = Gauge("vlforge_running_requests", "requests being generated", registry=r)
        self.batch_size = Histogram("vlforge_batch_size", "requests handed to the engine together (a batch starting, "
                                                          "or a group joining the running one)",
                                    buckets=BATCH_SIZES, registry=r)
        self.latency = Histogram("vlforge_request_latency_seconds", "from a request's arrival to its last token "
                                                                    "(finished generations)", buckets=SECONDS,
                                 registry=r)
        self.ttft = Histogram("vlforge_time_to_first_token_seconds", "from a request's arrival to the first text of "
                                                                     "its answer", buckets=SECONDS, registry=r)

    def watch(self, batcher, vlm) -> None:
        """Gauges and the engine's own counter read their sources when scraped."""
        self.queue.set_function(lambda: batcher.waiting)
        self.running.set_function(lambda: batcher.running)
        if hasattr(vlm, "images_shared"):
            self.registry.register(_ModelCounters(vlm))

    def finished(self, job, completion, now: float) -> None:
        """A job's generation ended with `completion` (the batcher's thread; prometheus_client is thread-safe)."""
        self.prompt_tokens.inc(completion.prompt_tokens)
        self.completion_tokens.inc(completion.completion_tokens)
        self.generations.labels(completion.finish_reason).inc()
        if completion.finish_reason == "cancelled":
            return  # nobody waited for the rest: its latency says nothing about the server
        self.latency.observe(now - job.arrived)
        if job.first_text_at is not None:
            self.ttft.observe(job.first_text_at - job.arrived)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ModelCounters:
    """A collector reading the engine's own count when scraped (the engine knows nothing of Prometheus)."""

    def __init__(self, vlm):
        self.vlm = vlm

    def collect(self):
        yield CounterMetricFamily("vlforge_images_shared", "images not encoded again because an identical one was "
                                                           "in their batch", value=self.vlm.images_shared)


class CountRequests:
    """ASGI middleware counting every HTTP request by route and status. Plain ASGI rather than
    Starlette's BaseHTTPMiddleware, which would wrap the streamed responses and the disconnect
    detection of the routes."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # the app raised before answering (the server's error handler answers 500)

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(route_label(scope["path"]), str(status)).inc()


__all__ = ["CountRequests", "ServeMetrics", "route_label"]
