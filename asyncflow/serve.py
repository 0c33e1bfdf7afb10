"""The long-running processes: API, workers, scheduler, and `up` which runs them all."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from kombu import Queue

from asyncflow import liveness
from shared import heap, preflight, presence, reload
from shared.config import Settings
from shared.consumer import StepConsumer
from shared.logs import setup_logging
from shared.messaging import bound_shutdown, queue_name
from shared.messaging.consumers import ConsumerPool, GroupedStepMessages, StepMessages
from shared.runtime import Runtime
from shared.schedules.service import InvalidSchedule
from shared.storage import StorageError, patiently
from shared.storage.base import ProcessStore

log = logging.getLogger(__name__)


def run_api(settings: Settings, host: str, port: int) -> None:
    import uvicorn

    from oss_api.app import create_app

    setup_logging(settings, "api")
    preflight.check_servers(settings)
    if settings.migrate_on_start:
        _migrate(settings)
    runtime = Runtime(settings)
    runtime.flows  # noqa: B018 - fail at start-up on a bad flows.yaml, not on first request
    if settings.api_workers == 1:
        reload.reload_on_hangup(runtime)
        app = create_app(runtime)
        heap.settle()
        uvicorn.run(app, host=host, port=port, log_config=None, access_log=False)
        return
    # Each worker process builds its app from the same environment and keeps its own
    # registry row (shared.presence); /metrics adds them up.
    reload.serve_api_workers(runtime, host, port)  # uvicorn's supervisor, passing SIGHUP on


def run_worker(settings: Settings, modules: list[str], concurrency: int, metrics_port: int = 0) -> None:
    setup_logging(settings, "worker")
    # A stop asked for while the kombu pool starts takes effect once it has started, as a
    # logged stop (Celery's worker installs its own handlers, later).
    stop = _stop_on_signals() if settings.worker_pool == "kombu" else None
    preflight.check_servers(settings)
    if metrics_port:
        from asyncflow.metrics import serve_multiprocess

        serve_multiprocess(metrics_port)
    runtime = Runtime(settings)
    if stop is not None:
        _run_consumer_pool(runtime, modules, concurrency, stop)
        return
    consumer = runtime.consumer(modules)
    _start_modules(consumer)
    bound_shutdown(runtime.celery, consumer, settings.shutdown_grace)
    presence.serve_worker(runtime, modules, concurrency)  # its registry row, with its pool's metrics
    queues = ",".join(queue_name(m) for m in modules)
    log.info("consuming %s with %d processes", queues, concurrency)
    heap.settle()  # before Celery forks its pool processes, which inherit it
    runtime.celery.worker_main(
        [
            "worker",
            "--queues", queues,
            "--concurrency", str(concurrency),
            "--pool", "prefork",
            "--hostname", f"{'+'.join(modules)}@%h.{os.getpid()}",
            "--without-gossip",
            "--without-mingle",
            "--loglevel", settings.log_level,
        ]
    )


def _start_modules(consumer: StepConsumer) -> None:
    for module in consumer.modules.values():
        module.start(consumer.settings)  # fail now, not on the first message


def _run_consumer_pool(runtime: Runtime, modules: list[str], concurrency: int, stop: threading.Event) -> None:
    """`asyncflow worker` (`--pool kombu`): consumer processes of our own (shared.messaging.consumers)."""
    settings = runtime.settings
    consumer, running = runtime.timed_consumer(modules)
    _start_modules(consumer)
    # The queues as Celery declares them (on RabbitMQ with x-max-priority, which a declare must repeat).
    queues = [runtime.celery.amqp.queues[queue_name(m)] for m in modules]
    _declare(runtime, queues)

    def consumer_process() -> StepMessages:
        connection = runtime.celery.connection_for_read()
        if settings.worker_prefetch > 1:
            return GroupedStepMessages(connection, queues, consumer, running, settings.worker_prefetch)
        return StepMessages(connection, queues, consumer, running)

    pool = ConsumerPool(consumer_process, consumer, running, concurrency, settings.shutdown_grace, stop)
    row = presence.worker_presence(runtime, modules, concurrency, pool.in_flight)
    log.info("consuming %s with %d processes", ",".join(q.name for q in queues), concurrency)
    heap.settle()  # before the consumer processes are forked, which inherit it
    try:
        pool.run()
    finally:
        row.stop()
        runtime.close()


def _declare(runtime: Runtime, queues: list[Queue]) -> None:
    """Declare the queues once, before the consumer processes start.

    Each declares them again as it connects; on the embedded broker two that
    create the same queue's row at once race, and the loser exits.
    """
    try:
        with runtime.celery.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1)
            for queue in queues:
                queue(connection.default_channel).declare()
    except Exception as exc:  # the consumer processes connect, and declare, as the broker comes back
        log.warning("could not declare the queues yet: %s", exc)


def run_scheduler(settings: Settings, stop: threading.Event | None = None) -> None:
    """Schedules and governance sweeps (shared.scheduler) until SIGTERM or SIGINT.

    The schedules of flows.yaml are applied first; a wrong one stops the start.
    """
    setup_logging(settings, "scheduler")
    preflight.check_servers(settings)
    if settings.migrate_on_start:
        _migrate(settings)
    runtime = Runtime(settings)
    stop = stop or _stop_on_signals()
    try:
        patiently(
            lambda: runtime.schedules.declare(runtime.flows.schedules),
            settings.outcome_patience,
            "applying the schedules of flows.yaml",
        )
    except InvalidSchedule as exc:
        raise SystemExit(f"{settings.flows}: {exc}") from None
    reload.reload_on_hangup(runtime, declare_schedules=True)
    with presence.serving_scheduler(runtime):
        runtime.scheduler.run(stop)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when ``up`` dies, even by SIGKILL.

    Linux's PR_SET_PDEATHSIG, set between fork and exec; it outlives the exec. A
    child whose parent died before that is stopped at once. Elsewhere, nothing.
    """
    pr_set_pdeathsig = 1

    def arm() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _migrate(settings: Settings) -> None:
    # Alembic is imported only here: a process started with migrations off (behind `up`,
    # or ASYNCFLOW_MIGRATE_ON_START=false) does not pay for its import.
    from shared.migrate import upgrade

    upgrade(settings.resolved_database_url())


