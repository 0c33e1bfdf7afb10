"""Prometheus metrics of a worker: its pool processes count, the main process serves.

prometheus_client decides at import whether metrics live in shared files, so
:func:`prepare_multiprocess` must run before anything imports the metrics.
"""

from __future__ import annotations

import os
import shutil

from shared.config import Settings


def prepare_multiprocess(settings: Settings) -> None:
    directory = settings.home / "metrics" / str(os.getpid())
    shutil.rmtree(directory, ignore_errors=True)  # counters of a previous run with this pid
    directory.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)


def serve_multiprocess(port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(port, registry=registry)
