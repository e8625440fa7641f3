"""Prometheus metrics of one server, kept in its own CollectorRegistry (several servers can coexist).

The engine loop thread feeds request and engine figures; the HTTP layer counts rejected requests.
prometheus_client's metrics are thread-safe, so /metrics renders without touching the engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from tandem.engine.engine import Engine

FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """Request, token, latency, scheduler, KV-cache and speculative-decoding metrics."""

    def __init__(self, model_name: str, num_speculative_tokens: int = 0, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        # Names follow vLLM's metrics with the tandem_ prefix (tandem_request_success, ..._num_drafts).
        self.requests_finished = Counter("tandem_request_success", "Finished sequences by finish reason",
                                         m + ["finished_reason"], registry=r)
        self.request_errors = Counter("tandem_request_errors", "Requests answered with an error, by HTTP status",
                                      m + ["status"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of accepted requests", m, registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Generated tokens", m, registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time from arrival to the first token",
                              m, buckets=_LATENCY_BUCKETS, registry=r)
        # One observation per output of a sequence, the whole gap, as vLLM: a step's accepted drafts come together
        self.itl = Histogram("tandem_inter_token_latency_seconds",
                             "Time between one sequence's successive outputs (one per engine step that gave it tokens)",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Time from arrival to the end of a request",
                             m, buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge("tandem_num_requests_running", "Sequences holding a batch slot", m, registry=r)
        self.waiting = Gauge("tandem_num_requests_waiting", "Sequences waiting for a slot", m, registry=r)
        self.kv_usage = Gauge("tandem_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", m, registry=r)
        self.kv_free = Gauge("tandem_kv_cache_free_blocks", "KV blocks free or evictable", m, registry=r)
        self.kv_total = Gauge("tandem_kv_cache_total_blocks", "KV blocks in the pool", m, registry=r)
        self.preemptions = Counter("tandem_num_preemptions", "Sequences preempted (their KV freed, recomputed later)",
                                   m, registry=r)
        self.prefix_queries = Counter("tandem_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (first admissions)", m, registry=r)
        self.prefix_hits = Counter("tandem_prefix_cache_hits", "Prompt tokens the prefix cache served", m, registry=r)
        self.draft_rounds = Counter("tandem_spec_decode_num_drafts", "Verified draft rounds", m, registry=r)
        self.draft_tokens = Counter("tandem_spec_decode_num_draft_tokens", "Draft tokens verified", m, registry=r)
        self.accepted_tokens = Counter("tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       m, registry=r)
        self.accepted_per_pos = Counter("tandem_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by draft position", m + ["position"], registry=r)
        # Adaptive speculation (num_speculative_tokens_per_batch_size="auto"): what it chose, what it believes.
        self.steps_by_num_drafts = Counter("tandem_spec_decode_steps_by_num_drafts",
                                           "Engine steps by the drafts per request they proposed (adaptive)",
                                           m + ["num_drafts"], registry=r)
        self.estimated_acceptance = Gauge("tandem_spec_decode_estimated_acceptance",
                                          "Estimated P(the first position + 1 drafts are accepted) (adaptive)",
                                          m + ["position"], registry=r)
        self._steps_seen = [0] * (num_speculative_tokens + 1)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.running,
                       self.waiting, self.kv_usage, self.kv_free, self.kv_total, self.draft_rounds, self.draft_tokens,
                       self.accepted_tokens):  # every series shows from the start, as vLLM's
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(model_name, reason)
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(model_name, str(pos))
        self._spec_seen = (0, 0, 0, [0] * num_speculative_tokens)
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)
        for metric in (self.preemptions, self.prefix_queries, self.prefix_hits):
            metric.labels(model_name)

    # ---------------------------------------------------------------- called by the loop thread
    def on_accepted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_tokens(self, num_new: int, gap_s: float | None) -> None:
        """num_new tokens of one sequence arrived gap_s after its previous ones (None: the first ones)."""
        self.generation_tokens.labels(self.model_name).inc(num_new)
        if gap_s is not None and num_new:
            self.itl.labels(self.model_name).observe(gap_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)

    def on_finished(self, reasons: list[str], e2e_s: float) -> None:
        """A request ended: one finished sequence a reason (n > 1 counts n, as vLLM's child requests
        do, in the success counter, the end-to-end latency and the TTFT alike)."""
        for reason in reasons:
            self.requests_finished.labels(self.model_name, reason).inc()
            self.e2e.labels(self.model_name).observe(e2e_s)

    def observe_engine(self, engine: Engine) -> None:
        """Copy scheduler, KV and speculative figures from the engine (only from its owning thread)."""
        name = self.model_name
        sched = engine.scheduler
        self.running.labels(name).set(len(sched.running))
        self.waiting.labels(name).set(len(sched.waiting))
        self.kv_usage.labels(name).set(sched.blocks.usage)
        self.kv_free.labels(name).set(sched.blocks.num_free_blocks)
        self.kv_total.labels(name).set(sched.blocks.num_blocks)
        self.preemptions.labels(name).inc(sched.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = sched.num_preemptions
        queries, hits = self._prefix_seen
        self.prefix_queries.labels(name).inc(sched.num_prefix_queries - queries)
        self.prefix_hits.labels(name).inc(sched.num_prefix_hits - hits)
        self._prefix_seen = (sched.num_prefix_queries, sched.num_prefix_hits)
        spec = engine.spec_metrics
        if spec is None:
            return
        rounds, drafts, accepted, per_pos = self._spec_seen
        self.draft_rounds.labels(name).inc(spec.num_draft_rounds - rounds)
        self.draft_tokens.labels(name).inc(spec.num_draft_tokens - drafts)
        self.accepted_tokens.labels(name).inc(spec.num_accepted_tokens - accepted)
        for pos, (now, before) in enumerate(zip(spec.accepted_per_position, per_pos)):
            self.accepted_per_pos.labels(name, str(pos)).inc(now - before)
        self._spec_seen = (spec.num_draft_rounds, spec.num_draft_tokens, spec.num_accepted_tokens,
                           list(spec.accepted_per_position))
        adaptive = engine.adaptive
        if adaptive is not None:
            for k, (now, before) in enumerate(zip(adaptive.num_steps_by_k, self._steps_seen)):
                self.steps_by_num_drafts.labels(name, str(k)).inc(now - before)
            self._steps_seen = list(adaptive.num_steps_by_k)
            for pos, value in enumerate(adaptive.estimator.survival()):
                self.estimated_acceptance.labels(name, str(pos)).set(value)

    # ---------------------------------------------------------------- called by the HTTP layer
    def on_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
