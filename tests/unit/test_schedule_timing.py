"""When schedules fire: cron in time zones (DST), seconds, intervals, bounds, jitter, validation."""

from __future__ import annotations

import math
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.schedules.model import When
from shared.schedules.timing import (
    InvalidWhen,
    check,
    initial_cursor,
    jitter_of,
    times_after,
    times_between,
)

NY = "America/New_York"
BERLIN = "Europe/Berlin"


def at(local: str, tz: str = "UTC", fold: int = 0) -> float:
    """Epoch seconds of a wall-clock time in ``tz``."""
    return datetime.fromisoformat(local).replace(tzinfo=ZoneInfo(tz), fold=fold).timestamp()


def wall(t: float, tz: str) -> str:
    """A time as the clock on the wall shows it, with its UTC offset."""
    return datetime.fromtimestamp(t, ZoneInfo(tz)).strftime("%Y-%m-%d %H:%M:%S%z")


# --- DST ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tz", "expr", "day_before", "expected"),
    [
        # spring forward: 02:00 -> 03:00; the 02:30 job runs once, right after the gap
        (NY, "30 2 * * *", "2024-03-09T12:00", ["2024-03-10 03:00:00-0400", "2024-03-11 02:30:00-0400"]),
        (BERLIN, "30 2 * * *", "2024-03-30T12:00", ["2024-03-31 03:00:00+0200", "2024-04-01 02:30:00+0200"]),
        # fall back: the repeated hour; the job in it runs once, on the first pass
        (NY, "30 1 * * *", "2024-11-02T12:00", ["2024-11-03 01:30:00-0400", "2024-11-04 01:30:00-0500"]),
        (BERLIN, "30 2 * * *", "2024-10-26T12:00", ["2024-10-27 02:30:00+0200", "2024-10-28 02:30:00+0100"]),
    ],
)
def test_a_fixed_time_job_fires_once_on_a_dst_day(tz: str, expr: str, day_before: str, expected: list[str]) -> None:
    times = times_after(When(cron=expr, timezone=tz), at(day_before, tz), 2)
    assert [wall(t, tz) for t in times] == expected


@pytest.mark.parametrize(
    ("tz", "day", "hours"),
    [
        (NY, "2024-03-10", 23),
        (NY, "2024-11-03", 25),
        (BERLIN, "2024-03-31", 23),
        (BERLIN, "2024-10-27", 25),
    ],
)
@pytest.mark.parametrize(("expr", "step"), [("*/30 * * * *", 1800), ("0 * * * *", 3600), ("0,30 * * * *", 1800)])
def test_a_wildcard_job_keeps_its_real_time_rhythm_across_dst(
    tz: str, day: str, hours: int, expr: str, step: int
) -> None:
    start = at(f"{day}T00:00", tz)
    end = start + hours * 3600
    assert end == at(f"{day}T00:00", tz) + hours * 3600
    times = times_between(When(cron=expr, timezone=tz), start - 1, end - 1, 1000)
    assert times[0] == start
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == [step] * (len(times) - 1)
    assert len(times) == hours * 3600 // step  # both passes of a repeated hour, none in a gap


def test_both_passes_of_the_repeated_hour_fire_for_a_wildcard_job() -> None:
    times = times_between(When(cron="*/30 * * * *", timezone=NY), at("2024-11-03T00:59", NY), at("2024-11-03T02:00", NY), 10)
    assert [wall(t, NY) for t in times] == [
        "2024-11-03 01:00:00-0400",
        "2024-11-03 01:30:00-0400",
        "2024-11-03 01:00:00-0500",
        "2024-11-03 01:30:00-0500",
        "2024-11-03 02:00:00-0500",
    ]


