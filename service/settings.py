"""Settings, read from the environment once at the entry point and passed in."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import msgspec


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    database_url: str | None = None
    data_dir: str = ".taskledger"
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    admin_token: str | None = None
    migrate_on_start: bool = True
    pool_min: int = 2
    pool_max: int = 10
    batch_max: int = 256
    writer_queue_max: int = 10_000
    max_body_bytes: int = 4 * 1024 * 1024
    escalate_after_seconds: int = 3600
    sweep_interval_seconds: float = 1.0
    job_heartbeat_timeout_seconds: int = 60
    sse_keepalive_seconds: float = 15.0
    sse_poll_seconds: float = 1.0
    sse_queue_max: int = 1000
    max_streams_per_token: int = 64
    stream_token_ttl_seconds: int = 300
    # Capacity of one server process (README "Configuration", service.http.server_limits):
    # open SSE streams and ordinary requests get separate budgets.
    max_streams: int = 10_000
    max_connections: int = 1024
    keep_alive_seconds: float = 5.0
    backlog: int = 4096
    sse_send_timeout_seconds: float = 30.0
    stream_retry_after_seconds: int = 5
    # On SIGTERM, /readyz answers 503 for this long before the server stops
    # taking requests, so a load balancer's health check drains it first.
    drain_seconds: float = 0.0
    webhook_poll_seconds: float = 1.0  # how soon another replica's events are delivered
    webhook_timeout_seconds: float = 10.0
    webhook_retry_base_seconds: float = 1.0  # a failed delivery is retried after 1, 2, 4, ... s
    webhook_retry_max_seconds: float = 300.0
    idempotency_ttl_seconds: int = 24 * 3600
    audit_key: str | None = None  # PEM file of the Ed25519 signing key (default: under data_dir)
    audit_checkpoint_every_events: int = 1000  # 0: not by count
    audit_checkpoint_every_seconds: float = 60.0  # 0: not by time
    # Telemetry (docs/OPERATIONS.md, "Telemetry")
    metrics_cache_seconds: float = 5.0  # how long /metrics reuses its tasks/jobs-by-state query
    log_format: Literal["json", "text"] | None = None  # None: json under serve, text in the CLI tools
    otel: bool = False  # OpenTelemetry traces (the otel extra); the exporter from the OTEL_* variables

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            key = "TASKLEDGER_" + field.name.upper()
            if key in env and env[key] != "":
                values[field.name] = env[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return msgspec.convert(values, cls, strict=False)
