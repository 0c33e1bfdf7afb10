"""Start Asyncflow's real processes (API, scheduler, workers) for a test session."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shared.config import Settings
from shared.migrate import upgrade
from shared.states import STOPPED
from shared.testing import wait_for

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    name: str
    home: Path
    env: dict[str, str]
    worker_groups: list[list[str]] | None  # None: everything through `asyncflow up`
    port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # One client for every call a test makes: httpx.get builds a client, and with it an SSL
    # context, per call (tens of ms on a slow host; a wait over 520 tasks took half a minute).
    # No connection is kept, as tests kill the API and start it again.
    http: httpx.Client = field(
        default_factory=lambda: httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))
    )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def journal(self) -> Path:
        return self.home / "journal.jsonl"

    def start(self) -> None:
        self.env.update(
            ASYNCFLOW_HOME=str(self.home),
            ASYNCFLOW_API_PORT=str(self.port),
            ASYNCFLOW_API_URL=self.url,
            TESTMOD_JOURNAL=str(self.journal),
            PYTHONPATH=os.pathsep.join([str(SUPPORT), str(REPO)]),
        )
        self.env.setdefault("ASYNCFLOW_FLOWS", str(SUPPORT / "flows.yaml"))
        self.env.setdefault("ASYNCFLOW_HARD_TIMEOUT_GRACE", "1")
        self.env.setdefault("ASYNCFLOW_SCHEDULER_TICK", "0.05")
        if self.worker_groups is None:
            self.spawn("up", "up", "--port", str(self.port))
            self.wait_healthy(60)
            return
        # Migrated from here: `asyncflow db upgrade` would cost an interpreter and its imports.
        upgrade(Settings(home=self.home, database_url=self.env.get("ASYNCFLOW_DATABASE_URL")).resolved_database_url())
        self.env["ASYNCFLOW_MIGRATE_ON_START"] = "false"
        self.spawn("api", "api", "--port", str(self.port))
        self.spawn("scheduler", "scheduler")
        for group in self.worker_groups:
            self.spawn("worker-" + "+".join(group), "worker", *group, "-c", "2")
        self.wait_healthy(30)

    def wait_healthy(self, timeout: float) -> None:
        """Until the API answers /healthz (a respawned one takes a few seconds to listen)."""
        wait_for(self._healthy, timeout, f"{self.name} API to answer /healthz")

    def spawn(self, key: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.home / f"{key}.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncflow", *args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.home,
            start_new_session=True,
        )
        self.procs[key] = proc
        return proc

    def run_cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "asyncflow", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.home,
        )

    def _healthy(self) -> bool:
        for key, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{key} exited with {proc.returncode}:\n{self.log(key)}")
        try:
            return self.http.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self, key: str, sig: int = signal.SIGKILL, group: bool = True) -> None:
        """Signal one process (or its whole process group: the worker and its pool)."""
        proc = self.procs[key]
        if proc.poll() is None:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    def respawn(self, key: str, *extra: str) -> None:
        """Start ``key`` again with the command line it had (plus ``extra`` arguments)."""
        args = [str(a) for a in self.procs[key].args[3:]]  # after: python -m asyncflow
        self.procs[key].wait(timeout=60)
        self.spawn(key, *args, *extra)

    def log(self, key: str, tail: int | None = 4000) -> str:
        path = self.home / f"{key}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-tail:] if tail else text

    def stop(self) -> None:
        # SIGTERM to each main process, as a service manager stops a service: a worker
        # then stops its own pool. (SIGTERM to the whole group can kill a pool process
        # holding the pool's queue lock, and billiard's exit then waits on it forever.)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
            except ProcessLookupError:
                pass
            proc.wait()
        self.http.close()

    # --- API helpers -------------------------------------------------------------

    def submit(self, flow: str, parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        body = {"flow": flow, "parameters": parameters or {}, **extra}
        response = self.http.post(self.url + "/api/tasks", json=body)
        assert response.status_code in (200, 201), response.text
        return response.json()

    def get(self, task_id: str) -> dict[str, Any]:
        response = self.http.get(f"{self.url}/api/tasks/{task_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str) -> httpx.Response:
        return self.http.post(self.url + path)

    def wait_stopped(self, task_id: str, timeout: float = 60) -> dict[str, Any]:
        last: dict[str, Any] = {}

        def stopped() -> dict[str, Any] | None:
            last["doc"] = doc = self.get(task_id)
            return doc if doc["task_status"] in STOPPED else None

        try:
            return wait_for(stopped, timeout, f"task {task_id} to stop on {self.name}")
        except AssertionError as exc:
            logs = "\n".join(f"--- {key}\n{self.log(key)}" for key in self.procs)
            raise AssertionError(f"{exc}\nlast document: {json.dumps(last.get('doc'), indent=1)}\n{logs}") from None

    def executions(self, task_id: str) -> list[dict[str, Any]]:
        """What the test modules really ran for ``task_id``, in order."""
        if not self.journal.exists():
            return []
        lines = self.journal.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["task"] == task_id]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def tries(doc: dict[str, Any]) -> list[tuple[int, int, str]]:
    """A task document's attempts as (cursor, attempt, outcome), in order, without the starts
    given back by a consumer process whose round ran long (shared.saga.Released): the same
    attempt goes out again with its handler not run, so it is not a try. How often that
    happens depends on the host's speed, not on what a test checks."""
    return [(a["cursor"], a["attempt"], a["outcome"]) for a in doc["attempts"] if a["outcome"] != "released"]
