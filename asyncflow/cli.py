"""`asyncflow`: start the processes (up, api, worker, scheduler) and operate tasks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NoReturn

import click

from asyncflow.client import ApiClient, follow, parse_param, render
from shared.config import Settings, load_settings
from shared.flows import FlowsError, load_flows
from shared.states import STOPPED


def _settings() -> Settings:
    return load_settings()


def _client() -> ApiClient:
    settings = _settings()
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return ApiClient(settings.resolved_api_url(), api_key=key)


@click.group()
def main() -> None:
    """Asyncflow: multi-step tasks with retries, timeouts and saga compensation."""


# --- processes -------------------------------------------------------------------


@main.command()
@click.option("--port", type=int, default=None, help="API port (default 8000)")
def up(port: int | None) -> None:
    """Run everything on this machine: API, scheduler and all module workers."""
    from asyncflow.serve import run_all

    settings = _settings()
    flows = _load(settings.flows, check_commands=True)
    _check_api_keys(settings)
    sys.exit(run_all(settings, port or settings.api_port, sorted(flows.push_module_names())))


@main.command()
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
@click.option("--workers", type=click.IntRange(1, 64), default=None, help="API processes (default 1)")
def api(host: str | None, port: int | None, workers: int | None) -> None:
    """Run the intake HTTP API."""
    from asyncflow.serve import run_api

    settings = _settings()
    if workers is not None:
        settings = settings.model_copy(update={"api_workers": workers})
    _load(settings.flows)
    _check_api_keys(settings)
    run_api(settings, host or settings.api_host, port or settings.api_port)


@main.command()
@click.argument("modules", nargs=-1, required=True)
@click.option("--concurrency", "-c", type=int, default=None, help="Pool processes")
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics of the worker and its pool")
def worker(modules: tuple[str, ...], concurrency: int | None, metrics_port: int | None) -> None:
    """Consume the queues of MODULES (e.g. `asyncflow worker resource mysql`)."""
    settings = _settings()
    port = metrics_port or settings.worker_metrics_port
    if port:
        from asyncflow.metrics import prepare_multiprocess

        prepare_multiprocess(settings)  # before anything creates a metric
    from asyncflow.serve import run_worker

    try:
        run_worker(settings, list(modules), concurrency or settings.worker_concurrency, port)
    except FlowsError as exc:
        _fail(exc)


@main.command()
def scheduler() -> None:
    """Run the timers: publish retries and polls when they are due."""
    from asyncflow.serve import run_scheduler

    run_scheduler(_settings())


# --- tasks -------------------------------------------------------------------------


@main.command()
@click.argument("flow")
@click.option("--param", "-p", "params", multiple=True, help="KEY=VALUE (VALUE parsed as JSON if it can be)")
@click.option("--task-id", default=None, help="Client task id: resubmitting it returns the same task")
@click.option("--priority", type=int, default=0)
@click.option("--user", "user_id", default=None)
@click.option("--wait", is_flag=True, help="Follow the task until it stops")
def submit(flow: str, params: tuple[str, ...], task_id: str | None, priority: int, user_id: str | None, wait: bool) -> None:
    """Submit a task of FLOW."""
    client = _client()
    body = {
        "flow": flow,
        "parameters": dict(parse_param(p) for p in params),
        "priority": priority,
        "user_id": user_id,
        "task_id": task_id,
    }
    doc = client.call("POST", "/api/tasks", json=body)
    click.echo(f"task {doc['task_id']} submitted ({flow})")
    if wait:
        doc = follow(lambda: client.call("GET", f"/api/tasks/{doc['task_id']}"), click.echo)
        click.echo(render(doc))
        sys.exit(0 if doc["task_status"] == 0 else 1)


@main.command()
@click.argument("task_id")
@click.option("--watch", is_flag=True, help="Refresh until the task stops")
@click.option("--json", "as_json", is_flag=True, help="Print the raw task document")
def status(task_id: str, watch: bool, as_json: bool) -> None:
    """Show a task: status, steps, parameters and every attempt."""
    client = _client()
    while True:
        doc = client.call("GET", f"/api/tasks/{task_id}")
        click.echo(json.dumps(doc, indent=2) if as_json else render(doc))
        if not watch or doc["task_status"] in STOPPED:
            return
        time.sleep(1)
        click.echo()


@main.command("list")
@click.option("--flow", default=None)
@click.option("--status", "status_code", type=int, default=None)
@click.option("--user", "user_id", default=None)
@click.option("--limit", type=int, default=20)
def list_tasks(flow: str | None, status_code: int | None, user_id: str | None, limit: int) -> None:
    """List tasks, newest first."""
    params = {k: v for k, v in dict(flow=flow, status=status_code, user_id=user_id, limit=limit).items() if v is not None}
    for doc in _client().call("GET", "/api/tasks", params=params)["tasks"]:
        click.echo(
            f"{doc['task_id']}  {doc['flow']:<24} status {doc['task_status']} {doc['status_name']:<16}"
            f" cursor {doc['task_cursor']}  {doc['task_message'] or ''}"
        )


def _operation(name: str, help_text: str) -> None:
    @main.command(name, help=help_text)
    @click.argument("task_id")
    def command(task_id: str) -> None:
        doc = _client().call("POST", f"/api/tasks/{task_id}/{name}")
        click.echo(f"task {task_id}: status {doc['task_status']} {doc['status_name']}")


_operation("cancel", "Cancel a running task: its current attempt ends, then completed steps are compensated.")
_operation("retry", "Run a failed or cancelled task again from its failed step.")
_operation("resume", "Resume the compensation of a task whose rollback failed.")


# --- flows and database ---------------------------------------------------------------


@main.group()
def flows() -> None:
    """flows.yaml tools."""


@flows.command("validate")
@click.argument("file", required=False, type=click.Path(path_type=Path))
def validate(file: Path | None) -> None:
    """Check FILE (default: $ASYNCFLOW_FLOWS or ./flows.yaml), including module commands."""
    path = file or _settings().flows
    flow_set = _load(path, check_commands=True)
    click.echo(f"{path}: {len(flow_set.flows)} flows OK ({', '.join(sorted(flow_set.flows))})")


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Apply the Alembic migrations to $ASYNCFLOW_DATABASE_URL."""
    from shared.migrate import upgrade

    url = _settings().resolved_database_url()
    upgrade(url)
    click.echo(f"schema is current on {url}")


def _load(path: Path, check_commands: bool = False):  # type: ignore[no-untyped-def]
    try:
        return load_flows(path, check_commands=check_commands)
    except FlowsError as exc:
        _fail(exc)


def _check_api_keys(settings: Settings) -> None:
    """Fail at start-up, with the file and entry, on unusable API keys (the API would anyway)."""
    from oss_api.auth import AuthConfigError, load_keys

    try:
        load_keys(settings)
    except AuthConfigError as exc:
        click.echo(str(exc), err=True)
        raise SystemExit(2) from None


def _fail(exc: FlowsError) -> NoReturn:
    for problem in exc.problems:
        click.echo(problem, err=True)
    raise SystemExit(2) from None