def test_a_wildcard_minute_in_a_fixed_hour_follows_the_wall_clock() -> None:
    """Debian cron's rule: with ``*`` in the minute or hour field, no DST adjustment at all."""
    in_two = When(cron="*/30 2 * * *", timezone=NY)
    assert times_between(in_two, at("2024-03-10T00:00", NY), at("2024-03-10T05:00", NY), 10) == []  # no 02:xx
    in_one = When(cron="*/30 1 * * *", timezone=NY)
    fall = times_between(in_one, at("2024-11-03T00:00", NY), at("2024-11-03T04:00", NY), 10)
    assert [wall(t, NY) for t in fall] == [
        "2024-11-03 01:00:00-0400",
        "2024-11-03 01:30:00-0400",
        "2024-11-03 01:00:00-0500",
        "2024-11-03 01:30:00-0500",
    ]


def test_starting_in_the_second_pass_of_a_repeated_hour_does_not_go_back() -> None:
    second_pass = at("2024-11-03T01:10", NY, fold=1)
    assert [wall(t, NY) for t in times_after(When(cron="30 1 * * *", timezone=NY), second_pass, 1)] == [
        "2024-11-04 01:30:00-0500"
    ]
    assert [wall(t, NY) for t in times_after(When(cron="*/30 * * * *", timezone=NY), second_pass, 1)] == [
        "2024-11-03 01:30:00-0500"
    ]


def test_cron_reads_the_time_zone() -> None:
    [t] = times_after(When(cron="0 9 * * *", timezone="Asia/Kolkata"), at("2024-06-01T00:00"), 1)
    assert wall(t, "UTC") == "2024-06-01 03:30:00+0000"


ZONES = [NY, BERLIN, "UTC", "Australia/Lord_Howe", "Asia/Kolkata"]
EXPRS = ["30 2 * * *", "30 1 * * *", "*/30 * * * *", "0 * * * *", "15,45 1-3 * * *", "*/20 30 2 * * *", "0 0 * * 0"]
DST_DAYS = [at("2024-03-10T00:00", NY), at("2024-11-03T00:00", NY), at("2024-03-31T00:00", BERLIN),
            at("2024-10-27T00:00", BERLIN), at("2024-04-07T00:00", "Australia/Lord_Howe"),
            at("2024-10-06T00:00", "Australia/Lord_Howe")]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    tz=st.sampled_from(ZONES),
    expr=st.sampled_from(EXPRS),
    day=st.sampled_from(DST_DAYS),
    offsets=st.lists(st.floats(-86400, 2 * 86400), min_size=1, max_size=5),
)
def test_the_times_after_any_moment_are_the_tail_of_one_sequence(
    tz: str, expr: str, day: float, offsets: list[float]
) -> None:
    when = When(cron=expr, timezone=tz)
    origin, end = day - 2 * 86400, day + 4 * 86400
    every_time = times_between(when, origin, end, 10_000)
    assert every_time == sorted(set(every_time))
    for offset in offsets:
        after = day + offset
        expected = [t for t in every_time if t > after]
        got = times_after(when, after, 5)
        n = min(5, len(expected))
        assert got[:n] == expected[:n]
        assert len(got) == 5 and all(t > end for t in got[n:])
        assert times_between(when, after, after + 86400, 10_000) == [t for t in expected if t <= after + 86400]


# --- seconds ------------------------------------------------------------------------


def test_six_fields_put_seconds_first() -> None:
    minute = at("2024-05-01T12:00")
    assert times_after(When(cron="*/10 * * * * *"), minute, 7) == [minute + s for s in (10, 20, 30, 40, 50, 60, 70)]
    assert times_after(When(cron="*/10 * * * * *"), minute + 12.5, 2) == [minute + 20, minute + 30]
    assert times_after(When(cron="5,7 * * * * *"), minute, 3) == [minute + 5, minute + 7, minute + 65]
    assert times_after(When(cron="0-2 */2 * * * *"), minute - 0.5, 4) == [minute, minute + 1, minute + 2, minute + 120]
    assert times_after(When(cron="15 30 12 * * *"), minute, 2) == [minute + 1815, minute + 86400 + 1815]


