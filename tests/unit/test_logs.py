"""Log lines: the text and JSON formats, and the attempt fields every line carries."""

from __future__ import annotations

import gc
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from shared.config import Settings
from shared.logs import (
    AttemptFields,
    AttemptFilter,
    JsonFormatter,
    TextFormatter,
    attempt_context,
    current_attempt,
    name_message,
    record_fields,
    setup_logging,
)
from shared.messaging.celery_logs import attempt_fields, follow_attempts
from shared.states import StepType
from shared.task import StepMessage

ATTEMPT = AttemptFields(
    task_id="t-1", flow="deploy", step=1, seq=4, attempt=2, module="mysql", command="create_db",
)
ATTEMPT_KEYS = {"task_id", "flow", "step", "seq", "attempt", "module", "command"}


def record(msg: str = "hello world", *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    """A record as a logger makes it, then passed through the attempt filter as the handler does."""
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    logger = logging.getLogger("shared.example")
    rec = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, args, exc_info, extra=extra)
    assert AttemptFilter().filter(rec)
    return rec


def test_no_attempt_no_fields() -> None:
    rec = record()
    line = json.loads(JsonFormatter("worker").format(rec))
    assert not ATTEMPT_KEYS & line.keys()
    assert TextFormatter("worker").format(rec).endswith("shared.example: hello world")


def test_json_line_has_the_record_and_the_attempt() -> None:
    with attempt_context(ATTEMPT):
        rec = record(status="done")
    line = json.loads(JsonFormatter("worker").format(rec))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert line["level"] == "WARNING"
    assert line["process"] == "worker"
    assert line["pid"] == rec.process
    assert line["logger"] == "shared.example"
    assert line["message"] == "hello world"
    assert {k: line[k] for k in ATTEMPT_KEYS} == ATTEMPT.fields()
    assert line["status"] == "done"
    assert "exception" not in line


def test_explicit_extra_wins_over_the_attempt() -> None:
    with attempt_context(ATTEMPT):
        rec = record(task_id="other", seq=9)
    line = json.loads(JsonFormatter("api").format(rec))
    assert (line["task_id"], line["seq"], line["flow"]) == ("other", 9, "deploy")
    text = TextFormatter("api").format(rec)
    assert "task_id=other flow=deploy step=1 seq=9 attempt=2 module=mysql command=create_db" in text


def test_a_field_never_replaces_the_line_s_own_keys() -> None:
    rec = record(level="mine", message_id="m")
    line = json.loads(JsonFormatter("api").format(rec))
    assert line["level"] == "WARNING"
    assert line["message_id"] == "m"


def test_exception_rendered_in_both_formats() -> None:
    with attempt_context(ATTEMPT):
        rec = record("failed", exc=True)
    line = json.loads(JsonFormatter("worker").format(rec))
    assert line["message"] == "failed"
    assert line["exception"].startswith("Traceback (most recent call last):")
    assert line["exception"].rstrip().endswith("ValueError: boom")
    first, *rest = TextFormatter("worker").format(rec).splitlines()
    # The fields stay on the line of the message, the traceback follows.
    assert first.endswith(
        "shared.example: failed task_id=t-1 flow=deploy step=1 seq=4 attempt=2 module=mysql command=create_db"
    )
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: boom"


def test_text_shape_and_quoting() -> None:
    rec = record(reason="two words", empty="", plain="x")
    text = TextFormatter("scheduler").format(rec)
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING scheduler\[\d+\] shared.example: hello world "
        r'reason="two words" empty="" plain=x',
        text,
    )


@pytest.mark.parametrize("value", ["a\tb", "a\u00a0b", "line\nbreak", 'say "hi"', "k=v"])
def test_a_value_with_a_space_of_any_kind_a_quote_or_an_equals_sign_is_quoted(value: str) -> None:
    text = TextFormatter("worker").format(record(v=value))
    assert text.endswith(" v=" + json.dumps(value, ensure_ascii=False))


def test_attempt_fields_are_a_new_dict_each_time() -> None:
    fields = ATTEMPT.fields()
    assert fields == {"task_id": "t-1", "flow": "deploy", "step": 1, "seq": 4, "attempt": 2,
                      "module": "mysql", "command": "create_db"}
    fields["task_id"] = "changed"
    assert ATTEMPT.fields()["task_id"] == "t-1"


def test_json_values_that_json_cannot_hold_become_strings() -> None:
    rec = record(path=Path("/tmp/x"), when=object())
    line = json.loads(JsonFormatter("up").format(rec))
    assert line["path"] == "/tmp/x"
    assert line["when"].startswith("<object object")


def test_json_message_with_newlines_stays_one_line() -> None:
    out = JsonFormatter("api").format(record("a\nb %s", "world"))
    assert "\n" not in out
    assert json.loads(out)["message"] == "a\nb world"


def test_attempt_context_nests_and_ends() -> None:
    other = AttemptFields("t-2", "f", 0, 1, 1, "m", "c")
    assert current_attempt() is None
    with attempt_context(ATTEMPT):
        with attempt_context(other):
            assert current_attempt() is other
        assert current_attempt() is ATTEMPT
        with attempt_context(None):
            assert current_attempt() is ATTEMPT
    assert current_attempt() is None
    assert record_fields(record()) == {}


