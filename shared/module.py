"""What a module author writes against: a named set of command handlers.

A module file creates one :class:`Module`, decorates its handlers, and is named
in ``flows.yaml``; ``asyncflow worker NAME`` imports it and consumes its queue.

    module = Module("resource")

    @module.command("check_resource")
    def check_resource(ctx: StepContext) -> dict:
        ...
        return {"Checked": True}      # merged into the task's Parameters

A handler returns a dict (or None) on success, raises to fail the attempt
(:class:`PermanentError` skips the remaining retries), or returns
:class:`PollLater` when the work goes on elsewhere and should be looked at again.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.config import Settings


class ModuleError(Exception):
    """A module or command cannot be found or is declared wrongly."""


class PermanentError(Exception):
    """The attempt failed in a way that retrying cannot fix (bad input, no quota)."""


@dataclass(frozen=True)
class PollLater:
    """Not finished yet: run this command again after ``after`` seconds.

    It does not use up a retry. ``parameters`` are merged into the task's
    Parameters first, so the next poll sees e.g. an external job id.
    """

    after: float
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepContext:
    task_id: str
    flow: str
    cursor: int
    step_type: int  # 0 normal, 1 rollback (seed 004 §三)
    attempt: int
    parameters: Mapping[str, Any]
    settings: Settings
    key: str | None = None  # set for deliveries that are not step attempts (alarms)
    # Where heartbeat() reports to; None outside a worker (tests calling a handler).
    progress_sink: Callable[[Mapping[str, Any]], None] | None = field(default=None, repr=False, compare=False)

    def heartbeat(self, **progress: Any) -> None:
        """Report progress of long work (JSON values), shown with the running attempt.

        The worker keeps a running attempt alive on its own; this only says how
        far it got. The latest report is stored with the next heartbeat.
        """
        if self.progress_sink is not None:
            self.progress_sink(progress)

    @property
    def idempotency_key(self) -> str:
        """Same for every delivery of one attempt; differs between attempts."""
        return self.key or idempotency_key(self.task_id, self.cursor, self.step_type, self.attempt)

    @property
    def is_rollback(self) -> bool:
        return self.step_type == 1


def idempotency_key(task_id: str, cursor: int, step_type: int, attempt: int) -> str:
    """The key a handler (push or pull) uses to make one attempt's side effects happen once."""
    return f"{task_id}:{cursor}:{step_type}:{attempt}"


Handler = Callable[[StepContext], "Mapping[str, Any] | PollLater | None"]
StartupHook = Callable[[Settings], None]


class Module:
    def __init__(self, name: str) -> None:
        self.name = name
        self.commands: dict[str, Handler] = {}
        self._startup: list[StartupHook] = []
        self._started = False

    def command(self, name: str) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            if name in self.commands:
                raise ModuleError(f"module {self.name!r} registers command {name!r} twice")
            self.commands[name] = fn
            return fn

        return register

    def on_startup(self, fn: StartupHook) -> StartupHook:
        """Run once per process before the first command (create tables, connect)."""
        self._startup.append(fn)
        return fn

    def start(self, settings: Settings) -> None:
        if not self._started:
            for hook in self._startup:
                hook(settings)
            self._started = True

    def handler(self, command: str) -> Handler:
        try:
            return self.commands[command]
        except KeyError:
            raise ModuleError(f"module {self.name!r} has no command {command!r}") from None


def import_module_object(import_path: str, name: str) -> Module:
    """Import ``import_path`` and return the :class:`Module` called ``name`` in it."""
    try:
        py = importlib.import_module(import_path)
    except Exception as exc:  # a broken module file must be reported, not crash the caller
        raise ModuleError(
            f"module {name!r}: cannot import {import_path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    found = [v for v in vars(py).values() if isinstance(v, Module) and v.name == name]
    if not found:
        raise ModuleError(f"module {name!r}: {import_path!r} defines no Module({name!r})")
    return found[0]
