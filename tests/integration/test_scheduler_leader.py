"""The scheduler loop over real stores: one leader fires, a successor takes over, nothing twice.

Schedulers here are stepped by hand on a manual clock, over memory, SQLite and
PostgreSQL; tests/e2e/test_schedules_e2e.py kills real scheduler processes.
"""

from __future__ import annotations

from dataclasses import replace

from shared.flows import parse_flows
from shared.pull.service import PullService
from shared.saga import Timing
from shared.scheduler import Cadence, Scheduler
from shared.schedules.definition import Definition
from shared.schedules.model import RunState
from shared.schedules.service import ScheduleService
from shared.service import TaskService
from shared.states import TaskStatus
from shared.storage import PullStore, TaskStore
from shared.storage.base import ScheduleStore
from shared.testing import ManualClock, QueuePublisher

FLOWS = parse_flows(
    {"flows": {"one": {"steps": [{"normal": {"module": "m", "command": "c", "timeout": 10}}]}}}
)
CADENCE = Cadence(sweep=0.2, lease_ttl=5.0, load_ahead=60.0, changes=0.2)


class Node:
    """One scheduler process: its own services over the shared stores."""

    def __init__(self, name: str, store: TaskStore, pull: PullStore, schedules: ScheduleStore, clock: ManualClock):
        self.publisher = QueuePublisher()
        tasks = TaskService(store, self.publisher, FLOWS, clock=clock, timing=Timing(requeue_after=600))
        self.service = ScheduleService(schedules, tasks, PullService(pull, clock=clock), clock=clock)
        self.scheduler = Scheduler(tasks, self.service.pull, self.service, CADENCE, clock, owner=name)

    def step(self) -> float:
        return self.scheduler.step()

    @property
    def leads(self) -> bool:
        return self.scheduler.lease is not None


def nodes(store: TaskStore, pull: PullStore, schedules: ScheduleStore, clock: ManualClock, n: int) -> list[Node]:
    return [Node(f"node{i}", store, pull, schedules, clock) for i in range(n)]


def run_for(clock: ManualClock, seconds: float, *alive: Node, step: float = 0.1) -> None:
    end = clock() + seconds
    while clock() < end:
        for node in alive:
            node.step()
        clock.advance(step)


def fired_times(schedules: ScheduleStore, schedule_id: str) -> list[float]:
    return sorted(r.scheduled_at for r in schedules.runs(schedule_id, 10_000) if r.state is RunState.FIRED)


