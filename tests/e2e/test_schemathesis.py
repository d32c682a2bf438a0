"""A bounded Schemathesis run against the committed OpenAPI document: no 5xx, and
every answer (status, media type, body) as the document says. SSE routes are left
out (endless bodies); the run is seeded, so a failure reproduces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ADMIN_TOKEN, ROOT, ServerProcess

CHECKS = ",".join((
    "not_a_server_error", "status_code_conformance", "content_type_conformance",
    "response_schema_conformance", "response_headers_conformance",
))


@pytest.mark.slow
def test_the_api_answers_as_its_committed_document_says_to_generated_requests(
    db_url: str, tmp_path: Path
) -> None:
    s = ServerProcess(db_url).start()
    try:
        out = subprocess.run(
            [str(Path(sys.executable).with_name("st")), "--no-color", "run", str(ROOT / "openapi" / "openapi.json"),
             "--url", s.base, "-H", f"Authorization: Bearer {ADMIN_TOKEN}", "--checks", CHECKS,
             "--max-examples", os.environ.get("TL_SCHEMATHESIS_EXAMPLES", "60"), "--seed", "13",
             "--exclude-path-regex", "/stream$", "--phases", "examples,coverage,fuzzing",
             "--request-timeout", "20"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    finally:
        s.stop()
