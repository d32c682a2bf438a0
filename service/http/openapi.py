"""Prints the app's OpenAPI document (the committed copy is openapi/openapi.json)."""

from __future__ import annotations

import json
import sys
from typing import Any

from taskledger.service.http import openapi_docs
from taskledger.service.http.app import create_app
from taskledger.service.settings import Settings


def document() -> dict[str, Any]:
    return openapi_docs.document(create_app(Settings(database_url="postgresql://unused/none")))


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
