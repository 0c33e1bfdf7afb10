"""Task <-> row mapping. The steps list is stored as JSON inside the task row.

Rows outlive releases: decoding reads the keys it knows, ignores the others and
fills the ones an older release did not write, so a change to the flow config
never makes stored tasks unreadable.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from shared.states import Phase, StepState, StepType, TaskStatus
from shared.task import FIRST_STEPS_KEPT, Active, Command, Step, Task, is_first_steps

# What orjson would encode and json refuses goes to json instead, which refuses it
# as before: a type it does not know, or a subclass that may encode itself otherwise.
_AS_JSON_DOES = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS


def json_text(value: Any) -> bytes:
    """A JSON column's text, as PostgreSQL is sent it.

    orjson encodes a task's steps and parameters in a fraction of json's CPU
    (json's encoding was 8 % of a flow's instructions, benchmarks/README.md). The same
    documents come out, but for NaN and infinities (null here; json's tokens are
    invalid JSON, which PostgreSQL refuses) and integers past 64 bits, which orjson
    refuses and json writes.
    """
    try:
        return orjson.dumps(value, option=_AS_JSON_DOES)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()


def orjson_reads_as_json_does(text: bytes) -> bool:
    """Whether orjson reads the JSON ``text`` as json would, where it reads it at all.

    orjson reads an integer past 64 bits as a float, where json reads it whole: a
    run of 19 digits or more may be one. What else they differ on orjson refuses
    (NaN, infinities and numbers past a float's range, a byte-order mark, UTF-16
    and UTF-32, surrogates).
    """
    return _LONG_RUN not in text.translate(_DIGITS_AS_ZERO)


# Every digit as 0: a run of 19 digits is then a run of 19 zeros, found in a tenth of a regular expression's time.
_DIGITS_AS_ZERO, _LONG_RUN = bytes.maketrans(b"123456789", b"000000000"), b"0" * 19


def command_from_json(data: dict[str, Any]) -> Command:
    max_retry_interval = float(data.get("max_retry_interval", -1))
    if max_retry_interval < 0 and "retry_interval" in data:
        # Before the retry rule had one encoding, uniform retries waited retry_interval seconds.
        max_retry_interval = -float(data["retry_interval"])
    return Command(
        module=str(data["module"]),
        command=str(data["command"]),
        timeout=float(data.get("timeout", 300)),
        retry=int(data.get("retry", 0)),
        max_retry_interval=max_retry_interval,
    )


def command_to_json(command: Command) -> dict[str, Any]:
    # Field by field: dataclasses.asdict copies each value deeply, and every save of
    # a task encodes all its steps' commands.
    return {
        "module": command.module,
        "command": command.command,
        "timeout": command.timeout,
        "retry": command.retry,
        "max_retry_interval": command.max_retry_interval,
    }


def step_to_json(step: Step) -> dict[str, Any]:
    return {
        "normal": command_to_json(step.normal),
        "rollback": command_to_json(step.rollback) if step.rollback else None,
        "state": int(step.state),
        "rollback_state": int(step.rollback_state),
        "code": int(step.code),
        "message": step.message,
        "time_start": step.time_start,
        "time_end": step.time_end,
        "rollback_time_start": step.rollback_time_start,
        "rollback_time_end": step.rollback_time_end,
        "attempts": step.attempts,
        "rollback_attempts": step.rollback_attempts,
    }


# The JSON of the steps every new task of a flow shares (shared.task.first_steps), made
# once: new tasks are most of what an intake stores. Shared, so never changed by
# whoever reads it. Kept as that cache is, by id beside the steps, and bounded.
_first_json: dict[int, tuple[tuple[Step, ...], list[dict[str, Any]]]] = {}


def steps_to_json(steps: tuple[Step, ...]) -> list[dict[str, Any]]:
    cached = _first_json.get(id(steps))
    if cached is not None and cached[0] is steps:
        return cached[1]
    data = [step_to_json(s) for s in steps]
    if is_first_steps(steps):
        if len(_first_json) >= FIRST_STEPS_KEPT:
            _first_json.clear()
        _first_json[id(steps)] = (steps, data)
    return data


def step_from_json(data: dict[str, Any]) -> Step:
    rollback = data.get("rollback")
    return Step(
        normal=command_from_json(data["normal"]),
        rollback=command_from_json(rollback) if rollback is not None else None,
        state=StepState(data["state"]),
        rollback_state=StepState(data["rollback_state"]),
        code=int(data["code"]),
        message=data.get("message"),
        time_start=data.get("time_start"),
        time_end=data.get("time_end"),
        rollback_time_start=data.get("rollback_time_start"),
        rollback_time_end=data.get("rollback_time_end"),
        attempts=int(data.get("attempts", 0)),
        rollback_attempts=int(data.get("rollback_attempts", 0)),
    )


def task_to_row(task: Task, now: float) -> dict[str, Any]:
    return task_fields(task) | {"updated_at": now}


def task_fields(task: Task) -> dict[str, Any]:
    """The task's row but for when it was written: what :func:`task_from_row` reads back."""
    active = task.active
    return {
        "task_id": task.task_id,
        "flow": task.flow,
        "status": int(task.status),
        "cursor": task.cursor,
        "message": task.message,
        "priority": task.priority,
        "user_id": task.user_id,
        "parameters": dict(task.parameters),
        "steps": steps_to_json(task.steps),
        "created_at": task.created_at,
        "started_at": task.started_at,
        "ended_at": task.ended_at,
        "cancel_requested": task.cancel_requested,
        "seq": task.seq,
        "active_seq": active.seq if active else None,
        "active_cursor": active.cursor if active else None,
        "active_type": int(active.type) if active else None,
        "active_attempt": active.attempt if active else None,
        "active_phase": int(active.phase) if active else None,
        "due_at": active.due_at if active else None,
        "active_started_at": active.started_at if active else None,
        "active_held": active.held if active else 0,
        "version": task.version,
    }


def task_from_row(row: Any) -> Task:
    m = row._mapping if hasattr(row, "_mapping") else row
    active = None
    if m["active_seq"] is not None:
        active = Active(
            seq=m["active_seq"],
            cursor=m["active_cursor"],
            type=StepType(m["active_type"]),
            attempt=m["active_attempt"],
            phase=Phase(m["active_phase"]),
            due_at=m["due_at"],
            started_at=m["active_started_at"],
            held=m.get("active_held") or 0,  # rows written before 0006 have none
        )
    return Task(
        task_id=m["task_id"],
        flow=m["flow"],
        status=TaskStatus(m["status"]),
        cursor=m["cursor"],
        parameters=dict(m["parameters"]),
        steps=tuple(step_from_json(s) for s in m["steps"]),
        created_at=m["created_at"],
        priority=m["priority"],
        user_id=m["user_id"],
        message=m["message"],
        started_at=m["started_at"],
        ended_at=m["ended_at"],
        cancel_requested=bool(m["cancel_requested"]),
        seq=m["seq"],
        active=active,
        version=m["version"],
    )
