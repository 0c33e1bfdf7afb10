"""`asyncflow schedule`: reading the operator's times and durations, and printing schedules and runs.

Times are shown in the local time zone with their UTC offset, to the second
(``2026-11-24 02:00:00 +0100``); durations compactly (``90`` → ``1m30s``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click

# Where "now" comes from for +10m and "in 5m" (tests put their manual clock here).
clock: Callable[[], float] = time.time

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"\d+(?:\.\d+)?"
_PART = re.compile(rf"({_NUMBER})([smhd])")
_DURATION = re.compile(rf"(?:{_NUMBER}[smhd])+")
_EPOCH = re.compile(_NUMBER)
TIME_HELP = "epoch seconds, ISO 8601 (2026-11-24T02:00, offset optional), now, or relative: +10m, -2h"
DURATION_HELP = "seconds, or 30s, 5m, 2h, 1d, 1h30m"

# API field -> the option of `schedule add` that sets it, where their names differ.
OPTION_OF = {
    "schedule_id": "--id",
    "parameters": "--param",
    "task_stage": "--stage",
    "task_content": "--content",
    "run_at": "--at",
    "start_at": "--start",
    "end_at": "--end",
    "catchup_window": "--catchup-window",
    "pause_on_failure": "--pause-on-failure",
    "task_type": "--task-type",
}


# --- reading ----------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """``90``, ``1.5``, ``30s``, ``5m``, ``2h``, ``1d``, ``1h30m`` -> seconds; ValueError otherwise."""
    text = text.strip().lower()
    if _EPOCH.fullmatch(text):
        return float(text)
    if not _DURATION.fullmatch(text):
        raise ValueError(f"{text!r} is not a duration ({DURATION_HELP})")
    return sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(text))


def zone(name: str | None) -> tzinfo | None:
    """The IANA zone ``name`` (None: the local zone); ValueError if unknown."""
    if name is None:
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}") from None


def parse_time(text: str, tz: tzinfo | None = None) -> float:
    """A TIME option -> epoch seconds. A time without offset is in ``tz`` (None: local time)."""
    text = text.strip()
    if text.lower() == "now":
        return clock()
    if text[:1] in "+-" and len(text) > 1:
        offset = parse_duration(text[1:])
        return clock() + (offset if text[0] == "+" else -offset)
    if _EPOCH.fullmatch(text):
        return float(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a time ({TIME_HELP})") from None
    if moment.tzinfo is None:
        # astimezone() reads a naive datetime as local time.
        moment = moment.replace(tzinfo=tz) if tz is not None else moment.astimezone()
    return moment.timestamp()


class Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()


def time_option(text: str | None, option: str, tz: tzinfo | None = None) -> float | None:
    """``parse_time`` for option ``option``, failing as a click usage error."""
    if text is None:
        return None
    try:
        return parse_time(text, tz)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


# --- showing ----------------------------------------------------------------------------


def fmt_time(value: float | None) -> str:
    """Local time with UTC offset, to the second; '-' for none."""
    if value is None:
        return "-"
    return datetime.fromtimestamp(value).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")


def fmt_duration(seconds: float) -> str:
    """Compact: 45s, 5m, 1h30m, 2d3h; fractions of a second only under a minute."""
    if seconds < 60:
        return f"{seconds:g}s"
    rest = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def relative(value: float) -> str:
    """``in 5m`` / ``5m ago`` from now, to the minute past an hour."""
    delta = value - clock()
    size = abs(delta)
    if size >= 3600:
        size = round(size / 60) * 60
    text = fmt_duration(round(size))
    return f"in {text}" if delta >= 0 else f"{text} ago"


def target_text(doc: dict[str, Any]) -> str:
    return doc["flow"] if doc.get("flow") else f"type:{doc['task_type']}"


def when_text(doc: dict[str, Any]) -> str:
    if doc.get("cron") is not None:
        return f"cron {doc['cron']} ({doc['timezone']})"
    if doc.get("every") is not None:
        return f"every {fmt_duration(doc['every'])}"
    return f"at {fmt_time(doc.get('run_at'))}"


def next_text(doc: dict[str, Any]) -> str:
    if doc["state"] != "active":
        return str(doc["state"])
    times = doc.get("next_fire_times") or []
    return fmt_time(times[0]) if times else "buffered"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: Iterable[int] = ()) -> str:
    """Columns two spaces apart, left-aligned (``right``: indexes of right-aligned columns)."""
    lines = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    aligned = frozenset(right)
    return "\n".join(
        "  ".join(c.rjust(w) if i in aligned else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        .rstrip()
        for line in lines
    )


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def schedules_table(docs: Sequence[dict[str, Any]]) -> str:
    rows = [
        (d["schedule_id"], target_text(d), when_text(d), next_text(d), d["overlap"], _clip(d.get("note") or "", 40))
        for d in docs
    ]
    return table(("ID", "TARGET", "WHEN", "NEXT", "OVERLAP", "NOTE"), rows)


def _late(run: dict[str, Any]) -> str:
    if run.get("fired_at") is None:
        return "-"
    return f"{round((run['fired_at'] - run['scheduled_at']) * 1000)}"


def runs_table(runs: Sequence[dict[str, Any]]) -> str:
    rows = [
        (
            fmt_time(r["scheduled_at"]),
            fmt_time(r.get("fired_at")),
            _late(r),
            r.get("task_id") or "-",
            r["status"],
            r.get("reason") or "",
        )
        for r in runs
    ]
    return table(("SCHEDULED", "FIRED", "LATE(ms)", "TASK", "STATUS", "REASON"), rows, right=(2,))


def runs_summary(runs: Sequence[dict[str, Any]]) -> str:
    """``2 fired, 1 skipped (overlap)``."""
    counts: dict[str, int] = {}
    for r in runs:
        key = r["state"] + (f" ({r['reason']})" if r.get("reason") else "")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in counts.items()) or "no new runs"


def render_schedule(doc: dict[str, Any], runs: Sequence[dict[str, Any]] | None = None) -> str:
    """A schedule for people: what it starts, when, under which policy, where it stands."""
    state = {"paused": "PAUSED", "done": "done (no more firings)"}.get(doc["state"], "active")
    lines = [f"schedule {doc['schedule_id']}  {state}"]

    def row(label: str, value: str) -> None:
        lines.append(f"  {label:<9} {value}")

    if doc.get("note"):
        row("note", doc["note"])
    if doc.get("flow"):
        row("target", f"flow {doc['flow']}  parameters {json.dumps(doc.get('parameters') or {}, sort_keys=True)}")
    else:
        target = f"type:{doc['task_type']}"
        if doc.get("task_stage"):
            target += f"  stage {doc['task_stage']}"
        if doc.get("task_content"):
            target += f"  content {_clip(doc['task_content'], 60)!r}"
        row("target", target)
    if doc.get("user_id"):
        row("user", doc["user_id"])
    row("when", when_text(doc))
    if doc.get("start_at") is not None or doc.get("end_at") is not None:
        row("window", f"from {fmt_time(doc.get('start_at'))} until {fmt_time(doc.get('end_at'))}")
    if doc.get("jitter"):
        row("jitter", f"up to {fmt_duration(doc['jitter'])} late")
    row(
        "policy",
        f"overlap {doc['overlap']}, catch-up window {fmt_duration(doc['catchup_window'])}, "
        f"pause on failure {'yes' if doc['pause_on_failure'] else 'no'}",
    )
    first = "if resumed" if doc["state"] == "paused" else "next"
    for i, at in enumerate(doc.get("next_fire_times") or []):
        row(first if i == 0 else "", f"{fmt_time(at)}  ({relative(at)})")
    if doc.get("last_scheduled_at") is not None:
        row("handled", f"every time up to {fmt_time(doc['last_scheduled_at'])}")
    if doc.get("running_task_id"):
        row("running", f"task {doc['running_task_id']}")
    if doc.get("buffered"):
        row("buffered", ", ".join(fmt_time(t) for t in doc["buffered"]))
    row("created", f"{fmt_time(doc['created_at'])}  updated {fmt_time(doc['updated_at'])}")
    if runs is not None:
        lines.append("")
        lines.append(f"runs ({len(runs)} newest):" if runs else "runs: none yet")
        if runs:
            lines += ["  " + line for line in runs_table(runs).splitlines()]
    return "\n".join(lines)
