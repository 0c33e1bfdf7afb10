"""A module whose worker does not finish starting until the file $GATEMOD_OPEN exists.

For start-up order tests: its worker process runs, but has not registered
itself (shared.presence) until the test opens the gate.
"""

from __future__ import annotations

import os
import threading

from shared.config import Settings
from shared.module import Module, StepContext

gated = Module("gated")


@gated.on_startup
def _wait_for_gate(settings: Settings) -> None:
    gate = os.environ["GATEMOD_OPEN"]
    while not os.path.exists(gate):
        threading.Event().wait(0.05)


@gated.command("step")
def _step(ctx: StepContext) -> None:
    return None
