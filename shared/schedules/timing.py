"""When a schedule's firings fall: validation, scheduled times, jitter, the first cursor.

Pure: no I/O, no clock, no globals. Times are epoch seconds (floats).

``cron`` is read by cronsim in ``When.timezone``, so daylight saving time behaves
as cron users expect (Debian cron's rules): a job at a fixed time that falls in
the spring-forward gap runs once, right after the gap; a job at a fixed time in
the repeated hour of the fall-back runs once, on its first pass; a job whose
minute or hour field starts with ``*`` (``*/30 * * * *``, ``0 * * * *``) keeps
its real-time rhythm through both transitions, so it also runs in the second
pass of the repeated hour. Six fields put seconds first (Quartz, Spring, robfig
cron): cronsim finds the matching minutes from the last five fields, with the
rules above, and each matching minute fires at each second of the first field.
"""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from cronsim.cronsim import Field

from shared.schedules.model import When

MIN_EVERY = 1.0
MAX_EVERY = 366 * 86400.0

_UTC = UTC
# Cron times are looked for between these (datetime stops at year 9999).
_CRON_FIRST = datetime(1900, 1, 1, tzinfo=_UTC).timestamp()
_CRON_LAST = datetime(9000, 1, 1, tzinfo=_UTC).timestamp()


class InvalidWhen(ValueError):
    """A ``When`` that cannot be scheduled: ``field`` names the culprit, ``problem`` says why."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def check(when: When) -> None:
    """Raise :class:`InvalidWhen` unless ``when`` can be scheduled."""
    for name in ("run_at", "every", "start_at", "end_at", "jitter"):
        value = getattr(when, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidWhen(name, "must be a number")
        if not math.isfinite(value):
            raise InvalidWhen(name, "must be a finite number")
    given = [name for name in ("run_at", "cron", "every") if getattr(when, name) is not None]
    if len(given) != 1:
        raise InvalidWhen(given[1] if given else "run_at", "give exactly one of run_at, cron, every")
    _zone(when.timezone)
    if when.cron is not None:
        if not isinstance(when.cron, str):
            raise InvalidWhen("cron", "must be a string")
        try:
            minutes, _ = _split_cron(when.cron)
            CronSim(minutes, datetime(2000, 1, 1, tzinfo=_UTC))
        except CronSimError as e:
            raise InvalidWhen("cron", f"cannot read {when.cron!r}: {e}") from None
    if when.every is not None:
        if when.every < MIN_EVERY:
            raise InvalidWhen("every", f"must be at least {MIN_EVERY:g} second")
        if when.every > MAX_EVERY:
            raise InvalidWhen("every", f"must be at most 366 days ({MAX_EVERY:g} seconds)")
    if when.start_at is not None and when.end_at is not None and when.end_at <= when.start_at:
        raise InvalidWhen("end_at", "must be after start_at")
    if when.jitter < 0:
        raise InvalidWhen("jitter", "must not be negative")
    if when.every is not None and when.jitter >= when.every:
        raise InvalidWhen("jitter", "must be shorter than every")


def times_after(when: When, after: float, count: int) -> list[float]:
    """The first ``count`` scheduled times strictly after ``after``, ascending."""
    return _times(when, after, math.inf, count)


def times_between(when: When, after: float, until: float, limit: int) -> list[float]:
    """The scheduled times ``t`` with ``after < t <= until``, ascending, at most ``limit``."""
    return _times(when, after, until, limit)


def jitter_of(schedule_id: str, scheduled_at: float, jitter: float) -> float:
    """The delay in ``[0, jitter)`` of the firing at ``scheduled_at``: the same for everyone who asks."""
    if not jitter > 0:
        return 0.0
    key = f"{schedule_id}\0{round(scheduled_at * 1000)}".encode("utf-8", "surrogatepass")
    fraction = (int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 11) / 2.0**53
    return min(fraction * jitter, math.nextafter(jitter, 0.0))


def initial_cursor(when: When, now: float) -> float:
    """The cursor of a schedule created at ``now``: every scheduled time up to it counts as handled.

    Nothing scheduled before the creation fires, except a ``run_at`` that is already
    past (a one-off "run at 12:00" sent at 12:00:01 still runs, once).
    """
    if when.run_at is not None and when.run_at <= now:
        return math.nextafter(when.run_at, -math.inf)
    return now


# --- internals ---------------------------------------------------------------------


def _zone(name: str) -> ZoneInfo:
    if name == "localtime":  # the host's zone: two schedulers could disagree
        raise InvalidWhen("timezone", "'localtime' depends on the host; name a zone such as 'Europe/Berlin'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError, TypeError):
        raise InvalidWhen("timezone", f"unknown time zone {name!r}") from None


def _split_cron(expr: str) -> tuple[str, tuple[int, ...]]:
    """The five-field expression of the minutes, and the seconds of each minute."""
    parts = expr.split()
    if len(parts) == 5:
        return expr, (0,)
    if len(parts) != 6:
        raise CronSimError(f"expected 5 fields, or 6 with seconds first; got {len(parts)}")
    seconds = Field.SECOND.parse(parts[0].upper())
    return " ".join(parts[1:]), tuple(sorted(s for s in seconds if isinstance(s, int)))


def _times(when: When, after: float, until: float, limit: int) -> list[float]:
    if when.end_at is not None:
        until = min(until, when.end_at)
    if limit <= 0 or not after < until:
        return []
    if when.run_at is not None:
        ok = after < when.run_at <= until and (when.start_at is None or when.run_at >= when.start_at)
        return [when.run_at] if ok else []
    if when.every is not None:
        return _every_times(when.every, when.start_at, after, until, limit)
    if when.cron is not None:
        if when.start_at is not None:
            after = max(after, math.nextafter(when.start_at, -math.inf))
        return _cron_times(when.cron, when.timezone, after, until, limit)
    return []


def _every_times(every: float, start_at: float | None, after: float, until: float, limit: int) -> list[float]:
    anchor = 0.0 if start_at is None else start_at
    if after < anchor:
        k = 0
    else:  # the first k with anchor + k * every > after, without walking from the anchor
        k = math.floor((after - anchor) / every) + 1
        while anchor + k * every <= after:
            k += 1
        while k > 0 and anchor + (k - 1) * every > after:
            k -= 1
    out: list[float] = []
    while len(out) < limit:
        t = anchor + k * every
        if t > until:
            break
        out.append(t)
        k += 1
    return out


def _cron_times(expr: str, tz: str, after: float, until: float, limit: int) -> list[float]:
    minutes, seconds = _split_cron(expr)
    lowest = max(after, _CRON_FIRST)
    if lowest >= _CRON_LAST:
        return []
    # cronsim starts one second after a whole second: floor, as fromtimestamp would
    # round x.9999999 up to x + 1 and miss x + 1. With seconds, the minute that holds
    # ``after`` may still have times after it.
    start = math.floor(lowest) - (0 if seconds == (0,) else 60)
    out: list[float] = []
    last = after
    # cronsim stops by itself when nothing matches for 50 years.
    for dt in CronSim(minutes, datetime.fromtimestamp(start, _zone(tz))):
        minute = dt.timestamp()
        for second in seconds:
            t = minute + second
            if t <= last:  # before ``after`` (a first pass of a repeated hour, or a fold)
                continue
            if t > until:
                return out
            out.append(t)
            last = t
            if len(out) >= limit:
                return out
        if minute >= _CRON_LAST:
            break
    return out
