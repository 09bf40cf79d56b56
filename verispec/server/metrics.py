"""The server's Prometheus metrics, one registry per server (tests start several).

Names follow vLLM's where they fit (vllm:spec_decode_num_draft_tokens_total, ...:num_accepted_
tokens_per_pos, vllm:time_to_first_token_seconds, vllm:num_requests_running / _waiting), with the
prefix `verispec:`. Speculative-decoding series carry a `method` label: requests choose methods.
Acceptance by position here is vLLM's: accepted at position i / steps that drafted.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from verispec.core.types import DraftSource, GenerationStats, Step

disable_created_metrics()  # no *_created series (process-wide, as vLLM does)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Counters the scheduler and the HTTP layer update; `render` gives the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("verispec:num_requests_running", "Sequences in the running batch",
                             registry=r)
        self.waiting = Gauge("verispec:num_requests_waiting", "Requests queued for the batch",
                             registry=r)
        self.success = Counter("verispec:request_success", "Requests that ended, by finish reason "
                               "(stop, length, abort: the client went away)", ["finished_reason"],
                               registry=r)
        self.rejected = Counter("verispec:request_rejected", "Requests refused (bad_request, "
                                "queue_full, shutting_down) or failed (internal_error)", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("verispec:prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("verispec:generation_tokens", "Generated tokens", ["method"],
                                         registry=r)
        self.forwards = Counter("verispec:spec_decode_num_forwards", "Sequence steps (one target "
                                "forward each, shared by the batch)", ["method"], registry=r)
        self.drafts = Counter("verispec:spec_decode_num_drafts", "Sequence steps that drafted",
                              ["method"], registry=r)
        self.draft_tokens = Counter("verispec:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                    ["method"], registry=r)
        self.accepted_tokens = Counter("verispec:spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted", ["method"], registry=r)
        self.accepted_per_pos = Counter("verispec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position",
                                        ["method", "position"], registry=r)
        self.acceptance_rate = Gauge("verispec:spec_decode_acceptance_rate_per_pos", "Accepted at "
                                     "position i / steps that drafted", ["method", "position"],
                                     registry=r)
        self.mean_accepted = Gauge("verispec:spec_decode_mean_accepted_tokens", "tau: tokens per "
                                   "sequence step (target forward)", ["method"], registry=r)
        self.time_to_first_token = Histogram("verispec:time_to_first_token_seconds", "From arrival "
                                             "to the first generated token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.e2e_latency = Histogram("verispec:e2e_request_latency_seconds", "From arrival to the "
                                     "last token", buckets=LATENCY_BUCKETS, registry=r)
        self._totals: dict[str, GenerationStats] = {}  # per method: the counts behind the gauges

    def stepped(self, method: str, step: Step) -> None:
        """One sequence's step."""
        totals = self._totals.setdefault(method, GenerationStats())
        totals.add(step)
        self.generation_tokens.labels(method).inc(len(step.tokens))
        self.forwards.labels(method).inc()
        if step.num_drafted and step.source is not DraftSource.GRAMMAR:  # forced: the grammar's, not drafts
            drafts = totals.drafted_by_position[0]  # steps that drafted
            self.drafts.labels(method).inc()
            self.draft_tokens.labels(method).inc(step.num_drafted)
            self.accepted_tokens.labels(method).inc(step.num_accepted)
            for position in range(step.num_accepted):
                self.accepted_per_pos.labels(method, str(position)).inc()
            for position, accepted in enumerate(totals.accepted_by_position):
                self.acceptance_rate.labels(method, str(position)).set(accepted / drafts)
        self.mean_accepted.labels(method).set(totals.mean_accepted_tokens)

    def finished(self, submitted: float, reason: str) -> None:
        """A request that arrived at `submitted` (perf_counter) ended (every sequence finished, or
        the client went away)."""
        self.success.labels(reason).inc()
        self.e2e_latency.observe(time.perf_counter() - submitted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
