"""Celery's own log lines in a worker: our handler and format, and the attempt's fields.

Celery writes about one step in two processes. The pool process runs the attempt
and logs "Task ... succeeded", "... retry" or "... raised" after the task body has
returned, still between the task_prerun and task_postrun signals: the attempt is
entered and left there (:func:`follow_attempts`), so the body's lines and Celery's
share it. The worker's main process logs "Task ... received" as it builds the
request, before any attempt runs: :class:`~shared.messaging.StepRequest` names its
message then (:func:`shared.logs.name_message`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import signals
from celery.utils.log import get_multiprocessing_logger

from shared.logs import AttemptFields, enter_attempt, leave_attempt
from shared.task import StepMessage


def attempt_fields(args: Sequence[Any]) -> AttemptFields | None:
    """The log fields of a step task's arguments; None when they hold no step message."""
    try:
        message = StepMessage.from_payload(args[0])
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return AttemptFields.of(message)


def follow_attempts(task_name: str) -> None:
    """Lines logged while a ``task_name`` task runs in this process carry its attempt's fields."""

    def enter(sender: Any = None, args: Sequence[Any] = (), **_: Any) -> None:
        if getattr(sender, "name", None) == task_name:
            enter_attempt(attempt_fields(args))

    def leave(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == task_name:
            leave_attempt()

    # Signals are process-wide: one pair per task name, however many apps register it.
    signals.task_prerun.connect(enter, weak=False, dispatch_uid=f"asyncflow-enter-{task_name}")
    signals.task_postrun.connect(leave, weak=False, dispatch_uid=f"asyncflow-leave-{task_name}")


def _through_our_handler(**_: Any) -> None:
    """A receiver of setup_logging: Celery configures no logger when there is one.

    billiard's logger (a pool process that died, ...) does not propagate by itself:
    it goes to our handler, at the level Celery would give it.
    """
    billiard_logger = get_multiprocessing_logger()
    billiard_logger.propagate = True
    billiard_logger.setLevel(logging.ERROR)


def _redirect_output(instance: Any = None, **_: Any) -> None:
    # What Celery does itself when it owns logging: what the worker (and its pool
    # processes, forked later) print becomes log lines in our format.
    if instance is not None and instance.redirect_stdouts:
        instance.app.log.redirect_stdouts(instance.redirect_stdouts_level)


def keep_process_logging() -> None:
    """Celery's loggers go through the handler of :func:`shared.logs.setup_logging`.

    Otherwise a worker gives Celery's task loggers and billiard's logger handlers of
    their own in Celery's format, which a JSON log shipper cannot read. Pool
    processes are forked from the worker: they inherit its handler, and the
    receivers connected here.
    """
    signals.setup_logging.connect(_through_our_handler, weak=False, dispatch_uid="asyncflow-logging")
    signals.celeryd_after_setup.connect(_redirect_output, weak=False, dispatch_uid="asyncflow-redirect")
