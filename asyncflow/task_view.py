"""Tasks for people: `asyncflow status` (a document, a live view, a stream of changes) and `list`.

Everything here reads the API's task documents (oss_api.schemas.TaskDocument as
JSON) and returns text or a rich renderable; the loops that fetch and print are
:func:`follow` and :func:`watch_live`. "Now" comes from :data:`schedules_view.clock`,
and the wait between two fetches is :data:`pause`, so tests can hold time still
and drive the task between fetches.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from asyncflow import schedules_view as sv
from shared.states import STOPPED, TaskStatus

Doc = dict[str, Any]

# How the loops wait between two fetches (tests put a step of their own here).
pause: Callable[[float], None] = time.sleep

STATUS_NAMES = {
    0: "success", 1: "pending", 2: "running", 3: "rolling back",
    4: "failed (compensated)", 5: "ROLLBACK FAILED (operator needed)", 6: "cancelled",
}
# Task statuses in which completed steps are being, or have been, compensated.
_COMPENSATING = {3, 4, 5, 6}
TIMELINE_WIDTH = 24


class StatusType(click.ParamType):
    """A task status by name (failed, rollback_failed) or number (4)."""

    name = "STATUS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip().lower().replace(" ", "_").replace("-", "_")
        if text.isdigit() and int(text) in TaskStatus._value2member_map_:
            return int(text)
        for status in TaskStatus:
            if status.label == text:
                return int(status)
        self.fail(f"{value!r} is not a status ({STATUS_HELP})", param, ctx)


STATUS = StatusType()
STATUS_HELP = ", ".join(f"{s.label} ({int(s)})" for s in TaskStatus)


# --- pieces ---------------------------------------------------------------------------------


def took(seconds: float) -> str:
    """A duration to read at a glance: 0.4s, 12s, 3m20s, 1h5m."""
    seconds = max(seconds, 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    return sv.fmt_duration(round(seconds) if seconds < 3600 else round(seconds / 60) * 60)


def span(start: float | None, end: float | None, now: float) -> str:
    """How long from ``start`` to ``end`` (or until now, if it has not ended); '' if it never started."""
    if start is None:
        return ""
    return took((end if end is not None else now) - start)


def local_time(value: float | None) -> str:
    """Local time to the second, without offset (for tables)."""
    return datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def status_text(doc: Doc) -> str:
    return f"status {doc['task_status']} {STATUS_NAMES.get(doc['task_status'], '?')}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def rollback_shown(doc: Doc, step: Doc) -> bool:
    """A rollback is shown when it ran, or is due: the task compensates a step that did work."""
    if not step["rollback_command"]:
        return False
    if step["rollback_state"] not in ("pending", "none"):
        return True
    return doc["task_status"] in _COMPENSATING and step["state"] in ("succeeded", "failed", "cancelled")


def rollback_text(doc: Doc, step: Doc, now: float) -> str:
    if not rollback_shown(doc, step):
        return ""
    text = f"rollback {step['rollback_module']}.{step['rollback_command']}: {step['rollback_state']}"
    if step["rollback_attempts"] > 1:
        text += f" ({step['rollback_attempts']} attempts)"
    took_ = span(step["rollback_time_start"], step["rollback_time_end"], now)
    return text + (f" {took_}" if took_ and step["rollback_state"] != "pending" else "")


def running_attempt(doc: Doc) -> Doc | None:
    """The attempt running now (its progress and heartbeat), from the document's attempts."""
    current = doc.get("current")
    if not current or current["phase"] != "running":
        return None
    for attempt in reversed(doc.get("attempts") or []):
        if attempt["seq"] == current["seq"]:
            return attempt
    return None


def progress_text(progress: Any, width: int = 60) -> str:
    if not progress:
        return ""
    if isinstance(progress, dict):
        text = ", ".join(f"{k}={json.dumps(v)}" for k, v in progress.items())
    else:
        text = json.dumps(progress)
    return text if len(text) <= width else text[: width - 1] + "…"


def step_line(doc: Doc, index: int, now: float) -> str:
    """One line for a step: action, state, attempts, how long it took, its rollback, its last message."""
    step = doc["steps"][index]
    parts = [f"[{index}] {step['normal_module']}.{step['normal_command']}", step["state"]]
    if step["attempts"] > 1:
        parts.append(plural(step["attempts"], "attempt"))
    if step["state"] != "pending":
        parts.append(span(step["time_start"], step["time_end"], now))
    parts.append(rollback_text(doc, step, now))
    if step["message"] and step["state"] != "succeeded":
        parts.append(f"({step['message']})")
    return "  ".join(p for p in parts if p)


