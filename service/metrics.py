"""This process's metrics, exposed at GET /metrics through prometheus-client.

Three kinds of figures, each read where it is cheapest and exact:

- counted where they happen, in this process: HTTP requests (the request
  middleware), writer batches (the writer, after each commit), SSE streams and
  the tailer (service.http.live), and the facts this process committed
  (`observe_commit`: jobs created and ended with their durations, verdicts by
  checker). They are per process: the service's totals are the sum over the
  replicas Prometheus scrapes (docs/OPERATIONS.md, "Metrics").
- read at scrape time from this process's objects: queue depth, SSE
  subscribers, tailer lag (callback gauges).
- read at scrape time from the projections, the same in every replica: tasks
  and jobs by state and each projection's lag, from one grouped query cached
  for `cache_seconds`, so scrapes of many replicas cost the database little.

Each app has its own registry, so several apps in one process (the tests) do
not share counters.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from taskledger.log import HEAD_SEQ_SQL, RecordedEvent
from taskledger.projections import jobs as job_views
from taskledger.projections import tasks as task_views

log = logging.getLogger("taskledger.metrics")

# `_created` series double every counter's lines and nobody here graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
PREFIX: Final = "taskledger_"

# Counters other modules increment by name: name -> (help, label names).
COUNTERS: Final[Mapping[str, tuple[str, tuple[str, ...]]]] = {
    "writer_overloaded_total": ("Commands refused because the writer's queue was full.", ()),
    "sse_streams_refused_total": ("SSE streams refused, by reason (capacity, token).", ("reason",)),
    "sse_send_timeouts_total": ("SSE streams closed because a client read too slowly.", ()),
    "sse_events_delivered_total": ("Events handed to SSE subscribers (queued live, or read to catch up).", ()),
    "sse_tailer_reconnects_total": ("Times the SSE tailer reconnected to PostgreSQL.", ()),
    "sse_subscriber_overflows_total": ("SSE subscribers dropped because their queue overflowed.", ()),
}
GAUGE_HELP: Final[Mapping[str, str]] = {
    "writer_queue_depth": "Commands waiting for the writer.",
    "sse_subscribers": "Live SSE subscribers of this process.",
    "sse_streams_open": "Open SSE streams of this process.",
    "sse_streams_max": "The most SSE streams this process serves at once.",
    "sse_tailer_lag_events": "Events committed that the SSE tailer has not read yet.",
    "sse_tailer_cursor": "The seq the SSE tailer has read up to.",
    "sse_tailer_connected": "1 while the SSE tailer's LISTEN connection is up.",
    "sse_tailer_idle_seconds": "Seconds the tailer has been behind without advancing.",
    "process_open_files_limit": "The open-files limit (soft) of this process.",
}
_LATENCY: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_JOB_SECONDS: Final = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)
# Checker names come from task specs: past this many distinct ones a process
# counts the rest as "other", so a client cannot blow up the series count.
MAX_CHECKERS: Final = 64
_JOB_ENDS: Final = {"job.completed": "completed", "job.failed": "failed", "job.cancelled": "cancelled"}

_LAG_SQL: Final = f"SELECT name, {HEAD_SEQ_SQL} - seq AS n FROM projection_checkpoints"


class Metrics:
    def __init__(self, *, cache_seconds: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            PREFIX + "http_requests_total", "HTTP requests by method, route template and status.",
            ("method", "route", "status"), registry=r)
        self.http_seconds = Histogram(
            PREFIX + "http_request_seconds", "HTTP request latency (to the end of the response) by route template.",
            ("method", "route"), buckets=_LATENCY, registry=r)
        self.batch_size = Histogram(
            PREFIX + "writer_batch_size", "Commands per committed writer batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.batch_seconds = Histogram(
            PREFIX + "writer_batch_seconds", "Time from a batch's BEGIN to its COMMIT.", buckets=_LATENCY, registry=r)
        self.commits = Counter(PREFIX + "writer_commits_total", "Writer batches committed.", registry=r)
        self.commands = Counter(PREFIX + "writer_commands_total", "Commands in committed writer batches.", registry=r)
        self.events = Counter(PREFIX + "events_appended_total", "Events this process appended, by type.",
                              ("type",), registry=r)
        self.jobs_created = Counter(PREFIX + "jobs_created_total", "Jobs created.", registry=r)
        self.jobs_ended = {
            state: Counter(PREFIX + f"jobs_{state}_total", f"Jobs that ended {state}.", registry=r)
            for state in _JOB_ENDS.values()}
        self.job_seconds = Histogram(
            PREFIX + "job_duration_seconds", "From a job's creation to its end, by how it ended.",
            ("state",), buckets=_JOB_SECONDS, registry=r)
        self.verdicts = Counter(
            PREFIX + "verdicts_total", "Verifier verdicts by checker and outcome (PASS, FAIL, BLOCKED).",
            ("checker", "outcome"), registry=r)
        self._checkers: set[str] = set()
        self._counters = {
            name: Counter(PREFIX + name, help_, labels, registry=r) for name, (help_, labels) in COUNTERS.items()}
        for name, (_help, labels) in COUNTERS.items():
            if not labels:
                self._counters[name].inc(0)
        self.gauges: dict[str, Callable[[], float]] = {}
        self._gauges: dict[str, Gauge] = {}
        self.projections = _ProjectionFigures(cache_seconds)
        r.register(self.projections)

    # -- what other modules call ---------------------------------------------

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_seconds.labels(method, route).observe(seconds)

    def observe_commit(
        self, commands: int, seconds: float, events: Sequence[RecordedEvent], jobs: Mapping[str, Any]
    ) -> None:
        """A writer batch committed: `jobs` maps job ids to the states the batch wrote."""
        self.batch_size.observe(commands)
        self.batch_seconds.observe(seconds)
        self.commits.inc()
        self.commands.inc(commands)
        for ev in events:
            self.events.labels(ev.type).inc()
            if ev.type == "task.verdict":
                self.verdicts.labels(self._checker(ev.data.get("checker")), str(ev.data.get("outcome"))).inc()
            elif ev.type == "job.created":
                self.jobs_created.inc()
            elif (ended := _JOB_ENDS.get(ev.type)) is not None:
                self.jobs_ended[ended].inc()
                state = jobs.get(ev.stream.removeprefix("job:"))
                if state is not None and state.ended_at and state.created_at:
                    self.job_seconds.labels(ended).observe(max(0.0, state.ended_at - state.created_at))

    def inc(self, name: str, by: float = 1, **labels: str) -> None:
        c = self._counters[name]
        (c.labels(**labels) if labels else c).inc(by)

    def gauge(self, name: str, fn: Callable[[], float]) -> None:
        """A gauge read from `fn` at scrape time (a failing `fn` reads as NaN)."""
        self.gauges[name] = fn
        g = self._gauges.get(name)
        if g is None:
            g = self._gauges[name] = Gauge(PREFIX + name, GAUGE_HELP.get(name, name), registry=self.registry)
        g.set_function(lambda: _safe(name, fn))

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's current value, e.g. `value("writer_commits_total")`."""
        return self.registry.get_sample_value(PREFIX + name, labels)

    async def render(self, pool: Any) -> bytes:
        await self.projections.refresh(pool)
        return generate_latest(self.registry)

    def _checker(self, name: object) -> str:
        checker = str(name)
        if checker in self._checkers:
            return checker
        if len(self._checkers) >= MAX_CHECKERS:
            return "other"
        self._checkers.add(checker)
        return checker


