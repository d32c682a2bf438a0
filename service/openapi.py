"""Prints the app's OpenAPI document (the committed copy is openapi/openapi.json)."""

from __future__ import annotations

import json
import sys
from typing import Any

from service.app import create_app
from service.settings import Settings


def document() -> dict[str, Any]:
    app = create_app(Settings(database_url="postgresql://unused/none"))
    schema: dict[str, Any] = app.openapi_schema.to_schema()
    return schema


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