def test_six_fields_follow_the_same_dst_rules_in_each_matching_minute() -> None:
    spring = times_after(When(cron="*/20 30 2 * * *", timezone=NY), at("2024-03-09T12:00", NY), 4)
    assert [wall(t, NY) for t in spring] == [
        "2024-03-10 03:00:00-0400",
        "2024-03-10 03:00:20-0400",
        "2024-03-10 03:00:40-0400",
        "2024-03-11 02:30:00-0400",
    ]
    fall = times_after(When(cron="*/30 30 1 * * *", timezone=NY), at("2024-11-02T12:00", NY), 3)
    assert [wall(t, NY) for t in fall] == [
        "2024-11-03 01:30:00-0400",
        "2024-11-03 01:30:30-0400",
        "2024-11-04 01:30:00-0500",
    ]


# --- every --------------------------------------------------------------------------


def test_every_counts_from_the_epoch_without_start_at() -> None:
    when = When(every=60)
    assert times_after(when, 125, 3) == [180, 240, 300]
    assert times_after(when, 180, 1) == [240]  # strictly after
    assert times_after(when, 179.999, 1) == [180]
    assert times_after(when, -10, 2) == [0, 60]


def test_every_counts_from_start_at() -> None:
    when = When(every=60, start_at=1000.5)
    assert times_after(when, 0, 2) == [1000.5, 1060.5]
    assert times_after(when, 1000.5, 1) == [1060.5]
    assert times_after(when, 1_000_000, 1) == [1000.5 + 16650 * 60]


@settings(max_examples=300, deadline=None)
@given(
    every=st.floats(1, 366 * 86400),
    start_at=st.none() | st.floats(0, 2e9),
    after=st.floats(-1e9, 4e9),
    count=st.integers(0, 5),
)
def test_every_is_the_anchor_plus_whole_steps(every: float, start_at: float | None, after: float, count: int) -> None:
    anchor = 0.0 if start_at is None else start_at
    times = times_after(When(every=every, start_at=start_at), after, count)
    assert len(times) == count
    if not times:
        return
    k0 = round((times[0] - anchor) / every)
    assert times == [anchor + (k0 + i) * every for i in range(count)]
    assert times[0] > after
    assert k0 == 0 or anchor + (k0 - 1) * every <= after
    assert times_between(When(every=every, start_at=start_at), after, times[-1], 100) == times


@pytest.mark.parametrize(
    ("every", "start_at", "after"),
    [  # cases where the division rounds the wrong way: the first step is one too early, or one too late
        (1.1, 443383332.5460701, 452533516.4460701),
        (813.53815565581, 1076957591.4756887, 7330159236.638709),
        (439.95941035033286, 791420889.4415349, 2057442369.1933181),
        (223.0, 1536291698.4281652, 3691409413.428165),
    ],
)
def test_every_finds_the_first_step_despite_rounding(every: float, start_at: float, after: float) -> None:
    [t] = times_after(When(every=every, start_at=start_at), after, 1)
    assert t > after
    k = round((t - start_at) / every)
    assert t == start_at + k * every and start_at + (k - 1) * every <= after


# --- bounds, run_at -----------------------------------------------------------------


def test_no_time_falls_before_start_at_or_after_end_at() -> None:
    day = at("2024-05-01T00:00")
    cron = When(cron="0 * * * *", start_at=day + 3 * 3600, end_at=day + 5 * 3600)
    assert times_after(cron, day, 10) == [day + 3 * 3600, day + 4 * 3600, day + 5 * 3600]
    assert times_between(cron, day, day + 4 * 3600 + 1, 10) == [day + 3 * 3600, day + 4 * 3600]
    assert times_after(cron, day + 5 * 3600, 10) == []
    every = When(every=600, start_at=day + 30, end_at=day + 1830)
    assert times_after(every, 0, 10) == [day + 30, day + 630, day + 1230, day + 1830]
    assert times_after(When(every=600, end_at=day + 1), day - 600, 10) == [day]