def _safe(name: str, fn: Callable[[], float]) -> float:
    try:
        return float(fn())
    except Exception:  # a gauge must never break the endpoint
        log.warning("gauge %s failed", name, exc_info=True)
        return math.nan


class _ProjectionFigures(Collector):
    """Tasks and jobs by state and projection lag, from one snapshot, cached."""

    def __init__(self, cache_seconds: float) -> None:
        self.cache_seconds = cache_seconds
        self._rows: list[tuple[str, str, int]] | None = None
        self._at = -math.inf
        self._lock = asyncio.Lock()

    async def refresh(self, pool: Any) -> None:
        if time.monotonic() - self._at < self.cache_seconds:
            return
        async with self._lock:
            if time.monotonic() - self._at < self.cache_seconds:
                return
            try:
                async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
                    tasks = await task_views.count_by_state(conn)
                    jobs = await job_views.count_by_state(conn)
                    lag = await conn.fetch(_LAG_SQL)
            except Exception as e:  # the process's own figures are still worth serving
                log.warning("metrics: the projections could not be read: %r", e)
                self._rows = None
            else:
                self._rows = ([("tasks", k, n) for k, n in tasks.items()] + [("jobs", k, n) for k, n in jobs.items()]
                              + [("lag", r["name"], int(r["n"])) for r in lag])
            self._at = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        if self._rows is None:
            return
        families = {
            "tasks": GaugeMetricFamily(PREFIX + "tasks", "Tasks by state (the tasks projection).", labels=["state"]),
            "jobs": GaugeMetricFamily(PREFIX + "jobs", "Jobs by state (the jobs projection).", labels=["state"]),
            "lag": GaugeMetricFamily(PREFIX + "projection_lag_events",
                                     "Events committed that a projection has not folded yet.", labels=["projection"]),
        }
        for kind, key, n in self._rows:
            families[kind].add_metric([key], n)
        yield from families.values()
