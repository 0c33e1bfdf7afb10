"""`asyncflow`: start the processes (up, api, worker, scheduler) and operate tasks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from asyncflow import schedules_view as view
from asyncflow.client import ApiClient, ApiError, follow, parse_param, render
from shared.config import Settings, load_settings
from shared.flows import FlowsError, load_flows
from shared.schedules.model import Overlap
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
    """Fire schedules and run the timers (retries, polls, requeues, expiries); one of several leads."""
    from asyncflow.serve import run_scheduler

    settings = _settings()
    _load(settings.flows)
    run_scheduler(settings)


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


# --- schedules ---------------------------------------------------------------------------


@main.group()
def schedule() -> None:
    """Schedules: start a flow (or a v1 task) at a time, on a cron, or every so often."""


def _call_schedule(method: str, path: str, client: ApiClient | None = None, **kwargs: Any) -> Any:
    """The API call, wrong fields named with the `schedule add` option that sets them."""
    try:
        return (client or _client()).call(method, path, **kwargs)
    except ApiError as exc:
        raise click.ClickException(exc.describe(view.OPTION_OF)) from None


def _echo_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2))


@schedule.command("add")
@click.option("--flow", default=None, help="Flow each firing starts (or give --task-type)")
@click.option("--param", "-p", "params", multiple=True, help="KEY=VALUE (VALUE parsed as JSON if it can be)")
@click.option("--task-type", default=None, help="v1 task type each firing creates a task of (instead of --flow)")
@click.option("--stage", "task_stage", default=None, help="task_stage of the v1 task")
@click.option("--content", "task_content", default=None, help="task_content of the v1 task")
@click.option("--at", "run_at", metavar="TIME", default=None, help=f"Fire once at TIME: {view.TIME_HELP}")
@click.option("--cron", default=None, help='Cron expression, read in --timezone: "0 2 * * *" (6 fields: seconds first)')
@click.option("--every", type=view.DURATION, default=None, help=f"Fire every DURATION: {view.DURATION_HELP}")
@click.option("--id", "schedule_id", default=None, help="Schedule id (default: generated); adding again returns it")
@click.option("--timezone", default=None, help="IANA zone of --cron and of times without offset (API default UTC)")
@click.option("--start", metavar="TIME", default=None, help="No firing before TIME")
@click.option("--end", metavar="TIME", default=None, help="No firing after TIME")
@click.option("--jitter", type=view.DURATION, default=None, help="Delay each firing by up to DURATION")
@click.option(
    "--overlap",
    type=click.Choice([o.value for o in Overlap]),
    default=None,
    help="What a firing does while the previous task still runs (default skip)",
)
@click.option("--catchup-window", type=view.DURATION, default=None, help="Missed firings younger than this still fire")
@click.option("--pause-on-failure", is_flag=True, help="Pause the schedule when a task it started fails")
@click.option("--paused", is_flag=True, help="Create it paused")
@click.option("--note", default=None, help="Free text shown by list and show")
@click.option("--user", "user_id", default=None, help="Owner of the tasks it creates (admin keys)")
@click.option("--json", "as_json", is_flag=True, help="Print the raw schedule document")
def schedule_add(
    params: tuple[str, ...], run_at: str | None, start: str | None, end: str | None, as_json: bool, **fields: Any
) -> None:
    """Add a schedule. Give one of --flow, --task-type and one of --at, --cron, --every."""
    if (fields["flow"] is None) == (fields["task_type"] is None):
        raise click.UsageError("give exactly one of --flow, --task-type")
    if sum(v is not None for v in (run_at, fields["cron"], fields["every"])) != 1:
        raise click.UsageError("give exactly one of --at, --cron, --every")
    try:
        tz = view.zone(fields["timezone"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--timezone") from None
    body = {
        **fields,  # named as the API names them
        "parameters": dict(parse_param(p) for p in params) if params else None,
        "run_at": view.time_option(run_at, "--at", tz),
        "start_at": view.time_option(start, "--start", tz),
        "end_at": view.time_option(end, "--end", tz),
    }
    client = _client()
    doc = _call_schedule("POST", "/api/schedules", client, json={k: v for k, v in body.items() if v is not None})
    if as_json:
        _echo_json(doc)
        return
    if client.last_status == 200:
        click.echo(f"schedule {doc['schedule_id']} already exists with this definition")
    click.echo(view.render_schedule(doc))


@schedule.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, help="At most this many (by id)")
@click.option("--after", default=None, help="Those with an id after this one (the next page)")
@click.option("--json", "as_json", is_flag=True, help="Print the raw list")
def schedule_list(limit: int, after: str | None, as_json: bool) -> None:
    """List schedules by id. Columns: target, timing, next firing, overlap policy, note."""
    params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
    doc = _call_schedule("GET", "/api/schedules", params=params)
    if as_json:
        _echo_json(doc)
        return
    docs = doc["schedules"]
    if not docs:
        click.echo("no schedules" + (f" after {after}" if after else ""))
        return
    click.echo(view.schedules_table(docs))
    if len(docs) == limit:
        click.echo(f"(more may follow: --after {docs[-1]['schedule_id']})", err=True)


@schedule.command("show")
@click.argument("schedule_id")
@click.option("--json", "as_json", is_flag=True, help="Print the raw schedule and runs")
def schedule_show(schedule_id: str, as_json: bool) -> None:
    """Show a schedule in full, with its 10 newest runs."""
    doc = _call_schedule("GET", f"/api/schedules/{schedule_id}")
    runs = _call_schedule("GET", f"/api/schedules/{schedule_id}/runs", params={"limit": 10})["runs"]
    if as_json:
        _echo_json({"schedule": doc, "runs": runs})
    else:
        click.echo(view.render_schedule(doc, runs))


@schedule.command("pause")
@click.argument("schedule_id")
@click.option("--note", default=None, help="Why (replaces the schedule's note)")
def schedule_pause(schedule_id: str, note: str | None) -> None:
    """Pause a schedule: nothing fires until it is resumed."""
    body = {"note": note} if note is not None else None
    doc = _call_schedule("POST", f"/api/schedules/{schedule_id}/pause", json=body)
    click.echo(f"schedule {schedule_id} paused" + (f": {doc['note']}" if doc["note"] else ""))


@schedule.command("resume")
@click.argument("schedule_id")
def schedule_resume(schedule_id: str) -> None:
    """Resume a paused schedule. Firings that fell in the pause are not made up for."""
    doc = _call_schedule("POST", f"/api/schedules/{schedule_id}/resume")
    click.echo(f"schedule {schedule_id} resumed, next firing: {view.next_text(doc)}")


@schedule.command("delete")
@click.argument("schedule_id")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation")
def schedule_delete(schedule_id: str, yes: bool) -> None:
    """Delete a schedule and its run records. The tasks it started are left alone."""
    if not yes:
        doc = _call_schedule("GET", f"/api/schedules/{schedule_id}")
        click.confirm(
            f"delete schedule {schedule_id} ({view.target_text(doc)}, {view.when_text(doc)})?", abort=True
        )
    _call_schedule("DELETE", f"/api/schedules/{schedule_id}")
    click.echo(f"schedule {schedule_id} deleted")


def _echo_runs(what: str, runs: list[dict[str, Any]]) -> None:
    click.echo(f"{what}: {view.runs_summary(runs)}")
    if runs:
        click.echo(view.runs_table(runs))


@schedule.command("trigger")
@click.argument("schedule_id")
def schedule_trigger(schedule_id: str) -> None:
    """Fire now. The overlap policy applies; a paused schedule fires too."""
    runs = _call_schedule("POST", f"/api/schedules/{schedule_id}/trigger")["runs"]
    _echo_runs(f"schedule {schedule_id} triggered", runs)


@schedule.command("backfill")
@click.argument("schedule_id")
@click.option("--start", metavar="TIME", required=True, help=f"From this scheduled time, inclusive: {view.TIME_HELP}")
@click.option("--end", metavar="TIME", required=True, help="To this scheduled time, inclusive")
def schedule_backfill(schedule_id: str, start: str, end: str) -> None:
    """Fire missed times. Every scheduled time in [--start, --end] without a run fires (no offset: local time)."""
    body = {"start": view.time_option(start, "--start"), "end": view.time_option(end, "--end")}
    runs = _call_schedule("POST", f"/api/schedules/{schedule_id}/backfill", json=body)["runs"]
    _echo_runs(f"schedule {schedule_id} backfilled", runs)


@schedule.command("runs")
@click.argument("schedule_id")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, help="At most this many")
@click.option("--before", metavar="TIME", default=None, help="Runs scheduled before TIME (the next page)")
@click.option("--json", "as_json", is_flag=True, help="Print the raw runs")
def schedule_runs(schedule_id: str, limit: int, before: str | None, as_json: bool) -> None:
    """Show a schedule's runs, newest first. LATE is fired - scheduled, in ms."""
    params: dict[str, Any] = {"limit": limit}
    if before is not None:
        params["before"] = view.time_option(before, "--before")
    doc = _call_schedule("GET", f"/api/schedules/{schedule_id}/runs", params=params)
    if as_json:
        _echo_json(doc)
    elif doc["runs"]:
        click.echo(view.runs_table(doc["runs"]))
    else:
        click.echo(f"schedule {schedule_id} has no runs" + (" before that" if before else " yet"))


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
