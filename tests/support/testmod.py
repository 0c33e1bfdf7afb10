"""Modules for end-to-end tests, steered by the task's Parameters.

Parameters read (cursor = step index):
  fail_at: [cursors]           the normal command fails every attempt
  fail_rollback_at: [cursors]  the rollback command fails every attempt
  flaky: {"cursor": n}         the normal command fails its first n attempts
  hang_at: [cursors]           the normal command blocks (its timeout must stop it)
  hang_hard_at: [cursors]      blocks and swallows the soft time limit (only a kill stops it)
  hang_deaf_at: [cursors]      blocks with the time limit's signal blocked (only the worker's
                               hard-limit kill from outside stops it)
  poll: {"cursor": n}          the normal command answers "poll later" n times first
  hang_first: [cursors]        blocks on the first attempt only
  fail_if_exists: {"cursor": path}  fails while that file exists
  wait_for_file: {"cursor": path}   works until that file exists (an external job), reporting
                               progress with heartbeats
  kill_worker_after: {"cursor": path}  once (while that file does not exist): does the work,
                               creates the file, then SIGKILLs its worker process and itself,
                               before the outcome can be stored
Every execution is appended to the file named by $TESTMOD_JOURNAL, so tests can
check what really ran, in which order, besides what the database says (and how
many objects the process running it keeps out of the collector's passes).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from typing import Any

from shared.module import Module, PollLater, StepContext

alpha = Module("alpha")
beta = Module("beta")


def _journal(ctx: StepContext, what: str) -> None:
    path = os.environ.get("TESTMOD_JOURNAL")
    if path:
        line = json.dumps({"task": ctx.task_id, "cursor": ctx.cursor, "type": ctx.step_type,
                           "attempt": ctx.attempt, "what": what, "pid": os.getpid(),
                           "frozen": gc.get_freeze_count()})
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _do(ctx: StepContext) -> dict[str, Any] | PollLater:
    p = ctx.parameters
    key = str(ctx.cursor)
    _journal(ctx, "do")
    if ctx.cursor in p.get("hang_at", []):
        threading.Event().wait()  # blocks until the time limit interrupts or kills it
    if ctx.cursor in p.get("hang_hard_at", []):
        while True:
            try:
                threading.Event().wait()
            except BaseException:  # a handler that ignores the interrupt
                continue
    if ctx.cursor in p.get("hang_deaf_at", []):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # as if stuck where no signal gets through
        while True:
            time.sleep(1)
    if ctx.cursor in p.get("hang_first", []) and ctx.attempt == 1:
        threading.Event().wait()
    signal_file = p.get("wait_for_file", {}).get(key)
    while signal_file and not os.path.exists(signal_file):
        ctx.heartbeat(waiting_for=signal_file)
        threading.Event().wait(0.05)
    guard = p.get("fail_if_exists", {}).get(key)
    if guard and os.path.exists(guard):
        raise RuntimeError(f"{guard} exists")
    if ctx.cursor in p.get("fail_at", []):
        raise RuntimeError(f"forced failure at step {ctx.cursor}")
    if ctx.attempt <= int(p.get("flaky", {}).get(key, 0)):
        raise RuntimeError(f"flaky failure, attempt {ctx.attempt}")
    marker = p.get("kill_worker_after", {}).get(key)
    if marker and not os.path.exists(marker):
        open(marker, "w").close()  # noqa: SIM115 - the process is about to die
        os.kill(os.getppid(), signal.SIGKILL)  # the worker's main process: nobody acknowledges
        os.kill(os.getpid(), signal.SIGKILL)
    polls_wanted = int(p.get("poll", {}).get(key, 0))
    polled = int(p.get(f"polled_{key}", 0))
    if polled < polls_wanted:
        return PollLater(0.2, {f"polled_{key}": polled + 1})
    return {f"done_{key}": ctx.idempotency_key}


def _undo(ctx: StepContext) -> None:
    _journal(ctx, "undo")
    if ctx.cursor in ctx.parameters.get("fail_rollback_at", []):
        raise RuntimeError(f"forced rollback failure at step {ctx.cursor}")


for _module in (alpha, beta):
    _module.command("step")(_do)
    _module.command("undo")(_undo)