def test_one_leader_fires_and_a_successor_takes_over_without_gaps_or_doubles(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    a, b, c = nodes(store, pull_store, schedule_store, clock, 3)
    a.step()  # a leads: first to ask
    b.step()
    c.step()
    assert [n.leads for n in (a, b, c)] == [True, False, False]
    a.service.add(Definition(schedule_id="tick", flow="one", every=1.0, overlap="allow_all"))
    run_for(clock, 10, a, b, c)
    first = fired_times(schedule_store, "tick")
    assert len(first) >= 9
    # a dies (stops renewing): within the lease time another leads and catches up.
    run_for(clock, 8, b, c)
    assert b.leads or c.leads
    run_for(clock, 5, b, c)
    times = fired_times(schedule_store, "tick")
    assert times == sorted(set(times)), "a firing recorded twice"
    expected = [t for t in range(int(times[0]), int(clock()) - 1)]
    assert [int(t) for t in times[: len(expected)]] == expected, "a scheduled second was missed"
    # Every firing created its task once; its first step was published once.
    published = [m.task_id for n in (a, b, c) for m in n.publisher.messages]
    assert sorted(published) == sorted(set(published))
    assert len(published) == len(times)


def test_a_deposed_leader_that_wakes_up_fires_nothing(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    a, b = nodes(store, pull_store, schedule_store, clock, 2)
    a.step()
    a.service.add(Definition(schedule_id="tick", flow="one", every=1.0, overlap="allow_all"))
    run_for(clock, 3, a)
    run_for(clock, 7, b)  # a froze (a long GC pause, a stopped VM); b took over
    assert b.leads
    before = fired_times(schedule_store, "tick")
    # a wakes with its old timetable and old lease, before it would renew or reread anything.
    for what in ("renew", "load", "changes"):
        a.scheduler._due[what] = clock() + 100
    assert a.scheduler.timetable.next_at() is not None
    a.step()
    assert not a.leads, "the fenced write must make it stand down"
    assert fired_times(schedule_store, "tick") == before


def test_changes_by_users_reach_the_leader_and_deleted_schedules_stop(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    leader, api = nodes(store, pull_store, schedule_store, clock, 2)
    run_for(clock, 1, leader)
    api.service.add(Definition(schedule_id="soon", flow="one", run_at=clock() + 2))
    run_for(clock, 3, leader)
    assert len(fired_times(schedule_store, "soon")) == 1
    api.service.add(Definition(schedule_id="often", flow="one", every=1.0, overlap="allow_all"))
    run_for(clock, 2.5, leader)
    api.service.pause("often", "maintenance")
    paused_at = len(fired_times(schedule_store, "often"))
    assert paused_at >= 1
    run_for(clock, 5, leader)
    assert len(fired_times(schedule_store, "often")) == paused_at
    api.service.resume("often")
    run_for(clock, 3, leader)
    assert len(fired_times(schedule_store, "often")) > paused_at
    api.service.delete("often")
    run_for(clock, 3, leader)
    assert schedule_store.get("often") is None and schedule_store.runs("often", 10) == []


def test_buffered_firing_starts_when_the_running_task_ends(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    [leader] = nodes(store, pull_store, schedule_store, clock, 1)
    leader.service.add(Definition(schedule_id="b1", flow="one", every=10.0, overlap="buffer_one"))
    run_for(clock, 35, leader)  # fires once; the next is buffered, the one after skipped
    runs = {r.state for r in schedule_store.runs("b1", 100)}
    assert runs == {RunState.FIRED, RunState.BUFFERED, RunState.SKIPPED}
    [first] = [r for r in schedule_store.runs("b1", 100) if r.state is RunState.FIRED]
    assert first.task_id is not None
    task = store.get(first.task_id)
    assert task is not None and store.save(replace(task, status=TaskStatus.SUCCESS), clock())
    run_for(clock, 2, leader)  # watched: the buffered one starts within a watch interval
    fired = [r for r in schedule_store.runs("b1", 100) if r.state is RunState.FIRED]
    assert len(fired) == 2


def test_a_failed_task_pauses_a_schedule_with_pause_on_failure(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    [leader] = nodes(store, pull_store, schedule_store, clock, 1)
    leader.service.add(Definition(schedule_id="p", flow="one", every=3600.0, pause_on_failure=True))
    run_for(clock, 1, leader)
    clock.advance(3599 - clock() % 3600)
    run_for(clock, 2, leader)
    [run] = schedule_store.runs("p", 10)
    assert run.task_id is not None
    task = store.get(run.task_id)
    assert task is not None and store.save(replace(task, status=TaskStatus.FAILED), clock())
    run_for(clock, 2, leader)
    paused = schedule_store.get("p")
    assert paused is not None and paused.paused and run.task_id in paused.note


def test_missed_firings_beyond_the_catchup_window_are_recorded_as_skipped(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    [leader] = nodes(store, pull_store, schedule_store, clock, 1)
    leader.service.add(Definition(schedule_id="m", flow="one", every=60.0, catchup_window=120, overlap="allow_all"))
    clock.advance(600)  # no scheduler ran for ten minutes
    run_for(clock, 1, leader)
    runs = schedule_store.runs("m", 100)
    assert {r.state for r in runs if clock() - r.scheduled_at > 121} == {RunState.SKIPPED}
    assert {r.state for r in runs if clock() - r.scheduled_at <= 120} == {RunState.FIRED}
    assert len(runs) == 10


def test_old_runs_are_purged_by_the_leader(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore
) -> None:
    clock = ManualClock(1_700_000_000.0)
    [leader] = nodes(store, pull_store, schedule_store, clock, 1)
    leader.scheduler.cadence = replace(CADENCE, retention=30.0)
    leader.service.add(Definition(schedule_id="r", flow="one", every=10.0, overlap="allow_all"))
    run_for(clock, 120, leader, step=1.0)
    kept = [r.scheduled_at for r in schedule_store.runs("r", 100)]
    assert kept and min(kept) >= clock() - 30 - 60 - 1  # purged each minute, 30 s retention
    assert len(kept) < 11
