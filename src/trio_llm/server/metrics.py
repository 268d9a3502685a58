"""``/metrics``: the actors' ``statistics()`` rendered as Prometheus text.

A collector reads the records at scrape time instead of keeping counters of its own,
so the numbers can never drift from what the actors report to tests. Names are
llama-server's (``llamacpp:...``) where the meaning is the same, so existing
dashboards keep working; our own additions are prefixed ``trio_llm_``. The registry
is private to the server: several servers in one test process do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from trio_llm.engine.actor import BackendActorStatistics
from trio_llm.residency.sleep import ArenaStatistics
from trio_llm.server.embeddings import EmbedderStatistics
from trio_llm.server.media import MediaStatistics
from trio_llm.server.queue import QueueStatistics
from trio_llm.server.slots import SlotsStatistics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
N_TOKENS_MAX = "llamacpp:n_tokens_max"
#: llama-server's ``Process-Start-Time-Unix`` header of ``/metrics``: a wall-clock date,
#: not a duration, which trio's (monotonic) clock cannot give; taken when the server
#: module is imported, at start-up
PROCESS_START_UNIX = int(time.time())  # noqa: TID251 (a date, read once; no timing logic)


@attrs.frozen
class StatisticsSources:
    slots: Callable[[], SlotsStatistics]
    queue: Callable[[], QueueStatistics]
    backend: Callable[[], BackendActorStatistics]
    is_sleeping: Callable[[], bool]
    #: the residency gate's arena figures (``SleepController.arena_statistics``); None:
    #: a gate without them, and no ``trio_llm_arena_*`` metrics
    arena: Callable[[], ArenaStatistics] | None = None
    #: an embedding server's passes (``Embedder.statistics``), counted with the slots'
    #: prompt figures as llama-server counts its embedding tasks; None: not one
    embeddings: Callable[[], EmbedderStatistics] | None = None
    #: the image encoder's figures (``MediaEncoder.statistics``); None: no --mmproj
    media: Callable[[], MediaStatistics] | None = None


@attrs.define(eq=False)
class ServerCollector(Collector):
    sources: StatisticsSources

    def collect(self) -> Iterator[Metric]:
        s = self.sources.slots()
        q = self.sources.queue()
        b = self.sources.backend()
        if self.sources.embeddings is not None:
            e = self.sources.embeddings()
            s = attrs.evolve(s, n_prompt_tokens_processed=s.n_prompt_tokens_processed + e.n_prompt_tokens,
                             t_prompt_processing=s.t_prompt_processing + e.t_prompt, n_decode=s.n_decode + e.n_decode)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", s.n_prompt_tokens_processed)
        yield counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from a slot's cache.",
                      s.n_prompt_tokens_cached)
        yield counter("llamacpp:prompt_seconds", "Prompt process time.", s.t_prompt_processing)
        yield counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", s.n_tokens_predicted)
        yield counter("llamacpp:tokens_predicted_seconds", "Predict process time.", s.t_tokens_generation)
        yield counter("llamacpp:n_decode", "Number of forward passes (llama_decode() calls).", s.n_decode)
        # llama-server's one counter without the _total suffix (see render)
        tokens_max = Metric(N_TOKENS_MAX, "Largest observed n_tokens (the longest prompt of a slot).", "counter")
        tokens_max.add_sample(N_TOKENS_MAX, {}, s.n_tokens_max)
        yield tokens_max
        # no speculative decoding here (no draft model): llama-server's counters, honestly 0
        yield counter("llamacpp:spec_decode_num_draft_tokens", "Draft tokens generated (no draft model: 0).", 0)
        yield counter("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens accepted (no draft model: 0).", 0)
        yield counter("llamacpp:spec_decode_num_drafts", "Drafts made (no draft model: 0).", 0)
        yield gauge(
            "llamacpp:n_busy_slots_per_decode",
            "Average number of busy slots per forward pass.",
            s.n_busy_slots_total / s.n_decode if s.n_decode else 0.0,
        )
        yield gauge(
            "llamacpp:prompt_tokens_seconds",
            "Average prompt throughput in tokens/s.",
            s.n_prompt_tokens_processed / s.t_prompt_processing if s.t_prompt_processing else 0.0,
        )
        yield gauge(
            "llamacpp:predicted_tokens_seconds",
            "Average generation throughput in tokens/s.",
            s.n_tokens_predicted / s.t_tokens_generation if s.t_tokens_generation else 0.0,
        )
        yield gauge("llamacpp:kv_cache_tokens", "KV cache positions in use.", s.kv_tokens)
        yield gauge(
            "llamacpp:kv_cache_usage_ratio",
            "KV cache usage (1 = every position of every slot in use).",
            s.kv_tokens / s.kv_capacity if s.kv_capacity else 0.0,
        )
        yield gauge("llamacpp:requests_processing", "Number of requests processing.", s.n_processing)
        yield gauge("llamacpp:requests_deferred", "Number of requests deferred.", q.n_deferred + q.n_pending)
        yield counter(
            "trio_llm_requests_cancelled",
            "Requests cancelled (client gone), waiting or running.",
            q.cancelled + s.n_tasks_cancelled,
        )
        yield counter("trio_llm_requests_finished", "Requests that ran to completion.", s.n_tasks_done)
        phases = CounterMetricFamily("trio_llm_step_seconds", "Time the slots loop spent per phase of its steps.",
                                     labels=["phase"])
        for phase, seconds in s.t_phases:
            phases.add_metric([phase], seconds)
        yield phases
        yield counter("trio_llm_backend_calls", "Calls into the backend actor.", b.calls)
        yield counter("trio_llm_backend_busy_seconds", "Time the backend actor spent in calls.", b.busy_seconds)
        yield gauge("trio_llm_is_sleeping", "1 while the model is not resident.", float(self.sources.is_sleeping()))
        if self.sources.arena is not None:
            yield from _arena_metrics(self.sources.arena())
        if self.sources.media is not None:
            m = self.sources.media()
            yield counter("trio_llm_images_encoded", "Images run through the image encoder (--mmproj).", m.n_encoded)
            yield counter("trio_llm_images_cached", "Images found in the encoder's cache (not encoded again).",
                          m.n_cached)
            yield counter("trio_llm_image_encode_seconds", "Time spent encoding images (on the CPU).", m.t_encode)


def _arena_metrics(a: ArenaStatistics) -> Iterator[Metric]:
    """The arena as a scheduler (issue 16): residency, hand-offs and their costs."""
    yield GaugeMetricFamily("trio_llm_arena_resident", "1 while this server's model is resident on the GPU.",
                            value=float(a.resident))
    yield CounterMetricFamily("trio_llm_arena_acquisitions", "GPU tokens taken (the coordinated load counts).",
                              value=a.acquisitions)
    yields = CounterMetricFamily("trio_llm_arena_yields", "GPU tokens given to a waiting server, by reason.",
                                 labels=["reason"])
    for reason, n in a.yields.items():
        yields.add_metric([reason], n)
    yield yields
    cumulative = list(a.wait_buckets) or [0] * (len(a.wait_bounds) + 1)
    buckets = [(f"{b:g}", n) for b, n in zip(a.wait_bounds, cumulative, strict=False)]
    buckets.append(("+Inf", cumulative[-1]))
    yield HistogramMetricFamily("trio_llm_arena_wait_seconds", "Time each take of the GPU token waited.",
                                buckets=buckets, sum_value=a.wait_seconds)
    yield CounterMetricFamily("trio_llm_arena_held_seconds", "Time this server held the GPU token.",
                              value=a.held_seconds)
    yield CounterMetricFamily("trio_llm_arena_restored_bytes", "Device bytes allocated by restores (wakes).",
                              value=a.restored_bytes)
    if a.coresident:
        # co-residency (--arena-budget): what this server counts against the budget
        yield GaugeMetricFamily("trio_llm_arena_coresident", "1 while resident with a shared hold of the token "
                                "(co-residency under --arena-budget).", value=float(a.resident))
        yield GaugeMetricFamily("trio_llm_arena_footprint_bytes", "Device bytes this server counts against the "
                                "arena budget when resident.", value=a.footprint_bytes)
        yield GaugeMetricFamily("trio_llm_arena_budget_bytes", "This server's --arena-budget.", value=a.budget_bytes)
        yield GaugeMetricFamily("trio_llm_arena_members", "Co-residents in the arena ledger at the last read "
                                "(this server included while resident).", value=a.members)
        yield GaugeMetricFamily("trio_llm_arena_pinned", "1 if this server is pinned (--arena-pin).",
                                value=float(a.pinned))


def make_registry(sources: StatisticsSources) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(sources))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    # prometheus-client names every counter's HELP/TYPE lines ``<name>_total``; llama-
    # server exposes ``llamacpp:n_tokens_max`` as a counter without it, and dashboards
    # (and llama.cpp's tests) look it up by that name
    return generate_latest(registry).replace(f"{N_TOKENS_MAX}_total ".encode(), f"{N_TOKENS_MAX} ".encode())
