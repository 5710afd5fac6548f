"""What ``GET /metrics`` reports, in Prometheus text format: one ``CollectorRegistry`` per app, so that two servers
in one process (tests) keep their own counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hfspec.serve.events import Engine, Usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PASS_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "hfspec_requests", "Requests the engine finished, by finish reason", ["finish_reason"], registry=r
        )
        self.cancelled = Counter(
            "hfspec_requests_cancelled", "Requests cancelled before their end (a client gone)", registry=r
        )
        self.errors = Counter("hfspec_http_errors", "Error responses, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("hfspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("hfspec_generation_tokens", "Tokens generated", registry=r)
        self.target_passes = Counter("hfspec_target_passes", "Target forwards, summed over requests", registry=r)
        self.drafted = Counter("hfspec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("hfspec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.tokens_per_pass = Histogram(
            "hfspec_tokens_per_pass", "Tokens committed per target pass, per request", buckets=PASS_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "hfspec_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "hfspec_time_per_output_token_seconds",
            "Time per output token after the first, per request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hfspec_e2e_request_latency_seconds", "Request latency, end to end", buckets=LATENCY_BUCKETS, registry=r
        )
        Gauge("hfspec_requests_running", "Rows in the engine's batch", registry=r).set_function(lambda: engine.running)
        Gauge("hfspec_requests_waiting", "Requests queued behind the batch", registry=r).set_function(
            lambda: engine.waiting
        )

    def finished(self, reason: str, usage: Usage, ttft: float | None, seconds: float, client_gone: bool) -> None:
        """Count one request that the engine ended (``client_gone``: cancelled because its client left)."""
        self.requests.labels(finish_reason=reason).inc()
        if client_gone:
            self.cancelled.inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.target_passes.inc(usage.target_passes)
        self.drafted.inc(usage.drafted)
        self.accepted.inc(usage.accepted)
        if usage.target_passes:
            self.tokens_per_pass.observe(usage.completion_tokens / usage.target_passes)
        if ttft is not None:
            self.ttft.observe(ttft)
            if usage.completion_tokens > 1:
                self.tpot.observe((seconds - ttft) / (usage.completion_tokens - 1))
        self.e2e.observe(seconds)
