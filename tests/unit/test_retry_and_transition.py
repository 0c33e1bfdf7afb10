"""The pieces both kinds of task share: the retry rule, the compare-and-set loop, outage patience."""

from __future__ import annotations

import pytest

from shared.retry import reconnect_delay, retry_delay
from shared.storage import StorageUnavailable, patiently
from shared.testing import ManualClock
from shared.transition import MAX_CAS_ROUNDS, TooManyRounds, compare_and_set


def test_the_seed_retry_rule_progressive_uniform_and_at_once() -> None:
    assert [retry_delay(n, 10) for n in range(7)] == [1, 2, 4, 8, 10, 10, 10]  # seed 000 §三.1's example
    assert [retry_delay(n, -5) for n in range(3)] == [5, 5, 5]
    assert [retry_delay(n, -0.2) for n in range(3)] == [0.2, 0.2, 0.2]
    assert retry_delay(3, 0) == 0
    assert retry_delay(10_000, 3600) == 3600  # no overflow however many retries


def test_reconnect_backoff_doubles_up_to_its_cap() -> None:
    assert [reconnect_delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert [reconnect_delay(n, first=0.5, cap=8) for n in range(6)] == [0.5, 1, 2, 4, 8, 8]
    assert reconnect_delay(10_000) == 30


class Cell:
    """A versioned record with a compare-and-set, and another writer that can cut in."""

    def __init__(self) -> None:
        self.value, self.version = 0, 0
        self.loads = 0
        self.cut_in = 0  # how many writes of another writer land before ours

    def load(self) -> tuple[int, int]:
        self.loads += 1
        return self.value, self.version

    def write(self, seen: tuple[int, int], new: int | None) -> bool | None:
        if new is None:
            return None
        if self.cut_in:
            self.cut_in -= 1
            self.value, self.version = self.value + 100, self.version + 1
        if seen[1] != self.version:
            return False
        self.value, self.version = new, self.version + 1
        return True


def test_a_lost_race_is_decided_again_on_what_the_winner_stored() -> None:
    cell = Cell()
    cell.cut_in = 2
    effects: list[tuple[tuple[int, int], int | None]] = []
    seen, new = compare_and_set(
        "cell", cell.load, lambda r: r[0] + 1, cell.write, effects=lambda r, d: effects.append((r, d))
    )
    assert (seen, new) == ((200, 2), 201)
    assert (cell.value, cell.version, cell.loads) == (201, 3, 3)
    assert effects == [((200, 2), 201)]  # once, after the write that stuck


def test_a_no_op_decided_on_a_callers_copy_is_decided_again_on_a_fresh_read() -> None:
    cell = Cell()
    cell.value, cell.version = 5, 1
    stale_copy = (0, 0)
    seen, new = compare_and_set(
        "cell", cell.load, lambda r: None if r[0] == 0 else r[0] + 1, cell.write, known=stale_copy
    )
    assert (seen, new, cell.value, cell.loads) == ((5, 1), 6, 6, 1)
    assert compare_and_set("cell", cell.load, lambda r: None, cell.write) == ((6, 2), None)


def test_a_record_changed_on_every_round_gives_up_loudly() -> None:
    cell = Cell()
    cell.cut_in = MAX_CAS_ROUNDS
    with pytest.raises(TooManyRounds, match=f"cell: gave up after {MAX_CAS_ROUNDS}"):
        compare_and_set("cell", cell.load, lambda r: r[0] + 1, cell.write)


def test_patiently_waits_out_a_short_outage_and_gives_up_after_its_patience() -> None:
    clock = ManualClock()
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        clock.advance(seconds)

    failures = iter([True, True, False])

    def flaky() -> str:
        if next(failures):
            raise StorageUnavailable("connection refused")
        return "stored"

    assert patiently(flaky, 60, "storing", clock, sleep) == "stored"
    assert pauses == [0.5, 1]

    def down() -> str:
        raise StorageUnavailable("connection refused")

    pauses.clear()
    with pytest.raises(StorageUnavailable):
        patiently(down, 10, "storing", clock, sleep)
    assert pauses == [0.5, 1, 2, 4] and sum(pauses) <= 10
