"""A serving process's start-up objects, kept out of the cyclic garbage collector's passes."""

from __future__ import annotations

import gc


def settle() -> None:
    """Freeze what start-up built: modules, routes, schemas, flows, statements.

    A process keeps them for its whole life, yet each full collection walked them
    all again, and in an API process that walk held requests for tens of
    milliseconds: with the heap settled, create_task's p99 under load went from
    60–93 ms to 17–20 ms (benchmarks/README.md, "Collector pauses"). Frozen objects
    are still freed by reference counting; only a cycle among them would never be
    collected, and start-up objects live as long as the process anyway. Settled
    before a fork, it is the forked processes' too: a worker's consumer processes
    walked theirs in a full collection of about 80 ms each.
    """
    gc.collect()
    gc.freeze()
