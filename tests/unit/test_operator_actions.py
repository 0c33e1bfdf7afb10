"""Retry and resume with corrected parameters: the saga's merge, the service's checks and the history."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.flows import Action, Flow, FlowSet, StepDef
from shared.parameters import InvalidParameters
from shared.saga import Cancel, Failed, InvalidAction, Resume, Retry, Started, Submit, Succeeded, decide
from shared.service import TaskService
from shared.states import StepType, TaskStatus
from shared.storage import InMemoryStore, TaskEvent
from shared.task import Task, new_task
from shared.testing.clock import ManualClock
from shared.testing.fakes import QueuePublisher

FLOW = Flow(
    name="f",
    steps=(
        StepDef(normal=Action(module="m", command="do0"), rollback=Action(module="m", command="undo0")),
        StepDef(normal=Action(module="m", command="do1"), rollback=Action(module="m", command="undo1")),
    ),
)
DECLARED = FLOW.model_copy(
    update={
        "name": "declared",
        "parameters": {
            "type": "object",
            "properties": {
                "Cpu": {"type": "integer", "minimum": 1, "maximum": 64},
                "Zone": {"type": "string", "default": "a"},
            },
            "required": ["Cpu"],
        },
    }
)


def outcome(task: Task, event: Any, now: float = 10.0) -> Task:
    """Start the outstanding attempt, then apply ``event(seq)``."""
    assert task.active is not None
    task = decide(task, Started(task.active.seq), now).task
    return decide(task, event(task.active.seq), now).task


def failed_at_step_1(parameters: dict[str, Any], flow: Flow = FLOW) -> Task:
    """A task whose step 1 failed and whose step 0 was compensated."""
    task = decide(new_task("t1", flow, parameters, now=1.0), Submit(), 1.0).task
    task = outcome(task, lambda seq: Succeeded(seq))
    task = outcome(task, lambda seq: Failed(seq, "bad Cpu", permanent=True))  # step 1; its rollback is queued
    task = outcome(task, lambda seq: Succeeded(seq))  # undo1
    task = outcome(task, lambda seq: Succeeded(seq))  # undo0
    assert task.status is TaskStatus.FAILED
    return task


def rollback_failed(parameters: dict[str, Any]) -> Task:
    task = decide(new_task("t1", FLOW, parameters, now=1.0), Submit(), 1.0).task
    task = outcome(task, lambda seq: Succeeded(seq))
    task = outcome(task, lambda seq: Failed(seq, "bad", permanent=True))
    task = outcome(task, lambda seq: Failed(seq, "undo failed", permanent=True))
    assert task.status is TaskStatus.ROLLBACK_FAILED
    return task


# --- the saga: pure --------------------------------------------------------------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=5,
)
parameter_maps = st.dictionaries(st.sampled_from(["Cpu", "Zone", "fail_at", "x"]), json_values, max_size=4)


@given(original=parameter_maps, corrections=parameter_maps)
def test_retry_merges_the_corrections_over_the_parameters_and_sends_them(
    original: dict[str, Any], corrections: dict[str, Any]
) -> None:
    d = decide(failed_at_step_1(original), Retry(corrections), 20.0)
    assert d.task.parameters == {**original, **corrections}
    (message,) = d.messages
    assert message.parameters == {**original, **corrections}
    assert (message.cursor, message.type) == (0, StepType.NORMAL)  # step 0 was undone: redone first


@given(original=parameter_maps, corrections=parameter_maps)
def test_resume_merges_the_corrections_before_compensating_again(
    original: dict[str, Any], corrections: dict[str, Any]
) -> None:
    d = decide(rollback_failed(original), Resume(corrections), 20.0)
    (message,) = d.messages
    assert (message.cursor, message.type) == (1, StepType.ROLLBACK)
    assert d.task.parameters == message.parameters == {**original, **corrections}


def test_no_corrections_change_nothing_but_the_state() -> None:
    task = failed_at_step_1({"Cpu": 4})
    assert decide(task, Retry(), 20.0).task.parameters is task.parameters


def test_an_action_the_state_forbids_is_refused_with_or_without_corrections() -> None:
    running = decide(new_task("t1", FLOW, {"Cpu": 4}, now=1.0), Submit(), 1.0).task
    with pytest.raises(InvalidAction):
        decide(running, Retry({"Cpu": 8}), 2.0)
    with pytest.raises(InvalidAction):
        decide(running, Resume({"Cpu": 8}), 2.0)


# --- the service: checks and history ---------------------------------------------------------------


def service(flows: dict[str, Flow] | None = None) -> TaskService:
    flow_set = FlowSet(flows if flows is not None else {"f": FLOW, "declared": DECLARED}, {}, "test")
    return TaskService(InMemoryStore(), QueuePublisher(), flow_set, clock=ManualClock(50.0))


def stored_failed(svc: TaskService, flow: Flow, parameters: dict[str, Any]) -> str:
    task = failed_at_step_1(parameters, flow)
    svc.store.create(task, 1.0)
    return task.task_id


def test_a_retry_with_corrections_records_who_changed_what() -> None:
    svc = service()
    task_id = stored_failed(svc, FLOW, {"Cpu": 4, "fail_at": [1]})
    task = svc.operate(task_id, Retry({"fail_at": [], "Zone": "b"}), actor="alice")
    assert task.parameters == {"Cpu": 4, "fail_at": [], "Zone": "b"}
    assert svc.get(task_id).parameters == task.parameters and task.version == svc.get(task_id).version
    assert svc.store.events(task_id) == [
        TaskEvent(task_id, 50.0, "retry", "alice",
                  {"step": 0, "parameters": {"fail_at": {"old": [1], "new": []}, "Zone": {"new": "b"}}})
    ]


def test_a_value_equal_in_python_but_not_in_json_is_a_change() -> None:
    svc = service()
    task_id = stored_failed(svc, FLOW, {"flag": 1})
    svc.operate(task_id, Retry({"flag": True}))
    (event,) = svc.store.events(task_id)
    assert event.detail["parameters"] == {"flag": {"old": 1, "new": True}}
    assert event.actor is None


def test_corrections_are_checked_against_the_declaration_and_nothing_is_stored_when_refused() -> None:
    svc = service()
    task_id = stored_failed(svc, DECLARED, {"Cpu": 4, "Zone": "a"})
    before = svc.get(task_id)
    with pytest.raises(InvalidParameters) as refused:
        svc.operate(task_id, Retry({"Cpu": 500}), actor="alice")
    assert refused.value.detail[0]["field"] == "parameters.Cpu"
    assert svc.get(task_id) == before
    assert svc.store.events(task_id) == []
    assert not svc.publisher.messages  # type: ignore[attr-defined]


def test_declared_defaults_fill_in_a_parameter_the_task_lacked() -> None:
    svc = service()
    task_id = stored_failed(svc, DECLARED, {"Cpu": 4})  # stored before Zone had a default
    task = svc.operate(task_id, Retry({"Cpu": 8}))
    assert task.parameters == {"Cpu": 8, "Zone": "a"}
    assert svc.store.events(task_id)[0].detail["parameters"] == {"Cpu": {"old": 4, "new": 8}, "Zone": {"new": "a"}}


def test_the_state_is_refused_before_the_parameters_are_looked_at() -> None:
    svc = service()
    task, _ = svc.submit("declared", {"Cpu": 4})
    with pytest.raises(InvalidAction):
        svc.operate(task.task_id, Retry({"Cpu": "many"}))


def test_a_flow_gone_from_flows_yaml_takes_corrections_unchecked() -> None:
    svc = service({})
    task_id = stored_failed(svc, DECLARED, {"Cpu": 4})
    assert svc.operate(task_id, Retry({"Cpu": "many"})).parameters["Cpu"] == "many"


def test_cancel_is_recorded_once_and_resume_says_where_it_starts() -> None:
    svc = service()
    task, _ = svc.submit("f", {"Cpu": 4})
    assert task.active is not None
    svc.apply(task.task_id, Started(task.active.seq))  # running: the cancel waits for its outcome
    svc.operate(task.task_id, Cancel(), actor="bob")
    svc.operate(task.task_id, Cancel(), actor="bob")  # already requested: changes nothing, not recorded
    assert [(e.kind, e.actor, e.detail) for e in svc.store.events(task.task_id)] == [("cancel", "bob", {})]

    svc = service()
    task = rollback_failed({"Cpu": 4})
    svc.store.create(task, 1.0)
    svc.operate(task.task_id, Resume({"Cpu": 2}), actor="carol")
    (event,) = svc.store.events(task.task_id)
    assert (event.kind, event.detail) == ("resume", {"step": 1, "parameters": {"Cpu": {"old": 4, "new": 2}}})
