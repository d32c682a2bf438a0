"""Log lines as JSON objects or text, each with the ids of the request being served.

The request middleware (service.telemetry) sets REQUEST_ID and CORRELATION_ID
for as long as a request runs; `configure_logging` stamps them on every record.
JSON is the default under `serve` (one object a line, for a log shipper), text
in the CLI tools; TASKLEDGER_LOG_FORMAT chooses. Work the writer does for a
request runs in the writer's own task, so its lines carry no request id; the
events it appends carry it in `meta`.

This module is imported by every CLI command: it stays light.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import os
import re
import sys
from typing import Any, Final

REQUEST_ID: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar("request_id", default=None)
CORRELATION_ID: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar("correlation_id", default=None)
# The rule service.writer.commands applies before an id reaches an event's meta.
VALID_ID: Final = re.compile(r"^[\x20-\x7e]{1,200}$")

# Attributes every LogRecord has; anything else was passed in `extra` and is logged too.
_RECORD_FIELDS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class ContextFilter(logging.Filter):
    """Stamps each record with the ids of the request being served."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.correlation_id = CORRELATION_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and value is not None:
                out[key] = value
        out["pid"] = record.process
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = [f"{k}={v}" for k in ("request_id", "correlation_id") if (v := getattr(record, k, None))]
        return f"{text} [{' '.join(ids)}]" if ids else text


def configure_logging(fmt: str | None, level: str | None = None, *, default: str = "text") -> None:
    """Every record to stderr in `fmt` ("json" or "text"; `default` when unset)."""
    chosen = (fmt or default).lower()
    if chosen not in ("json", "text"):
        raise ValueError(f"TASKLEDGER_LOG_FORMAT must be json or text, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel((level or os.environ.get("TASKLEDGER_LOG_LEVEL") or "WARNING").upper())
