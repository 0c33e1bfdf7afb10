"""JSON columns on PostgreSQL are encoded by orjson: the same documents json writes,
and the same refusals for what JSON cannot hold."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.storage.codec import json_text

scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # past 64 bits too: orjson refuses those, json writes them
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
documents = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=25
)


@given(documents)
def test_every_json_document_reads_back_as_json_wrote_it(value: Any) -> None:
    assert json.loads(json_text(value)) == json.loads(json.dumps(value))


def test_integers_past_64_bits_and_non_string_keys_are_written_as_json_does() -> None:
    value = {"huge": 2**70, "negative": -(2**64), 1: "one"}
    assert json.loads(json_text(value)) == {"huge": 2**70, "negative": -(2**64), "1": "one"}


class Colour(enum.StrEnum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int


@pytest.mark.parametrize("value", [datetime.datetime(2026, 1, 1), Point(1), object()])
def test_values_json_refuses_are_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        json_text({"v": value})


def test_a_string_subclass_encodes_as_json_encodes_it() -> None:
    assert json.loads(json_text({"c": Colour.RED})) == {"c": "red"}
