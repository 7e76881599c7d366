"""The context inspector (issue #20) in a real browser: Debian's Chromium driven by Playwright, against the six
services as real processes. The `make run` demo conversation (trimmed pages, offloads, an in-loop fold and a
turn-start fold) is opened after a login with a key; the turn's chart has one point per step and the window and
trigger lines; a step's request shows the trim marker, whose link reads the full text back; a running turn's
page follows it live; another tenant's key sees 404. Each page is saved as a PNG (``CTX_UI_SHOTS``: a folder,
``make ui-shots`` sets bench/results/ui; else the test's temporary folder)."""

from __future__ import annotations

import io
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ctxbuild_orchestration.demo import PAGE, anomaly_position, generate_log, inspector_url, run_demo
from httpx_sse import connect_sse
from rich.console import Console

from tests.support.auth import AUTH

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("CTX_CHROMIUM", "/usr/bin/chromium")
# what the machine's probe runs Chromium with: as root (no sandbox), headless, and nothing that calls out
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 90_000  # Playwright's auto-waiting bound on a loaded 2-core machine (never a sleep)
TRACE_UI_URL = "http://127.0.0.1:16686/trace/{trace_id}"  # tests/e2e/conftest.py gives the edge this template


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ["CTX_UI_SHOTS"]) if os.environ.get("CTX_UI_SHOTS") else tmp_path_factory.mktemp("ui")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"Chromium is not installed at {CHROMIUM}: the inspector's browser tests need Debian's "
                    "chromium (`apt-get install -y chromium`; `make test` installs it when run as root)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def demo(stack, all_services) -> dict:
    """The `make run` demo's conversation, through the real edge."""
    return run_demo(all_services, Console(file=io.StringIO(), width=200), api_key=stack.env["CTX_API_KEY"])


