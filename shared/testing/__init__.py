"""Test support shipped with Asyncflow, for its own tests and for users testing their modules.

- :class:`Harness`: flows and modules in one process, queues drained in order.
- :class:`InProcess`: the real runtime over an in-memory (or given) store, a
  queue publisher and a manual clock; ``oss_api.testing.open_client`` adds HTTP.
- :class:`ManualClock`, :class:`QueuePublisher`: the fakes at the edges.
- :func:`wait_for`: wait on a condition with a deadline.
"""

from shared.testing.clock import ManualClock
from shared.testing.fakes import QueuePublisher
from shared.testing.harness import Harness
from shared.testing.runtime import InProcess
from shared.testing.waiting import wait_for

__all__ = ["Harness", "InProcess", "ManualClock", "QueuePublisher", "wait_for"]
