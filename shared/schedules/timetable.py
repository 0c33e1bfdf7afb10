"""The leader's timetable: schedules loaded ahead into memory, soonest first.

The leader sleeps until the earliest entry is due instead of polling the table.
A schedule whose latest task must be watched (a firing is buffered behind it, or
its failure pauses the schedule) comes back every ``WATCH_EVERY`` seconds while
that task runs; in the table its ``fire_at`` stays at its cursor, so whichever
scheduler leads next finds it due and watches it too.
"""

from __future__ import annotations

import heapq

from shared.schedules.model import Schedule
from shared.schedules.plan import next_fire_at

WATCH_EVERY = 1.0


def watched(s: Schedule) -> bool:
    return s.running is not None and not s.paused and (bool(s.buffered) or s.policy.pause_on_failure)


def wake_at(s: Schedule) -> float | None:
    """The stored moment the leader must act on ``s`` (``af_schedules.fire_at``)."""
    if s.paused:
        return None
    at = next_fire_at(s)
    if watched(s) and s.cursor is not None:
        return s.cursor if at is None else min(at, s.cursor)
    return at


class Timetable:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str, int]] = []
        self._known: dict[str, Schedule] = {}
        self._at: dict[str, float] = {}  # the one live heap entry of each schedule

    def __len__(self) -> int:
        return len(self._known)

    def put(self, s: Schedule, now: float, not_before: float = 0.0) -> None:
        """Track ``s``: a newer version replaces the one held; one that never fires again is dropped."""
        held = self._known.get(s.schedule_id)
        if held is not None and held.version >= s.version:
            return  # tracked already (read again by a reload), or this copy is older
        at = None if s.paused else next_fire_at(s)
        if watched(s):
            at = min(at, now + WATCH_EVERY) if at is not None else now + WATCH_EVERY
        if at is None:
            self._forget(s.schedule_id)
            return
        at = max(at, not_before)
        self._known[s.schedule_id] = s
        self._at[s.schedule_id] = at
        heapq.heappush(self._heap, (at, s.schedule_id, s.version))

    def _live(self, entry: tuple[float, str, int]) -> bool:
        at, schedule_id, version = entry
        s = self._known.get(schedule_id)
        return s is not None and s.version == version and self._at[schedule_id] == at

    def _forget(self, schedule_id: str) -> Schedule | None:
        self._at.pop(schedule_id, None)
        return self._known.pop(schedule_id, None)

    def pop_due(self, now: float, limit: int) -> list[Schedule]:
        """Up to ``limit`` schedules due by ``now``, soonest first; they leave the timetable."""
        due: list[Schedule] = []
        while self._heap and self._heap[0][0] <= now and len(due) < limit:
            entry = heapq.heappop(self._heap)
            if self._live(entry) and (s := self._forget(entry[1])) is not None:
                due.append(s)
        return due

    def next_at(self) -> float | None:
        while self._heap:
            if self._live(self._heap[0]):
                return self._heap[0][0]
            heapq.heappop(self._heap)  # superseded by a newer entry, or gone
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._known.clear()
        self._at.clear()
