"""The scheduler: everything that happens because time passed, not because a message came.

Today that is the governance sweeps (:mod:`~shared.scheduler.sweeps`): waiting
saga messages published when due (retry backoff, poll later), queued ones that
nobody started published again, running attempts past their deadline failed,
and v1 leases past max_processing_time expired. :class:`Scheduler` runs them in
a loop (``asyncflow scheduler``). Every change is a compare-and-set, so several
schedulers can run at once without firing anything twice.
"""

from shared.scheduler.loop import Scheduler
from shared.scheduler.sweeps import sweep_leases, sweep_tasks

__all__ = ["Scheduler", "sweep_leases", "sweep_tasks"]
