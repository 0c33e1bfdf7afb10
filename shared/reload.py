"""Reloading flows.yaml in running processes, on SIGHUP.

The API processes and the scheduler hold flows.yaml in memory: on SIGHUP each
reads it again and, when it is valid, uses it for what is submitted (or fired)
from then on; an invalid file is logged with its problems and the flows in use
stay. Step workers need no reload: a task carries its steps' settings from its
submit, and a worker runs them with the code of its modules.

`asyncflow up` leaves ``up.pid`` under its home, naming itself, its parts and the
flows.yaml it runs, and passes SIGHUP on to its parts that hold flows;
`asyncflow flows reload` checks that file, then signals it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.config import Settings
from shared.flows import FlowsError, parse_flows_file
from shared.processes import runs
from shared.runtime import Runtime
from shared.schedules.service import InvalidSchedule
from shared.storage import StorageUnavailable

log = logging.getLogger(__name__)

PIDFILE = "up.pid"
# The parts of `asyncflow up` that hold flows.yaml; the worker needs no reload (see above).
HOLDING_FLOWS = ("api", "scheduler")
# How long a part just started may take to be ready for SIGHUP (without a handler, SIGHUP ends it).
READY_WITHIN = 30.0


def on_hangup(action: Callable[[], object]) -> None:
    """Run ``action`` at each SIGHUP, on a thread of its own.

    The handler only wakes the thread: what a reload does (read files, log, use
    the database) must not run inside a signal handler, which interrupts whatever
    the main thread holds. Two signals close together make one or two reloads.
    Only the main thread can install it; elsewhere (an embedding) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("not reloading on SIGHUP: only the main thread can handle signals")
        return
    wake = threading.Event()

    def serve() -> None:
        while True:
            wake.wait()
            wake.clear()
            try:
                action()
            except Exception:
                log.exception("reload on SIGHUP failed")

    threading.Thread(target=serve, name="sighup", daemon=True).start()
    signal.signal(signal.SIGHUP, lambda *_: wake.set())


def reload_flows(runtime: Runtime, declare_schedules: bool = False) -> bool:
    """Reload ``runtime``'s flows and log what happened; True when the new ones are in use.

    ``declare_schedules`` (the scheduler): apply the file's ``schedules:`` again,
    as at start.
    """
    try:
        flows = runtime.reload_flows()
    except FlowsError as exc:
        log.error("flows.yaml not reloaded, the flows loaded before stay in use: %s", "; ".join(exc.problems))
        return False
    log.info("flows reloaded from %s: %s", flows.source, ", ".join(sorted(flows.flows)))
    if declare_schedules:
        try:
            runtime.schedules.declare(flows.schedules)
        except (InvalidSchedule, StorageUnavailable) as exc:
            log.error("the schedules of %s were not applied (send SIGHUP again): %s", flows.source, exc)
    return True


def reload_on_hangup(runtime: Runtime, declare_schedules: bool = False) -> None:
    """An API process or the scheduler: reload flows.yaml at each SIGHUP."""
    on_hangup(lambda: reload_flows(runtime, declare_schedules))


# --- several API processes under uvicorn ----------------------------------------------------


