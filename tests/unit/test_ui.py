"""The dashboard over the in-process runtime: pages, filters, actions, sign-in and the cross-site guard.

The browser tests (tests/e2e/test_ui_browser.py) drive the same pages through
Chromium against real processes; these check the rules quickly and on every run.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from oss_api.testing import TestClient, open_client
from oss_api.ui import timeline, workers
from oss_api.ui.stats import percentile, step_stats
from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import load_flows
from shared.scheduler.sweeps import sweep_tasks
from shared.states import StepType
from shared.storage import AttemptRecord
from shared.storage.base import ProcessRecord
from shared.testing import InProcess
from tests.support.asgi import post_cut_short

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ADMIN_KEY = "admin-key-0001"
READER_KEY = "reader-key-0001"


@dataclass
class Ui:
    client: TestClient
    app: InProcess

    def submit(self, **parameters: Any) -> str:
        r = self.client.post("/api/tasks", json={"flow": "three", "parameters": parameters},
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 201, r.text
        return str(r.json()["task_id"])

    def drain(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.syspath_prepend(str(SUPPORT))
        testmod = importlib.import_module("testmod")
        consumer = StepConsumer(
            self.app.runtime.service, {"alpha": testmod.alpha, "beta": testmod.beta},
            self.app.runtime.settings, clock=self.app.clock,
        )
        while True:
            while self.app.publisher.messages:
                self.app.clock.advance(0.5)
                consumer.handle(self.app.publisher.messages.popleft())
            self.app.clock.advance(5.0)  # past any retry delay: the scheduler publishes what is due
            if not sweep_tasks(self.app.runtime.service, self.app.clock.now):
                return

    def sign_in(self, key: str, expect: int = 303) -> None:
        token = csrf(self.client.get("/ui/login"))
        r = self.client.post("/ui/login", data={"csrf": token, "key": key, "next": "/ui"},
                             headers=SAME_ORIGIN, follow_redirects=False)
        assert r.status_code == expect, r.text

    def post(self, path: str, **fields: Any) -> Any:
        page = self.client.get("/ui")
        return self.client.post(path, data={"csrf": csrf(page), **fields}, headers=SAME_ORIGIN,
                                follow_redirects=True)


SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}


def csrf(response: Any) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]{32})"', response.text)
    assert found, response.text[:500]
    return found.group(1)


@pytest.fixture
def ui(tmp_path: Path) -> Iterator[Ui]:
    settings = Settings(home=tmp_path, api_keys=f"{ADMIN_KEY}=root:admin,{READER_KEY}=ann")
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path, settings=settings)
    with open_client(app.runtime) as client:
        yield Ui(client, app)


def test_pages_need_a_key_and_the_login_form_keeps_it_in_an_httponly_cookie(ui: Ui) -> None:
    r = ui.client.get("/ui/tasks/x", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login?next=%2Fui%2Ftasks%2Fx"
    ui.sign_in("wrong-key-123", expect=401)
    assert "asyncflow_key" not in ui.client.cookies
    token = csrf(ui.client.get("/ui/login"))
    r = ui.client.post("/ui/login", data={"csrf": token, "key": ADMIN_KEY, "next": "https://evil.example/"},
                       headers=SAME_ORIGIN, follow_redirects=False)
    assert r.headers["location"] == "/ui"  # no open redirect
    cookie = r.headers["set-cookie"]
    assert "asyncflow_key=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    page = ui.client.get("/ui")
    assert page.status_code == 200 and "root · admin" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_the_list_filters_and_links_each_task_to_its_page(ui: Ui, monkeypatch: pytest.MonkeyPatch) -> None:
    ui.sign_in(ADMIN_KEY)
    ok = ui.submit(order={"id": 7})
    bad = ui.submit(fail_at=[1], order={"id": 8})
    ui.drain(monkeypatch)
    listed = ui.client.get("/ui").text
    assert f'href="/ui/tasks/{ok}"' in listed and f'href="/ui/tasks/{bad}"' in listed
    failed = ui.client.get("/ui", params={"status": "failed"}).text
    assert bad in failed and ok not in failed
    by_parameter = ui.client.get("/ui", params={"param": "order.id=7"}).text
    assert ok in by_parameter and bad not in by_parameter
    assert "expected a UTC time" in ui.client.get("/ui", params={"from": "yesterday"}).text


def test_the_task_page_shows_why_it_failed_and_the_rollback_path(ui: Ui, monkeypatch: pytest.MonkeyPatch) -> None:
    ui.sign_in(ADMIN_KEY)
    task_id = ui.submit(fail_at=[1])
    ui.drain(monkeypatch)
    page = ui.client.get(f"/ui/tasks/{task_id}").text
    assert "forced failure at step 1" in page
    assert 'aria-label="Rollback path"' in page and "alpha.undo" in page
    assert page.count('class="rb oc-succeeded"') == 2  # beta.undo then alpha.undo, drawn as rollback rows
    assert "Retry from the failed step" in page
    assert "data-refresh" not in page  # ended: no live updates


def test_admin_retries_with_corrected_parameters_and_the_history_shows_it(
    ui: Ui, monkeypatch: pytest.MonkeyPatch
) -> None:
    ui.sign_in(ADMIN_KEY)
    task_id = ui.submit(fail_at=[1])
    ui.drain(monkeypatch)
    r = ui.post(f"/ui/tasks/{task_id}/retry", parameters='{"fail_at": []}')
    assert "Task retried" in r.text
    ui.drain(monkeypatch)
    page = ui.client.get(f"/ui/tasks/{task_id}").text
    assert "st-success" in page and "Operator actions" in page and "root" in page
    r = ui.post(f"/ui/tasks/{task_id}/retry", parameters="[1]")
    assert "must be a JSON object" in r.text


def test_a_read_only_key_sees_only_its_tasks_and_cannot_act(ui: Ui, monkeypatch: pytest.MonkeyPatch) -> None:
    task_id = ui.submit()
    ui.sign_in(READER_KEY)
    assert task_id not in ui.client.get("/ui").text  # root's task
    assert ui.client.get(f"/ui/tasks/{task_id}").status_code == 404
    r = ui.post(f"/ui/tasks/{task_id}/cancel")
    assert r.status_code == 403 and "read-only" in r.text


def test_actions_from_another_site_or_without_the_token_are_refused(ui: Ui) -> None:
    ui.sign_in(ADMIN_KEY)
    task_id = ui.submit()
    token = csrf(ui.client.get("/ui"))
    path = f"/ui/tasks/{task_id}/cancel"
    cross = ui.client.post(path, data={"csrf": token}, headers={"Sec-Fetch-Site": "cross-site"})
    assert cross.status_code == 403 and "cross-site" in cross.text
    other_origin = ui.client.post(path, data={"csrf": token}, headers={"Origin": "https://evil.example"})
    assert other_origin.status_code == 403
    no_token = ui.client.post(path, data={"csrf": "0" * 32}, headers=SAME_ORIGIN)
    assert no_token.status_code == 403
    assert ui.app.runtime.service.get(task_id).status.label == "pending"


def test_a_form_the_browser_cut_short_is_answered_not_raised(ui: Ui) -> None:
    headers = [(b"content-type", b"application/x-www-form-urlencoded"), (b"sec-fetch-site", b"same-origin")]
    status, page = asyncio.run(post_cut_short(ui.client.app, "/ui/login", headers, b"csrf=0123&key=ad"))
    assert status == 400 and b"the form ended early: the browser disconnected" in page


def test_bulk_cancel_reports_each_refusal(ui: Ui) -> None:
    ui.sign_in(ADMIN_KEY)
    ids = [ui.submit(), ui.submit()]
    r = ui.post("/ui/tasks/bulk", action="cancel", task_id=[*ids, "nope"], back="/ui")
    assert "2 of 3 task(s) cancelled" in r.text and "nope" in r.text
    assert {ui.app.runtime.service.get(i).status.label for i in ids} == {"cancelled"}


def test_every_page_renders_and_none_is_in_the_openapi_schema(ui: Ui, monkeypatch: pytest.MonkeyPatch) -> None:
    ui.sign_in(ADMIN_KEY)
    ui.submit(fail_at=[1], fail_rollback_at=[0])
    ui.drain(monkeypatch)
    for path in ("/ui", "/ui/alarms", "/ui/flows?window=7d", "/ui/schedules", "/ui/v1", "/ui/static/style.css"):
        assert ui.client.get(path).status_code == 200, path
    assert "forced rollback failure at step 0" in ui.client.get("/ui/alarms").text
    assert ui.client.get("/ui/tasks/nope").status_code == 404
    schema = ui.client.get("/openapi.json").json()
    assert not [p for p in schema["paths"] if p.startswith("/ui")]


def test_step_stats_count_ended_attempts_and_take_nearest_rank_percentiles() -> None:
    def attempt(seq: int, outcome: str | None, seconds: float, kind: StepType = StepType.NORMAL) -> AttemptRecord:
        return AttemptRecord("t", seq, 0, kind, 1, "m", "c", started_at=0.0, ended_at=seconds, outcome=outcome)

    figures = step_stats(
        [attempt(1, "succeeded", 1.0), attempt(2, "failed", 3.0), attempt(3, "succeeded", 2.0),
         attempt(4, None, 9.0), attempt(5, "poll_later", 9.0), attempt(6, "succeeded", 5.0, StepType.ROLLBACK)]
    )
    normal = figures[(0, StepType.NORMAL)]
    assert (normal.attempts, normal.succeeded, normal.p50, normal.p99) == (3, 2, 2.0, 3.0)
    assert figures[(0, StepType.ROLLBACK)].success_rate == 1.0
    assert percentile([], 50) is None


def test_the_timeline_shows_a_retry_waiting_for_its_delay(ui: Ui, monkeypatch: pytest.MonkeyPatch) -> None:
    task_id = ui.submit(flaky={"1": 1})
    monkeypatch.syspath_prepend(str(SUPPORT))
    testmod = importlib.import_module("testmod")
    consumer = StepConsumer(ui.app.runtime.service, {"alpha": testmod.alpha, "beta": testmod.beta},
                            ui.app.runtime.settings, clock=ui.app.clock)
    for _ in range(2):  # step 1 succeeds, step 2 fails its first attempt
        consumer.handle(ui.app.publisher.messages.popleft())
    task = ui.app.runtime.service.get(task_id)
    found = timeline.rows(task, ui.app.runtime.service.attempts(task_id), ui.app.clock.now)
    assert [(r.label, r.attempt, r.outcome) for r in found] == [
        ("1 alpha.step", 1, "succeeded"), ("2 beta.step", 1, "failed"), ("2 beta.step", 2, "waiting"),
    ]
    assert found[-1].backoff == 0.2 and found[-1].due_at is not None
    bars = timeline.bars(found, task.created_at, ui.app.clock.now + 1)
    assert all(0 <= b.wait_x <= 100 and b.run_x + b.run_w <= 100.5 for b in bars)


# --- workers and queues -----------------------------------------------------------------------


def worker_row(pid: int, seen_at: float, modules: list[str], stopped_at: float | None = None,
               in_flight: list[dict[str, Any]] | None = None, waits: list[tuple[str, float]] | None = None
               ) -> ProcessRecord:
    samples = [["asyncflow_step_queue_wait_seconds_bucket", {"module": m, "le": le}, n]
               for m in modules for le, n in (waits or [])]
    metrics = [{"name": "asyncflow_step_queue_wait_seconds", "type": "histogram", "help": "", "samples": samples}]
    return ProcessRecord(
        process_id=f"worker@h:{pid}", role="worker", host="h", pid=pid, started_at=seen_at - 60, seen_at=seen_at,
        detail={"modules": modules, "concurrency": 2, "in_flight": in_flight or []}, metrics=metrics,
        stopped_at=stopped_at,
    )


def test_queue_wait_quantiles_are_the_bounds_of_their_buckets() -> None:
    cumulative = [("0.005", 50.0), ("0.01", 90.0), ("0.1", 99.0), ("+Inf", 100.0)]
    waits = workers.queue_waits([{
        "name": "asyncflow_step_queue_wait_seconds", "type": "histogram", "help": "",
        "samples": [["asyncflow_step_queue_wait_seconds_bucket", {"module": "alpha", "le": le}, n]
                    for le, n in cumulative],
    }])
    assert waits == {"alpha": (0.005, 0.1)}
    assert workers.quantile([], 0.5) is None


def test_module_rows_list_the_live_workers_of_each_module_and_leave_the_silent_out() -> None:
    now, interval = 1000.0, 5.0
    live = worker_row(1, now - 2, ["alpha"], in_flight=[{"task_id": "t1", "module": "alpha", "command": "step"}],
                      waits=[("0.01", 3.0), ("+Inf", 4.0)])
    silent = worker_row(2, now - 16, ["alpha", "beta"])  # missed three heartbeats
    stopped = worker_row(3, now - 1, ["beta"], stopped_at=now - 1)
    rows = workers.module_rows(["beta", "alpha"], [live, silent, stopped], now, interval, {"asyncflow.alpha": 7})
    assert [(r.module, r.depth, [w.pid for w in r.workers]) for r in rows] == [("alpha", 7, [1]), ("beta", None, [])]
    assert rows[0].wait_p50 == 0.01
    shown, gone = workers.split([live, silent, stopped], now, interval)
    assert [p.pid for p in shown] == [1] and sorted(p.pid for p in gone) == [2, 3]


def test_the_workers_page_shows_each_module_its_workers_and_their_attempts(ui: Ui) -> None:
    ui.sign_in(ADMIN_KEY)
    store = ui.app.runtime.process_store
    now = time.time()  # registry rows are wall-clock times (shared.presence)
    store.register(worker_row(4242, now, ["alpha", "beta"],
                              in_flight=[{"task_id": "task-in-flight-1", "module": "alpha", "command": "step"}]))
    html = ui.client.get("/ui/workers").text
    assert "Workers and queues" in html and "asyncflow.alpha" in html and "h:4242" in html
    assert '<a href="/ui/tasks/task-in-flight-1">' in html
    assert 'href="/ui/workers" class="here"' in html
