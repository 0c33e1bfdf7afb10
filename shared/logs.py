"""Logging for the processes the CLI starts: one line per event, as text or JSON.

Every line logged while a step attempt runs carries the attempt's fields (task id,
flow, step, seq, attempt, module, command), whoever logs it: our code, a module's
own logger, Celery, SQLAlchemy. The attempt is a context variable set around the
attempt (:func:`attempt_context`) and a filter on the handler puts it on each
record; fields passed explicitly through ``extra=`` win over it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from logging.handlers import WatchedFileHandler
from typing import TYPE_CHECKING, Any
from weakref import WeakValueDictionary

from shared.config import Settings

if TYPE_CHECKING:
    from shared.task import StepMessage, Task


@dataclass(frozen=True)
class AttemptFields:
    """What identifies one step attempt in a log line."""

    task_id: str
    flow: str
    step: int  # the step's index in the flow (the task's cursor)
    seq: int
    attempt: int
    module: str
    command: str

    @classmethod
    def of(cls, message: StepMessage) -> AttemptFields:
        return cls(
            task_id=message.task_id,
            flow=message.flow,
            step=message.cursor,
            seq=message.seq,
            attempt=message.attempt,
            module=message.module,
            command=message.command,
        )

    @classmethod
    def of_active(cls, task: Task) -> AttemptFields | None:
        """The fields of ``task``'s outstanding attempt, if it has one."""
        active = task.active
        if active is None:
            return None
        action = task.steps[active.cursor].action(active.type)
        return cls(task.task_id, task.flow, active.cursor, active.seq, active.attempt, action.module, action.command)

    def fields(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies every value, a quarter of a worker's logging in a profile.
        return dict(vars(self))


# Where the filter puts the attempt on a record: one attribute, because "module"
# is already a LogRecord's (its source file), and extra= fields override it per field.
RECORD_ATTRIBUTE = "asyncflow_attempt"

_current: ContextVar[AttemptFields | None] = ContextVar("asyncflow_attempt", default=None)

# Lines that name a message only by its broker id, logged before any attempt is
# under way (Celery's "Task ... received"), find the attempt here. Weak: an entry
# lives as long as the object that holds the fields (Celery's request).
_by_message: WeakValueDictionary[str, AttemptFields] = WeakValueDictionary()


def current_attempt() -> AttemptFields | None:
    return _current.get()


def enter_attempt(fields: AttemptFields | None) -> None:
    """Make ``fields`` the attempt of the lines that follow, until :func:`leave_attempt`.

    For hooks that start and end an attempt in separate calls (Celery's signals);
    otherwise use :func:`attempt_context`.
    """
    _current.set(fields)


def leave_attempt() -> None:
    _current.set(None)


@contextmanager
def attempt_context(fields: AttemptFields | None) -> Iterator[None]:
    """The lines logged inside the block carry ``fields`` (nothing changes for None)."""
    if fields is None:
        yield
        return
    token = _current.set(fields)
    try:
        yield
    finally:
        _current.reset(token)


def name_message(message_id: str, fields: AttemptFields) -> None:
    """Lines whose Celery ``data`` names ``message_id`` get ``fields`` while they are held."""
    _by_message[message_id] = fields


def _named_message(record: logging.LogRecord) -> AttemptFields | None:
    # Celery's worker passes its log arguments again as extra ``data``, the
    # message id among them: that is its only handle on the message.
    data = getattr(record, "data", None)
    if isinstance(data, Mapping):
        message_id = data.get("id")
        if isinstance(message_id, str):
            return _by_message.get(message_id)
    return None


class AttemptFilter(logging.Filter):
    """Puts the current attempt on every record (the formatters render its fields)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, RECORD_ATTRIBUTE):
            setattr(record, RECORD_ATTRIBUTE, _current.get() or _named_message(record))
        return True


# The attributes every LogRecord has; anything else on a record came from
# ``extra=`` or the filter. Not fields either: "data", Celery's copy of its log
# arguments, and "color_message", uvicorn's message with terminal colours.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "data", "color_message", RECORD_ATTRIBUTE,
}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of a record: the attempt's, then the other extras (which win)."""
    attempt = getattr(record, RECORD_ATTRIBUTE, None)
    fields = attempt.fields() if isinstance(attempt, AttemptFields) else {}
    for name, value in vars(record).items():
        if name not in _STANDARD and not name.startswith("_"):
            fields[name] = value
    return fields


# What makes a value quoted: the same characters as str.isspace, and the quote and the equals sign.
_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _text_value(value: Any) -> str:
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """``time LEVEL process[pid] logger: message key=value ...``, a traceback below."""

    def __init__(self, process: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {process}[%(process)d] %(name)s: %(message)s")
        self._second: tuple[int, str] = (-1, "")  # the last second formatted, and its text

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        # logging's own, with the date and time of day made once a second, not once a line.
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second, text = self._second
        if second != int(record.created):
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (int(record.created), text)
        return f"{text},{int(record.msecs):03d}"  # as logging's default_msec_format

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = super().formatMessage(record)
        fields = " ".join(f"{k}={_text_value(v)}" for k, v in record_fields(record).items())
        return f"{line} {fields}" if fields else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "process": self.process,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        for name, value in record_fields(record).items():
            line.setdefault(name, value)  # a field named like a key above does not replace it
        return json.dumps(line, ensure_ascii=False, default=str)


def make_handler(settings: Settings, process: str) -> logging.Handler:
    """The one handler of a process: the format and destination of ``settings``, with attempt fields."""
    # A file is reopened when logrotate moves it away; several processes may append to it.
    handler: logging.Handler = (
        logging.StreamHandler() if settings.log_file is None else WatchedFileHandler(settings.log_file)
    )
    formatter = JsonFormatter(process) if settings.log_format == "json" else TextFormatter(process)
    handler.setFormatter(formatter)
    handler.addFilter(AttemptFilter())
    return handler


def setup_logging(settings: Settings, process: str) -> None:
    """Send every logger of this process (uvicorn's and Celery's included) and the
    warnings through one handler.

    ``process`` names the role in each line: api, worker, scheduler, up.
    """
    # What no format here prints, a record need not look up: the caller's file and
    # line (a walk of the stack; stack_info=True then adds nothing, and nothing here
    # asks for it), the thread's and the process's names. Together with the time of
    # day, a quarter of what a worker's line costs it.
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [make_handler(settings, process)]
    root.setLevel(settings.log_level.upper())
    logging.captureWarnings(True)  # warnings too, instead of raw text on stderr