def serve_api_workers(runtime: Runtime, host: str, port: int) -> None:
    """``runtime.settings.api_workers`` API processes under uvicorn's supervisor, reloading on SIGHUP.

    uvicorn's supervisor answers SIGHUP by starting new workers in place of the
    old ones, and each new one would read flows.yaml as it is: a bad file would
    fail its start, and a worker that died would be replaced by one that cannot
    start. So the workers read a copy of the last good file instead; on SIGHUP
    the supervisor checks flows.yaml, copies it over when it is good, and passes
    the signal on to every worker, which reloads in place.
    """
    import uvicorn
    from uvicorn.supervisors.multiprocess import Multiprocess

    settings = runtime.settings
    original = settings.flows

    with tempfile.TemporaryDirectory(prefix="asyncflow-api-") as directory:
        good = Path(directory) / "flows.yaml"
        good.write_bytes(original.read_bytes())
        os.environ["ASYNCFLOW_FLOWS"] = str(good)  # what the workers' settings read

        class Supervisor(Multiprocess):
            def handle_hup(self) -> None:
                try:
                    raw = original.read_bytes()
                    runtime.reload_flows(parse_flows_file(raw, str(original)))
                except OSError as exc:
                    log.error("flows.yaml not reloaded, the flows loaded before stay in use: %s", exc)
                    return
                except FlowsError as exc:
                    log.error("flows.yaml not reloaded, the flows loaded before stay in use: %s", "; ".join(exc.problems))
                    return
                staged = good.with_suffix(".new")
                staged.write_bytes(raw)
                os.replace(staged, good)
                for process in self.processes:
                    if process.pid is not None and process.process.is_alive():
                        os.kill(process.pid, signal.SIGHUP)
                log.info("flows reloaded from %s; %d API processes told", original, len(self.processes))

        config = uvicorn.Config(
            "oss_api.app:app_from_environment", factory=True, workers=settings.api_workers,
            host=host, port=port, log_config=None, access_log=False,
        )
        Supervisor(config, sockets=[config.bind_socket()]).run()


# --- asyncflow up, and asyncflow flows reload -----------------------------------------------


@dataclass(frozen=True)
class Up:
    """A running `asyncflow up`, as its pidfile names it."""

    pid: int
    flows: Path
    parts: dict[str, int] = field(default_factory=dict)  # part name -> pid
    modules: tuple[str, ...] = ()  # those it started a worker for


def forward_hangup(settings: Settings, parts: Mapping[str, subprocess.Popen[Any]], modules: list[str]) -> None:
    """`asyncflow up`: write up.pid, and pass each SIGHUP on to the parts that hold flows."""
    path = settings.home / PIDFILE
    running = find_up(settings.home)
    if running is not None and running.pid != os.getpid():
        log.warning("%s names another running asyncflow up (pid %d); left as it is", path, running.pid)
    else:
        doc = {
            "pid": os.getpid(),
            "flows": str(settings.flows.resolve()),
            "parts": {name: p.pid for name, p in parts.items()},
            "modules": modules,
        }
        staged = path.with_suffix(".new")
        # With a database and a broker of their own, nothing else made the home folder.
        path.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(staged, path)
        atexit.register(_remove_pidfile, path, os.getpid())

    def forward() -> None:
        told = []
        for name, proc in parts.items():
            if name in HOLDING_FLOWS and proc.poll() is None and handles_hangup(proc.pid, READY_WITHIN):
                proc.send_signal(signal.SIGHUP)
                told.append(f"{name} (pid {proc.pid})")
        log.info("SIGHUP passed on to %s", ", ".join(told) or "no part")

    on_hangup(forward)


def _remove_pidfile(path: Path, pid: int) -> None:
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def find_up(home: Path) -> Up | None:
    """The `asyncflow up` running with this home, or None (no pidfile, or its process is gone)."""
    try:
        doc = json.loads((home / PIDFILE).read_text(encoding="utf-8"))
        up = Up(
            pid=int(doc["pid"]),
            flows=Path(doc["flows"]),
            parts={str(k): int(v) for k, v in doc.get("parts", {}).items()},
            modules=tuple(doc.get("modules", ())),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return up if _is_asyncflow(up.pid) else None


def _is_asyncflow(pid: int) -> bool:
    """Whether ``pid`` runs and, where /proc tells, runs asyncflow (not a process that reused the pid)."""
    if not runs(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not sys.platform.startswith("linux") or not cmdline.exists():
        return True
    try:
        return b"asyncflow" in cmdline.read_bytes()
    except OSError:
        return False


def handles_hangup(pid: int, within: float = 0.0) -> bool:
    """Whether ``pid`` has a SIGHUP handler (without one, SIGHUP would end it), waiting up to ``within`` s.

    Linux tells through /proc; elsewhere this answers True.
    """
    deadline = time.monotonic() + within
    while True:
        caught = _caught_signals(pid)
        if caught is None:
            return True
        if caught & (1 << (signal.SIGHUP - 1)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _caught_signals(pid: int) -> int | None:
    """The mask of signals ``pid`` catches (/proc/PID/status SigCgt), or None where that cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    return None
