"""A Python worker for Asyncflow v1 pull-mode tasks (seed 001 §一–§三).

A worker leases tasks of one type with ``/v1/hold_tasks``, runs the handler of
each task's stage in a bounded thread pool, and reports with ``/v1/set_task``.
A handler runs *one* stage and hands the task back (seed 001 §一: a task must
not hold a worker for long); the server re-queues it for its next stage::

    from asyncflow.sdk import Done, Job, NextStage, PollAgain, Worker

    worker = Worker("http://127.0.0.1:8000", "video", max_threads=8)

    @worker.stage("")                      # a task created without a stage
    def submit(job: Job) -> NextStage:
        job_id = start_moderation(job.content_json()["source"])
        return NextStage("check", {"job": job_id})

    @worker.stage("check")
    def check(job: Job) -> Done | PollAgain:
        result = moderation_result(job.content_json()["job"])
        return PollAgain() if result is None else Done({"result": result})

    worker.run()                           # until worker.stop() or Ctrl-C

What a handler returns becomes the task's status:

============================  ===============================================
``Done(content, log)``        3 success
``NextStage(stage, content)`` 1 pending at ``stage`` (the next stage)
``PollAgain(content, log)``   1 pending at the same stage: look again later
``Retry(log)`` or an error    4: a failed attempt, retried by the server
                              per the type's max_retry_num/max_retry_interval
============================  ===============================================

A task whose stage has no handler is a failed attempt too. Content may be a
``str`` or anything JSON-serialisable (sent as compact JSON).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeAlias

import httpx

__all__ = ["ApiError", "Done", "Job", "NextStage", "Outcome", "PollAgain", "Retry", "Worker"]

log = logging.getLogger(__name__)

# The server's limits (shared.pull.MAX_CONTENT_BYTES / MAX_LOG_BYTES, counted in
# characters): checked here so an oversized report becomes a failed attempt now
# instead of a refused set_task that leaves the task leased until it times out.
MAX_CONTENT = 4096
MAX_LOG = 4096
PENDING, RUNNING, SUCCESS, FAILED = 1, 2, 3, 4
MIN_POLL_INTERVAL = 0.05  # schedule_interval 0 means "poll often", not "spin"


class ApiError(Exception):
    """The server answered with a ``code`` other than 0."""


@dataclass(frozen=True)
class Job:
    """One leased task, as a handler sees it."""

    task_id: str
    task_type: str
    stage: str
    content: str
    user_id: str = ""
    crt_retry_num: int = 0
    max_retry_num: int = 0
    schedule_log: str = ""

    def content_json(self) -> Any:
        """The content parsed as JSON; an empty content is ``{}``."""
        return json.loads(self.content) if self.content else {}


@dataclass(frozen=True)
class Done:
    content: Any = None
    log: str | None = None


@dataclass(frozen=True)
class NextStage:
    stage: str
    content: Any = None
    log: str | None = None


@dataclass(frozen=True)
class PollAgain:
    content: Any = None
    log: str | None = None


@dataclass(frozen=True)
class Retry:
    log: str = "retry requested"


Outcome: TypeAlias = Done | NextStage | PollAgain | Retry
Handler: TypeAlias = Callable[[Job], Outcome]


class Worker:
    """Pulls tasks of ``task_type`` and runs their stage handlers in a thread pool.

    ``backlog_limit`` (default ``2 * max_threads``): no hold_tasks while this many
    jobs are queued or running locally (seed 001: stop pulling over a threshold).
    One hold_tasks may still bring up to the type's ``schedule_limit`` tasks.
    ``poll_interval``: seconds between polls; None reads the type's
    ``schedule_interval`` from the server (1 s when that fails).
    ``http``: an ``httpx.Client`` to use (its base URL is ignored: paths are
    absolute); by default one is made with connect retries.
    ``heartbeat``: while a handler runs, report it alive (set_task status 2) every
    third of the server's heartbeat timeout; the server then ends a lease whose
    reports stop within that timeout (a killed worker's tasks run again in
    seconds) instead of after max_processing_time.
    """

    def __init__(
        self,
        base_url: str,
        task_type: str,
        *,
        api_key: str | None = None,
        max_threads: int = 8,
        backlog_limit: int | None = None,
        poll_interval: float | None = None,
        drain_timeout: float = 30.0,
        http: httpx.Client | None = None,
        heartbeat: bool = False,
    ) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.task_type = task_type
        self.max_threads = max_threads
        self.backlog_limit = backlog_limit if backlog_limit is not None else 2 * max_threads
        self.poll_interval = poll_interval
        self.drain_timeout = drain_timeout
        self.heartbeat = heartbeat
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._own_http = http is None
        self.http = http or httpx.Client(timeout=30, transport=httpx.HTTPTransport(retries=3))
        self._handlers: dict[str, Handler] = {}
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix=f"asyncflow-{task_type}")
        self._lock = threading.Lock()
        self._inflight: dict[Future[Outcome], str] = {}  # queued or running job -> task_id
        self._stop = threading.Event()

    # -- handlers -------------------------------------------------------------------

    def stage(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: ``fn`` handles tasks at stage ``name`` ("" is a new task's stage)."""

        def register(fn: Handler) -> Handler:
            self._handlers[name] = fn
            return fn

        return register

    # -- the server ------------------------------------------------------------------

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One v1 request; raises ``httpx.HTTPError`` or :class:`ApiError`."""
        response = self.http.request(method, f"{self.base_url}/v1/{path}", headers=self._headers, **kwargs)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        if answer.get("code") != 0:
            raise ApiError(f"{path}: {answer.get('msg')}")
        return answer

    def register_task_type(self, **config: Any) -> None:
        """Create or replace this worker's task type (schedule_limit, max_retry_num...)."""
        self.call("POST", "register_task_type", json={"task_type_data": {"task_type": self.task_type, **config}})

    def resolve_poll_interval(self) -> float:
        if self.poll_interval is None:
            try:
                types = self.call("GET", "get_task_schedule_cfg_list")["task_schedule_cfg_list"]
                found = [t for t in types if t.get("task_type") == self.task_type]
                self.poll_interval = float(found[0]["schedule_interval"]) if found else 1.0
            except (httpx.HTTPError, ApiError, ValueError, KeyError) as exc:
                log.warning("cannot read schedule_interval of %s (%s): polling every 1 s", self.task_type, exc)
                return 1.0  # not cached: the next run() asks again
        return max(self.poll_interval, MIN_POLL_INTERVAL)

    # -- the loop --------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Jobs queued or running in the local pool."""
        with self._lock:
            return len(self._inflight)

    def poll(self) -> list[Future[Outcome]]:
        """One hold_tasks unless the backlog is full; the jobs it started."""
        if self.backlog >= self.backlog_limit:
            log.debug("backlog %d >= %d: not pulling %s", self.backlog, self.backlog_limit, self.task_type)
            return []
        body: dict[str, Any] = {"task_type": self.task_type}
        if self.heartbeat:
            body["heartbeat"] = True
        answer = self.call("POST", "hold_tasks", json=body)
        tasks = answer["task_list"]
        beat_every = float(answer["heartbeat_timeout"]) / 3 if self.heartbeat else None
        futures = []
        for task in tasks:
            future = self._pool.submit(self._execute, task, beat_every)
            with self._lock:
                self._inflight[future] = task["task_id"]
            future.add_done_callback(self._forget)
            futures.append(future)
        return futures

    def _forget(self, future: Future[Outcome]) -> None:
        with self._lock:
            self._inflight.pop(future, None)

    def run_once(self) -> list[Outcome]:
        """Poll once and wait for the jobs that poll started; their outcomes."""
        futures = self.poll()
        wait(futures)
        return [f.result() for f in futures]

    def run(self, stop: threading.Event | None = None) -> None:
        """Poll every poll interval until ``stop`` (or :meth:`stop`), then drain.

        Errors reaching the server are logged and the next tick tries again.
        Draining waits up to ``drain_timeout`` for queued and running jobs; queued
        jobs still waiting after that are handed back to the server (status 1) so
        they do not stay leased until max_processing_time. The pool is shut down
        afterwards: a worker runs once.
        """
        if stop is not None:
            self._stop = stop  # so stop() wakes this same wait
        stop = self._stop
        interval = self.resolve_poll_interval()
        log.info("worker for %s: polling every %.2f s, %d threads", self.task_type, interval, self.max_threads)
        while not stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a worker loop outlives a bad tick (server down, 5xx...)
                log.warning("hold_tasks for %s failed: %s", self.task_type, exc)
            stop.wait(interval)  # wakes at once on stop(): no busy loop, no late exit
        self.drain()

    def stop(self) -> None:
        """Ask :meth:`run` to stop polling, drain and return."""
        self._stop.set()

    def drain(self) -> None:
        with self._lock:
            pending = dict(self._inflight)
        wait(pending, timeout=self.drain_timeout)
        for future, task_id in pending.items():
            if future.cancel():  # never started: give the task back for another worker
                self._report(task_id, {"status": PENDING, "schedule_log": "released: worker stopping"})
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._own_http:
            self.http.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one job ---------------------------------------------------------------------

    def _execute(self, task: dict[str, Any], beat_every: float | None = None) -> Outcome:
        job = Job(
            task_id=task["task_id"],
            task_type=task.get("task_type", self.task_type),
            stage=task.get("task_stage") or "",
            content=task.get("task_content") or "",
            user_id=task.get("user_id") or "",
            crt_retry_num=int(task.get("crt_retry_num") or 0),
            max_retry_num=int(task.get("max_retry_num") or 0),
            schedule_log=task.get("schedule_log") or "",
        )
        handler = self._handlers.get(job.stage)
        done = threading.Event()
        if beat_every is not None:
            threading.Thread(target=self._beat, args=(job.task_id, beat_every, done), daemon=True).start()
        try:
            if handler is None:
                outcome: Outcome = Retry(f"no handler for stage {job.stage!r} in this worker")
            else:
                try:
                    outcome = handler(job)
                    if not isinstance(outcome, Done | NextStage | PollAgain | Retry):
                        outcome = Retry(f"handler returned {type(outcome).__name__}, not an outcome")
                except Exception as exc:  # a failed attempt: the server retries per the type's policy
                    log.exception("task %s stage %r failed", job.task_id, job.stage)
                    outcome = Retry(f"{type(exc).__name__}: {exc}")
        finally:
            done.set()
        self._report(job.task_id, _report(job, outcome))
        return outcome

    def _beat(self, task_id: str, every: float, done: threading.Event) -> None:
        """Report the job alive until it is done, or until the server says its lease is over."""
        while not done.wait(every):
            try:
                self.call("POST", "set_task", json={"task_data": {"task_id": task_id, "status": RUNNING}})
            except ApiError as exc:
                log.warning("heartbeat for %s refused, stopping its heartbeats: %s", task_id, exc)
                return
            except httpx.HTTPError as exc:  # the next one may get through before the lease ends
                log.warning("heartbeat for %s failed: %s", task_id, exc)

    def _report(self, task_id: str, data: dict[str, Any]) -> None:
        try:
            self.call("POST", "set_task", json={"task_data": {"task_id": task_id, **data}})
        except Exception as exc:
            # The lease runs out after max_processing_time and the server retries the
            # task: reporting again here could race with that, so log and move on.
            log.error("set_task for %s failed: %s", task_id, exc)


