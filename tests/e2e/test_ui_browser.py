"""The dashboard in a real browser (Debian's Chromium through Playwright) against real processes.

An API, a scheduler and a worker run on the embedded backend with API keys on;
the tests sign in through the login form as an operator would. Screenshots of
each page go to $UI_SCREENSHOTS_DIR (default: <tmp>/asyncflow-ui-screenshots).

Locally the tests skip when Playwright or /usr/bin/chromium is missing; under
CI=true they fail instead (.ci/run installs the chromium package).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import require_service
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack

CHROMIUM = Path("/usr/bin/chromium")
ADMIN_KEY = "ui-admin-key-0001"
READER_KEY = "ui-reader-key-0001"
WAIT_MS = 30_000

pytestmark = pytest.mark.timeout(180)


def _browser_problem() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install -e '.[test]')"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    return None


if _browser_problem() is None:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
else:  # pragma: no cover - only without the browser
    Browser = Page = Any


@pytest.fixture(scope="module")
def shots() -> Path:
    where = Path(os.environ.get("UI_SCREENSHOTS_DIR") or Path(tempfile.gettempdir()) / "asyncflow-ui-screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_service("Chromium", _browser_problem())
    env = {"ASYNCFLOW_API_KEYS": f"{ADMIN_KEY}=root:admin,{READER_KEY}=ann"}
    with open_stack("embedded", tmp_path_factory.mktemp("ui"), env=env, groups=[["alpha", "beta", "monitor"]]) as s:
        yield s


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Browser]:
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def signed_in(browser: Browser, stack: Stack, key: str) -> Page:
    context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=stack.url)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/ui")
    expect(page).to_have_url(f"{stack.url}/ui/login?next=%2Fui")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(f"{stack.url}/ui")
    return page


@pytest.fixture
def admin(browser: Browser, stack: Stack) -> Iterator[Page]:
    page = signed_in(browser, stack, ADMIN_KEY)
    yield page
    page.context.close()


def api(stack: Stack, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    response = httpx.request(
        method, stack.url + path, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    assert response.status_code < 300, response.text
    return response.json()


def submit(stack: Stack, flow: str = "three", user: str | None = None, **parameters: Any) -> str:
    body: dict[str, Any] = {"flow": flow, "parameters": parameters}
    if user:
        body["user_id"] = user
    return str(api(stack, "POST", "/api/tasks", body)["task_id"])


def status_pill(page: Page) -> Any:
    return page.locator(".taskhead .pill")


def test_a_task_succeeds_live_on_its_page_and_another_compensates(
    admin: Page, stack: Stack, shots: Path, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    running = submit(stack, wait_for_file={"1": str(release)})
    admin.goto(f"/ui/tasks/{running}")
    expect(status_pill(admin)).to_have_text("running")
    expect(admin.locator(".timeline tr.oc-running")).to_contain_text("beta.step")
    admin.screenshot(path=str(shots / "task-running.png"), full_page=True)
    admin.evaluate("window.notReloaded = true")
    release.touch()
    # The page follows the task by itself: same document, new state.
    expect(status_pill(admin)).to_have_text("success")
    assert admin.evaluate("window.notReloaded") is True
    expect(admin.locator(".timeline tr.oc-succeeded")).to_have_count(3)
    admin.screenshot(path=str(shots / "task-succeeded.png"), full_page=True)

    failing = submit(stack, fail_at=[2])
    admin.goto(f"/ui/tasks/{failing}")
    expect(status_pill(admin)).to_have_text("failed")
    expect(admin.locator(".why")).to_contain_text("forced failure at step 2")
    lane = admin.get_by_label("Rollback path")
    expect(lane.locator(".box.rb.st-succeeded")).to_have_count(3)  # the failed step's own, then 2, then 1
    expect(admin.locator(".timeline tr.rb")).to_have_count(3)
    expect(admin.locator(".timeline tr.detail")).to_contain_text("forced failure at step 2")
    admin.screenshot(path=str(shots / "task-compensated.png"), full_page=True)


def test_cancel_a_running_task_from_its_page(admin: Page, stack: Stack, tmp_path: Path) -> None:
    release = tmp_path / "release"
    task_id = submit(stack, wait_for_file={"1": str(release)})
    admin.goto(f"/ui/tasks/{task_id}")
    expect(status_pill(admin)).to_have_text("running")
    # The task is running from its first step on: cancel once step 1 waits, so that
    # both steps have run and both are compensated.
    expect(admin.locator(".timeline tr.oc-running")).to_contain_text("beta.step")
    admin.once("dialog", lambda dialog: dialog.accept())
    admin.get_by_role("button", name="Cancel task").click()
    expect(admin.locator(".notice")).to_contain_text("Task cancelled")
    release.touch()  # the attempt in flight ends; then its step and step 1 are compensated
    expect(status_pill(admin)).to_have_text("cancelled")
    expect(admin.get_by_label("Rollback path").locator(".box.rb.st-succeeded")).to_have_count(2)


def test_resume_an_alarm_with_corrected_parameters(admin: Page, stack: Stack, shots: Path) -> None:
    task_id = submit(stack, fail_at=[1], fail_rollback_at=[0])
    admin.goto("/ui/alarms")
    row = admin.locator("tr", has=admin.get_by_role("link", name=task_id))
    # The alarms page refreshes itself: the task appears once its compensation has failed.
    expect(row).to_contain_text("forced rollback failure at step 0", timeout=60_000)
    admin.screenshot(path=str(shots / "alarms.png"), full_page=True)
    row.get_by_role("link", name=task_id).click()
    expect(status_pill(admin)).to_have_text("rollback failed")
    admin.get_by_text("with corrected parameters").last.click()
    admin.get_by_label("Parameter corrections (JSON object)").last.fill('{"fail_rollback_at": []}')
    admin.get_by_role("button", name="Resume the rollback").click()
    expect(admin.locator(".notice")).to_contain_text("Task resumed")
    expect(status_pill(admin)).to_have_text("failed")
    expect(admin.locator("table.events")).to_contain_text("resume")
    expect(admin.locator("table.events")).to_contain_text("fail_rollback_at")


def test_filter_the_list_by_parameter_and_status(admin: Page, stack: Stack, shots: Path) -> None:
    wanted = submit(stack, flow="noop", order="A-1")
    other = submit(stack, flow="noop", order="B-2")
    admin.goto("/ui")
    admin.get_by_label("Parameter").fill("order=A-1")
    admin.get_by_role("button", name="Filter").click()
    expect(admin.get_by_role("link", name=wanted)).to_be_visible()
    expect(admin.get_by_role("link", name=other)).to_have_count(0)
    admin.goto("/ui")
    admin.get_by_label("Status").select_option("failed")
    admin.get_by_role("button", name="Filter").click()
    expect(admin.locator("table.tasks tbody tr").first).to_contain_text("failed")
    expect(admin.get_by_role("link", name=wanted)).to_have_count(0)
    admin.goto("/ui")
    expect(admin.locator("#counts .count.st-success .n")).not_to_have_text("0")
    admin.screenshot(path=str(shots / "tasks.png"), full_page=True)


def test_a_read_only_key_sees_its_own_tasks_and_is_refused_actions(
    browser: Browser, stack: Stack, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    theirs = submit(stack, user="ann", wait_for_file={"0": str(release)})
    not_theirs = submit(stack, flow="noop")
    reader = signed_in(browser, stack, READER_KEY)
    try:
        expect(reader.locator(".role")).to_have_text("ann · read-only")
        expect(reader.get_by_role("link", name=theirs)).to_be_visible()
        expect(reader.get_by_role("link", name=not_theirs)).to_have_count(0)
        reader.get_by_role("link", name=theirs).click()
        expect(reader.get_by_role("button", name="Cancel task")).to_have_count(0)
        # A hand-made form with this browser's own token: the server still refuses it.
        reader.evaluate(
            """(taskId) => {
                const form = document.createElement("form");
                form.method = "post";
                form.action = "/ui/tasks/" + taskId + "/cancel";
                form.appendChild(document.querySelector("input[name=csrf]").cloneNode());
                document.body.appendChild(form);
                form.submit();
            }""",
            theirs,
        )
        expect(reader.locator("main")).to_contain_text("read-only: actions need an admin key")
        assert api(stack, "GET", f"/api/tasks/{theirs}")["status_name"] == "running"
    finally:
        release.touch()
        reader.context.close()


def test_flows_schedules_v1_and_login_pages_render(admin: Page, browser: Browser, stack: Stack, shots: Path) -> None:
    api(stack, "POST", "/api/schedules", {"schedule_id": "nightly-noop", "flow": "noop", "cron": "0 2 * * *",
                                          "note": "nightly check"})
    api(stack, "POST", "/v1/register_task_type", {"task_type_data": {"task_type": "checksum", "schedule_limit": 5}})
    admin.goto("/ui/flows?window=1h")
    expect(admin.locator("section.flow").first).to_be_visible()
    expect(admin.locator("section.flow", has_text="three").locator("table.stats")).to_contain_text("alpha.undo")
    admin.screenshot(path=str(shots / "flows.png"), full_page=True)
    admin.goto("/ui/schedules")
    admin.get_by_role("link", name="nightly-noop").click()
    admin.get_by_role("button", name="Trigger now").click()
    expect(admin.locator(".notice")).to_contain_text("Triggered")
    expect(admin.locator("table.tasks tbody tr").first).to_contain_text("fired")
    admin.screenshot(path=str(shots / "schedule.png"), full_page=True)
    admin.goto("/ui/schedules")
    admin.screenshot(path=str(shots / "schedules.png"), full_page=True)
    admin.goto("/ui/v1")
    expect(admin.locator("table.tasks")).to_contain_text("checksum")
    admin.screenshot(path=str(shots / "v1.png"), full_page=True)
    anonymous = browser.new_page(base_url=stack.url)
    anonymous.goto("/ui/login")
    anonymous.screenshot(path=str(shots / "login.png"))
    anonymous.context.close()


def test_the_workers_page_shows_the_worker_and_its_attempt_in_flight(
    admin: Page, stack: Stack, tmp_path: Path, shots: Path
) -> None:
    release = tmp_path / "release"
    task_id = submit(stack, wait_for_file={"1": str(release)})
    admin.goto("/ui/workers")
    row = admin.locator("tr", has=admin.locator("td.id", has_text="beta"))
    expect(row).to_contain_text("asyncflow.beta")
    # The registry row is renewed every heartbeat interval: the page refreshes until it shows the attempt.
    expect(row.locator(f'a[href="/ui/tasks/{task_id}"]')).to_be_visible(timeout=15_000)
    expect(admin.locator("td", has_text="alpha, beta, monitor").first).to_be_visible()
    admin.screenshot(path=str(shots / "workers.png"), full_page=True)
    release.touch()