def api(base: str, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else AUTH
    return httpx.Client(base_url=base, headers=headers, timeout=60)


def logged_in(browser, base: str, key: str, target: str):
    """A fresh browser context: open ``target``, get sent to the login page, log in, land back on ``target``."""
    from playwright.sync_api import expect

    ctx = browser.new_context(base_url=base, viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(WAIT_MS)
    page = ctx.new_page()
    page.goto(target)
    expect(page).to_have_url(re.compile(r"/ui/login\?next="))
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    expect(page).to_have_url(base + target)
    return ctx, page


def turn_ids(base: str, cid: str) -> list[str]:
    with api(base) as http:
        msgs = http.get(f"/v1/conversations/{cid}/messages").json()["messages"]
    return list(dict.fromkeys(m["turnId"] for m in msgs if m.get("turnId")))


def test_demo_conversation_chart_step_and_read_back(browser, demo, all_services, stack, shots):
    from playwright.sync_api import expect

    base, cid = all_services, demo["conversationId"]
    turns = turn_ids(base, cid)
    assert len(turns) == 3
    # the URL `make run` prints for the demo conversation
    ctx, page = logged_in(browser, base, stack.env["CTX_API_KEY"], inspector_url(base, cid).removeprefix(base))
    try:
        # the login page set an HttpOnly, SameSite=Strict cookie for /ui only
        cookie = next(c for c in ctx.cookies() if c["name"] == "ctx_ui_key")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
        assert page.evaluate("document.cookie") == ""  # not readable by scripts
        # 1. the conversation: its turns, its attachment, its archives and the message tree
        expect(page.get_by_test_id("turns").locator("tbody tr")).to_have_count(3)
        expect(page.get_by_test_id("attachments")).to_contain_text("service.log")
        expect(page.get_by_test_id("archives").locator("a.uri")).to_have_count(21)  # 20 pages + 1 transcript
        with api(base) as http:
            path = http.get(f"/v1/conversations/{cid}/messages").json()["messages"]
        expect(page.get_by_test_id("tree").locator("li.msg")).to_have_count(len(path))  # no branches: one path
        expect(page.get_by_test_id("tree").locator("li.msg.current")).to_have_count(len(path))
        page.screenshot(path=str(shots / "conversation.png"), full_page=True)
        page.goto("/ui/conversations")
        expect(page.get_by_test_id("conversations")).to_contain_text(cid)
        page.screenshot(path=str(shots / "conversations.png"), full_page=True)

        # 2. turn 2: the chart has one point per step, the window and trigger lines, and its markers
        tid = turns[1]
        with api(base) as http:
            events = http.get(f"/v1/conversations/{cid}/turns/{tid}").json()["events"]
        steps = [e["data"] for e in events if e["type"] == "StepServed"]
        page.goto(f"/ui/conversations/{cid}/turns/{tid}")
        expect(page.get_by_test_id("steps").locator("tbody tr")).to_have_count(len(steps))
        page.wait_for_function("() => window.inspectorChart && window.inspectorChart.data.labels.length > 0")
        chart = page.evaluate("""() => Object.fromEntries(window.inspectorChart.data.datasets.map(
            d => [d.label, d.data]))""")
        assert chart["served tokens"] == [s["servedTokens"] for s in steps]
        assert chart["window"] == [16_000] * len(steps)
        assert chart["compaction trigger"] == [12_800] * len(steps)
        assert len(chart["raw history tokens"]) == len(steps)
        assert all(r >= s for r, s in zip(chart["raw history tokens"], chart["served tokens"], strict=True))
        trimmed_steps = [i for i, v in enumerate(chart["outputs trimmed"]) if v is not None]
        folded_steps = [i for i, v in enumerate(chart["compaction (in-loop)"]) if v is not None]
        assert trimmed_steps and len(folded_steps) == 1
        page.screenshot(path=str(shots / "turn.png"), full_page=True)

        # 3. the step that first serves page 16 (the anomaly's page): its request shows the trim marker …
        page_no, _ = anomaly_position(generate_log())
        call = next(e["data"] for e in events if e["type"] == "ToolCallRequested"
                    and e["data"]["input"].get("offset") == (page_no - 1) * PAGE)
        result = next(e["data"] for e in events if e["type"] == "ToolResultRecorded"
                      and e["data"]["toolCallId"] == call["toolCallId"])
        uri = result["offload"]["uri"]
        step = call["step"] + 1
        page.get_by_test_id("steps").locator(f"tr[data-step='{step}'] a.step-link").click()
        expect(page).to_have_url(f"{base}/ui/conversations/{cid}/turns/{tid}/steps/{step}")
        trimmed = page.locator("li.rmsg.new", has=page.locator("mark.trim", has_text=uri))
        expect(trimmed).to_have_count(1)
        expect(trimmed).not_to_contain_text("temperature_c=21.1")  # the excerpt hides the anomaly
        expect(page.get_by_test_id("markers")).to_contain_text("trimmed")
        traceparent = next(e for e in events if e["type"] == "StepServed"
                           and e["data"]["step"] == step)["metadata"]["traceparent"]
        trace_id = traceparent.split("-")[1]
        expect(page.get_by_test_id("trace-link")).to_have_attribute("href", TRACE_UI_URL.format(trace_id=trace_id))
        page.screenshot(path=str(shots / "step.png"), full_page=False)
        # … and its link reads the full text back
        trimmed.locator("mark.trim a.uri").first.click()
        expect(page.get_by_test_id("readback")).to_contain_text("ERROR sensor-3 temperature_c=21.1")
        start = (page_no - 1) * PAGE
        expect(page.get_by_test_id("readback")).to_contain_text(generate_log()[start + 3000:start + 3200])
        page.screenshot(path=str(shots / "read-back.png"), full_page=False)

        # a compaction step shows its summary and the archive of the folded span
        fold = next(e["data"] for e in events if e["type"] == "CompactionDecided" and e["data"]["phase"] == "in-loop"
                    and e["data"]["status"] == "done")
        page.goto(f"/ui/conversations/{cid}/turns/{tid}/steps/{fold['step']}")
        box = page.get_by_test_id("compaction")
        expect(box).to_contain_text("in-loop compaction")
        expect(box).to_contain_text("Read the first half of service.log")  # the task, verbatim in the summary
        box.locator("p a.uri").first.click()
        expect(page.get_by_test_id("readback")).to_contain_text("read_file")
        # turn 3 was folded at turn start: its step 1 shows the stored summary and its transcript
        page.goto(f"/ui/conversations/{cid}/turns/{turns[2]}/steps/1")
        expect(page.get_by_test_id("compaction")).to_contain_text("turn-start compaction")
        page.screenshot(path=str(shots / "step-turn-start-compaction.png"), full_page=False)
    finally:
        ctx.close()


def test_another_tenant_sees_404(browser, demo, all_services, stack, shots):
    from playwright.sync_api import expect

    base, cid = all_services, demo["conversationId"]
    admin = {"Authorization": f"Bearer {stack.env['CTX_ADMIN_API_KEY']}"}
    r = httpx.post(f"{base}/v1/keys", headers=admin, json={"tenantId": "ui-other", "name": "inspector test"},
                   timeout=30)
    assert r.status_code == 201, r.text
    other = r.json()["key"]
    ctx, page = logged_in(browser, base, other, "/ui/conversations")
    try:
        expect(page.get_by_test_id("tenant")).to_have_text("ui-other")
        expect(page.locator("main")).not_to_contain_text(cid)
        tid = turn_ids(base, cid)[0]
        for path in (f"/ui/conversations/{cid}", f"/ui/conversations/{cid}/turns/{tid}",
                     f"/ui/conversations/{cid}/turns/{tid}/steps/1"):
            response = page.goto(path)
            assert response is not None and response.status == 404, path
            expect(page.locator("h1")).to_have_text("Not found")
        page.screenshot(path=str(shots / "other-tenant-404.png"))
        for path in (f"/ui/api/conversations/{cid}/turns/{tid}/timeline",
                     f"/ui/api/conversations/{cid}/turns/{tid}/events"):
            assert page.request.get(path).status == 404, path
        # the same answer as for a conversation that does not exist
        assert page.goto("/ui/conversations/conv_does_not_exist").status == 404
    finally:
        ctx.close()
    # without the cookie: the pages send to the login, the JSON endpoints answer 401
    anon = browser.new_context(base_url=base)
    try:
        assert anon.request.get(f"/ui/api/conversations/{cid}/turns/{tid}/timeline").status == 401
        assert anon.request.get(f"/ui/conversations/{cid}", max_redirects=0).status == 303
        bad = anon.request.post("/ui/login", form={"key": "ctx_0123456789abcdef_" + "x" * 43, "next": "/ui/"})
        assert bad.status == 401
    finally:
        anon.close()


def finished(http: httpx.Client, events_url: str) -> str:
    """The turn's terminal event type, followed over its SSE stream."""
    with connect_sse(http, "GET", events_url) as sse:
        for ev in sse.iter_sse():
            if ev.event in ("TurnCompleted", "TurnFailed"):
                return ev.event
    raise AssertionError("the event stream ended without a terminal event")


def test_branches_in_the_tree(browser, all_services, stack, shots):
    """A regenerated answer is a sibling branch: the tree shows both, the current path through the newest."""
    from playwright.sync_api import expect

    base = all_services
    with api(base) as http:
        cid = http.post("/v1/conversations", json={"title": "inspector branches"}).json()["id"]
        first = http.post(f"/v1/conversations/{cid}/turns", json={
            "text": "Pick a colour.", "provider": {"kind": "replay", "script": [{"text": "Blue."}]}}).json()
        assert finished(http, first["events"]) == "TurnCompleted"
        again = http.post(f"/v1/conversations/{cid}/turns/{first['turnId']}/regenerate", json={
            "provider": {"kind": "replay", "script": [{"text": "Green."}]}}).json()
        assert finished(http, again["events"]) == "TurnCompleted"
    ctx, page = logged_in(browser, base, stack.env["CTX_API_KEY"], f"/ui/conversations/{cid}")
    try:
        tree = page.get_by_test_id("tree")
        expect(tree.locator("li.msg")).to_have_count(3)  # the question and its two answers
        expect(tree.locator(".badge.branch")).to_have_text(["branch 1/2", "branch 2/2"])
        expect(tree.locator("li.msg.current")).to_have_count(2)
        expect(tree.locator("li.msg.current").last).to_contain_text("Green.")
        expect(page.get_by_test_id("turns")).to_contain_text(f"regenerates {first['turnId']}")
        page.screenshot(path=str(shots / "conversation-branches.png"))
    finally:
        ctx.close()


def test_running_turn_updates_live(browser, all_services, stack, fake_openai, shots):
    """A turn whose model answers only when the test says so: the page opened while it runs gains its steps
    and ends 'completed' from the SSE stream, without a reload."""
    from playwright.sync_api import expect

    base = all_services
    with api(base) as http:
        cid = http.post("/v1/conversations", json={"title": "inspector live",
                                                   "settings": {"contextWindow": 16_000}}).json()["id"]
        att = http.post(f"/v1/conversations/{cid}/attachments",
                        files={"file": ("notes.txt", ("note " * 400).encode(), "text/plain")})
        assert att.status_code == 201, att.text
        hold = threading.Event()
        fake_openai.hold_next = hold
        try:
            started = http.post(f"/v1/conversations/{cid}/turns", json={
                "text": "How long is notes.txt? (read_file handle: notes.txt)",
                "provider": {"kind": "openai", "model": "fake-model"}})
            assert started.status_code == 202, started.text
            tid = started.json()["turnId"]
            ctx, page = logged_in(browser, base, stack.env["CTX_API_KEY"], f"/ui/conversations/{cid}/turns/{tid}")
            try:
                expect(page.get_by_test_id("status")).to_have_text("running")
                expect(page.get_by_test_id("steps").locator("tbody tr")).to_have_count(0)
                page.evaluate("window.__notReloaded = true")
                page.screenshot(path=str(shots / "turn-live-running.png"))
                hold.set()  # the model answers: step 1 (read_file), then step 2 (the answer)
                expect(page.get_by_test_id("status")).to_have_text("completed")
                expect(page.get_by_test_id("steps").locator("tbody tr")).to_have_count(2)
                assert page.evaluate("window.__notReloaded") is True
                served = page.evaluate("""() => window.inspectorChart.data.datasets.find(
                    d => d.label === 'served tokens').data.length""")
                assert served == 2
                assert page.evaluate("""() => window.inspectorChart.data.datasets.some(
                    d => d.label === 'cache-read tokens')""")  # the fake reports cached tokens
                page.screenshot(path=str(shots / "turn-live-completed.png"))
            finally:
                ctx.close()
        finally:
            hold.set()
            fake_openai.hold_next = None
        log = http.get(f"/v1/conversations/{cid}/turns/{tid}").json()
        assert log["status"] == "completed", json.dumps(log.get("error"))