def run_all(settings: Settings, port: int, modules: list[str]) -> int:
    """`asyncflow up`: API, scheduler and one worker for every module, supervised."""
    setup_logging(settings, "up")
    _refuse_taken_port(settings.api_host, port)  # before anything starts: a second `up` stops here
    preflight.check_servers(settings)
    _migrate(settings)
    env = dict(os.environ, ASYNCFLOW_MIGRATE_ON_START="false", ASYNCFLOW_API_PORT=str(port))
    cmd = [sys.executable, "-m", "asyncflow"]
    die_with_us = _die_with_parent(os.getpid())
    stop = _stop_on_signals()
    commands = {"api": [*cmd, "api", "--port", str(port)], "scheduler": [*cmd, "scheduler"]}
    if modules:  # none when every module is pull-mode (worked through the v1 API)
        commands["worker"] = [*cmd, "worker", *modules]

    def start(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(commands[name], env=env, preexec_fn=die_with_us)

    children = {name: start(name) for name in commands}
    reload.forward_hangup(settings, children, modules)
    code = _supervise(settings, port, children, stop, start)
    for proc in children.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + settings.shutdown_grace + 15
    for proc in children.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    return code


def _refuse_taken_port(host: str, port: int) -> None:
    """Stop `up` at once when the API could not listen on ``host``:``port``.

    Bound as uvicorn binds (SO_REUSEADDR), so a port left in TIME_WAIT by a
    stopped `up` is not taken for a busy one.
    """
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise SystemExit(
            f"asyncflow up: the API cannot listen on {host}:{port} ({exc.strerror or exc}). "
            f"Is another `asyncflow up` or `asyncflow api` running? Stop it, or choose another port: "
            f"`asyncflow up --port {port + 1}` (or ASYNCFLOW_API_PORT)."
        ) from None


# How often `up` says which parts it still waits for.
WAITING_NOTE_EVERY = 15.0


# A part that dies once `up` is up is started again after this long, doubling per
# death up to RESTART_AT_MOST, back to the first once it ran RESTART_RESET_AFTER.
RESTART_FIRST, RESTART_AT_MOST, RESTART_RESET_AFTER = 1.0, 30.0, 60.0


def _supervise(
    settings: Settings,
    port: int,
    children: dict[str, subprocess.Popen[bytes]],
    stop: threading.Event,
    start: Callable[[str], subprocess.Popen[bytes]],
) -> int:
    """Say "is up" once every part answers; then keep them running until a stop signal (0).

    The API answers by /healthz; the scheduler and the worker by their registry
    rows (shared.presence), renewed once they reached the database. A part that
    dies before that is a start-up failure: everything stops (1). One that dies
    later (killed, out of memory) is started again, as a service manager would;
    its attempts in flight are failed by their missing heartbeats and run again.
    """
    url = liveness.local_url(settings.api_host, port)
    store = Runtime(settings).process_store
    host = liveness.this_host()
    waiting = set(children)
    note_at = time.monotonic() + WAITING_NOTE_EVERY
    started = dict.fromkeys(children, time.monotonic())
    pause = dict.fromkeys(children, RESTART_FIRST)
    restart_at: dict[str, float] = {}
    while not stop.is_set():
        dead = {name: p.returncode for name, p in children.items() if p.poll() is not None}
        if dead and waiting:
            log.error("stopping everything: %s exited before asyncflow was up", dead)
            return 1
        now = time.monotonic()
        for name, code in dead.items():
            if name not in restart_at:
                if now - started[name] >= RESTART_RESET_AFTER:
                    pause[name] = RESTART_FIRST
                log.error("%s exited with %s: starting it again in %gs", name, code, pause[name])
                restart_at[name] = now + pause[name]
                pause[name] = min(pause[name] * 2, RESTART_AT_MOST)
            elif now >= restart_at[name]:
                del restart_at[name]
                children[name] = start(name)
                started[name] = now
                log.info("%s started again (pid %d)", name, children[name].pid)
        if waiting:
            waiting -= _answering(waiting, children, url, store, host, settings.heartbeat_interval)
            if not waiting:
                log.info(
                    "asyncflow is up: API on %s (docs at /docs), database %s, broker %s",
                    url, settings.resolved_database_url(), settings.resolved_broker_url(),
                )
            elif time.monotonic() >= note_at:
                log.info("waiting for %s to answer", ", ".join(sorted(waiting)))
                note_at += WAITING_NOTE_EVERY
        stop.wait(0.2 if waiting else 0.5)
    return 0


def _answering(
    names: set[str], children: dict[str, subprocess.Popen[bytes]], url: str, store: ProcessStore, host: str,
    interval: float,
) -> set[str]:
    answering = set()
    if "api" in names and liveness.api_answers(url):
        answering.add("api")
    others = names - {"api"}
    if others:
        try:
            pids = liveness.seen_pids(store, host, time.time(), interval)
        except StorageError as exc:
            log.debug("reading the process registry failed: %s", exc)
            pids = set()
        answering |= {name for name in others if children[name].pid in pids}
    return answering
