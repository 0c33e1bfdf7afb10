"""The pure part of pull-mode modules: step ids, and set_task -> saga event."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.flows import parse_flows
from shared.pull.rules import PullStatus, Report
from shared.pull.steps import InvalidStepReport, parse_step_id, step_event, step_id
from shared.saga import Failed, PollLater, Started, Submit, Succeeded, Timing, decide
from shared.task import Task, new_task

FLOWS = parse_flows(
    {
        "modules": {"dns": {"mode": "pull"}},
        "flows": {"f": {"steps": [{"normal": {"module": "dns", "command": "add", "timeout": 10}}]}},
    }
)
TASK_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", fullmatch=True)


@given(TASK_IDS, st.integers(min_value=0, max_value=2**31))
def test_a_step_id_names_its_task_and_seq(task_id: str, seq: int) -> None:
    assert parse_step_id(step_id(task_id, seq)) == (task_id, seq)
    assert len(step_id(task_id, seq)) <= 80  # the v1 id column


@pytest.mark.parametrize("text", ["", "abc", ".5", "abc.", "abc.x", "abc.-1", "abc.5a"])
def test_other_ids_are_not_steps(text: str) -> None:
    assert parse_step_id(text) is None


def running_task(started_at: float = 100.0) -> Task:
    task = new_task("t1", FLOWS.flows["f"], {}, 0.0)
    task = decide(task, Submit(), 0.0, Timing()).task
    return decide(task, Started(1), started_at, Timing()).task


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        (Report(PullStatus.SUCCESS, task_content='{"A": 1}'), Succeeded(1, {"A": 1})),
        (Report(PullStatus.SUCCESS), Succeeded(1, {})),
        (Report(PullStatus.FAILED, schedule_log="no"), Failed(1, "no")),
        (Report(PullStatus.FAILED), Failed(1, "the worker reported a failure")),
        (Report(PullStatus.PENDING, task_content='{"Job": "j"}'), PollLater(1, 7.0, {"Job": "j"})),
        (Report(PullStatus.PENDING, crt_retry_num=1, schedule_log="x"), Failed(1, "x")),
        (Report(PullStatus.RUNNING), None),
    ],
)
def test_each_report_is_one_saga_event(report: Report, expected: object) -> None:
    assert step_event(report, 1, running_task(), 7.0, now=105.0) == expected


def test_success_after_the_timeout_is_a_timeout() -> None:
    event = step_event(Report(PullStatus.SUCCESS), 1, running_task(started_at=100.0), 7.0, now=110.5)
    assert isinstance(event, Failed) and event.timed_out


@pytest.mark.parametrize("content", ["[1]", "3", "not json", '"text"'])
def test_a_result_must_be_a_json_object(content: str) -> None:
    with pytest.raises(InvalidStepReport):
        step_event(Report(PullStatus.SUCCESS, task_content=content), 1, running_task(), 7.0, now=101.0)
