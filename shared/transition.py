"""One transition of a stored record: load, decide, compare-and-set, then effects.

Both kinds of task change this way: saga tasks (:mod:`shared.service`, decided by
:func:`shared.saga.decide`) and v1 pull-mode tasks (:mod:`shared.pull.service`,
decided by :mod:`shared.pull.rules`). The decision is pure; the write succeeds
only if the record still has the version the decision was made on, so two
writers never both apply a change decided on the same state. The loser decides
again on what the winner stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Record = TypeVar("Record")
Decision = TypeVar("Decision")

# A record changed by another writer on every round this many times in a row is
# not contention but a loop: give up loudly.
MAX_CAS_ROUNDS = 20


class TooManyRounds(RuntimeError):
    """The compare-and-set kept losing; something writes the record in a loop."""


def compare_and_set(
    what: str,
    load: Callable[[], Record],
    decide: Callable[[Record], Decision],
    write: Callable[[Record, Decision], bool | None],
    known: Record | None = None,
    effects: Callable[[Record, Decision], None] | None = None,
) -> tuple[Record, Decision]:
    """Decide on the stored record and store the result; returns (record decided on, decision).

    ``write`` stores the decision with a compare-and-set and returns True, False
    when another writer got there first, or None when the decision changes
    nothing. ``known`` is a copy the caller just stored, which saves a read; a
    decision to change nothing is then made again on a fresh read, since the copy
    may be out of date. ``effects`` (publish, count, log) run once, after the
    write that succeeded.
    """
    for _ in range(MAX_CAS_ROUNDS):
        from_copy = known is not None
        record = known if known is not None else load()
        known = None
        decision = decide(record)
        written = write(record, decision)
        if written is None and from_copy:
            continue
        if written is None:
            return record, decision
        if written:
            if effects is not None:
                effects(record, decision)
            return record, decision
    raise TooManyRounds(f"{what}: gave up after {MAX_CAS_ROUNDS} concurrent updates")
