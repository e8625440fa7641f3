"""The `metrics` object of a completion or chat response: vLLM's per-request timing figures
(--enable-per-request-metrics) and acceptance figures (--per-request-spec-decode-metrics), in
vLLM's field names and units, for clients such as AIPerf that read them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.outputs import RequestMetrics, RequestOutput


@dataclass(frozen=True)
class ResponseMetrics:
    """What a response's `metrics` object carries.

    timing: time_to_first_token_ms (from scheduling), generation_time_ms (first to last token),
    queue_time_ms, mean_itl_ms and tokens_per_second (all tokens over scheduling to last token);
    spec_decode: "none", "summary" (counts and acceptance histograms) or "detailed" (with each
    round's accepted and drafted counts); num_spec_tokens: k (0: no draft model, nothing to report).
    """

    timing: bool = False
    spec_decode: str = "none"
    num_spec_tokens: int = 0

    @property
    def enabled(self) -> bool:
        return self.timing or self.reports_spec_decode

    @property
    def reports_spec_decode(self) -> bool:
        return self.spec_decode != "none" and self.num_spec_tokens > 0

    def extra(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The response's extra fields: none when off; {"metrics": None} when the figures belong to
        more than one generation (several prompts, or n > 1: vLLM's rule); else {"metrics": {...}}."""
        if not self.enabled:
            return {}
        if len(outputs) != 1 or len(outputs[0].outputs) != 1 or outputs[0].metrics is None:
            return {"metrics": None}
        m = outputs[0].metrics
        body: dict[str, Any] = timing_metrics(m) if self.timing else {}
        if self.reports_spec_decode:
            body["speculative_decoding"] = spec_decode_metrics(m, self.num_spec_tokens, self.spec_decode == "detailed")
        return {"metrics": body}


def timing_metrics(m: RequestMetrics) -> dict[str, float | None]:
    """vLLM's per-request timing fields, in milliseconds (None where a time is missing)."""

    def ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else (end - start) * 1e3

    generation = ms(m.first_token_time, m.last_token_time)
    n = m.num_generation_tokens
    inference = ms(m.first_scheduled_time, m.last_token_time)
    return {
        "time_to_first_token_ms": ms(m.first_scheduled_time, m.first_token_time),
        "generation_time_ms": generation,
        "queue_time_ms": ms(m.arrival_time, m.first_scheduled_time),
        "mean_itl_ms": generation / (n - 1) if generation is not None and n > 1 else None,
        "tokens_per_second": n / (inference / 1e3) if inference else None,
    }


def spec_decode_metrics(m: RequestMetrics, k: int, detailed: bool) -> dict[str, Any]:
    """vLLM's metrics.speculative_decoding: acceptance_histogram[j] counts the rounds that accepted j
    of their drafts (dense, k + 1 long); acceptance_histogram_by_draft_length the same by the number
    of drafts a round counted (keys as strings, as JSON has them). A round's counted drafts are
    those that could become output: drafts verified past max_tokens are left out, as everywhere in
    the acceptance figures (vLLM likewise leaves out drafts a grammar invalidated)."""
    steps, accepted, drafted = m.num_draft_rounds, m.num_accepted_tokens, m.num_draft_tokens
    out: dict[str, Any] = {
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": list(m.acceptance_histogram) or [0] * (k + 1),
        "acceptance_histogram_by_draft_length": {str(n): list(row) for n, row in m.acceptance_by_num_drafts.items()},
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": k,
    }
    if detailed:
        out["per_step_accepted"] = list(m.per_step_accepted or [])
        out["per_step_drafted"] = list(m.per_step_drafted or [])
    return out
