"""The step each pool process of a worker runs, and the time limits of each attempt.

A delivery may run the flow's next steps after the delivered one
(:meth:`shared.consumer.StepConsumer.handle`), so Celery's time limits, set per
delivery, cannot be an attempt's. Each attempt gets its own from a timer in the
pool process: at its timeout the handler is interrupted; if it swallows that and
is still running ``grace`` seconds later, its process kills itself. Celery's
limits stay as a backstop for a handler stuck where no signal gets through.

When a pool process dies, the worker's main process reports the lost attempt, but
it knows only the message it delivered, which is stale once the delivery ran on.
So a pool process notes the step it ran on to (and why it killed itself) in a file
named by its pid, in a directory of its worker, and the main process reads it back.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import zlib
from _signal import getsignal as raw_getsignal  # type: ignore[import-not-found]  # no stub: the C function
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
from celery.exceptions import SoftTimeLimitExceeded

from shared.consumer import AttemptTimedOut
from shared.module import Handler, PollLater, StepContext
from shared.processes import runs
from shared.records import evolve
from shared.task import StepMessage

# The main process of a worker of our own kills a consumer process this long after
# its handler's hard limit: the process's own timer (RunningSteps.call) goes first
# when a signal reaches it.
KILL_MARGIN = 1.0


class Alarm:
    """The process's SIGALRM handler: it interrupts the attempt whose time limit is armed.

    Installed at the first attempt, and again only if something replaced it
    since (a handler with a timer of its own that did not put ours back). One
    installed and put back around every attempt made :meth:`RunningSteps.call`
    of a no-op handler take 17 us instead of 11 (``signal.signal`` converts each
    handler to and from its enum).
    """

    def __init__(self) -> None:
        self._due: Callable[[], None] | None = None

    def arm(self, due: Callable[[], None], seconds: float) -> None:
        """Call ``due`` in the main thread in ``seconds``, until disarmed."""
        # The C function signal.getsignal wraps: the wrapper looks the answer up in its
        # Handlers enum, which raises and catches a ValueError for a Python handler
        # (3 % of a worker's CPU in a profile; a no-op attempt 3.2 against 1.4 µs).
        if raw_getsignal(signal.SIGALRM) is not _ring:
            signal.signal(signal.SIGALRM, _ring)
        self._due = due
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def disarm(self) -> None:
        self._due = None  # first: a signal already on its way then finds nothing to interrupt
        signal.setitimer(signal.ITIMER_REAL, 0)

    def ring(self) -> None:
        if self._due is not None:  # else a timer of the attempt before, already over
            self._due()


ALARM = Alarm()


def _ring(signum: int, frame: object) -> None:
    ALARM.ring()


class RunningSteps:
    def __init__(self, grace: float, root: Path | None = None) -> None:
        self.grace = grace
        root = Path(tempfile.gettempdir()) if root is None else root
        remove_orphans(root)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{_prefix()}{os.getpid()}-", dir=root))
        self._current: tuple[str, StepMessage] | None = None  # in a pool process
        self._noted: dict[str, Any] = {}  # the note of _current, without its times
        self._started = 0.0  # set by deliver: a consumer process of our own
        self._deadline: float | None = None
        self._limit: float | None = None  # the hard limit that deadline enforces, in seconds
        self._note = -1  # the pool process's note file, open for writing
        # A consumer process holding several deliveries (shared.group_commit): the
        # attempts besides _current, as noted, and the task whose handler runs now.
        self._others: list[dict[str, Any]] = []
        self._payloads: dict[int, tuple[StepMessage, dict[str, Any]]] = {}
        self._running: str | None = None
        self._holding = False
        self._held_limit: float | None = None  # the longest hard limit of the deliveries held
        self._note_pid: int | None = None
        owner = os.getpid()

        def remove() -> None:
            if os.getpid() == owner:  # not in a forked pool process that exits
                shutil.rmtree(self.directory, ignore_errors=True)

        atexit.register(remove)

    # --- in a pool process ---------------------------------------------------------

    def begin(self, delivery: str, message: StepMessage, ran_on: bool) -> None:
        """Delivery ``delivery`` now runs ``message``; ``ran_on``: not the delivered one."""
        self._run(delivery, message)
        if self._started:  # a consumer process of our own: the attempt in flight starts now
            self._started = time.time()
        if ran_on:
            self._write({})

    def deliver(self, delivery: str, message: StepMessage, hard_limit: float | None) -> None:
        """A consumer process of our own (shared.messaging.consumers) took ``message``: noted at once.

        Its main process knows no delivery, so it reads every one from the note,
        and kills the process once the note's deadline has passed: ``hard_limit``
        seconds after the delivery, or sooner, while a handler runs, at that
        attempt's own hard limit (:meth:`call`) and KILL_MARGIN.
        """
        self._run(delivery, message)
        self._started = time.time()
        self._deadline = self._started + hard_limit if hard_limit else None
        self._limit = hard_limit
        self._write({})

    def hold(self, delivery: str, message: StepMessage, others: list[StepMessage], limit: float | None) -> None:
        """A consumer process holding several deliveries (shared.group_commit): each attempt, noted at once.

        ``message`` (of ``delivery``) and the ``others`` wait for a commit or for
        their turn on the process's one thread; if the process dies, the main
        process reports each of them lost. While no handler runs, the note's
        deadline is ``limit`` (the longest hard limit of the deliveries held) from
        the last time the deliveries moved on: a process stuck between handlers
        (a commit that never answers) is killed then. While a handler runs, its
        own hard limit is the deadline (:meth:`call`).
        """
        if self._current is None or self._current[1] is not message:
            self._run(delivery, message)
            self._started = time.time()
        self._holding, self._held_limit = True, limit
        self._deadline = time.time() + limit if limit else None
        self._limit = limit
        payloads = {}
        for other in others:  # each made once while it is held: the note is written at every change
            known = self._payloads.get(id(other))
            payloads[id(other)] = known if known is not None and known[0] is other else (other, _noted_payload(other))
        self._payloads = payloads
        self._others = [payload for _, payload in payloads.values()]
        self._write({})

    def finish(self) -> None:
        """The delivery is over: the note says so, and a death from now on loses no attempt."""
        self._current, self._noted, self._others, self._payloads = None, {}, [], {}
        self._holding, self._held_limit = False, None
        self._write({})

    def call(self, handler: Handler, ctx: StepContext, timeout: float) -> Mapping[str, Any] | PollLater | None:
        """Run a handler under its attempt's time limits (the consumer's ``invoke``)."""
        timer = threading.current_thread() is threading.main_thread()  # where Celery runs tasks
        delivery_limits = self._deadline, self._limit
        deadline = time.time() + timeout + self.grace + KILL_MARGIN
        # Holding several deliveries, the handler's own limit stands, sooner or later than theirs.
        watched = self._started > 0 and (self._holding or self._deadline is None or deadline < self._deadline)
        if watched:  # a handler no signal reaches is killed at its own limit, not at its delivery's
            self._deadline, self._limit = deadline, timeout + self.grace
            self._running = ctx.task_id if self._others else None
            self._write({})
        if timer:
            interrupted = False

            def time_is_up() -> None:
                nonlocal interrupted
                if interrupted:
                    self._kill_self(f"killed after the hard time limit of {timeout + self.grace:g}s")
                interrupted = True
                signal.setitimer(signal.ITIMER_REAL, max(self.grace, 0.001))
                raise AttemptTimedOut(f"timed out after {timeout:g}s")

            ALARM.arm(time_is_up, timeout)
        try:
            return handler(ctx)
        except SoftTimeLimitExceeded as exc:  # Celery's backstop
            raise AttemptTimedOut(str(exc)) from exc
        finally:
            if timer:
                ALARM.disarm()
            if watched:
                self._deadline, self._limit = delivery_limits
                if self._holding:  # the deliveries held moved on: their deadline starts again
                    limit = self._held_limit
                    self._deadline, self._limit = (time.time() + limit if limit else None), limit
                self._running = None
                self._write({})

    def _kill_self(self, reason: str) -> None:
        self._write({"killed": reason})
        os.kill(os.getpid(), signal.SIGKILL)

    def _run(self, delivery: str, message: StepMessage) -> None:
        self._current = (delivery, message)
        self._noted = {}  # made at its first write: Celery's pool notes only the steps run on

    def _write(self, extra: dict[str, str]) -> None:
        if self._current is None:
            if self._note_pid != os.getpid():
                return  # nothing noted in this process yet
            data = b"{}"
        else:
            if not self._noted:
                delivery, message = self._current
                self._noted = {"delivery": delivery, "message": _noted_payload(message)}
            note = self._noted
            if self._started:
                note = note | {"started": self._started, "deadline": self._deadline, "limit": self._limit}
            if self._others:
                note = note | {"others": self._others, "running": self._running}
            data = orjson.dumps(note | extra)  # up to three notes a step: a tenth of json's cost
        # One write at the start of the file, which stays open: a step run on costs a
        # system call, not an open, a write, a close and a rename. The length and
        # checksum in front tell a whole note from one the kernel cut off as the
        # process was killed (it may stop between pages); that one reads as no note.
        if self._note_pid != os.getpid():  # opened in this process, not inherited at a fork
            self._note = os.open(self.directory / str(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self._note_pid = os.getpid()
        os.pwrite(self._note, b"%d %d\n" % (len(data), zlib.crc32(data)) + data, 0)

    # --- in the worker's main process ------------------------------------------------

    def step_of(self, delivery: str, pid: int | None, delivered: StepMessage) -> tuple[StepMessage, str | None]:
        """The step that pool process ``pid`` ran last for ``delivery``, and why it killed itself."""
        if pid is None:
            return delivered, None
        try:
            note = read_note(self.directory / str(pid))
        except (OSError, ValueError):
            return delivered, None  # it never ran on, nor killed itself; or its note was cut off
        if note.get("delivery") != delivery:
            return delivered, None  # a note of an earlier delivery of that process
        return StepMessage.from_payload(note["message"]), note.get("killed")


    def note_of(self, pid: int) -> dict[str, Any]:
        """What consumer process ``pid`` runs now: {} when idle, or when it never noted a step.

        Keys: ``delivery``, ``message`` (a StepMessage payload), ``started`` (of
        the attempt), ``deadline`` (wall clock) and ``limit`` (the hard limit it
        enforces, in seconds), from :meth:`deliver`; ``killed`` (why it killed itself).
        A process holding several deliveries (:meth:`hold`) adds ``others`` (their
        payloads) and ``running`` (the task whose handler runs, None between handlers).
        """
        try:
            return read_note(self.directory / str(pid))
        except (OSError, ValueError):
            return {}

    def forget(self, pid: int) -> None:
        """Remove the note of a process that is gone (its pid may be reused)."""
        try:
            os.unlink(self.directory / str(pid))
        except FileNotFoundError:
            pass


def _noted_payload(message: StepMessage) -> dict[str, Any]:
    # The parameters and the task stay in the database; the report needs the step only.
    return evolve(message, parameters={}, known=None).to_payload()


def _prefix() -> str:
    return f"asyncflow-worker-{socket.gethostname()}-"


def remove_orphans(root: Path) -> None:
    """Remove the note directories that workers of this host left behind when they died.

    A worker removes its own at exit, but not when it is killed (SIGKILL, the
    out-of-memory killer) nor after the last-resort exit of a cold shutdown that
    hangs (``os._exit``). The next worker started removes those whose process, named
    with the host in the directory's name, no longer runs.
    """
    prefix = _prefix()
    for path in root.glob(prefix + "*"):
        pid = path.name[len(prefix) :].partition("-")[0]
        if pid.isdigit() and not runs(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def read_note(path: Path) -> dict[str, Any]:
    """A pool process's note; ValueError if it is not whole."""
    head, _, rest = path.read_bytes().partition(b"\n")
    size, crc = (int(field) for field in head.split())
    data = rest[:size]
    if len(data) != size or zlib.crc32(data) != crc:
        raise ValueError("a note cut off as it was written")
    note: dict[str, Any] = json.loads(data)
    return note