def test_run_at_is_one_time() -> None:
    when = When(run_at=5000.0)
    assert times_after(when, 4999.9, 5) == [5000.0]
    assert times_after(when, 5000.0, 5) == []
    assert times_after(when, 4000.0, 0) == []
    assert times_between(when, 4000, 4999.999, 5) == []
    assert times_between(when, 4000, 5000, 5) == [5000.0]
    assert times_after(When(run_at=5000.0, start_at=5001), 0, 5) == []
    assert times_after(When(run_at=5000.0, end_at=4999), 0, 5) == []


def test_limit_and_count_cut_the_list() -> None:
    assert times_between(When(cron="* * * * * *"), 0, 1000, 3) == [1, 2, 3]
    assert times_between(When(every=1), 0, 1000, 0) == []
    assert len(times_after(When(cron="* * * * *"), 0, 1000)) == 1000


def test_a_cron_that_never_matches_again_ends() -> None:
    assert times_after(When(cron="0 0 29 2 *", end_at=at("2025-01-01T00:00")), at("2024-03-01T00:00"), 5) == []
    assert times_after(When(cron="0 0 29 2 *"), at("2024-03-01T00:00"), 1) == [at("2028-02-29T00:00")]


# --- initial cursor -----------------------------------------------------------------


def test_initial_cursor() -> None:
    assert initial_cursor(When(every=60), 1234.5) == 1234.5
    assert initial_cursor(When(cron="* * * * *"), 1234.5) == 1234.5
    assert initial_cursor(When(run_at=2000.0), 1234.5) == 1234.5
    past = When(run_at=1000.0)
    cursor = initial_cursor(past, 1234.5)
    assert cursor < 1000.0
    assert times_after(past, cursor, 5) == [1000.0]  # a run_at just past still fires, once
    exact = When(run_at=1234.5)
    assert times_after(exact, initial_cursor(exact, 1234.5), 5) == [1234.5]
    # nothing scheduled at or before creation fires for cron and every
    assert times_after(When(every=60), initial_cursor(When(every=60), 1200.0), 1) == [1260.0]


# --- jitter -------------------------------------------------------------------------


def test_jitter_is_zero_without_jitter() -> None:
    assert jitter_of("s", 1000.0, 0.0) == 0.0


@given(sid=st.text(max_size=20), t=st.floats(0, 4e9), jitter=st.floats(1e-3, 1e6))
def test_jitter_is_deterministic_and_in_range(sid: str, t: float, jitter: float) -> None:
    j = jitter_of(sid, t, jitter)
    assert 0.0 <= j < jitter
    assert jitter_of(sid, t, jitter) == j
    assert jitter_of(sid, t + 0.0001, jitter) == j or round((t + 0.0001) * 1000) != round(t * 1000)


def test_jitter_spreads_over_its_range() -> None:
    samples = [jitter_of("nightly", 1.7e9 + 60 * i, 100.0) for i in range(2000)]
    assert 45 < sum(samples) / len(samples) < 55
    assert min(samples) < 5 and max(samples) > 95
    assert len({jitter_of(f"s{i}", 1.7e9, 100.0) for i in range(100)}) == 100  # the id counts too


