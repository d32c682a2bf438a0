"""A small in-process metrics registry rendered in Prometheus text format."""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Callable

log = logging.getLogger("taskledger.metrics")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.request_seconds = Histogram((0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.batch_size = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.counters: dict[str, int] = defaultdict(int)
        self.gauges: dict[str, Callable[[], float]] = {}

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests[(method, route, status)] += 1
        self.request_seconds.observe(seconds)

    def observe_batch(self, size: int) -> None:
        self.batch_size.observe(size)
        self.counters["writer_commits_total"] += 1
        self.counters["writer_commands_total"] += size

    def inc(self, name: str, by: int = 1) -> None:
        self.counters[name] += by

    def gauge(self, name: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = fn

    def render(self) -> str:
        out: list[str] = []
        out.append("# HELP taskledger_http_requests_total HTTP requests by method, route and status.")
        out.append("# TYPE taskledger_http_requests_total counter")
        for (m, r, s), n in sorted(self.requests.items()):
            out.append(f'taskledger_http_requests_total{{method="{m}",route="{r}",status="{s}"}} {n}')
        _hist(out, "taskledger_http_request_seconds", "HTTP request latency.", self.request_seconds)
        _hist(out, "taskledger_writer_batch_size", "Commands per committed batch.", self.batch_size)
        typed: set[str] = set()
        for name, n in sorted(self.counters.items()):
            # A counter name may carry its labels: `name{reason="x"}` (one TYPE line per name).
            base = name.split("{", 1)[0]
            if base not in typed:
                typed.add(base)
                out.append(f"# TYPE taskledger_{base} counter")
            out.append(f"taskledger_{name} {n}")
        for name, fn in sorted(self.gauges.items()):
            try:
                v = fn()
            except Exception:  # a gauge must never break the endpoint
                log.warning("gauge %s failed", name, exc_info=True)
                continue
            out.append(f"# TYPE taskledger_{name} gauge")
            out.append(f"taskledger_{name} {v}")
        return "\n".join(out) + "\n"


def _hist(out: list[str], name: str, help_: str, h: Histogram) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} histogram")
    acc = 0
    for b, c in zip(h.buckets, h.counts, strict=False):
        acc += c
        out.append(f'{name}_bucket{{le="{b}"}} {acc}')
    acc += h.counts[-1]
    out.append(f'{name}_bucket{{le="+Inf"}} {acc}')
    out.append(f"{name}_sum {h.total}")
    out.append(f"{name}_count {h.n}")
