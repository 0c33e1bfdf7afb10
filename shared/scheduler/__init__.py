"""The scheduler: everything that happens because time passed, not because a message came.

The schedules users define (:mod:`shared.schedules`), and the governance sweeps
(:mod:`~shared.scheduler.sweeps`): waiting saga messages published when due
(retry backoff, poll later), queued ones that nobody started published again,
running attempts past their deadline failed, and v1 leases past
max_processing_time expired. :class:`Scheduler` is ``asyncflow scheduler``: any
number may run; the one holding the lease does the work.
"""

from shared.scheduler.loop import Cadence, Scheduler
from shared.scheduler.sweeps import sweep_leases, sweep_tasks

__all__ = ["Cadence", "Scheduler", "sweep_leases", "sweep_tasks"]
