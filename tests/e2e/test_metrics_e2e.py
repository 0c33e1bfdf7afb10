"""One /metrics for the whole stack: `asyncflow up` on the embedded default, scraped at the API."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.testing import wait_for
from tests.e2e.conftest import open_stack

pytestmark = pytest.mark.e2e


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of the exposition: sample name -> {sorted labels: value}."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def value(samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float | None:
    return samples.get(name, {}).get(tuple(sorted(labels.items())))


def test_api_metrics_cover_the_workers_scheduler_and_queues(tmp_path: Path) -> None:
    # A short heartbeat, so the worker's row carries its pool's counts soon after the task ends.
    env = {"ASYNCFLOW_HEARTBEAT_INTERVAL": "0.5"}
    with open_stack("embedded", tmp_path, env=env, groups=None) as stack:
        task = stack.submit("noop")
        assert stack.wait_stopped(task["task_id"])["task_status"] == 0

        def reported() -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
            # Each process's row carries the snapshot of its last heartbeat: the scheduler's
            # may still be the one from before it took the lead when the worker's is current,
            # and the worker's one taken before the flow's last step ended.
            samples = scrape(stack.url)
            first = value(samples, "asyncflow_step_attempts_total", module="alpha", command="step", outcome="succeeded")
            second = value(samples, "asyncflow_step_attempts_total", module="beta", command="step", outcome="succeeded")
            leading = value(samples, "asyncflow_scheduler_leader") == 1
            swept = (value(samples, "asyncflow_scheduler_lag_seconds_count") or 0) > 0
            return samples if (first, second) == (2, 1) and leading and swept else None

        # Counted in the worker's pool processes, summed into the one exposition: all three
        # attempts within the wait, or it fails.
        samples = wait_for(reported, 30, "the worker's attempts and the scheduler's lead in the API's /metrics")
        assert value(
            samples, "asyncflow_step_seconds_count", module="alpha", command="step", outcome="succeeded"
        ) == 2
        assert value(
            samples, "asyncflow_step_seconds_bucket", module="beta", command="step", outcome="succeeded", le="+Inf"
        ) == 1
        assert value(samples, "asyncflow_step_queue_wait_seconds_count", module="alpha") == 2
        # The API's own, and the scheduler's.
        assert value(samples, "asyncflow_tasks_submitted_total", flow="noop") == 1
        assert value(samples, "asyncflow_api_intake_batch_size_count", call="submit") == 1
        assert value(samples, "asyncflow_scheduler_leader") == 1
        assert (value(samples, "asyncflow_scheduler_lag_seconds_count") or 0) > 0
        # Asked at scrape time: the broker's queues (drained) and the live processes.
        assert value(samples, "asyncflow_queue_depth", queue="asyncflow.alpha") == 0
        assert value(samples, "asyncflow_queue_depth", queue="asyncflow.beta") == 0
        for role in ("api", "scheduler", "worker"):
            assert value(samples, "asyncflow_processes", role=role) == 1, role
        seen = samples["asyncflow_process_last_seen_seconds"]
        assert {dict(labels)["role"] for labels in seen} == {"api", "scheduler", "worker"}
        assert "asyncflow_scrape_errors_total" not in samples
