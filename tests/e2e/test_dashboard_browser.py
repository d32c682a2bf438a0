"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright.

No browser is downloaded: Playwright launches the system Chromium
(`executable_path`). `.ci/run` installs it; without it this test fails, loudly.

Two `taskledger serve` processes share one database: the page is served by A,
the API clients (producer, maker on node-a, checker on node-b, a job runner)
write through B, so what the page shows travels through the log and A's
tailer, as it would with replicas. Midway A is stopped — the page's stream
drops — work goes on through B, and A is started again on the same port: the
page must resume from the last id it saw and show every later event exactly
once.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, ServerProcess

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # reported by the test itself, never a silent skip
    expect = sync_playwright = None  # type: ignore[assignment]

CHROMIUM = os.environ.get("TASKLEDGER_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]
ARTIFACTS = ROOT / "tests" / "artifacts"
WAIT_MS = 20_000


def _require_browser() -> None:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"Chromium is not installed at {CHROMIUM}: this end-to-end test needs Debian's chromium "
                    "(`apt-get install -y chromium chromium-driver`; .ci/run does it)", pytrace=False)
    if sync_playwright is None:
        pytest.fail("Playwright for Python is not installed: pip install -e '.[test]' "
                    "(never `playwright install`: the test uses the system Chromium)", pytrace=False)


class Api:
    """Speaks to one server with one token."""

    def __init__(self, base: str, token: str) -> None:
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def post(self, path: str, body: Any = None, status: int = 200) -> Any:
        r = self.http.post(path, json=body)
        assert r.status_code == status, f"POST {path} -> {r.status_code} {r.text[:500]}"
        return r.json() if r.content else None

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        assert r.status_code == 200, f"GET {path} -> {r.status_code} {r.text[:500]}"
        return r.json()


class Work:
    def __init__(self, producer: Api, maker: Api, checker: Api, proj: str) -> None:
        self.producer, self.maker, self.checker, self.proj = producer, maker, checker, proj
        self.current = proj

    def create(self, title: str) -> str:
        """A task in a project of its own, so that each claim below takes exactly this one."""
        tid = f"T-{uuid.uuid4().hex[:10]}"
        self.current = f"{self.proj}-{tid[2:6]}"
        self.producer.post("/tasks", {
            "id": tid, "project": self.current, "title": title, "spec": "do it",
            "requirements": [{"id": "R1", "text": "it builds"}, {"id": "R2", "text": "its tests pass"}],
        }, 201)
        return tid

    def claim(self, who: Api, types: list[str]) -> dict[str, Any]:
        t = who.post("/tasks/claim", {"task_types": types, "projects": [self.current], "lease_seconds": 60})
        assert t is not None
        return t  # type: ignore[no-any-return]

    def make(self, tid: str, *, then: Any = None) -> None:
        t = self.claim(self.maker, ["implement"])
        assert t["id"] == tid
        if then:
            then("running")
        self.maker.post(f"/tasks/{tid}/start", {"lease_id": t["lease_id"]})
        self.maker.post(f"/tasks/{tid}/complete", {"lease_id": t["lease_id"], "result": {"ok": True}})

    def check(self, outcome: str, verdicts: list[dict[str, str]], category: str | None = None) -> str:
        v = self.claim(self.checker, ["verify"])
        self.checker.post(f"/tasks/{v['id']}/start", {"lease_id": v["lease_id"]})
        body: dict[str, Any] = {"lease_id": v["lease_id"], "outcome": outcome, "verdicts": verdicts}
        if category:
            body["category"] = category
        self.checker.post(f"/tasks/{v['id']}/complete", body)
        return str(v["id"])


