"""`asyncflow`: start the processes (up, api, worker, scheduler) and operate tasks."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console

from asyncflow import schedules_view as view
from asyncflow import task_view
from asyncflow.client import ApiClient, ApiError, parse_param
from shared.config import Settings, load_settings
from shared.flows import FlowsError, FlowSet, load_flows
from shared.schedules.model import Overlap


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
@click.option(
    "--pool",
    type=click.Choice(["kombu", "celery"]),
    default=None,
    help="Consumer processes of Asyncflow's own, or Celery's prefork worker (default: ASYNCFLOW_WORKER_POOL, kombu)",
)
def worker(modules: tuple[str, ...], concurrency: int | None, metrics_port: int | None, pool: str | None) -> None:
    """Consume the queues of MODULES (e.g. `asyncflow worker resource mysql`)."""
    settings = _settings()
    if pool is not None:
        settings = settings.model_copy(update={"worker_pool": pool})
    port = metrics_port or settings.worker_metrics_port
    from asyncflow.metrics import prepare_multiprocess

    prepare_multiprocess(settings)  # before anything creates a metric: the pool's add up in this process
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


@main.command()
@click.argument("role", type=click.Choice(["worker", "scheduler", "api"]))
def health(role: str) -> None:
    """Exit 0 when a ROLE process on this host renewed its registry row lately (a container healthcheck)."""
    import time

    from asyncflow import liveness
    from shared.runtime import Runtime
    from shared.storage import StorageError

    settings = _settings()
    host = liveness.this_host()
    try:
        problem = liveness.health(
            Runtime(settings).process_store, role, host, time.time(), settings.heartbeat_interval
        )
    except StorageError as exc:
        problem = f"cannot read the process registry: {exc}"
    if problem:
        click.echo(problem, err=True)
        sys.exit(1)
    click.echo(f"{role} on {host}: alive")


# --- tasks -------------------------------------------------------------------------

PARAM_HELP = "KEY=VALUE (VALUE parsed as JSON if it can be: 4, true, [1], {\"a\": 1}); repeatable"


@main.command()
@click.argument("flow")
@click.option("--param", "-p", "params", multiple=True, help=PARAM_HELP)
@click.option("--task-id", default=None, help="Client task id: resubmitting it returns the same task")
@click.option("--priority", type=int, default=0, help="Higher runs first when queues are busy")
@click.option("--user", "user_id", default=None, help="Owner of the task (admin keys; else the key's user)")
@click.option("--wait", is_flag=True, help="Print each change until the task stops, then the task; exit 1 unless it succeeded")
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
        _wait(client, doc["task_id"], first=doc)


def _fetch(client: ApiClient, task_id: str) -> Callable[[], dict[str, Any]]:
    return lambda: client.call("GET", f"/api/tasks/{task_id}")


def _wait(client: ApiClient, task_id: str, first: dict[str, Any] | None = None) -> NoReturn:
    """One line per change until the task stops, then the task; exit 0 only if it succeeded."""
    doc = task_view.follow(_fetch(client, task_id), click.echo, first=first)
    click.echo()
    click.echo(task_view.render(doc))
    sys.exit(0 if doc["task_status"] == 0 else 1)


@main.command()
@click.argument("task_id")
@click.option(
    "--watch", is_flag=True,
    help="Follow the task until it stops: on a terminal a live view redrawn in place (steps, durations, "
    "timeline, the running attempt's progress); else one line per change. Exit 1 unless it succeeded",
)
@click.option("--wait", is_flag=True, help="Print one line per change until the task stops, then the task; exit 1 unless it succeeded")
@click.option("--json", "as_json", is_flag=True, help="Print the raw task document (once stopped, with --watch or --wait)")
def status(task_id: str, watch: bool, wait: bool, as_json: bool) -> None:
    """Show a task: status, steps, parameters, every attempt and its history."""
    client = _client()
    fetch = _fetch(client, task_id)
    if as_json:
        doc = task_view.follow(fetch, lambda _line: None) if watch or wait else fetch()
        click.echo(json.dumps(doc, indent=2))
        return
    if wait:
        _wait(client, task_id)
    if not watch:
        click.echo(task_view.render(fetch()))
        return
    console = Console()  # on sys.stdout: is it a terminal?
    if console.is_terminal:
        doc = task_view.watch_live(fetch, console)
    else:
        doc = task_view.follow(fetch, click.echo, interval=0.5)
    sys.exit(0 if doc["task_status"] == 0 else 1)


@main.command("list")
@click.option("--flow", default=None, help="Only tasks of this flow")
@click.option("--status", "status_code", type=task_view.STATUS, default=None,
              help=f"Only tasks in this status: {task_view.STATUS_HELP}")
@click.option("--user", "user_id", default=None, help="Only tasks of this user (admin keys; else the key's own)")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="At most this many")
@click.option("--json", "as_json", is_flag=True, help="Print the raw task documents")
def list_tasks(flow: str | None, status_code: int | None, user_id: str | None, limit: int, as_json: bool) -> None:
    """List tasks, newest first: id, flow, status, created (local time), duration, user, message."""
    params = {k: v for k, v in dict(flow=flow, status=status_code, user_id=user_id, limit=limit).items() if v is not None}
    docs = _client().call("GET", "/api/tasks", params=params)["tasks"]
    if as_json:
        click.echo(json.dumps(docs, indent=2))
    elif docs:
        click.echo(task_view.tasks_table(docs))
    else:
        click.echo("no tasks" + (" match" if len(params) > 1 else ""))


@main.command()
@click.argument("task_id")
def cancel(task_id: str) -> None:
    """Cancel a running task: its current attempt ends, then completed steps are compensated."""
    doc = _client().call("POST", f"/api/tasks/{task_id}/cancel")
    click.echo(f"task {task_id}: {task_view.status_text(doc)}")


@main.command()
@click.argument("task_id")
@click.option("--param", "-p", "params", multiple=True, help=f"Correct a parameter first: {PARAM_HELP}")
def retry(task_id: str, params: tuple[str, ...]) -> None:
    """Run a failed or cancelled task again from its failed step (earlier steps whose work was undone first).

    Each --param is merged over the task's parameters before it runs, checked as a submit's would be,
    and recorded in the task's history.
    """
    _operate("retry", task_id, params)


@main.command()
@click.argument("task_id")
@click.option("--param", "-p", "params", multiple=True, help=f"Correct a parameter first: {PARAM_HELP}")
def resume(task_id: str, params: tuple[str, ...]) -> None:
    """Resume the compensation of a task whose rollback failed, from that rollback.

    Each --param is merged over the task's parameters first, as with retry.
    """
    _operate("resume", task_id, params)


def _operate(action: str, task_id: str, params: tuple[str, ...]) -> None:
    client = _client()
    body = {"parameters": dict(parse_param(p) for p in params)} if params else None
    try:
        doc = client.call("POST", f"/api/tasks/{task_id}/{action}", json=body)
    except ApiError as exc:
        raise click.ClickException(exc.describe({"parameters": "--param"})) from None
    click.echo(f"task {task_id}: {action} accepted, {task_view.status_text(doc)}")
    if params:
        # What was recorded: the history's newest entry is this action.
        events = client.call("GET", f"/api/tasks/{task_id}")["events"] or []
        changed = task_view.parameter_changes(events[-1]["detail"]) if events else []
        for line in changed:
            click.echo(f"  {line}")
        if not changed:
            click.echo("  parameters unchanged (the values given were already the task's)")


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


@flows.command("check")
@click.argument("file", required=False, type=click.Path(path_type=Path))
def flows_check(file: Path | None) -> None:
    """Check FILE (default: $ASYNCFLOW_FLOWS or ./flows.yaml), including module commands.

    Prints each problem with the file, flow and field; exits 1 if there is one.
    """
    path = file or _settings().flows
    flow_set = _checked_flows(path, check_commands=True)
    click.echo(f"{path}: {len(flow_set.flows)} flows OK ({', '.join(sorted(flow_set.flows))})")


# The command's name before `check`, kept for scripts.
flows.add_command(click.Command("validate", callback=flows_check.callback, params=flows_check.params, hidden=True))


@flows.command("reload")
@click.option(
    "--pid", type=int, default=None,
    help="Signal this process (an `asyncflow api`, `scheduler` or `up`) instead of the `asyncflow up` "
    "named by up.pid under $ASYNCFLOW_HOME",
)
def flows_reload(pid: int | None) -> None:
    """Check flows.yaml, then have the running processes use it, without a restart.

    An invalid file is refused (exit 1) and the processes keep the flows they have.
    Workers need no reload. By hand: `kill -HUP` the API and scheduler processes.
    """
    from shared import reload

    settings = _settings()
    up = reload.find_up(settings.home) if pid is None else None
    if pid is None and up is None:
        raise click.ClickException(
            f"no running `asyncflow up` found ({settings.home / reload.PIDFILE}); give --pid of the process to reload"
        )
    # `up` runs workers here, so its file must name commands they have; an API or a
    # scheduler alone does not import module code.
    fresh = _checked_flows(up.flows if up else settings.flows, check_commands=up is not None)
    target = up.pid if up else pid
    assert target is not None
    if not reload.handles_hangup(target):
        raise click.ClickException(f"process {target} does not reload on SIGHUP (not an asyncflow process?)")
    try:
        os.kill(target, signal.SIGHUP)
    except ProcessLookupError:
        raise click.ClickException(f"no process {target}") from None
    if up is None:
        click.echo(f"process {target} signalled to reload {settings.flows}")
        return
    parts = ", ".join(f"{name} (pid {p})" for name, p in up.parts.items() if name in reload.HOLDING_FLOWS)
    click.echo(f"asyncflow up (pid {up.pid}) signalled to reload {up.flows}; it passes it on to {parts}")
    unserved = sorted(fresh.push_module_names() - set(up.modules))
    if unserved:
        click.echo(
            f"module(s) {', '.join(unserved)} have no worker under this `up`: their steps wait in their queues "
            f"until `asyncflow worker {' '.join(unserved)}` runs or `up` restarts",
            err=True,
        )


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


def _checked_flows(path: Path, check_commands: bool) -> FlowSet:
    """The flows of ``path``; each problem printed and exit 1 when it has any."""
    try:
        return load_flows(path, check_commands=check_commands)
    except FlowsError as exc:
        for problem in exc.problems:
            click.echo(problem, err=True)
        raise SystemExit(1) from None


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
