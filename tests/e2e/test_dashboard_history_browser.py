"""The dashboard's history, time travel, trust panel, filters and actions, in Debian's Chromium.

One `taskledger serve` process; each person (reader, producer, reviewer) has a
browser context of their own, so each has their own session cookie. The work
itself goes through the API with bearer tokens, as workers do.

Accessibility is checked with axe-core (MPL-2.0), fetched at test time with
`npm pack` at a pinned version and checked against its sha256; the file is
used as published, licence header and all. `TASKLEDGER_TEST_AXE` may name a
local copy of that same file for machines without the npm registry.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, ROOT, ServerProcess
from tests.e2e.test_dashboard_browser import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    WAIT_MS,
    Api,
    Work,
    _require_browser,
)

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # reported by _require_browser, never a silent skip
    expect = sync_playwright = None  # type: ignore[assignment]

AXE_VERSION = "4.14.1"
AXE_SHA256 = "29348999450cdf2849a8e70b7912fc2da85a849da39c0d0d5394f51d4a9ed95c"


def _axe_source() -> str:
    override = os.environ.get("TASKLEDGER_TEST_AXE")
    path = Path(override) if override else ROOT / ".pytest_cache" / f"axe-core-{AXE_VERSION}" / "axe.min.js"
    if not path.is_file():
        npm = shutil.which("npm")
        if override or npm is None:
            pytest.fail(f"axe-core {AXE_VERSION} is needed: install npm (it is fetched with `npm pack`) "
                        "or set TASKLEDGER_TEST_AXE to its axe.min.js", pytrace=False)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([npm, "pack", f"axe-core@{AXE_VERSION}", "--pack-destination", tmp, "--silent"],
                           check=True, timeout=180, capture_output=True)
            (tgz,) = Path(tmp).glob("axe-core-*.tgz")
            with tarfile.open(tgz) as tar:
                member = tar.extractfile("package/axe.min.js")
                assert member is not None
                body = member.read()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    body = path.read_bytes()
    assert hashlib.sha256(body).hexdigest() == AXE_SHA256, f"{path} is not axe-core {AXE_VERSION} as published"
    text = body.decode()
    # the MPL-2.0 notice travels with the file, unchanged
    banner = " ".join(text[:text.index("*/")].replace("*", " ").split())
    assert text.startswith(f"/*! axe v{AXE_VERSION}")
    assert "subject to the terms of the Mozilla Public License, v. 2.0" in banner
    return text


def _axe_serious(page: Any, axe: str, where: str) -> list[str]:
    """Serious and critical axe violations on the page as it stands (WCAG 2 A/AA rules)."""
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.evaluate(axe)
    result = page.evaluate("""() => axe.run(document, {
        runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa', 'best-practice']},
        resultTypes: ['violations']})""")
    assert result["testEngine"]["version"] == AXE_VERSION and len(result["passes"]) > 10, where
    return [f"{where}: {v['id']} ({v['impact']}): {v['help']} — " +
            "; ".join(n["target"][0] if isinstance(n["target"][0], str) else str(n["target"])
                      for n in v["nodes"][:5])
            for v in result["violations"] if v["impact"] in ("serious", "critical")]


class People:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.tokens = {
            "reader": server.token("reader", name="auditor"),
            "producer": server.token("producer", name="pat"),
            "reviewer": server.token("reviewer", name="rita"),
            "maker": server.token("worker", node="node-a", name="maker-1"),
            "checker": server.token("worker", node="node-b", name="checker-1"),
        }
        self.apis = {k: Api(server.base, t) for k, t in self.tokens.items()}
        self.admin = Api(server.base, ADMIN_TOKEN)
        self.work = Work(self.apis["producer"], self.apis["maker"], self.apis["checker"],
                         "p-" + uuid.uuid4().hex[:8])

    def close(self) -> None:
        for a in [*self.apis.values(), self.admin]:
            a.http.close()

    def head(self) -> int:
        return int(self.admin.get("/events", limit=1)["head_seq"])


class Browser:
    def __init__(self, pw: Any) -> None:
        self.browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        self.errors: list[str] = []

    def session(self, base: str, token: str) -> Any:
        ctx = self.browser.new_context(viewport={"width": 1500, "height": 1000}, timezone_id="UTC",
                                       service_workers="block")
        ctx.set_default_timeout(WAIT_MS)
        page = ctx.new_page()
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.goto(base + "/")
        page.fill("#token", token)
        page.click("#signin button[type=submit]")
        expect(page.locator("#conn")).to_have_attribute("data-state", "live")
        return page


def _board_cards(page: Any) -> dict[str, tuple[str, int]]:
    cards = page.eval_on_selector_all(
        ".task[data-id]", "els => els.map(e => [e.dataset.id, e.dataset.state, Number(e.dataset.attempt)])")
    return {i: (s, a) for i, s, a in cards}


def _expect_board_as_api(page: Any, people: People, seq: int) -> None:
    """Every card on the board is the task as GET /tasks/{id}?as_of_seq= gives it, and every task then is a card."""
    expect(page.locator("#board")).to_have_attribute("data-as-of", str(seq))
    expect(page.locator("#mode")).to_have_attribute("data-as-of", str(seq))
    shown = _board_cards(page)
    existed = {e["stream"][5:] for e in people.admin.get("/events", since_seq=0, limit=max(seq, 1))["events"]
               if e["seq"] <= seq and e["type"] == "task.created"}
    assert set(shown) == existed, (seq, set(shown) ^ existed)
    for tid, (state, attempt) in shown.items():
        then = people.admin.get(f"/tasks/{tid}", as_of_seq=seq)
        assert (state, attempt) == (then["state"], then["attempt"]), (seq, tid)


def test_history_time_travel_trust_and_acting_from_the_page(db_url: str) -> None:
    _require_browser()
    axe = _axe_source()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    srv = ServerProcess(db_url).start()
    people = People(srv)
    work = people.work
    producer = people.apis["producer"]
    violations: list[str] = []
    try:
        # ---- a history: a pass, a rejection and retry, a blocker, a parent in review
        t1 = work.create("Build the ledger")
        work.make(t1)
        work.check("PASS", [{"requirement_id": "R1", "verdict": "PASS", "reason": "builds on node-b"},
                            {"requirement_id": "R2", "verdict": "PASS", "reason": "412 tests pass"}])
        seq_t1_verified = people.head()
        t2 = work.create("Write the migration")
        work.make(t2)
        seq_t2_verifying = people.head()
        work.check("FAIL", [{"requirement_id": "R1", "verdict": "PASS", "reason": "builds"},
                            {"requirement_id": "R2", "verdict": "FAIL", "reason": "down-migration drops a table"}])
        t3 = work.create("Deploy to staging")
        work.make(t3)
        work.check("BLOCKED", [{"requirement_id": "R1", "verdict": "FAIL",
                                "reason": "staging credentials are missing"}], category="environment")
        gid, gproj = f"G-{uuid.uuid4().hex[:8]}", f"{work.proj}-goal"
        producer.post("/tasks", {"id": gid, "project": gproj, "title": "Release 1.0", "verification": None}, 201)
        producer.post("/tasks", {"id": gid + "-1", "project": gproj, "title": "Changelog",
                                 "parent_task_id": gid, "verification": None}, 201)
        sub = people.apis["maker"].post("/tasks/claim", {"task_types": ["implement"], "projects": [gproj]})
        people.apis["maker"].post(f"/tasks/{sub['id']}/start", {"lease_id": sub["lease_id"]})
        people.apis["maker"].post(f"/tasks/{sub['id']}/complete", {"lease_id": sub["lease_id"], "result": {}})
        assert producer.get(f"/tasks/{gid}")["state"] == "round_review"
        for i, (label, assignee) in enumerate([("ui", "alice"), ("ui", None), ("infra", "bob")]):
            producer.post("/tasks", {"id": f"F-{work.proj}-{i}", "project": f"{work.proj}-find",
                                     "title": f"Findable {label} {i}", "labels": [label],
                                     **({"assignee": assignee} if assignee else {})}, 201)

        with sync_playwright() as pw:
            b = Browser(pw)
            expect.set_options(timeout=WAIT_MS)

            # ================= a reader
            page = b.session(srv.base, people.tokens["reader"])
            violations += _axe_serious(page, axe, "board")

            # ---- trust at a glance (checking the chain is an admin's: a reader is told so)
            expect(page.locator("#trust-chain [data-state=unknown]")).to_contain_text("needs another role")
            ap = b.session(srv.base, ADMIN_TOKEN)
            expect(ap.locator("#trust-chain [data-state=ok]")).to_contain_text("verified")
            ap.context.close()
            expect(page.locator("#trust-checkpoint")).to_have_text("none in the log")
            expect(page.locator("#trust-writer")).to_contain_text("batches")
            expect(page.locator("#trust-lag")).to_contain_text("lag 0")

            # ---- the task page of the blocked task: timeline, attempts, verdicts, blocker, verifiers
            page.goto(srv.base + f"/#/tasks/{t3}")
            detail = page.locator("#detail")
            expect(detail).to_be_visible()
            expect(page.locator("#detail-title")).to_have_text("Deploy to staging")
            events = producer.get(f"/tasks/{t3}/events")["events"]
            rows = detail.locator("table.history tbody tr")
            expect(rows).to_have_count(len(events))
            claimed = detail.locator('table.history tr[data-type="task.claimed"]')
            expect(claimed.locator("td.who")).to_have_text("maker-1 (worker)")
            expect(claimed.locator("td.node")).to_have_text("node-a")
            expect(claimed.locator("td.when")).to_have_text(events[1]["recorded_at"].replace("T", " ")[:19] + "Z")
            expect(detail.locator('.attempt[data-attempt="1"] .verdict .reason')).to_contain_text(
                "staging credentials are missing")
            expect(detail.locator('.attempt[data-attempt="1"] h4')).to_contain_text("blocked")
            expect(detail.locator("#page-blockers .blocker-rec")).to_contain_text("Open.")
            expect(detail.locator(f'#verifiers a[data-id="V-{t3}"]')).to_have_count(1)
            # a reader's page offers nothing to do, and the service agrees
            expect(detail.locator("#readonly-note")).to_be_visible()
            expect(detail.locator("form.act")).to_have_count(0)
            csrf = page.evaluate("fetch('/ui/session').then(r => r.json()).then(s => s.csrf_token)")
            tried = page.evaluate("""([id, csrf]) => Promise.all(['unblock', 'cancel'].map(a =>
                fetch(`/tasks/${id}/${a}`, {method: 'POST', headers: {'Content-Type': 'application/json',
                 'X-CSRF-Token': csrf}, body: '{}'}).then(async r => [r.status, (await r.json()).code])))""",
                                  [t3, csrf])
            assert tried == [[403, "forbidden"], [403, "forbidden"]], tried
            violations += _axe_serious(page, axe, "task page (reader)")
            page.screenshot(path=str(ARTIFACTS / "dashboard-task.png"), full_page=True)

            # ---- a parent's page: the round and its sub-tasks as links
            page.goto(srv.base + f"/#/tasks/{gid}")
            expect(detail.locator('#rounds .round[data-round="1"]')).to_contain_text("1/1 done")
            expect(detail.locator(f'#rounds a[data-id="{gid}-1"]')).to_have_count(1)
            detail.locator(f'#rounds a[data-id="{gid}-1"]').click()
            expect(page.locator("#detail-title")).to_have_text("Changelog")
            expect(detail.locator("#page-parent")).to_have_text(gid)

            # ---- time travel: the slider, the date picker, and "live"
            page.goto(srv.base + "/#/?verify=1")
            expect(page.locator("#mode")).to_have_text("live")
            page.locator("#tt-seq").fill(str(seq_t2_verifying))
            _expect_board_as_api(page, people, seq_t2_verifying)
            assert f"as_of={seq_t2_verifying}" in page.url
            expect(page.locator(f'.col[data-col="verifying"] .task[data-id="{t2}"]')).to_have_count(1)
            for seq in (1, seq_t1_verified, people.head()):
                page.goto(srv.base + f"/#/?verify=1&as_of={seq}")
                _expect_board_as_api(page, people, seq)
            page.screenshot(path=str(ARTIFACTS / "dashboard-timetravel.png"), full_page=True)
            # a time: the last event recorded by then
            t_event = people.admin.get("/events", since_seq=seq_t1_verified - 1, limit=1)["events"][0]
            second = t_event["recorded_at"][:19]
            want = people.admin.get("/dashboard/seq-at", at=second + "Z")["seq"]
            page.fill("#tt-date", second)
            _expect_board_as_api(page, people, want)
            # a task page as of a seq, then live again
            page.goto(srv.base + f"/#/tasks/{t2}?as_of={seq_t2_verifying}")
            expect(detail).to_have_attribute("data-as-of", str(seq_t2_verifying))
            expect(detail.locator("#page-state")).to_have_text("verifying")
            then = [e for e in producer.get(f"/tasks/{t2}/events")["events"] if e["seq"] <= seq_t2_verifying]
            expect(rows).to_have_count(len(then))
            page.click("#tt-live")
            expect(page.locator("#mode")).to_have_text("live")
            expect(detail.locator("#page-state")).to_have_text("pending")
            expect(detail.locator('.attempt[data-attempt="2"] table.notes')).to_contain_text("drops a table")
            page.goto(srv.base + f"/#/tasks/{t2}?as_of=1")
            expect(detail.locator("#not-yet")).to_contain_text("did not exist yet")

            # ---- a task page updates live
            t4 = work.create("Ship it")
            page.goto(srv.base + f"/#/tasks/{t4}")
            expect(detail.locator("#page-state")).to_have_text("pending")
            expect(rows).to_have_count(1)
            work.make(t4)
            expect(detail.locator("#page-state")).to_have_text("verifying")
            expect(rows).to_have_count(len(producer.get(f"/tasks/{t4}/events")["events"]))
            expect(detail.locator('table.history tr[data-type="task.verifying"] td.after')).to_have_text(
                "verifying · attempt 1")

            # ---- finding things: filters in the URL, kept on reload
            page.goto(srv.base + f"/#/?project={work.proj}-find")
            expect(page.locator(".task[data-id]")).to_have_count(3)
            page.select_option("#f-label", "ui")
            expect(page.locator(".task[data-id]")).to_have_count(2)
            page.select_option("#f-assignee", "alice")
            expect(page.locator(".task[data-id]")).to_have_count(1)
            assert "label=ui" in page.url and "assignee=alice" in page.url
            page.reload()
            expect(page.locator("#conn")).to_have_attribute("data-state", "live")
            expect(page.locator(".task[data-id]")).to_have_count(1)
            expect(page.locator(f'.task[data-id="F-{work.proj}-0"]')).to_have_count(1)
            page.click("#f-clear")
            page.fill("#f-q", "Deploy to STAGING")
            expect(page.locator(".task[data-id]")).to_have_count(1)
            page.fill("#f-q", t1)
            expect(page.locator(f'.task[data-id="{t1}"]')).to_have_count(1)
            page.fill("#f-q", "")
            page.select_option("#f-state", "blocked")
            expect(page.locator(".task[data-id]")).to_have_count(1)
            # keyboard: a card is a link; Enter opens its page, Escape goes back
            page.locator(f'.task[data-id="{t3}"]').focus()
            page.keyboard.press("Enter")
            expect(page.locator("#detail-title")).to_have_text("Deploy to staging")
            page.keyboard.press("Escape")
            expect(page.locator("#board-view")).to_be_visible()
            assert "state=blocked" in page.url

            # ================= a producer: unblock and cancel from the page
            pp = b.session(srv.base, people.tokens["producer"])
            pp.goto(srv.base + f"/#/tasks/{t3}")
            pdetail = pp.locator("#detail")
            expect(pdetail.locator("#act-unblock")).to_be_visible()
            violations += _axe_serious(pp, axe, "task page (producer)")
            pp.fill("#unblock-notes", "credentials added")
            pp.click("#act-unblock button[type=submit]")
            expect(pdetail.locator("#act-result")).to_contain_text("done")
            expect(pdetail.locator("#page-state")).to_have_text("pending")
            expect(pdetail.locator("#page-blockers .resolution")).to_contain_text("retry — credentials added")
            unblocked = producer.get(f"/tasks/{t3}/events")["events"][-1]
            assert unblocked["type"] == "task.unblocked" and unblocked["meta"]["actor"] == "pat"
            # the reader's page follows it live
            expect(page.locator(f'.col[data-col="pending"] .task[data-id="{t3}"]')).to_have_count(0)
            page.click("#f-clear")
            expect(page.locator(f'.col[data-col="pending"] .task[data-id="{t3}"]')).to_have_count(1)
            pp.fill("#cancel-reason", "not this week")
            pp.click("#act-cancel button[type=submit]")
            expect(pdetail.locator("#page-state")).to_have_text("cancelled")
            expect(pdetail.locator("#act-cancel")).to_have_count(0)
            pp.screenshot(path=str(ARTIFACTS / "dashboard-actions.png"), full_page=True)
            # without the CSRF header the same session is refused, and nothing is written
            before = people.head()
            refused = pp.evaluate("""(id) => fetch(`/tasks/${id}/cancel`, {method: 'POST',
                headers: {'Content-Type': 'application/json'}, body: '{}'})
                .then(async r => [r.status, (await r.json()).code])""", t1)
            assert refused == [403, "csrf_failed"]
            assert people.head() == before

            # ================= a reviewer: the round review with its three answers
            rp = b.session(srv.base, people.tokens["reviewer"])
            rp.goto(srv.base + f"/#/tasks/{gid}")
            rdetail = rp.locator("#detail")
            expect(rdetail.locator("#act-review")).to_be_visible()
            expect(rdetail.locator("#act-cancel")).to_have_count(0)  # a reviewer may not cancel
            violations += _axe_serious(rp, axe, "task page (reviewer)")
            rp.select_option("#review-goal-clear", "true")
            rp.fill("#review-coverage", "R1 and R2 covered")
            rp.fill("#review-next", "nothing left")
            rp.fill("#review-notes", "ship it")
            rp.click("#act-review button[type=submit]")
            expect(rdetail.locator("#page-state")).to_have_text("done")
            rnd = rdetail.locator('#rounds .round[data-round="1"]')
            expect(rnd).to_contain_text("GOAL_ACHIEVED")
            expect(rnd).to_contain_text("R1 and R2 covered")
            expect(rnd).to_contain_text("nothing left")
            expect(rnd).to_contain_text("rita")
            reviewed = [e for e in producer.get(f"/tasks/{gid}/events")["events"] if e["type"] == "task.round_reviewed"]
            assert reviewed[0]["data"]["goal_clear"] is True and reviewed[0]["data"]["coverage"] == "R1 and R2 covered"

            # ---- the sign-in page too
            fresh = b.browser.new_context(viewport={"width": 1200, "height": 800})
            sp = fresh.new_page()
            sp.goto(srv.base + "/")
            expect(sp.locator("#signin")).to_be_visible()
            violations += _axe_serious(sp, axe, "sign-in")

            assert violations == [], "\n".join(violations)
            assert b.errors == [], b.errors
            b.browser.close()
    finally:
        people.close()
        srv.stop()


def test_a_producer_reassigns_from_the_task_page(db_url: str) -> None:
    _require_browser()
    srv = ServerProcess(db_url).start()
    people = People(srv)
    try:
        tid = people.work.create("Reassign me")
        with sync_playwright() as pw:
            b = Browser(pw)
            expect.set_options(timeout=WAIT_MS)
            pp = b.session(srv.base, people.tokens["producer"])
            pp.goto(srv.base + f"/#/tasks/{tid}")
            pp.fill("#reassign-to", "maker-1")
            pp.click("#act-reassign button[type=submit]")
            expect(pp.locator("#page-assignee")).to_have_text("maker-1")
            assert people.admin.get(f"/tasks/{tid}")["assignee"] == "maker-1"
            pp.fill("#reassign-to", "")
            pp.click("#act-reassign button[type=submit]")
            expect(pp.locator("#page-assignee")).to_have_text("anyone")
            rp = b.session(srv.base, people.tokens["reader"])
            rp.goto(srv.base + f"/#/tasks/{tid}")
            expect(rp.locator("#act-reassign")).to_have_count(0)
            assert b.errors == [], b.errors
            b.browser.close()
    finally:
        people.close()
        srv.stop()


def test_the_board_stays_usable_at_a_thousand_tasks(db_url: str) -> None:
    _require_browser()
    srv = ServerProcess(db_url).start()
    people = People(srv)
    proj = "big-" + uuid.uuid4().hex[:6]
    try:
        with httpx.Client(base_url=srv.base, headers={"Authorization": f"Bearer {people.tokens['producer']}"},
                          timeout=30) as http:
            for i in range(1000):
                r = http.post("/tasks", json={"id": f"B-{i:04d}", "project": proj, "title": f"bulk task {i}",
                                              "labels": ["even" if i % 2 == 0 else "odd"]})
                assert r.status_code == 201, r.text
        with sync_playwright() as pw:
            b = Browser(pw)
            expect.set_options(timeout=WAIT_MS)
            page = b.session(srv.base, people.tokens["reader"])
            pending = page.locator('.col[data-col="pending"]')
            expect(pending.locator("h3 .count")).to_have_text("1000")
            expect(pending.locator(".task")).to_have_count(50)  # paged: 50 cards drawn, not 1,000
            more = pending.locator("button.more")
            expect(more).to_have_text("Show 50 more (950 not shown)")
            more.click()
            expect(pending.locator(".task")).to_have_count(100)
            page.select_option("#f-label", "odd")
            expect(pending.locator("h3 .count")).to_have_text("500")
            page.fill("#f-q", "B-0777")
            expect(pending.locator(".task")).to_have_count(1)
            # the newest first, and live: a new task shows at the top of its column at once
            page.fill("#f-q", "")
            page.select_option("#f-label", "")
            people.apis["producer"].post("/tasks", {"id": "B-new", "project": proj, "title": "the newest"}, 201)
            expect(pending.locator(".task").first).to_have_attribute("data-id", "B-new")
            expect(pending.locator("h3 .count")).to_have_text("1001")
            # time travel over 1,000 tasks
            page.goto(srv.base + "/#/?as_of=500")
            expect(page.locator("#board")).to_have_attribute("data-as-of", "500")
            expect(pending.locator("h3 .count")).to_have_text("500")
            assert b.errors == [], b.errors
            b.browser.close()
    finally:
        people.close()
        srv.stop()