def test_the_dashboard_follows_the_stream_live_and_resumes_after_a_drop(db_url: str, tmp_path: Path) -> None:
    _require_browser()

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    a = ServerProcess(db_url).start()  # the page's origin
    b = ServerProcess(db_url).start()  # the API clients' replica
    tokens: list[str] = []
    apis: list[Api] = []
    try:
        reader = a.token("reader", name="auditor")
        tokens = [reader, b.token("producer"), b.token("worker", node="node-a", name="maker-1"),
                  b.token("worker", node="node-b", name="checker-1")]
        apis = [Api(b.base, t) for t in tokens[1:]]
        producer, maker, checker = apis
        work = Work(producer, maker, checker, "p-" + uuid.uuid4().hex[:8])

        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1600, "height": 1000}, service_workers="block",
            )
            ctx.set_default_timeout(WAIT_MS)
            expect.set_options(timeout=WAIT_MS)
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            urls: list[str] = []
            page.on("request", lambda r: urls.append(r.url))
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))

            def card(tid: str) -> Any:
                return page.locator(f'.task[data-id="{tid}"]')

            def in_column(tid: str, col: str) -> None:
                expect(page.locator(f'.col[data-col="{col}"] .task[data-id="{tid}"]')).to_have_count(1)

            # ---- sign in: without a session the page asks for a token
            page.goto(a.base + "/")
            expect(page.locator("#signin")).to_be_visible()
            page.fill("#token", "tl_wrong")
            page.click("#signin button[type=submit]")
            expect(page.locator("#signin-error")).to_contain_text("not accepted")
            page.fill("#token", reader)
            page.click("#signin button[type=submit]")
            expect(page.locator("#conn")).to_have_attribute("data-state", "live")
            expect(page.locator("#who")).to_contain_text("auditor")
            assert page.input_value("#token") == ""

            # ---- a task moves pending -> running -> verifying -> verified, live
            t1 = work.create("Build the ledger")
            in_column(t1, "pending")
            expect(card(t1)).to_contain_text("attempt 1/3")
            work.make(t1, then=lambda _: in_column(t1, "running"))
            in_column(t1, "verifying")
            expect(card(t1)).to_contain_text("maker node-a")
            work.check("PASS", [
                {"requirement_id": "R1", "verdict": "PASS", "reason": "builds clean on node-b"},
                {"requirement_id": "R2", "verdict": "PASS", "reason": "412 tests pass"}])
            in_column(t1, "verified")
            expect(card(t1)).to_contain_text("checker node-b")

            # ---- a parent: its current round and the round's summary
            gid, pproj = f"G-{uuid.uuid4().hex[:8]}", f"{work.proj}-goal"
            producer.post("/tasks", {"id": gid, "project": pproj, "title": "Release 1.0",
                                     "verification": None}, 201)
            producer.post("/tasks", {"id": gid + "-1", "project": pproj, "title": "Changelog",
                                     "parent_task_id": gid, "verification": None}, 201)
            parent = page.locator(f'#parents .parent[data-id="{gid}"]')
            expect(parent).to_contain_text("round 1")
            expect(parent).to_contain_text("in_progress")
            in_column(gid, "rounds")

            # ---- a rejection: the verdict's reason and the rework notes, attempt 2
            t2 = work.create("Write the migration")
            work.make(t2)
            in_column(t2, "verifying")
            work.check("FAIL", [{"requirement_id": "R1", "verdict": "PASS", "reason": "builds"},
                                {"requirement_id": "R2", "verdict": "FAIL",
                                 "reason": "down-migration drops the wrong table"}])
            retried = page.locator(f'.col[data-col="pending"] .task[data-id="{t2}"][data-attempt="2"]')
            expect(retried).to_have_count(1)
            card(t2).click()
            detail = page.locator("#detail")
            expect(detail).to_be_visible()
            expect(detail.locator(".verdict .reason")).to_contain_text(
                ["builds", "down-migration drops the wrong table"])
            expect(detail.locator("table.notes").first).to_contain_text("down-migration drops the wrong table")
            expect(detail.locator('.attempt[data-attempt="2"] table.notes')).to_contain_text("down-migration")
            page.click("#detail-close")

            # ---- blocked: the blocker panel, and the history an auditor clicks through
            t3 = work.create("Deploy to staging")
            work.make(t3)
            in_column(t3, "verifying")
            work.check("BLOCKED", [{"requirement_id": "R1", "verdict": "FAIL",
                                    "reason": "staging credentials are missing"}], category="environment")
            in_column(t3, "blocked")
            blocker = page.locator(f'#blockers .blocker[data-task="{t3}"]')
            expect(blocker).to_contain_text("staging credentials")
            blocker.locator("a").click()
            expect(page.locator("#detail-title")).to_have_text("Deploy to staging")
            history = detail.locator("table.history tr[data-seq]")
            types = [e["type"] for e in producer.get(f"/tasks/{t3}/events")["events"]]
            expect(history).to_have_count(len(types))
            assert history.evaluate_all("rows => rows.map(r => r.dataset.type)") == types
            assert types[0] == "task.created" and "task.verifying" in types and types[-1] == "task.blocked"
            # the state after each step comes from the replay API
            expect(detail.locator('table.history tr[data-type="task.created"] td.after')).to_have_text(
                "pending · attempt 1")
            expect(detail.locator('table.history tr[data-type="task.verifying"] td.after')).to_have_text(
                "verifying · attempt 1")
            expect(detail.locator('table.history tr[data-type="task.blocked"] td.after')).to_have_text(
                "blocked · attempt 1")
            detail.locator('table.history tr[data-type="task.verdict"] button').click()
            asof = detail.locator(".asof")
            expect(asof).to_contain_text("after task.verdict")
            expect(asof).to_contain_text("staging credentials are missing")
            expect(asof.locator("dd").first).to_have_text("verifying")
            assert any("as_of_seq=" in u for u in urls), "the history should come from the replay API"
            page.screenshot(path=str(ARTIFACTS / "dashboard-history.png"))
            page.click("#detail-close")
            expect(detail).to_be_hidden()

            # ---- a job: progress bar, stage, current command, ETA
            cmds = ["make build", "make test", "make package"]
            job = producer.post("/jobs", {"project": work.proj, "commands": cmds}, 201)
            jid = job["job_id"]
            jrow = page.locator(f'.job[data-id="{jid}"]')
            expect(jrow).to_contain_text("pending")
            run = maker.post("/jobs/claim", {"projects": [work.proj]})
            assert run["job_id"] == jid
            lease = run["lease_id"]

            def report(**body: Any) -> None:
                maker.post(f"/jobs/{jid}/report", {"lease_id": lease, **body})

            report(event="stage", stage="running")
            report(event="command_started", command="make build", index=0, total=3)
            report(event="command_completed", command="make build", index=0, total=3, exit_code=0,
                   duration=0.4)
            report(event="command_started", command="make test", index=1, total=3)
            expect(jrow.locator(".progress")).to_contain_text("1/3 commands")
            expect(jrow.locator(".current")).to_contain_text("make test")
            expect(jrow).to_contain_text("running")
            expect(jrow.locator(".eta")).to_have_text(re.compile(r"ETA \d+"))
            expect(jrow.locator(".bar")).to_have_attribute("aria-valuenow", re.compile(r"^33\.3"))
            expect(jrow.locator(".bar > span")).to_have_attribute("style", re.compile(r"width: ?33\.3"))

            # ---- the service drops the stream: A stops; work goes on through B
            before = page.evaluate("window.taskledgerDashboard.lastSeq")
            a.stop()
            expect(page.locator("#conn")).to_have_attribute("data-state", "wait")
            t4 = work.create("Ship it")
            work.make(t4)
            work.check("PASS", [{"requirement_id": "R1", "verdict": "PASS", "reason": "ok"},
                                {"requirement_id": "R2", "verdict": "PASS", "reason": "ok after the drop"}])
            report(event="command_completed", command="make test", index=1, total=3, exit_code=0,
                   duration=0.5)
            report(event="command_started", command="make package", index=2, total=3)
            head = producer.get("/events", limit=1)["head_seq"]
            assert head > before
            assert page.evaluate("window.taskledgerDashboard.lastSeq") == before  # nothing arrived meanwhile
            a.start()  # the same port: the browser reconnects by itself

            expect(page.locator("#conn")).to_have_attribute("data-state", "live")
            in_column(t4, "verified")
            expect(jrow.locator(".progress")).to_contain_text("2/3 commands")
            expect(jrow.locator(".current")).to_contain_text("make package")
            page.wait_for_function(f"window.taskledgerDashboard.lastSeq === {head}")

            # ---- and live again after the resume
            report(event="command_completed", command="make package", index=2, total=3, exit_code=0,
                   duration=0.2)
            report(event="finish", status="completed", exit_code=0)
            expect(jrow).to_have_attribute("data-state", "completed")
            expect(jrow.locator(".progress")).to_contain_text("100% · 3/3 commands")
            head = producer.get("/events", limit=1)["head_seq"]
            page.wait_for_function(f"window.taskledgerDashboard.lastSeq === {head}")

            # ---- nothing missed, nothing twice: the feed holds every seq once, gapless
            seqs = page.eval_on_selector_all("#feed li", "els => els.map(e => Number(e.dataset.seq))")
            assert len(seqs) == len(set(seqs)), "an event was shown twice"
            assert sorted(seqs, reverse=True) == seqs
            assert seqs == list(range(head, min(seqs) - 1, -1)), "an event is missing from the feed"
            live = page.eval_on_selector_all('#feed li[data-history="0"]', "els => els.length")
            assert live == head - page.evaluate("window.taskledgerDashboard.headAtLoad")
            verified_t4 = page.locator(f'#feed li[data-type="task.verified"]:has-text("task:{t4}")')
            expect(verified_t4).to_have_count(1)
            assert page.evaluate("window.taskledgerDashboard.received") == live

            page.locator("#board").scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

            # ---- the token never went into a URL, and never into a log
            assert urls, "no requests were recorded"
            for u in urls:
                assert all(t not in u for t in tokens), f"a token in a URL: {u}"
            assert all(t not in a.log() for t in tokens)
            assert [m for m in console if m.startswith("pageerror")] == [], console

            # ---- signing out: the form again, and the cookie no longer reads anything
            page.click("#signout")
            expect(page.locator("#signin")).to_be_visible()
            status = page.evaluate("fetch('/tasks').then(r => r.status)")
            assert status == 401
            ctx.close()
    finally:
        for api in apis:
            api.http.close()
        a.stop()
        b.stop()
