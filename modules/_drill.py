"""Failure drills for the example modules.

``Parameters["FailCommands"]`` lists commands that must fail, before doing any
work, for that task only: ``["deduct_resource"]`` shows the compensation of
step 2, ``["deduct_resource", "restore_resource"]`` a failing rollback and its
alarm. The failure is permanent, so no retries are spent on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from shared.module import Handler, Module, PermanentError, StepContext

PARAMETER = "FailCommands"


def command(module: Module, name: str) -> Callable[[Handler], Handler]:
    """Like ``module.command(name)``, honouring the FailCommands drill."""

    def register(fn: Handler) -> Handler:
        @functools.wraps(fn)
        def run(ctx: StepContext):  # type: ignore[no-untyped-def]
            drilled = ctx.parameters.get(PARAMETER) or ()
            if isinstance(drilled, list | tuple) and name in drilled:
                raise PermanentError(f"{name} failed on purpose ({PARAMETER} drill)")
            return fn(ctx)

        return module.command(name)(run)

    return register
