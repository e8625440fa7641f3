"""`LLM.get_metrics()`: the engine's counters and gauges as plain values, in the shapes of vLLM's
`vllm.v1.metrics.reader` (Counter, Gauge, Vector), named as the server's /metrics names them
(vLLM's "vllm:spec_decode_num_drafts" is "tandem_spec_decode_num_drafts" here; no "_total").

Only what the engine itself keeps: the scheduler's queue, KV and prefix-cache figures and the
speculative-decoding counts (those vLLM's spec_decode example reads). Request and token counters
and the latency histograms are the server's (tandem/server/metrics.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.engine import Engine


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """A counter per position (vLLM's num_accepted_tokens_per_pos)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(engine: Engine, model_name: str) -> list[Metric]:
    labels = {"model_name": model_name}
    sched = engine.scheduler
    out: list[Metric] = [
        Gauge("tandem_num_requests_running", labels, len(sched.running)),
        Gauge("tandem_num_requests_waiting", labels, len(sched.waiting)),
        Gauge("tandem_kv_cache_usage_perc", labels, sched.blocks.usage),
        Counter("tandem_num_preemptions", labels, sched.num_preemptions),
        Counter("tandem_prefix_cache_queries", labels, sched.num_prefix_queries),
        Counter("tandem_prefix_cache_hits", labels, sched.num_prefix_hits),
    ]
    spec = engine.spec_metrics
    if spec is not None:
        out += [
            Counter("tandem_spec_decode_num_drafts", labels, spec.num_draft_rounds),
            Counter("tandem_spec_decode_num_draft_tokens", labels, spec.num_draft_tokens),
            Counter("tandem_spec_decode_num_accepted_tokens", labels, spec.num_accepted_tokens),
            Vector("tandem_spec_decode_num_accepted_tokens_per_pos", labels, list(spec.accepted_per_position)),
        ]
    return out
