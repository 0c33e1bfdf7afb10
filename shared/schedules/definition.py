"""A schedule as users write it (API body, flows.yaml ``schedules:`` entry), and its checks.

Field by field, pydantic checks types and ranges; :meth:`Definition.problems`
checks what spans fields (one target, one kind of time, end after start, the cron
expression and the time zone), each problem named by its field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.names import NAME
from shared.pull.rules import MAX_CONTENT_BYTES
from shared.schedules.model import DEFAULT_CATCHUP_WINDOW, Overlap, Policy, Schedule, Target, When
from shared.schedules.timing import InvalidWhen, check, initial_cursor, times_after
from shared.storable import json_problem

# Short enough that the id of a task it creates ("sch.<id>.<ms>") fits a task id.
SCHEDULE_ID = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$"
YEAR = 366 * 24 * 3600.0


class Problem(Exception):
    """One or more fields of a definition are wrong: ``problems`` is [(field, what is wrong)]."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {p}" for f, p in problems))
        self.problems = problems


class Definition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schedule_id: str | None = Field(
        default=None, pattern=SCHEDULE_ID, description="Client-chosen id; replaying the same body returns it"
    )
    flow: str | None = Field(default=None, pattern=NAME, description="Flow to start (or give task_type)")
    parameters: dict[str, Any] | None = Field(default=None, description="Parameters of the flow's task")
    task_type: str | None = Field(default=None, pattern=NAME, description="v1 task type to create a task of")
    task_stage: str | None = Field(default=None, max_length=64)
    task_content: str | None = Field(default=None, max_length=MAX_CONTENT_BYTES)
    user_id: str | None = Field(default=None, max_length=128, description="Owner of the tasks it creates")
    run_at: float | None = Field(default=None, description="Fire once at this time (epoch seconds)")
    cron: str | None = Field(
        default=None, max_length=200, description="Cron expression: 5 fields, or 6 with seconds first"
    )
    every: float | None = Field(default=None, description="Fire every this many seconds")
    timezone: str = Field(default="UTC", max_length=64, description="IANA time zone the cron is read in")
    start_at: float | None = Field(default=None, description="No firing before this time (epoch seconds)")
    end_at: float | None = Field(default=None, description="No firing after this time (epoch seconds)")
    jitter: float = Field(default=0.0, ge=0, le=YEAR, description="Delay each firing by up to this many seconds")
    overlap: Overlap = Field(default=Overlap.SKIP, description="What a firing does while the last task still runs")
    catchup_window: float = Field(
        default=DEFAULT_CATCHUP_WINDOW, ge=0, le=YEAR, description="Missed firings younger than this still fire"
    )
    pause_on_failure: bool = Field(default=False, description="Pause when a task it started fails")
    paused: bool = False
    note: str = Field(default="", max_length=1000)

    @field_validator("parameters")
    @classmethod
    def _storable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            # flows.yaml can hold what JSON cannot: a date (2024-01-01 unquoted), NaN (.nan).
            raise ValueError(f"must be JSON (quote dates in YAML): {exc}") from None
        problem = json_problem(value, "parameters")
        if problem:
            raise ValueError(problem)
        return value

    def problems(self) -> list[tuple[str, str]]:
        """What spans fields; the time checks of :func:`shared.schedules.timing.check`."""
        found: list[tuple[str, str]] = []
        if (self.flow is None) == (self.task_type is None):
            found.append(("flow", "give exactly one of flow, task_type"))
        if self.flow is not None:
            found += [(name, "only with task_type") for name in ("task_stage", "task_content") if getattr(self, name)]
        if self.task_type is not None and self.parameters is not None:
            found.append(("parameters", "only with flow (a v1 task has task_content)"))
        # The times of ``When`` are checked for finiteness by ``check``; this one is not in it.
        if not math.isfinite(self.catchup_window):
            found.append(("catchup_window", "must be a finite number"))
        if not found:
            try:
                check(self.when())
            except InvalidWhen as exc:
                found.append((exc.field, exc.problem))
        return found

    def when(self) -> When:
        return When(
            run_at=self.run_at,
            cron=self.cron,
            every=self.every,
            timezone=self.timezone,
            start_at=self.start_at,
            end_at=self.end_at,
            jitter=self.jitter,
        )

    def schedule(self, schedule_id: str, now: float, new_run_at: bool = True) -> Schedule:
        """The schedule it defines; raises :class:`Problem`.

        ``new_run_at``: its ``run_at`` is being set now, so one older than the
        catch-up window is refused (it could never fire). A stored one-off that
        fired long ago is not.
        """
        found = self.problems()
        if not found and new_run_at and self.run_at is not None and now - self.run_at > self.catchup_window:
            found.append(("run_at", f"{now - self.run_at:.0f} s in the past, beyond catchup_window"))
        if found:
            raise Problem(found)
        when = self.when()
        cursor = initial_cursor(when, now)
        following = times_after(when, cursor, 1)
        return Schedule(
            schedule_id=schedule_id,
            target=Target(
                flow=self.flow,
                parameters=self.parameters or {},
                task_type=self.task_type,
                task_stage=self.task_stage or "",
                task_content=self.task_content or "",
                user_id=self.user_id,
            ),
            when=when,
            policy=Policy(self.overlap, self.catchup_window, self.pause_on_failure),
            paused=self.paused,
            note=self.note,
            created_at=now,
            updated_at=now,
            cursor=cursor,
            next_at=following[0] if following else None,
        )


def definition_of(schedule: Schedule) -> Definition:
    """The definition a schedule was made from (for replays and edits)."""
    t, w, p = schedule.target, schedule.when, schedule.policy
    return Definition(
        schedule_id=schedule.schedule_id,
        flow=t.flow,
        parameters=dict(t.parameters) if t.flow is not None else None,
        task_type=t.task_type,
        task_stage=t.task_stage or None,
        task_content=t.task_content or None,
        user_id=t.user_id,
        run_at=w.run_at,
        cron=w.cron,
        every=w.every,
        timezone=w.timezone,
        start_at=w.start_at,
        end_at=w.end_at,
        jitter=w.jitter,
        overlap=p.overlap,
        catchup_window=p.catchup_window,
        pause_on_failure=p.pause_on_failure,
        paused=schedule.paused,
        note=schedule.note,
    )
