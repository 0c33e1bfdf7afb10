"""The long-running processes: API, workers, scheduler, and `up` which runs them all."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from shared.config import Settings
from shared.logs import setup_logging
from shared.messaging import bound_shutdown, queue_name
from shared.migrate import upgrade
from shared.runtime import Runtime
from shared.schedules.service import InvalidSchedule
from shared.storage import patiently

log = logging.getLogger(__name__)


def run_api(settings: Settings, host: str, port: int) -> None:
    import uvicorn

    from oss_api.app import create_app

    setup_logging(settings.log_level, "api")
    if settings.migrate_on_start:
        upgrade(settings.resolved_database_url())
    runtime = Runtime(settings)
    runtime.flows  # noqa: B018 - fail at start-up on a bad flows.yaml, not on first request
    if settings.api_workers == 1:
        uvicorn.run(create_app(runtime), host=host, port=port, log_config=None, access_log=False)
        return
    # Each worker process builds its app from the same environment; /metrics adds them up.
    from asyncflow.metrics import prepare_multiprocess

    prepare_multiprocess(settings)
    uvicorn.run(
        "oss_api.app:app_from_environment", factory=True, workers=settings.api_workers,
        host=host, port=port, log_config=None, access_log=False,
    )


def run_worker(settings: Settings, modules: list[str], concurrency: int, metrics_port: int = 0) -> None:
    setup_logging(settings.log_level, "worker")
    if metrics_port:
        from asyncflow.metrics import serve_multiprocess

        serve_multiprocess(metrics_port)
    runtime = Runtime(settings)
    consumer = runtime.consumer(modules)
    for module in consumer.modules.values():
        module.start(settings)  # fail now, not on the first message
    bound_shutdown(runtime.celery, consumer, settings.shutdown_grace)
    queues = ",".join(queue_name(m) for m in modules)
    log.info("consuming %s with %d processes", queues, concurrency)
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


def run_scheduler(settings: Settings, stop: threading.Event | None = None) -> None:
    """Schedules and governance sweeps (shared.scheduler) until SIGTERM or SIGINT.

    The schedules of flows.yaml are applied first; a wrong one stops the start.
    """
    setup_logging(settings.log_level, "scheduler")
    if settings.migrate_on_start:
        upgrade(settings.resolved_database_url())
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


def run_all(settings: Settings, port: int, modules: list[str]) -> int:
    """`asyncflow up`: API, scheduler and one worker for every module, supervised."""
    setup_logging(settings.log_level, "up")
    upgrade(settings.resolved_database_url())
    env = dict(os.environ, ASYNCFLOW_MIGRATE_ON_START="false", ASYNCFLOW_API_PORT=str(port))
    cmd = [sys.executable, "-m", "asyncflow"]
    die_with_us = _die_with_parent(os.getpid())
    children = {
        "api": subprocess.Popen([*cmd, "api", "--port", str(port)], env=env, preexec_fn=die_with_us),
        "scheduler": subprocess.Popen([*cmd, "scheduler"], env=env, preexec_fn=die_with_us),
    }
    if modules:  # none when every module is pull-mode (worked through the v1 API)
        children["worker"] = subprocess.Popen([*cmd, "worker", *modules], env=env, preexec_fn=die_with_us)
    log.info(
        "asyncflow is up: API on http://%s:%d (docs at /docs), database %s, broker %s",
        settings.api_host, port, settings.resolved_database_url(), settings.resolved_broker_url(),
    )
    stop = _stop_on_signals()
    code = 0
    while not stop.is_set():
        dead = {name: p.returncode for name, p in children.items() if p.poll() is not None}
        if dead:
            log.error("stopping everything: %s exited", dead)
            code = 1
            break
        stop.wait(0.5)
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
