"""`asyncflow worker --pool celery`: Celery's prefork worker, through real processes.

The saga and crash tests that concern who runs a step (test_saga_e2e,
test_faults) are collected here again, on stacks whose workers run Celery's
worker instead of the default kombu pool: the same assertions hold.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack
from tests.e2e.test_faults import (  # noqa: F401 - collected again, on Celery's worker
    TIMING,
    test_consumer_killed_mid_step_is_recovered_by_the_expiry_sweep,
    test_message_lost_after_commit_is_published_again,
    test_replayed_message_is_acknowledged_and_ignored,
    test_sigterm_gives_up_on_a_stuck_attempt_after_the_grace,
    test_sigterm_lets_the_running_attempt_finish,
    test_worker_killed_between_the_handlers_end_and_the_commit_runs_the_step_again,
)
from tests.e2e.test_saga_e2e import (  # noqa: F401 - collected again, on Celery's worker
    test_handler_that_ignores_the_interrupt_is_killed,
    test_hanging_handler_is_stopped_by_its_timeout,
    test_killed_pool_process_counts_as_a_failed_attempt,
    test_rollback_failure_stops_raises_alarm_and_resume_retries_it,
    test_success_runs_every_step_once_and_merges_results,
)

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

CELERY = {"ASYNCFLOW_WORKER_POOL": "celery"}


# Redis is left out: what differs by broker is the publisher and the broker's own
# redelivery, which the default pool's tests cover on every broker.
@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("celery-" + request.param)
    with open_stack(request.param, home, CELERY, [["alpha"], ["beta", "monitor"]]) as s:
        yield s


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("celery-faults")
    with open_stack("postgres-rabbitmq", home, TIMING | CELERY, [["alpha"], ["beta", "monitor"]]) as s:
        yield s