def test_a_named_message_gives_its_fields_to_celery_lines_while_held() -> None:
    fields = AttemptFields("t-3", "f", 2, 7, 1, "m", "c")
    name_message("celery-id-1", fields)
    data = {"id": "celery-id-1", "name": "asyncflow.step"}
    rec = record("Task %(name)s[%(id)s] received", data, data=data)
    assert record_fields(rec) == fields.fields()
    assert "data" not in json.loads(JsonFormatter("worker").format(rec))
    unrelated = record("Task %(name)s[%(id)s] received", {"id": "other"}, data={"id": "other"})
    assert record_fields(unrelated) == {}
    del fields, rec
    gc.collect()  # the request that held the fields is gone: nothing is kept
    assert record_fields(record("x", data=data)) == {}


def step_payload(**overrides: object) -> dict[str, object]:
    message = StepMessage(
        task_id="t-9", flow="deploy", seq=3, cursor=1, type=StepType.NORMAL, attempt=2,
        module="mysql", command="create_db", timeout=10, retry=1, parameters={"a": 1},
    )
    return message.to_payload() | overrides


def test_attempt_fields_of_a_step_message() -> None:
    assert attempt_fields([step_payload()]) == AttemptFields("t-9", "deploy", 1, 3, 2, "mysql", "create_db")
    assert attempt_fields([]) is None
    assert attempt_fields([{"task_id": "t"}]) is None  # an alarm, say
    assert attempt_fields(["text"]) is None


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(AttemptFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_celery_s_trace_lines_carry_the_attempt_of_the_step_task() -> None:
    """Celery's tracer (the code a pool process runs) logs the outcome after the body."""
    follow_attempts("asyncflow.step")
    follow_attempts("asyncflow.step")  # idempotent: one pair of receivers
    app = Celery("logs-test", set_as_current=False)
    seen: dict[str, Any] = {}

    @app.task(name="asyncflow.step", shared=False)  # type: ignore[untyped-decorator]
    def step(payload: dict[str, Any]) -> None:
        seen["step"] = current_attempt()

    @app.task(name="asyncflow.alarm", shared=False)  # type: ignore[untyped-decorator]
    def alarm(payload: dict[str, Any]) -> None:
        seen["alarm"] = current_attempt()

    trace = logging.getLogger("celery.app.trace")
    collect, level = Collect(), trace.level
    trace.addHandler(collect)
    trace.setLevel(logging.INFO)
    try:
        step.apply(args=(step_payload(),))
        assert current_attempt() is None  # left when the task is over
        alarm.apply(args=(step_payload(),))
    finally:
        trace.removeHandler(collect)
        trace.setLevel(level)
    expected = AttemptFields("t-9", "deploy", 1, 3, 2, "mysql", "create_db")
    assert seen == {"step": expected, "alarm": None}
    succeeded = [r for r in collect.records if "succeeded" in r.getMessage()]
    assert len(succeeded) == 2, [r.getMessage() for r in collect.records]
    assert [record_fields(r) for r in succeeded] == [expected.fields(), {}]


def test_the_text_time_is_logging_s_own_though_made_once_a_second() -> None:
    ours, logging_s = TextFormatter("worker"), logging.Formatter()
    for created in (1_790_000_000.0, 1_790_000_000.4, 1_790_000_000.999, 1_790_000_001.0, 1_790_000_001.5, 1_700_000_000.25):
        rec = record()
        rec.created, rec.msecs = created, (created - int(created)) * 1000
        assert ours.formatTime(rec) == logging_s.formatTime(rec)
    assert ours.formatTime(rec, "%H") == logging_s.formatTime(rec, "%H")


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    looked_up = logging._srcfile, logging.logThreads, logging.logMultiprocessing
    try:
        yield
    finally:
        logging._srcfile, logging.logThreads, logging.logMultiprocessing = looked_up
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)


def test_setup_logging_json_to_a_file(tmp_path: Path, root_logging: None) -> None:
    path = tmp_path / "asyncflow.log"
    setup_logging(Settings(log_format="json", log_file=path, log_level="info"), "worker")
    with attempt_context(ATTEMPT):
        logging.getLogger("uvicorn.error").info("Started server process [%d]", 1, extra={"color_message": "x"})
        logging.getLogger("sqlalchemy.engine").warning("a warning")
    logging.getLogger("shared.x").debug("below the level")
    try:
        raise KeyError("k")
    except KeyError:
        logging.getLogger("shared.x").exception("no attempt")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["message"] for line in lines] == ["Started server process [1]", "a warning", "no attempt"]
    assert all({k: line[k] for k in ATTEMPT_KEYS} == ATTEMPT.fields() for line in lines[:2])
    assert "color_message" not in lines[0]
    assert not ATTEMPT_KEYS & lines[2].keys()
    assert "KeyError: 'k'" in lines[2]["exception"]


def test_setup_logging_text_by_default(tmp_path: Path, root_logging: None) -> None:
    path = tmp_path / "asyncflow.log"
    setup_logging(Settings(log_file=path), "scheduler")
    logging.getLogger("shared.x").info("tick", extra={"task_id": "t-1"})
    (line,) = path.read_text().splitlines()
    assert re.search(r" INFO scheduler\[\d+\] shared.x: tick task_id=t-1$", line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", line)


def test_the_format_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="log_format"):
        Settings(log_format="xml")  # type: ignore[arg-type]
