"""The Python worker SDK (asyncflow.sdk) against the real v1 API, in process."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from asyncflow.sdk import Done, Job, NextStage, PollAgain, Retry, Worker
from examples.fake_media_service import FakeMediaService
from examples.video_worker import build_worker
from oss_api.app import create_app
from oss_api.testing import TestClient
from shared.config import Settings
from shared.flows import load_flows
from shared.scheduler import sweep_leases
from shared.testing import InProcess, wait_for

SUPPORT = Path(__file__).resolve().parents[1] / "support"
BASE = "http://testserver"


class Server:
    def __init__(self, home: Path, settings: Settings | None = None) -> None:
        app = InProcess(load_flows(SUPPORT / "flows.yaml"), home, settings=settings)
        self.runtime = app.runtime
        self.clock = app.clock
        self.http = TestClient(create_app(self.runtime))

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        answer = self.http.request(method, f"/v1/{path}", **kwargs).json()
        assert answer["code"] == 0, answer
        return answer

    def register(self, task_type: str = "video", **config: Any) -> None:
        self.call("POST", "register_task_type", json={"task_type_data": {"task_type": task_type, **config}})

    def create(self, content: str = "", task_type: str = "video", **data: Any) -> str:
        body = {"task_data": {"task_type": task_type, "task_content": content, **data}}
        return self.call("POST", "create_task", json=body)["task_id"]

    def task(self, task_id: str) -> dict[str, Any]:
        return self.call("GET", "get_task", params={"task_id": task_id})["task_data"]

    def worker(self, task_type: str = "video", **options: Any) -> Worker:
        return Worker(BASE, task_type, http=self.http, **options)


@pytest.fixture
def server(tmp_path: Path) -> Server:
    return Server(tmp_path)


def test_done_sets_success_with_content_and_log(server: Server) -> None:
    server.register()
    task_id = server.create('{"n": 2}')
    worker = server.worker(poll_interval=0.1)
    seen: list[Job] = []

    @worker.stage("")
    def square(job: Job) -> Done:
        seen.append(job)
        return Done({"square": job.content_json()["n"] ** 2}, log="squared")

    assert worker.run_once() == [Done({"square": 4}, log="squared")]
    assert (seen[0].task_id, seen[0].stage, seen[0].task_type) == (task_id, "", "video")
    task = server.task(task_id)
    assert (task["status"], task["task_content"], task["schedule_log"]) == (3, '{"square":4}', "[] done: squared")
    assert worker.run_once() == []  # nothing left to hold


def test_next_stage_and_poll_again_move_the_task(server: Server) -> None:
    server.register()
    task_id = server.create("a")
    worker = server.worker()
    polls = iter([True, False])

    @worker.stage("")
    def first(job: Job) -> NextStage:
        return NextStage("second", job.content + "b")

    @worker.stage("second")
    def second(job: Job) -> PollAgain | NextStage:
        if next(polls):
            return PollAgain(log="not yet")  # same stage, content kept
        return NextStage("third", job.content + "c", log="moved")

    @worker.stage("third")
    def third(job: Job) -> Done:
        return Done(job.content + "d")

    stages = []
    for _ in range(4):
        assert len(worker.run_once()) == 1
        task = server.task(task_id)
        stages.append((task["status"], task["task_stage"], task["task_content"]))
    assert stages == [(1, "second", "ab"), (1, "second", "ab"), (1, "third", "abc"), (3, "third", "abcd")]
    assert server.task(task_id)["schedule_log"].splitlines() == [
        "[] -> second", "[second] poll again: not yet", "[second] -> third: moved", "[third] done",
    ]


def test_an_exception_is_a_failed_attempt_retried_per_policy(server: Server) -> None:
    server.register(max_retry_num=1, max_retry_interval=-5)  # one retry, 5 s later
    task_id = server.create()
    worker = server.worker()
    attempts: list[int] = []

    @worker.stage("")
    def flaky(job: Job) -> Done:
        attempts.append(job.crt_retry_num)
        raise RuntimeError("service down")

    outcomes = worker.run_once()
    assert outcomes == [Retry("RuntimeError: service down")]
    task = server.task(task_id)
    assert (task["status"], task["crt_retry_num"]) == (1, 1)  # pending again, retry counted
    assert worker.run_once() == []  # not before the retry interval
    server.clock.advance(5)
    assert len(worker.run_once()) == 1
    task = server.task(task_id)
    assert (task["status"], attempts) == (4, [0, 1])  # max_retry_num spent: failed for good
    assert task["schedule_log"].splitlines() == [
        "[] attempt 0 failed: RuntimeError: service down",
        "[] attempt 1 failed: RuntimeError: service down",
    ]


def test_retry_outcome_and_missing_stage_handler_fail_the_attempt(server: Server) -> None:
    server.register(max_retry_num=0)
    asked = server.create()
    unknown = server.create(task_stage="nobody_handles_this")
    worker = server.worker()

    @worker.stage("")
    def give_up(job: Job) -> Retry:
        return Retry("quota exceeded")

    assert len(worker.run_once()) == 2
    assert server.task(asked)["status"] == 4
    assert server.task(asked)["schedule_log"] == "[] attempt 0 failed: quota exceeded"
    task = server.task(unknown)
    assert task["status"] == 4
    assert "no handler for stage 'nobody_handles_this'" in task["schedule_log"]


def test_oversized_content_is_a_failed_attempt_not_a_stuck_lease(server: Server) -> None:
    server.register(max_retry_num=0)
    task_id = server.create()
    worker = server.worker()
    worker.stage("")(lambda job: Done("x" * 5000))
    worker.run_once()
    task = server.task(task_id)
    assert task["status"] == 4 and "over the 4096 limit" in task["schedule_log"]


def test_no_hold_while_the_backlog_is_full(server: Server) -> None:
    server.register(schedule_limit=1)
    first = server.create("1")
    server.clock.advance(1)  # an earlier order_time: the first is leased first
    second = server.create("2")
    worker = server.worker(max_threads=1, backlog_limit=1)
    release, started = threading.Event(), threading.Event()

    @worker.stage("")
    def blocking(job: Job) -> Done:
        started.set()
        assert release.wait(5)
        return Done()

    futures = worker.poll()  # leases the first task; its job blocks
    assert started.wait(5) and worker.backlog == 1
    assert worker.run_once() == []  # backlog full: no hold_tasks at all
    assert worker.poll() == []
    assert [server.task(t)["status"] for t in (first, second)] == [2, 1]  # the second is still pending
    release.set()
    assert [f.result(5) for f in futures] == [Done()]
    wait_for(lambda: worker.backlog == 0, 5, "an empty backlog")
    assert len(worker.run_once()) == 1
    assert [server.task(t)["status"] for t in (first, second)] == [3, 3]


def test_run_polls_until_stopped_and_drains(server: Server) -> None:
    server.register()
    ids = [server.create(str(n)) for n in range(5)]
    worker = server.worker(max_threads=2, poll_interval=0.05)
    worker.stage("")(lambda job: Done(job.content + "!"))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    try:
        wait_for(lambda: all(server.task(t)["status"] == 3 for t in ids), 5, "every task done")
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert [server.task(t)["task_content"] for t in ids] == ["0!", "1!", "2!", "3!", "4!"]


def test_poll_interval_comes_from_the_task_type(server: Server) -> None:
    server.register(schedule_interval=3)
    assert server.worker().resolve_poll_interval() == 3.0
    assert server.worker("unregistered").resolve_poll_interval() == 1.0


def test_the_video_example_end_to_end(server: Server) -> None:
    with FakeMediaService(duration=0.2) as media:
        worker = build_worker(BASE, media.url, http=server.http, max_threads=2)
        worker.register_task_type(schedule_interval=1, max_retry_num=3)
        good = server.create('{"source": "http://cdn.example/cat.mp4"}')
        bad = server.create('{"source": "http://cdn.example/reject-me.mp4"}')

        def finished() -> bool:
            worker.run_once()
            return all(server.task(t)["status"] == 3 for t in (good, bad))

        wait_for(finished, 10, "the worker to finish")

    task = server.task(good)
    content = json.loads(task["task_content"])
    assert content["approved"] is True and content["source"] == "http://cdn.example/cat.mp4"
    assert content["url"] == f"{media.url}/media/{content['transcode_job']}/cat.mp4.m3u8"
    log = task["schedule_log"].splitlines()
    assert log[0].startswith("[] -> check_moderation: moderation job ")
    assert log[1].startswith("[check_moderation] -> check_transcode: transcode job ")
    assert log[2] == "[check_transcode] done: transcoded"
    rejected = server.task(bad)
    assert json.loads(rejected["task_content"]).keys() == {"source", "moderation_job", "approved"}
    assert json.loads(rejected["task_content"])["approved"] is False
    assert rejected["schedule_log"].splitlines()[-1] == "[check_moderation] done: rejected by moderation"


def test_stop_hands_back_jobs_still_queued_after_the_drain_timeout(server: Server) -> None:
    server.register(schedule_limit=2)
    first = server.create("1")
    server.clock.advance(1)  # an earlier order_time: the first is leased first
    second = server.create("2")
    worker = server.worker(max_threads=1, poll_interval=0.05, drain_timeout=0.1)
    release, started = threading.Event(), threading.Event()

    @worker.stage("")
    def blocking(job: Job) -> Done:
        started.set()
        assert release.wait(5)
        return Done()

    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert started.wait(5)
        worker.stop()
        thread.join(5)
        assert not thread.is_alive()  # returned after drain_timeout, the first job still running
        assert [server.task(t)["status"] for t in (first, second)] == [2, 1]
        assert server.task(second)["schedule_log"] == "released: worker stopping"
    finally:
        release.set()
    wait_for(lambda: server.task(first)["status"] == 3, 5, "the first task done")


def test_a_worker_with_heartbeats_reports_each_running_job_alive_until_it_is_done(tmp_path: Path) -> None:
    server = Server(tmp_path, Settings(home=tmp_path, heartbeat_interval=0.05))  # heartbeat timeout 0.15 s
    server.register(max_processing_time=3600)
    task_id = server.create()
    service = server.runtime.pull_service

    def beats() -> float:
        return REGISTRY.get_sample_value("asyncflow_v1_reports_total", {"task_type": "video", "status": "2"}) or 0.0

    worker = server.worker(poll_interval=0.1, heartbeat=True)

    @worker.stage("")
    def slow(job: Job) -> Done:
        for n in range(1, 4):
            # Each heartbeat renews the lease: time passes on the server, the lease holds.
            # Beats are sequential, so the second one counted after this mark began after
            # the last advance of the clock and renewed the lease at the clock's present
            # time; the first one counted may have read the clock before that advance.
            mark = beats()
            wait_for(lambda mark=mark: beats() >= mark + 2, 10, f"heartbeat {n}")
            server.clock.advance(0.1)
            assert sweep_leases(service, server.clock()) == 0
        return Done(log="long work")

    assert worker.run_once() == [Done(log="long work")]
    data = server.task(task_id)
    assert data["status"] == 3, data
    settled = beats()
    time.sleep(0.2)  # a heartbeat still due after the outcome would show up now
    assert beats() == settled
