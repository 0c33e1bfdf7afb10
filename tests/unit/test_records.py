"""evolve: the copy with changes that the saga's records are made by."""

from __future__ import annotations

import dataclasses

import pytest

from shared.records import evolve
from shared.storage.codec import task_from_row
from tests.unit.test_stored_rows import ROW_0_1_0


def test_a_copy_is_what_replace_makes_the_original_is_untouched_and_a_wrong_name_is_refused() -> None:
    task = task_from_row(ROW_0_1_0)
    changed = evolve(task, seq=9, message="moved")
    assert changed == dataclasses.replace(task, seq=9, message="moved")
    assert (task.seq, task.message) == (ROW_0_1_0["seq"], ROW_0_1_0["message"])  # the original is untouched
    with pytest.raises(TypeError, match="no field"):
        evolve(task, sequence=9)


@dataclasses.dataclass(frozen=True)
class Checked:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("negative")


def test_a_record_that_checks_itself_is_refused_rather_than_copied_unchecked() -> None:
    with pytest.raises(TypeError, match="more than its fields"):
        evolve(Checked(1), value=-1)


@dataclasses.dataclass(frozen=True)
class Derived:
    value: int
    twice: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    value: int


@pytest.mark.parametrize("record", [Derived(1), Slotted(1)], ids=["init=False", "slots"])
def test_a_record_that_replace_would_build_otherwise_is_refused(record: object) -> None:
    with pytest.raises(TypeError, match="more than its fields"):
        evolve(record, value=2)
