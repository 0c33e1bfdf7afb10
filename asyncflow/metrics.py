"""Prometheus metrics of a worker: its pool processes count, the main process adds them up.

Celery's pool processes run the attempts, so the step metrics are counted there.
In prometheus_client's multiprocess mode each process writes its values to a
file of a folder of the worker's own; the worker's main process sums them
(shared.presence.pool_metrics) into its registry row, which the API's /metrics
adds to the rest of the stack, and serves them on ``--metrics-port`` if asked.

prometheus_client decides at import whether metrics live in shared files, so
:func:`prepare_multiprocess` must run before anything imports the metrics.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shared.config import Settings
from shared.processes import runs


def prepare_multiprocess(settings: Settings) -> None:
    folder = settings.home / "metrics"
    _forget_dead(folder)
    directory = folder / str(os.getpid())
    shutil.rmtree(directory, ignore_errors=True)  # counters of a previous run with this pid
    directory.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)


def _forget_dead(folder: Path) -> None:
    """Delete the folders of workers no longer running: their counts live on in their registry rows."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.name.isdigit() and not runs(int(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)


def serve_multiprocess(port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped in prometheus_client
    start_http_server(port, registry=registry)
