"""Stored task rows outlive releases: a row written before a change of the flow config still loads.

The row below is what release 0.1.0 wrote for a submitted two-step task: each
step's settings were a dump of the flows.yaml model, uniform retries spelled
``retry_interval`` (since folded into ``max_retry_interval``, see shared/retry.py).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from shared.flows import parse_flows
from shared.saga import Failed, Started, Submit, decide
from shared.states import Phase, StepType, TaskStatus
from shared.storage.codec import command_to_json, step_to_json, task_from_row, task_to_row
from shared.task import Command, new_task

NOW = 1_700_000_000.0

ROW_0_1_0: dict[str, Any] = {
    "task_id": "old-1",
    "flow": "two",
    "status": 1,
    "cursor": 0,
    "message": None,
    "priority": 0,
    "user_id": None,
    "parameters": {"Cpu": 4},
    "steps": [
        {
            "normal": {"module": "alpha", "command": "step", "timeout": 20.0, "retry": 2,
                       "retry_interval": 0.5, "max_retry_interval": -1.0},
            "rollback": {"module": "alpha", "command": "undo", "timeout": 20.0, "retry": 1,
                         "retry_interval": 1.0, "max_retry_interval": 8.0},
            "state": 0, "rollback_state": 0, "code": 0, "message": None,
            "time_start": None, "time_end": None, "rollback_time_start": None, "rollback_time_end": None,
            "attempts": 0, "rollback_attempts": 0,
        },
        {
            "normal": {"module": "beta", "command": "step", "timeout": 30.0, "retry": 0,
                       "retry_interval": 1.0, "max_retry_interval": -1.0},
            "rollback": None,
            "state": 0, "rollback_state": 0, "code": 0, "message": None,
            "time_start": None, "time_end": None, "rollback_time_start": None, "rollback_time_end": None,
            "attempts": 0, "rollback_attempts": 0,
        },
    ],
    "created_at": NOW, "started_at": None, "ended_at": None, "updated_at": NOW,
    "cancel_requested": False, "seq": 1,
    "active_seq": 1, "active_cursor": 0, "active_type": 0, "active_attempt": 1, "active_phase": 1,
    "due_at": NOW + 30, "active_started_at": None, "version": 1,
}


def test_a_row_of_release_0_1_0_loads_with_its_retry_settings() -> None:
    task = task_from_row(ROW_0_1_0)
    assert task.steps[0].normal == Command("alpha", "step", 20.0, 2, max_retry_interval=-0.5)
    assert task.steps[0].rollback == Command("alpha", "undo", 20.0, 1, max_retry_interval=8.0)
    assert task.steps[1].normal == Command("beta", "step", 30.0, 0, max_retry_interval=-1.0)
    assert task.active is not None and task.active.phase is Phase.QUEUED


def test_the_old_row_keeps_running_with_the_settings_it_was_submitted_with() -> None:
    task = task_from_row(ROW_0_1_0)
    task = decide(task, Started(1), NOW + 1).task
    decision = decide(task, Failed(1, "boom"), NOW + 2)
    assert decision.task.status is TaskStatus.RUNNING
    active = decision.task.active
    assert active is not None and active.phase is Phase.WAITING
    assert active.due_at == NOW + 2 + 0.5  # the uniform 0.5 s of its retry_interval


def test_keys_a_later_release_adds_or_drops_do_not_stop_a_row_loading() -> None:
    row = copy.deepcopy(ROW_0_1_0)
    step = row["steps"][0]
    step["normal"]["heartbeat"] = 5  # a setting this release does not know
    del step["normal"]["timeout"], step["normal"]["retry"]  # settings it would default
    step["future_field"] = {"x": 1}
    task = task_from_row(row)
    assert task.steps[0].normal == Command("alpha", "step", 300.0, 0, max_retry_interval=-0.5)


def test_rows_written_now_load_back_the_same() -> None:
    task = task_from_row(ROW_0_1_0)
    again = task_from_row(task_to_row(task, NOW))
    assert again == task
    assert task_to_row(task, NOW)["steps"][0]["normal"] == {
        "module": "alpha", "command": "step", "timeout": 20.0, "retry": 2, "max_retry_interval": -0.5,
    }
    assert again.steps[0].action(StepType.ROLLBACK).backoff(3) == 4


def test_a_command_is_stored_with_every_field_it_has() -> None:
    command = Command("alpha", "step", 20.0, 2, -0.5)
    assert command_to_json(command) == dataclasses.asdict(command)



def test_new_tasks_of_a_flow_share_their_first_steps_and_their_json() -> None:
    declared = {"flows": {"two": {"steps": [
        {"normal": {"module": "m", "command": "a"}, "rollback": {"module": "m", "command": "undo"}},
        {"normal": {"module": "m", "command": "b", "retry": 2}},
    ]}}}
    flow = parse_flows(declared).flows["two"]
    one, two = new_task("t1", flow, {}, NOW), new_task("t2", flow, {"x": 1}, NOW)
    assert one.steps is two.steps
    row = task_to_row(one, NOW)
    assert row["steps"] is task_to_row(two, NOW)["steps"]
    assert row["steps"] == [step_to_json(s) for s in one.steps]
    # A step that changes is a new step: the others' shared steps and JSON stay as they were.
    ran = decide(decide(one, Submit(), NOW).task, Started(1), NOW + 1).task
    assert ran.steps[0].state is not one.steps[0].state and two.steps is one.steps
    assert task_to_row(ran, NOW)["steps"][0]["state"] != row["steps"][0]["state"]
    assert task_to_row(two, NOW)["steps"] == [step_to_json(s) for s in two.steps]
    # Flows read again (a reload) are new objects, with steps of their own.
    again = parse_flows(declared).flows["two"]
    assert new_task("t3", again, {}, NOW).steps is not one.steps
    assert task_from_row(task_to_row(new_task("t3", again, {}, NOW), NOW)).steps == one.steps
