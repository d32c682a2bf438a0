"""ASGI entry point for server workers: settings are read here, once."""

import gc

from taskledger.service.http import server_signals
from taskledger.service.http.app import create_app
from taskledger.service.logs import configure_logging
from taskledger.service.settings import Settings

settings = Settings.from_env()
configure_logging(settings.log_format, default="json")
server_signals.install(drain_seconds=settings.drain_seconds)

app = create_app(settings)

# Everything created so far lives as long as the process: keep it out of the
# cyclic collector's generations, and collect the young generation less often,
# so a full collection over thousands of open streams does not stall delivery.
gc.collect()
gc.freeze()
gc.set_threshold(20_000, 20, 20)
