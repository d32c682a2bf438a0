"""ASGI entry point for server workers: settings are read here, once."""

from service.app import create_app
from service.settings import Settings

app = create_app(Settings.from_env())
