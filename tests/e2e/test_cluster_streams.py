"""The split deployment (deploy.cluster, stream_replicas): HAProxy sends the SSE routes to
stream-only replicas and every other request to the others."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from deploy.cluster import Cluster
from taskledger.service.ops.embedded import with_database
from tests.conftest import _drop, _run, fresh_database

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(pg_url: str, template_db: str) -> Iterator[Cluster]:
    name = fresh_database(pg_url, template_db)
    env = {"TASKLEDGER_MIGRATE_ON_START": "false"}
    c = Cluster(replicas=1, stream_replicas=2, database_url=with_database(pg_url, name), drain_seconds=0.5,
                check_ms=100, env=env)
    with c:
        yield c
    _run(_drop(pg_url, name))


def test_streams_go_to_the_stream_replicas_and_everything_else_to_the_others(cluster: Cluster) -> None:
    headers = {"Authorization": f"Bearer {cluster.admin_token}"}
    with httpx.Client(base_url=cluster.url, headers=headers, timeout=10) as http:
        created = http.post("/tasks", json={"id": "split-1", "title": "t", "project": "split"})
        assert created.status_code == 201, created.text
        assert created.headers["x-taskledger-replica"] == "r1"
        job = http.post("/jobs", json={"commands": ["true"], "project": "split"})
        assert job.status_code == 201, job.text
        job_id = job.json()["job_id"]
        for path in ("/tasks", "/tasks/split-1", "/tasks/split-1/events", f"/jobs/{job_id}", "/healthz",
                     "/events?since_seq=0", "/streams-are-not-this"):
            assert http.get(path).headers.get("x-taskledger-replica") == "r1", path
        # two streams of each kind: leastconn spreads open streams over the stream replicas
        served = set()
        streams = [http.stream("GET", p) for p in ("/stream", "/stream?since_seq=0", "/tasks/split-1/stream",
                                                   f"/jobs/{job_id}/stream")]
        try:
            for s in streams:
                r = s.__enter__()
                assert r.status_code == 200, r.read()
                served.add(r.headers["x-taskledger-replica"])
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        assert served == {"s1", "s2"}
