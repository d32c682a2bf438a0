"""The dashboard's page, static files and browser sessions (cookie auth), in process."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Any

import asyncpg
import httpx
import pytest
from litestar.testing import AsyncTestClient

from taskledger.service.http.app import create_app
from taskledger.service.http.deps import services_of
from taskledger.service.http.routes.dashboard import COOKIE
from taskledger.service.http.sessions import Sessions, b64
from taskledger.service.tokens import hash_token
from tests.conftest import ADMIN_TOKEN, AppHarness, ServerProcess, settings_for
from tests.flows import create_task, project


async def _sign_in(h: AppHarness, token: str) -> Any:
    h.http.cookies.clear()
    r = await h.http.post("/ui/session", json={"token": token})
    return r


def _cookie_header(r: Any) -> str:
    return r.headers.get("set-cookie", "")


async def test_page_and_static_files_are_public_with_a_strict_csp(harness: AppHarness) -> None:
    r = await harness.http.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert "/static/app.js" in r.text and "/static/app.css" in r.text
    # nothing from another origin
    assert "http://" not in r.text and "https://" not in r.text
    js = await harness.http.get("/static/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    again = await harness.http.get("/static/app.js", headers={"If-None-Match": js.headers["etag"]})
    assert again.status_code == 304
    assert (await harness.http.get("/static/app.css")).status_code == 200
    for bad in ("/static/nope.js", "/static/..%2Fapp.py", "/static/__init__.py"):
        assert (await harness.http.get(bad)).status_code == 404, bad


async def test_session_cookie_is_httponly_strict_and_grants_reads(harness: AppHarness) -> None:
    reader = await harness.client("reader", name="alice")
    r = await _sign_in(harness, reader.token or "")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "alice" and body["role"] == "reader" and body["access"] == "read"
    assert body["ttl_seconds"] == 300 and 0 < body["renew_after_seconds"] < body["ttl_seconds"]
    assert "task.verdict" in body["event_types"] and "job.heartbeat" in body["event_types"]
    assert r.headers["cache-control"] == "no-store"
    set_cookie = _cookie_header(r).lower()
    assert f"{COOKIE}=" in set_cookie and "httponly" in set_cookie and "samesite=strict" in set_cookie
    assert "path=/" in set_cookie and "max-age=300" in set_cookie
    assert (reader.token or "") not in _cookie_header(r)  # the cookie is not the token

    # reads with the cookie alone (no Authorization header)
    assert (await harness.http.get("/tasks")).status_code == 200
    assert (await harness.http.get("/events?limit=1")).status_code == 200
    assert (await harness.http.get("/blockers?open=true")).status_code == 200
    assert (await harness.http.get("/jobs")).status_code == 200
    me = await harness.http.get("/ui/session")
    assert me.status_code == 200 and me.json()["name"] == "alice"
    # without it, nothing
    harness.http.cookies.clear()
    assert (await harness.http.get("/tasks")).status_code == 401
    assert (await harness.http.get("/ui/session")).status_code == 401


async def test_cookie_never_grants_writes_even_for_an_admin_token(harness: AppHarness) -> None:
    r = await _sign_in(harness, ADMIN_TOKEN)
    assert r.status_code == 200
    assert r.json()["role"] == "reader" and r.json()["token_role"] == "admin"
    proj = project()
    attempts = [
        ("POST", "/tasks", {"title": "x", "project": proj}),
        ("POST", "/tokens", {"role": "admin", "name": "evil"}),
        ("POST", "/tasks/claim", {}),
        ("POST", "/jobs", {"commands": ["true"]}),
    ]
    for method, path, body in attempts:
        resp = await harness.http.request(method, path, json=body)
        assert resp.status_code == 401, (path, resp.status_code, resp.text)
    # ...and none of them happened
    listed = await harness.admin.ok(await harness.admin.get("/tasks", params={"project": proj}))
    assert listed["tasks"] == []
    # reads still work with the same cookie
    assert (await harness.http.get("/tasks")).status_code == 200


async def test_bad_tokens_are_refused_and_tokens_never_travel_in_urls(harness: AppHarness) -> None:
    assert (await _sign_in(harness, "tl_not-a-token")).status_code == 401
    assert (await _sign_in(harness, "")).status_code == 401
    assert COOKIE not in harness.http.cookies
    reader = await harness.client("reader")
    r = await harness.http.post("/ui/session", params={"token": reader.token}, json={"token": reader.token})
    assert r.status_code == 400 and "URL" in r.json()["detail"]
    assert COOKIE not in harness.http.cookies
    # the body is strict
    r = await harness.http.post("/ui/session", json={"token": reader.token, "role": "admin"})
    assert r.status_code == 400
    # a token in the query string is not a credential anywhere
    harness.http.cookies.clear()
    assert (await harness.http.get("/tasks", params={"token": reader.token})).status_code == 401
    assert (await harness.http.get("/stream", params={"access_token": reader.token})).status_code == 401


async def test_forged_tampered_and_expired_cookies_get_401(harness: AppHarness, pool: asyncpg.Pool) -> None:
    reader = await harness.client("reader")
    assert (await _sign_in(harness, reader.token or "")).status_code == 200
    good = harness.http.cookies[COOKIE]
    version, exp, token_hash, sig = good.split(".")
    secret = bytes(await pool.fetchval("SELECT secret FROM ui_secrets WHERE id = 1"))

    def signed(body: str, key: bytes = secret) -> str:
        return body + "." + b64(hmac.new(key, body.encode(), hashlib.sha256).digest())

    admin_hash = hash_token(ADMIN_TOKEN)
    forged = {
        "longer expiry, old signature": f"{version}.{int(exp) + 3600}.{token_hash}.{sig}",
        "another token's hash, old signature": f"{version}.{exp}.{admin_hash}.{sig}",
        "signed with another key": signed(f"{version}.{exp}.{token_hash}", b"k" * 32),
        "expired, properly signed": signed(f"{version}.{int(time.time()) - 1}.{token_hash}"),
        "unknown token, properly signed": signed(f"{version}.{exp}.{'0' * 64}"),
        "no signature": f"{version}.{exp}.{token_hash}",
        "garbage": "x" * 40,
        "too long": "v1." + "9" * 300,
    }
    for what, value in forged.items():
        harness.http.cookies.clear()
        harness.http.cookies.set(COOKIE, value)
        assert (await harness.http.get("/tasks")).status_code == 401, what
        assert (await harness.http.get("/stream")).status_code == 401, what
        assert (await harness.http.get("/ui/session")).status_code == 401, what
        assert (await harness.http.post("/ui/session/renew")).status_code == 401, what
    harness.http.cookies.clear()
    harness.http.cookies.set(COOKIE, good)
    assert (await harness.http.get("/tasks")).status_code == 200


async def test_expiry_renewal_revocation_and_logout(db_url: str, pool: asyncpg.Pool) -> None:
    app = create_app(settings_for(db_url, stream_token_ttl_seconds=3))
    async with AsyncTestClient(app=app, timeout=30) as http:
        h = AppHarness(http, app)
        reader = await h.client("reader")
        r = await _sign_in(h, reader.token or "")
        assert r.status_code == 200 and r.json()["renew_after_seconds"] == 1
        first = http.cookies[COOKIE]
        first_exp = int(first.split(".")[1])
        assert first_exp >= time.time() + 2
        await asyncio.sleep(1.2)
        renewed = await http.post("/ui/session/renew")
        assert renewed.status_code == 200
        assert http.cookies[COOKIE] != first
        second = http.cookies[COOKIE]
        assert int(second.split(".")[1]) > first_exp
        await asyncio.sleep(max(0.0, first_exp - time.time()) + 0.05)
        # the first cookie has expired by now; the renewed one has not (set by hand:
        # the client's cookie jar rounds Max-Age expiry down to whole seconds)
        http.cookies.clear()
        http.cookies.set(COOKIE, second)
        assert (await http.get("/tasks")).status_code == 200
        http.cookies.clear()
        http.cookies.set(COOKIE, first)
        assert (await http.get("/tasks")).status_code == 401
        assert (await http.get("/stream")).status_code == 401

        # a revoked token's session cannot be renewed (and GET /ui/session says so at once)
        assert (await _sign_in(h, reader.token or "")).status_code == 200
        await pool.execute("UPDATE tokens SET revoked_at = now() WHERE token_hash = $1",
                                     hash_token(reader.token or ""))
        assert (await http.post("/ui/session/renew")).status_code == 401
        assert (await _sign_in(h, reader.token or "")).status_code == 401

        # logout clears the cookie
        other = await h.client("reader")
        assert (await _sign_in(h, other.token or "")).status_code == 200
        out = await http.delete("/ui/session")
        assert out.status_code == 204
        assert "max-age=0" in _cookie_header(out).lower()
        assert COOKIE not in http.cookies
        assert (await http.get("/tasks")).status_code == 401


async def test_any_replica_accepts_a_session_another_issued(db_url: str) -> None:
    a, b = create_app(settings_for(db_url)), create_app(settings_for(db_url))
    async with AsyncTestClient(app=a, timeout=30) as ha, AsyncTestClient(app=b, timeout=30) as hb:
        reader = await AppHarness(ha, a).client("reader")
        assert (await ha.post("/ui/session", json={"token": reader.token})).status_code == 200
        hb.cookies.set(COOKIE, ha.cookies[COOKIE])
        assert (await hb.get("/tasks")).status_code == 200
        assert (await hb.get("/ui/session")).status_code == 200
    sa, sb = services_of(a).sessions, services_of(b).sessions
    assert sa._secret == sb._secret


@pytest.mark.parametrize("value", ["v1.1.2.3", "v2.9999999999." + "a" * 64 + ".x"])
def test_check_rejects_malformed_values_without_touching_the_database(value: str) -> None:
    s = Sessions(None, b"s" * 32, ttl=60, admin_token=None)  # type: ignore[arg-type]
    assert s.check(value) is None
    v, exp = s.issue("a" * 64, now=1000.0)
    assert s.check(v, now=1000.0 + 59) == ("a" * 64, exp)
    assert s.check(v, now=float(exp)) is None


def test_the_stream_accepts_the_cookie_on_reconnect_with_last_event_id(server: ServerProcess) -> None:
    """A real server: the cookie opens /stream, and a reconnect (Last-Event-ID) resumes after that id."""
    reader = server.token("reader")
    with server.client() as admin:
        for i in range(3):
            admin.post("/tasks", json={"title": f"t{i}", "project": "p-stream"}).raise_for_status()
    with httpx.Client(base_url=server.base, timeout=10) as http:
        assert http.post("/ui/session", json={"token": reader}).status_code == 200
        assert COOKIE in http.cookies

        def ids(headers: dict[str, str], params: dict[str, str]) -> list[int]:
            out: list[int] = []
            with http.stream("GET", "/stream", params=params, headers=headers) as s:
                assert s.status_code == 200
                assert s.headers["content-type"].startswith("text/event-stream")
                for line in s.iter_lines():
                    if line.startswith("id: "):
                        out.append(int(line[4:]))
                        if out[-1] == 3:
                            break
            return out

        assert ids({}, {"since_seq": "0"}) == [1, 2, 3]
        # Last-Event-ID wins over since_seq, as in a browser's reconnect to the same URL
        assert ids({"Last-Event-ID": "1"}, {"since_seq": "0"}) == [2, 3]
        http.cookies.clear()
        assert http.get("/stream", params={"since_seq": "0"}).status_code == 401


# ------------------------------------------------------------------ acting from a session


async def _event_count(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM events"))


async def test_a_session_acts_only_with_its_csrf_token_and_only_as_its_tokens_role_allows(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    proj = project()
    producer = await harness.client("producer", name="pat")
    reader = await harness.client("reader")
    for tid in ("c-1", "c-2"):
        await create_task(producer, proj, id=tid)

    r = await _sign_in(harness, producer.token or "")
    session = r.json()
    assert session["token_role"] == "producer" and session["role"] == "reader"
    assert session["actions"] == ["unblock", "cancel", "reassign"] and session["access"] == "read, act"
    csrf = session["csrf_token"]
    assert csrf and csrf not in _cookie_header(r)  # never in a cookie
    # the same CSRF token across a renewal (it is bound to the token, not the cookie)
    assert (await harness.http.post("/ui/session/renew")).json()["csrf_token"] == csrf

    before = await _event_count(pool)
    refused = {
        "no CSRF header": {},
        "a wrong CSRF token": {"X-CSRF-Token": csrf[:-2] + "xx"},
        "an empty CSRF token": {"X-CSRF-Token": ""},
        "another origin": {"X-CSRF-Token": csrf, "Origin": "https://evil.example"},
    }
    for what, headers in refused.items():
        resp = await harness.http.post("/tasks/c-1/cancel", json={"reason": "x"}, headers=headers)
        assert resp.status_code == 403, (what, resp.text)
        assert resp.json()["code"] == "csrf_failed", what
        assert resp.headers["content-type"].startswith("application/problem+json")
    assert await _event_count(pool) == before, "a refused action wrote an event"
    # the CSRF token is no credential without the cookie
    harness.http.cookies.clear()
    resp = await harness.http.post("/tasks/c-1/cancel", json={}, headers={"X-CSRF-Token": csrf})
    assert resp.status_code == 401
    assert (await _sign_in(harness, producer.token or "")).status_code == 200

    # with it, the producer's session cancels, as the producer
    origin = {"X-CSRF-Token": csrf, "Origin": "http://testserver.local"}
    resp = await harness.http.post("/tasks/c-1/cancel", json={"reason": "dup"}, headers=origin)
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "cancelled"
    ev = (await harness.admin.ok(await harness.admin.get("/tasks/c-1/events")))["events"][-1]
    assert ev["type"] == "task.cancelled" and ev["meta"]["actor"] == "pat" and ev["meta"]["role"] == "producer"
    # the API's rules, unchanged: a round review needs a reviewer; a bad body is a 400
    resp = await harness.http.post("/tasks/c-2/round-review", json={"decision": "GOAL_ACHIEVED"}, headers=origin)
    assert resp.status_code == 403 and resp.json()["code"] == "forbidden"
    resp = await harness.http.post("/tasks/c-2/unblock", json={"action": "later"}, headers=origin)
    assert resp.status_code == 400
    resp = await harness.http.post("/tasks/c-2/unblock", json={}, headers=origin)
    assert resp.status_code == 409 and resp.json()["code"] == "invalid_transition"
    # and the session is no bearer token for anything else
    before = await _event_count(pool)
    for path, body in (("/tasks", {"title": "x", "project": proj}), ("/tasks/claim", {}),
                       ("/jobs", {"commands": ["true"]})):
        resp = await harness.http.post(path, json=body, headers=origin)
        assert resp.status_code == 401, (path, resp.text)
    assert await _event_count(pool) == before

    # a reader's session stays read-only, CSRF token or not
    r = await _sign_in(harness, reader.token or "")
    assert r.json()["actions"] == [] and r.json()["access"] == "read"
    rcsrf = r.json()["csrf_token"]
    before = await _event_count(pool)
    for action in ("cancel", "unblock", "reassign", "round-review"):
        resp = await harness.http.post(f"/tasks/c-2/{action}", json={}, headers={"X-CSRF-Token": rcsrf})
        # 403 from the guard (reassign may not exist yet on this service: then 404/405)
        assert resp.status_code in ((403,) if action != "reassign" else (403, 404, 405)), (action, resp.text)
    assert await _event_count(pool) == before
    # another session's CSRF token does not fit this one
    resp = await harness.http.post("/tasks/c-2/cancel", json={}, headers={"X-CSRF-Token": csrf})
    assert resp.status_code == 403 and resp.json()["code"] == "csrf_failed"


async def test_a_revoked_tokens_session_cannot_act_even_within_the_cache(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    proj = project()
    producer = await harness.client("producer")
    await create_task(producer, proj, id="r-1")
    csrf = (await _sign_in(harness, producer.token or "")).json()["csrf_token"]
    assert (await harness.http.get("/tasks/r-1")).status_code == 200  # warms the lookup cache
    await pool.execute("UPDATE tokens SET revoked_at = now() WHERE token_hash = $1", hash_token(producer.token or ""))
    resp = await harness.http.post("/tasks/r-1/cancel", json={}, headers={"X-CSRF-Token": csrf})
    assert resp.status_code == 401
    assert (await harness.admin.ok(await harness.admin.get("/tasks/r-1")))["state"] == "pending"


async def test_the_chain_check_runs_as_the_sessions_own_role_with_the_csrf_header(harness: AppHarness) -> None:
    csrf = (await _sign_in(harness, ADMIN_TOKEN)).json()["csrf_token"]
    assert (await harness.http.get("/audit/verify", headers={"X-CSRF-Token": "nope"})).status_code == 403
    ok = await harness.http.get("/audit/verify", headers={"X-CSRF-Token": csrf})
    assert ok.status_code == 200 and ok.json()["ok"] is True
