"""Which firings are due: overlap policies, catch-up, pause on failure, trigger, backfill."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.schedules.model import (
    Overlap,
    Policy,
    Run,
    RunState,
    Schedule,
    SkipReason,
    Target,
    When,
    task_id_of,
)
from shared.schedules.plan import Plan, Running, next_fire_at, plan_backfill, plan_due, plan_trigger
from shared.schedules.timing import initial_cursor, jitter_of, times_after, times_between

T0 = 1_699_999_980.0  # a whole minute
SID = "nightly"
TARGET = Target(flow="f")


def schedule(
    when: When | None = None,
    *,
    overlap: Overlap = Overlap.SKIP,
    window: float = 300.0,
    pause_on_failure: bool = False,
    created: float = T0,
    **state: object,
) -> Schedule:
    """A schedule created at ``created``, with the cursor and next_at the API gives it."""
    when = when or When(every=60)
    cursor = initial_cursor(when, created)
    s = Schedule(
        SID,
        TARGET,
        when,
        Policy(overlap=overlap, catchup_window=window, pause_on_failure=pause_on_failure),
        created_at=created,
        cursor=cursor,
        next_at=first(times_after(when, cursor, 1)),
    )
    return replace(s, **state)  # type: ignore[arg-type]


def first(times: list[float]) -> float | None:
    return times[0] if times else None


def kinds(plan: Plan) -> list[tuple[float, str, str | None]]:
    """The run records as (seconds after T0, state, reason)."""
    return [(r.scheduled_at - T0, r.state.value, r.reason) for r in plan.runs]


def tid(t: float) -> str:
    return task_id_of(SID, T0 + t)


# --- the basics ---------------------------------------------------------------------


def test_nothing_due_changes_nothing() -> None:
    s = schedule()
    plan = plan_due(s, T0 + 59, Running.NONE)
    assert not plan.changed
    assert plan.schedule == s and plan.runs == () and plan.cancel == ()
    assert next_fire_at(s) == T0 + 60


def test_a_due_time_fires_and_moves_the_cursor() -> None:
    plan = plan_due(schedule(), T0 + 61, Running.NONE)
    assert plan.changed
    assert plan.runs == (Run(SID, T0 + 60, RunState.FIRED, fired_at=T0 + 61, task_id=tid(60)),)
    assert plan.fired == plan.runs
    assert (plan.schedule.cursor, plan.schedule.next_at, plan.schedule.running) == (T0 + 60, T0 + 120, tid(60))
    again = plan_due(plan.schedule, T0 + 61, Running.ALIVE)
    assert not again.changed


def test_a_scheduled_time_exactly_now_is_due() -> None:
    plan = plan_due(schedule(), T0 + 60, Running.NONE)
    assert kinds(plan) == [(60, "fired", None)]


def test_the_limit_bounds_one_plan_and_the_next_one_goes_on() -> None:
    s = schedule(overlap=Overlap.ALLOW_ALL, window=1e9)
    plan = plan_due(s, T0 + 600, Running.NONE, limit=3)
    assert [t for t, _, _ in kinds(plan)] == [60, 120, 180]
    assert plan.schedule.cursor == T0 + 180 and plan.schedule.next_at == T0 + 240
    rest = plan_due(plan.schedule, T0 + 600, Running.ALIVE, limit=3)
    assert [t for t, _, _ in kinds(rest)] == [240, 300, 360]


def test_run_at_fires_once_then_has_no_next() -> None:
    s = schedule(When(run_at=T0 - 5))  # created just after its moment: still fires
    assert s.next_at == T0 - 5
    plan = plan_due(s, T0 + 1, Running.NONE)
    assert kinds(plan) == [(-5, "fired", None)]
    assert plan.schedule.next_at is None and next_fire_at(plan.schedule) is None
    assert not plan_due(plan.schedule, T0 + 1000, Running.SUCCEEDED).runs


def test_a_schedule_without_cursor_counts_from_its_creation() -> None:
    s = replace(schedule(), cursor=None, next_at=None)
    plan = plan_due(s, T0 + 130, Running.NONE)
    assert [t for t, _, _ in kinds(plan)] == [60, 120]


def test_jitter_delays_a_firing_and_the_cursor_waits_for_it() -> None:
    s = schedule(When(every=60, jitter=50))
    t1 = T0 + 60
    j = jitter_of(SID, t1, 50)
    assert 0 < j < 50
    assert next_fire_at(s) == t1 + j
    early = plan_due(s, t1 + j - 0.001, Running.NONE)
    assert not early.changed
    on_time = plan_due(s, t1 + j, Running.NONE)
    assert kinds(on_time) == [(60, "fired", None)]
    assert on_time.schedule.cursor == t1


def test_a_pending_jittered_time_holds_back_later_ones() -> None:
    s = schedule(When(cron="* * * * *", jitter=600), overlap=Overlap.ALLOW_ALL, window=1e9)
    # find a minute whose jitter is longer than the next minute's plus 60 s
    times = times_after(s.when, s.cursor or T0, 50)
    i = next(i for i in range(49) if times[i] + jitter_of(SID, times[i], 600) > times[i + 1] + jitter_of(SID, times[i + 1], 600))
    now = times[i + 1] + jitter_of(SID, times[i + 1], 600)  # the later one is due, the earlier not yet
    plan = plan_due(s, now, Running.NONE)
    assert all(r.scheduled_at < times[i] for r in plan.runs)
    assert (plan.schedule.cursor or 0) < times[i] and plan.schedule.next_at == times[i]


# --- overlap ------------------------------------------------------------------------


def test_skip_records_an_overlapping_firing_as_skipped() -> None:
    s = schedule(running=tid(0))
    plan = plan_due(s, T0 + 61, Running.ALIVE)
    assert kinds(plan) == [(60, "skipped", "overlap")]
    assert plan.schedule.running == tid(0) and plan.fired == ()
    ended = plan_due(plan.schedule, T0 + 121, Running.SUCCEEDED)
    assert kinds(ended) == [(120, "fired", None)]
    assert ended.schedule.running == tid(120)


def test_skip_fires_only_the_first_of_several_due_times() -> None:
    plan = plan_due(schedule(), T0 + 190, Running.NONE)
    assert kinds(plan) == [(60, "fired", None), (120, "skipped", "overlap"), (180, "skipped", "overlap")]


def test_buffer_one_keeps_one_and_starts_it_when_the_running_task_ends() -> None:
    s = schedule(overlap=Overlap.BUFFER_ONE, running=tid(0))
    plan = plan_due(s, T0 + 130, Running.ALIVE)
    assert kinds(plan) == [(60, "buffered", None), (120, "skipped", "overlap")]
    assert plan.schedule.buffered == (T0 + 60,)
    still = plan_due(plan.schedule, T0 + 150, Running.ALIVE)
    assert not still.changed
    ended = plan_due(plan.schedule, T0 + 150, Running.SUCCEEDED)
    assert kinds(ended) == [(60, "fired", None)]
    assert ended.fired[0].task_id == tid(60) and ended.fired[0].fired_at == T0 + 150
    assert ended.schedule.buffered == () and ended.schedule.running == tid(60)


def test_buffer_all_starts_them_in_order_one_after_another() -> None:
    s = schedule(overlap=Overlap.BUFFER_ALL, running=tid(0))
    plan = plan_due(s, T0 + 190, Running.ALIVE)
    assert kinds(plan) == [(60, "buffered", None), (120, "buffered", None), (180, "buffered", None)]
    s = plan.schedule
    fired = []
    for status in (Running.FAILED, Running.SUCCEEDED, Running.SUCCEEDED):
        p = plan_due(s, T0 + 200, status)
        fired += [t for t, state, _ in kinds(p) if state == "fired"]
        s = p.schedule
    assert fired == [60, 120, 180]
    assert s.buffered == () and s.running == tid(180)


def test_buffered_firings_start_even_when_older_than_the_window() -> None:
    s = schedule(overlap=Overlap.BUFFER_ONE, window=30, running=tid(0))
    plan = plan_due(s, T0 + 61, Running.ALIVE)
    assert plan.schedule.buffered == (T0 + 60,)
    later = plan_due(plan.schedule, T0 + 100, Running.SUCCEEDED)
    assert kinds(later) == [(60, "fired", None)]


def test_a_running_task_that_is_gone_counts_as_ended() -> None:
    s = schedule(overlap=Overlap.BUFFER_ONE, running=tid(0), buffered=(T0 + 60,), cursor=T0 + 60, next_at=T0 + 120)
    plan = plan_due(s, T0 + 70, Running.NONE)
    assert kinds(plan) == [(60, "fired", None)]


def test_alive_without_a_running_task_counts_as_nothing_running() -> None:
    plan = plan_due(schedule(), T0 + 61, Running.ALIVE)
    assert kinds(plan) == [(60, "fired", None)]


def test_allow_all_fires_everything_and_tracks_the_newest() -> None:
    s = schedule(overlap=Overlap.ALLOW_ALL, running=tid(0))
    plan = plan_due(s, T0 + 190, Running.ALIVE)
    assert kinds(plan) == [(60, "fired", None), (120, "fired", None), (180, "fired", None)]
    assert plan.schedule.running == tid(180) and plan.cancel == ()


def test_cancel_other_cancels_the_running_task_and_fires_the_newest() -> None:
    s = schedule(overlap=Overlap.CANCEL_OTHER, running=tid(0))
    one = plan_due(s, T0 + 61, Running.ALIVE)
    assert kinds(one) == [(60, "fired", None)]
    assert one.cancel == (tid(0),) and one.schedule.running == tid(60)
    several = plan_due(s, T0 + 190, Running.ALIVE)
    assert kinds(several) == [(60, "skipped", "overlap"), (120, "skipped", "overlap"), (180, "fired", None)]
    assert several.cancel == (tid(0),)
    idle = plan_due(s, T0 + 61, Running.SUCCEEDED)
    assert kinds(idle) == [(60, "fired", None)] and idle.cancel == ()


# --- catch-up -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overlap", "in_window"),
    [(Overlap.SKIP, ["fired", "skipped", "skipped"]), (Overlap.ALLOW_ALL, ["fired", "fired", "fired"])],
)
def test_after_downtime_old_firings_are_missed_and_recent_ones_catch_up(overlap: Overlap, in_window: list[str]) -> None:
    s = schedule(overlap=overlap, window=150)
    now = T0 + 3600 + 30  # down for an hour
    plan = plan_due(s, now, Running.NONE)
    states = {t: state for t, state, _ in kinds(plan)}
    assert len(states) == 60
    assert all(states[t] == "skipped" for t in range(60, 3600 - 150 + 30, 60))
    assert all(r.reason == SkipReason.MISSED for r in plan.runs if r.scheduled_at - T0 < 3600 - 120)
    assert [states[t] for t in (3480, 3540, 3600)] == in_window
    assert plan.schedule.cursor == T0 + 3600


def test_a_window_of_zero_fires_only_what_is_on_time() -> None:
    s = schedule(window=0)
    assert kinds(plan_due(s, T0 + 60, Running.NONE)) == [(60, "fired", None)]
    assert kinds(plan_due(s, T0 + 60.5, Running.NONE)) == [(60, "skipped", "missed")]


def test_lateness_counts_from_the_jittered_moment() -> None:
    s = schedule(When(every=600, jitter=500, start_at=T0), window=10)
    t = T0 + 600
    due = t + jitter_of(SID, t, 500)
    assert due - t > 10
    assert kinds(plan_due(s, due + 5, Running.NONE)) == [(600, "fired", None)]
    assert kinds(plan_due(s, due + 11, Running.NONE)) == [(600, "skipped", "missed")]


# --- pause --------------------------------------------------------------------------


def test_a_failed_task_pauses_the_schedule_with_pause_on_failure() -> None:
    s = schedule(overlap=Overlap.BUFFER_ONE, pause_on_failure=True, running=tid(0), buffered=(T0 + 60,),
                 cursor=T0 + 60, next_at=T0 + 120)  # fmt: skip
    plan = plan_due(s, T0 + 500, Running.FAILED)
    assert plan.runs == () and plan.changed
    assert plan.schedule.paused and plan.schedule.note == f"paused on failure: task {tid(0)} failed"
    assert plan.schedule.running is None and plan.schedule.buffered == (T0 + 60,)
    assert plan.schedule.cursor == T0 + 60
    assert next_fire_at(plan.schedule) is None
    assert not plan_due(plan.schedule, T0 + 900, Running.NONE).changed


def test_a_failed_task_does_not_pause_without_pause_on_failure() -> None:
    plan = plan_due(schedule(running=tid(0)), T0 + 61, Running.FAILED)
    assert not plan.schedule.paused
    assert kinds(plan) == [(60, "fired", None)]


def test_a_succeeded_task_does_not_pause() -> None:
    plan = plan_due(schedule(pause_on_failure=True, running=tid(0)), T0 + 61, Running.SUCCEEDED)
    assert not plan.schedule.paused and kinds(plan) == [(60, "fired", None)]


def test_a_paused_schedule_fires_nothing_and_keeps_its_buffer() -> None:
    s = schedule(overlap=Overlap.BUFFER_ONE, paused=True, note="by hand", running=tid(0), buffered=(T0 + 60,),
                 cursor=T0 + 60, next_at=T0 + 120)  # fmt: skip
    plan = plan_due(s, T0 + 500, Running.SUCCEEDED)
    assert plan.runs == ()
    assert plan.schedule == replace(s, running=None)
    assert plan.schedule.note == "by hand"
    resumed = plan_due(replace(plan.schedule, paused=False), T0 + 500, Running.NONE)
    assert kinds(resumed)[0] == (60, "fired", None)


# --- trigger ------------------------------------------------------------------------


def test_trigger_fires_now_without_moving_the_cursor() -> None:
    s = schedule()
    plan = plan_trigger(s, T0 + 10.25, Running.NONE)
    assert plan.runs == (Run(SID, T0 + 10.25, RunState.FIRED, fired_at=T0 + 10.25, task_id=tid(10.25)),)
    assert plan.schedule.cursor == s.cursor and plan.schedule.next_at == s.next_at
    assert plan.schedule.running == tid(10.25)


@pytest.mark.parametrize(
    ("overlap", "state", "cancel"),
    [
        (Overlap.SKIP, "skipped", ()),
        (Overlap.BUFFER_ONE, "buffered", ()),
        (Overlap.BUFFER_ALL, "buffered", ()),
        (Overlap.ALLOW_ALL, "fired", ()),
        (Overlap.CANCEL_OTHER, "fired", (tid(0),)),
    ],
)
def test_trigger_follows_the_overlap_policy(overlap: Overlap, state: str, cancel: tuple[str, ...]) -> None:
    plan = plan_trigger(schedule(overlap=overlap, running=tid(0)), T0 + 10, Running.ALIVE)
    assert [s for _, s, _ in kinds(plan)] == [state]
    assert plan.cancel == cancel


def test_trigger_works_on_a_paused_schedule() -> None:
    plan = plan_trigger(schedule(paused=True), T0 + 10, Running.NONE)
    assert kinds(plan) == [(10, "fired", None)] and plan.schedule.paused


# --- backfill -----------------------------------------------------------------------


def test_backfill_fires_every_time_in_the_range_whatever_the_policy() -> None:
    s = schedule(overlap=Overlap.SKIP, window=0, created=T0 + 1000, running=None)
    plan = plan_backfill(s, T0 + 120, T0 + 300, T0 + 1000, limit=10)
    assert kinds(plan) == [(t, "fired", None) for t in (120, 180, 240, 300)]
    assert all(r.fired_at == T0 + 1000 and r.task_id == tid(r.scheduled_at - T0) for r in plan.runs)
    assert plan.schedule == replace(s, running=tid(300))
    busy = plan_backfill(replace(s, running="other"), T0 + 120, T0 + 300, T0 + 1000, limit=10)
    assert busy.schedule.running == "other" and len(busy.fired) == 4


def test_backfill_refuses_more_than_the_limit() -> None:
    s = schedule(created=T0 + 10_000)
    with pytest.raises(ValueError, match="more than 3"):
        plan_backfill(s, T0 + 60, T0 + 240, T0 + 10_000, limit=3)
    assert len(plan_backfill(s, T0 + 60, T0 + 180, T0 + 10_000, limit=3).runs) == 3


def test_backfill_leaves_times_after_the_cursor_and_buffered_ones_alone() -> None:
    s = schedule(overlap=Overlap.BUFFER_ONE, buffered=(T0 + 120,), cursor=T0 + 180, next_at=T0 + 240, running="x")
    plan = plan_backfill(s, T0 + 60, T0 + 600, T0 + 200, limit=100)
    assert [t for t, _, _ in kinds(plan)] == [60, 180]


def test_backfill_of_an_empty_range_changes_nothing() -> None:
    s = schedule(created=T0 + 1000)
    assert not plan_backfill(s, T0 + 61, T0 + 119, T0 + 1000, limit=5).changed


# --- properties ---------------------------------------------------------------------

WHENS = st.one_of(
    st.builds(
        lambda every, start, jit: When(every=every, start_at=start, jitter=jit * every),
        st.sampled_from([1.0, 7.5, 30.0, 60.0]),
        st.none() | st.floats(T0 - 100, T0 + 100),
        st.sampled_from([0.0, 0.3, 0.99]),
    ),
    st.builds(
        lambda cron, jit: When(cron=cron, jitter=jit),
        st.sampled_from(["* * * * *", "*/2 * * * *", "*/10 * * * * *", "0,20 * * * * *", "*/15 * * * * *"]),
        st.sampled_from([0.0, 5.0, 45.0, 150.0]),  # may exceed the period: jittered moments out of order
    ),
)
POLICIES = st.builds(
    Policy,
    overlap=st.sampled_from(list(Overlap)),
    catchup_window=st.sampled_from([0.0, 5.0, 60.0, 300.0, 1e9]),
    pause_on_failure=st.booleans(),
)
STEPS = st.lists(
    st.tuples(
        st.one_of(st.floats(0, 400), st.sampled_from([0.0, 1.0, 60.0])),  # time to the next call
        st.sampled_from(["keep", "keep", "succeed", "fail", "vanish", "resume"]),  # meanwhile
    ),
    min_size=1,
    max_size=25,
)


@dataclass
class History:
    """What the property test saw: every record with the `now` it was decided at."""

    records: dict[float, list[tuple[Run, float]]] = field(default_factory=dict)
    tasks: dict[str, str] = field(default_factory=dict)  # task id -> alive/succeeded/failed/gone/cancelled

    def alive(self) -> int:
        return sum(1 for status in self.tasks.values() if status == "alive")


STATUS = {"alive": Running.ALIVE, "succeeded": Running.SUCCEEDED, "failed": Running.FAILED,
          "cancelled": Running.FAILED, "gone": Running.NONE}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(when=WHENS, policy=POLICIES, start=st.floats(0, 120), steps=STEPS)
def test_any_sequence_handles_each_time_once_and_misses_none(
    when: When, policy: Policy, start: float, steps: list[tuple[float, str]]
) -> None:
    created = T0 + start
    cursor0 = initial_cursor(when, created)
    s = Schedule(SID, TARGET, when, policy, created_at=created, cursor=cursor0,
                 next_at=first(times_after(when, cursor0, 1)))  # fmt: skip
    h = History()
    now = created
    last_active_now = now
    for gap, event in steps:
        now += gap
        task = s.running
        if task is not None and h.tasks[task] == "alive" and event in ("succeed", "fail", "vanish"):
            h.tasks[task] = {"succeed": "succeeded", "fail": "failed", "vanish": "gone"}[event]
        if event == "resume" and s.paused:
            s = replace(s, paused=False, note="")
        running = Running.NONE if task is None else STATUS[h.tasks[task]]
        was_paused = s.paused
        plan = plan_due(s, now, running, limit=100_000)
        before_buffered = set(s.buffered)

        for run in plan.runs:
            t = run.scheduled_at
            moment = t + jitter_of(SID, t, when.jitter)
            late = now - moment
            previous = [r.state for r, _ in h.records.get(t, [])]
            h.records.setdefault(t, []).append((run, now))
            # (a) at most one record per time, except a buffered one that starts
            assert previous in ([], [RunState.BUFFERED]), (t, previous, run)
            if previous:
                assert run.state is RunState.FIRED and t in before_buffered
            # (c) a fired record names its task
            if run.state is RunState.FIRED:
                assert run.task_id == task_id_of(SID, t) and run.fired_at == now
                assert run.task_id not in h.tasks
                h.tasks[run.task_id] = "alive"
            else:
                assert run.task_id is None and run.fired_at is None
            # (d) missed only when older than the window, fired or buffered only within it
            if run.reason == SkipReason.MISSED:
                assert late > policy.catchup_window
            elif not previous:
                assert moment <= now and late <= policy.catchup_window
        assert not (plan.runs and was_paused)
        for task_id in plan.cancel:
            assert policy.overlap is Overlap.CANCEL_OTHER and h.tasks[task_id] == "alive"
            h.tasks[task_id] = "cancelled"

        new = plan.schedule
        # the state agrees with the records
        assert new.buffered == tuple(sorted(t for t, rs in h.records.items() if [r.state for r, _ in rs] == [RunState.BUFFERED]))
        if plan.fired:
            assert new.running == plan.fired[-1].task_id
        assert (new.cursor or 0) >= (s.cursor or 0) and (new.cursor or 0) <= now
        assert all(r.scheduled_at <= (new.cursor or 0) for r in plan.runs)
        assert new.next_at is None or new.next_at > (new.cursor or 0)
        assert new.next_at == first(times_after(when, new.cursor or 0, 1)) or new.paused
        assert plan.changed or (plan.runs == () and new == s)
        # (e) overlap: one task at a time but with ALLOW_ALL; BUFFER_ONE keeps at most one
        if policy.overlap is not Overlap.ALLOW_ALL:
            assert h.alive() <= 1
        if policy.overlap is Overlap.BUFFER_ONE:
            assert len(new.buffered) <= 1
        if policy.overlap is not Overlap.BUFFER_ONE and policy.overlap is not Overlap.BUFFER_ALL:
            assert new.buffered == ()
        s = new
        if not s.paused:
            last_active_now = now
        # planning again at the same moment has nothing more to do
        again = plan_due(s, now, Running.NONE if s.running is None else STATUS[h.tasks[s.running]], limit=100_000)
        assert not again.changed, again

    # (b) nothing missed: every time up to the last active moment less the jitter has a record
    if not s.paused:
        expected = times_between(when, cursor0, last_active_now - when.jitter, 100_000)
        assert all(t in h.records for t in expected), [t for t in expected if t not in h.records][:3]
    assert set(h.records) <= set(times_between(when, cursor0, now, 100_000))  # only real scheduled times