# --- check --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "field", "words"),
    [
        (When(), "run_at", "exactly one of run_at, cron, every"),
        (When(run_at=1.0, cron="* * * * *"), "cron", "exactly one"),
        (When(run_at=1.0, every=60), "every", "exactly one"),
        (When(cron="* * * * *", every=60), "every", "exactly one"),
        (When(cron="61 * * * *"), "cron", "Bad minute"),
        (When(cron="* * * *"), "cron", "got 4"),
        (When(cron="* * * * * * *"), "cron", "got 7"),
        (When(cron=""), "cron", "got 0"),
        (When(cron="*/0 * * * *"), "cron", "Bad minute"),
        (When(cron="60 * * * * *"), "cron", "Bad second"),
        (When(cron="0 0 31 2 *"), "cron", "Bad day-of-month"),
        (When(cron="* * * * FOO"), "cron", "Bad day-of-week"),
        (When(cron="@daily"), "cron", "got 1"),
        (When(cron="* * * * *", timezone="Mars/Olympus"), "timezone", "unknown time zone"),
        (When(cron="* * * * *", timezone="../etc/passwd"), "timezone", "unknown time zone"),
        (When(cron="* * * * *", timezone="Europe"), "timezone", "unknown time zone"),
        (When(cron="* * * * *", timezone=""), "timezone", "unknown time zone"),
        (When(cron="* * * * *", timezone="localtime"), "timezone", "host"),
        (When(every=60, timezone="Nowhere"), "timezone", "unknown time zone"),
        (When(every=0), "every", "at least 1 second"),
        (When(every=-5), "every", "at least 1 second"),
        (When(every=0.5), "every", "at least 1 second"),
        (When(every=366 * 86400 + 1), "every", "at most 366 days"),
        (When(every=math.nan), "every", "finite"),
        (When(every=math.inf), "every", "finite"),
        (When(run_at=math.nan), "run_at", "finite"),
        (When(run_at=-math.inf), "run_at", "finite"),
        (When(every=60, start_at=math.nan), "start_at", "finite"),
        (When(every=60, end_at=math.inf), "end_at", "finite"),
        (When(every=60, jitter=math.nan), "jitter", "finite"),
        (When(every=60, start_at=100, end_at=100), "end_at", "after start_at"),
        (When(cron="* * * * *", start_at=100, end_at=50), "end_at", "after start_at"),
        (When(every=60, jitter=-1), "jitter", "negative"),
        (When(every=60, jitter=60), "jitter", "shorter than every"),
        (When(every="60"), "every", "number"),  # type: ignore[arg-type]
        (When(cron=5), "cron", "string"),  # type: ignore[arg-type]
    ],
)
def test_check_names_the_bad_field(when: When, field: str, words: str) -> None:
    with pytest.raises(InvalidWhen) as caught:
        check(when)
    assert caught.value.field == field
    assert words in caught.value.problem
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "when",
    [
        When(run_at=1.7e9),
        When(cron="*/5 9-17 * * MON-FRI", timezone=BERLIN),
        When(cron="*/10 * * * * *"),
        When(cron="0 0 L * *", timezone="Asia/Kolkata"),
        When(every=1),
        When(every=366 * 86400, start_at=0, end_at=1e10, jitter=3600),
        When(every=60, jitter=59.9),
        When(cron="0 3 * * *", jitter=7200),  # cron's jitter is not bounded by its period
    ],
)
def test_check_accepts_good_whens(when: When) -> None:
    check(when)


@settings(max_examples=300, deadline=None)
@given(expr=st.lists(st.sampled_from(["*", "*/7", "1-5", "L", "LW", "5L", "MON#2", "1,2", "x", "-", "/", "0", "99"]),
                     min_size=0, max_size=7).map(" ".join))  # fmt: skip
def test_check_either_accepts_a_cron_or_raises_invalid_when(expr: str) -> None:
    when = When(cron=expr)
    try:
        check(when)
    except InvalidWhen as e:
        assert e.field == "cron"
        return
    times_after(when, 1.7e9, 2)  # an accepted expression can be computed


@pytest.mark.parametrize("expr", ["* * * * *", "* * * * * *"])
def test_a_time_just_after_a_moment_that_rounds_up_is_not_lost(expr: str) -> None:
    whole = at("2024-05-01T12:00")
    just_before = math.nextafter(whole, -math.inf)  # fromtimestamp would round it to ``whole``
    assert times_after(When(cron=expr), just_before, 1) == [whole]
    assert times_after(When(cron=expr, start_at=whole), 0, 1) == [whole]