def event_line(event: Doc) -> str:
    """One entry of the task's history: when, what, who, and what it changed."""
    who = event["actor"] or "anonymous"
    detail = event.get("detail") or {}
    text = f"{sv.fmt_time(event['at'])}  {event['kind']} by {who}"
    if "step" in detail:
        text += f", from step {detail['step']}"
    changes = parameter_changes(detail)
    return text + (": " + "; ".join(changes) if changes else "")


def parameter_changes(detail: Doc) -> list[str]:
    """The parameters an operator's retry or resume corrected, from its history entry: ``key: old → new``."""
    return [
        f"{key}: {json.dumps(c['old']) if 'old' in c else '(unset)'} → {json.dumps(c['new'])}"
        for key, c in (detail.get("parameters") or {}).items()
    ]


# --- the whole document ---------------------------------------------------------------------


def render(doc: Doc, now: float | None = None) -> str:
    """A task as `asyncflow status` prints it."""
    now = sv.clock() if now is None else now
    head = f"task {doc['task_id']}  flow {doc['flow']}"
    lines = [head, f"  {status_text(doc)}" + (f"  message: {doc['task_message']}" if doc["task_message"] else "")]
    times = f"  created {sv.fmt_time(doc['time_create'])}"
    if doc["time_start"] is not None:
        times += f"  started {local_time(doc['time_start'])[11:]}"
    if doc["time_end"] is not None:
        times += f"  ended {local_time(doc['time_end'])[11:]}"
    ran = span(doc["time_start"], doc["time_end"], now)
    lines.append(times + (f"  took {ran}" if ran else ""))
    if doc.get("user_id"):
        lines.append(f"  user {doc['user_id']}")
    lines.append(f"  parameters {json.dumps(doc['parameters'], sort_keys=True)}")
    lines.append("  steps:")
    lines += ["    " + step_line(doc, i, now) for i in range(len(doc["steps"]))]
    running = running_attempt(doc)
    if running is not None:
        lines.append("  running: " + _running_text(running, now))
    if doc.get("attempts"):
        lines.append("  attempts:")
        rows = [_attempt_row(a, now) for a in doc["attempts"]]
        table = sv.table(("SEQ", "STEP", "KIND", "#", "ACTION", "OUTCOME", "STARTED", "TOOK", "ERROR"), rows)
        lines += ["    " + line for line in table.splitlines()]
    if doc.get("events"):
        lines.append("  history:")
        lines += ["    " + event_line(e) for e in doc["events"]]
    return "\n".join(lines)


def _attempt_row(a: Doc, now: float) -> list[str]:
    return [
        str(a["seq"]),
        str(a["cursor"]),
        "rollback" if a["type"] == 1 else "normal",
        str(a["attempt"]),
        f"{a['module']}.{a['command']}",
        a["outcome"] or ("running" if a["started_at"] is not None else "-"),
        local_time(a["started_at"])[11:] if a["started_at"] is not None else "-",
        span(a["started_at"], a["ended_at"], now),
        " ".join((a["error"] or "").split())[:80],
    ]


def _running_text(attempt: Doc, now: float, where: bool = True) -> str:
    text = f"attempt {attempt['attempt']} for {span(attempt['started_at'], None, now)}"
    if where:
        text = f"step {attempt['cursor']} {text}"
    if attempt.get("heartbeat_at") is not None:
        text += f", last heartbeat {took(now - attempt['heartbeat_at'])} ago"
    progress = progress_text(attempt.get("progress"))
    return text + (f", progress {progress}" if progress else "")


# --- a stream of changes (not a terminal; --wait) -------------------------------------------------


def _step_key(doc: Doc, index: int) -> tuple[Any, ...]:
    s = doc["steps"][index]
    return (s["state"], s["attempts"], rollback_shown(doc, s), s["rollback_state"], s["rollback_attempts"])


def changes(before: Doc | None, after: Doc, now: float) -> list[str]:
    """What changed from ``before`` to ``after``, one line each; with no ``before``, where it stands."""
    lines: list[str] = []
    if before is None:
        lines.append(f"task {after['task_id']}  flow {after['flow']}  {status_text(after)}")
    for i, step in enumerate(after["steps"]):
        if before is None:
            if step["state"] != "pending" or rollback_shown(after, step):
                lines.append("  " + step_line(after, i, now))
        elif _step_key(before, i) != _step_key(after, i):
            lines.append("  " + step_line(after, i, now))
    running = running_attempt(after)
    was = running_attempt(before) if before is not None else None
    fresh = was is None or running is None or was["seq"] != running["seq"] or was.get("progress") != running["progress"]
    if running is not None and running.get("progress") and fresh:
        lines.append(f"  [{running['cursor']}] progress {progress_text(running['progress'])}")
    if before is not None and before["task_status"] != after["task_status"]:
        message = f"  ({after['task_message']})" if after["task_message"] else ""
        lines.append(f"{status_text(after)}{message}")
    return lines