def _content(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return json.dumps(content, separators=(",", ":"))


def _report(job: Job, outcome: Outcome) -> dict[str, Any]:
    """The set_task fields of an outcome, schedule_log extended by one line."""
    if isinstance(outcome, Done):
        data: dict[str, Any] = {"status": SUCCESS, "task_content": _content(outcome.content)}
        line = f"[{job.stage}] done" + (f": {outcome.log}" if outcome.log else "")
    elif isinstance(outcome, NextStage):
        data = {"status": PENDING, "task_stage": outcome.stage, "task_content": _content(outcome.content)}
        line = f"[{job.stage}] -> {outcome.stage}" + (f": {outcome.log}" if outcome.log else "")
    elif isinstance(outcome, PollAgain):
        data = {"status": PENDING, "task_stage": job.stage, "task_content": _content(outcome.content)}
        line = f"[{job.stage}] poll again: {outcome.log}" if outcome.log else ""
    else:
        data = {"status": FAILED}
        line = f"[{job.stage}] attempt {job.crt_retry_num} failed: {outcome.log}"
    content = data.get("task_content")
    if content is not None and len(content) > MAX_CONTENT:
        data = {"status": FAILED}
        line = f"[{job.stage}] content of {len(content)} characters is over the {MAX_CONTENT} limit"
    if line:
        # set_task replaces schedule_log: append to keep the task's history, newest last.
        history = f"{job.schedule_log}\n{line}" if job.schedule_log else line
        data["schedule_log"] = history[-MAX_LOG:]
    return {k: v for k, v in data.items() if v is not None}