def follow(fetch: Callable[[], Doc], echo: Callable[[str], None], interval: float = 0.2, first: Doc | None = None) -> Doc:
    """Print each change until the task stops; return the last document.

    ``first`` is a document already shown: only what changes after it is printed.
    """
    before = first
    while True:
        doc = fetch()
        for line in changes(before, doc, sv.clock()):
            echo(line)
        before = doc
        if doc["task_status"] in STOPPED:
            return doc
        pause(interval)


# --- the live view (a terminal) ---------------------------------------------------------------


def timeline(start: float | None, end: float | None, begin: float, finish: float, width: int, mark: str) -> str:
    """``mark`` over the part of [begin, finish] that [start, end] covers, in ``width`` columns."""
    cells = [" "] * width
    if start is None or finish <= begin:
        return "".join(cells)
    scale = width / (finish - begin)
    first = min(width - 1, max(0, int((start - begin) * scale)))
    last = min(width - 1, max(first, int(((end if end is not None else finish) - begin) * scale - 1e-9)))
    for i in range(first, last + 1):
        cells[i] = mark
    return "".join(cells)


def live_view(doc: Doc, now: float) -> Group:
    """The task as `status --watch` draws it on a terminal: header, one row per step, the running attempt."""
    begin = doc["time_start"] or doc["time_create"]
    finish = doc["time_end"] if doc["time_end"] is not None else now
    ran = span(doc["time_start"], doc["time_end"], now)
    times = f"\n  created {sv.fmt_time(doc['time_create'])}"
    if ran:
        times += f"  {'took' if doc['time_end'] is not None else 'running for'} {ran}"
    header = Text.assemble(
        (f"task {doc['task_id']}", "bold"),
        f"  flow {doc['flow']}  ",
        (status_text(doc), _status_style(doc["task_status"])),
        times,
    )
    if doc["task_message"]:
        header.append(f"\n  {doc['task_message']}")
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("#", "STEP", "STATE", "TRIES", "TOOK", "TIMELINE", "ROLLBACK", "NOW"):
        table.add_column(column, no_wrap=column != "NOW")
    running = running_attempt(doc)
    for i, step in enumerate(doc["steps"]):
        bar = timeline(step["time_start"], step["time_end"], begin, finish, TIMELINE_WIDTH, "█")
        if step["rollback_time_start"] is not None:
            back = timeline(step["rollback_time_start"], step["rollback_time_end"], begin, finish, TIMELINE_WIDTH, "░")
            bar = "".join(b if b != " " else r for b, r in zip(bar, back, strict=True))
        note = ""
        if running is not None and running["cursor"] == i:
            note = _running_text(running, now, where=False)
        elif step["message"] and step["state"] != "succeeded":
            note = step["message"]
        table.add_row(
            str(i),
            f"{step['normal_module']}.{step['normal_command']}",
            Text(step["state"], _state_style(step["state"])),
            str(step["attempts"] or ""),
            span(step["time_start"], step["time_end"], now) if step["state"] != "pending" else "",
            f"|{bar}|",
            rollback_text(doc, step, now).removeprefix("rollback "),
            note,
        )
    return Group(header, Text(""), table)


def _status_style(status: int) -> str:
    return {0: "green", 2: "cyan", 3: "yellow", 4: "red", 5: "bold red", 6: "magenta"}.get(status, "")


def _state_style(state: str) -> str:
    return {"succeeded": "green", "running": "cyan", "failed": "red", "cancelled": "magenta"}.get(state, "dim")


def watch_live(fetch: Callable[[], Doc], console: Console, interval: float = 0.5) -> Doc:
    """Redraw the live view in place until the task stops; the last drawing stays on screen."""
    doc = fetch()
    with Live(live_view(doc, sv.clock()), console=console, auto_refresh=False) as live:
        while doc["task_status"] not in STOPPED:
            pause(interval)
            doc = fetch()
            live.update(live_view(doc, sv.clock()), refresh=True)
    return doc


# --- lists ----------------------------------------------------------------------------------------


def tasks_table(docs: Sequence[Doc], now: float | None = None) -> str:
    """`asyncflow list`: one row per task, newest first."""
    now = sv.clock() if now is None else now
    rows = [
        (
            d["task_id"],
            d["flow"],
            d["status_name"],
            local_time(d["time_create"]),
            span(d["time_start"], d["time_end"], now) or "-",
            d.get("user_id") or "-",
            " ".join((d["task_message"] or "").split())[:60],
        )
        for d in docs
    ]
    return sv.table(("TASK", "FLOW", "STATUS", "CREATED", "DURATION", "USER", "MESSAGE"), rows, right=(4,))
