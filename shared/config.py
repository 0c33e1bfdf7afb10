"""Settings, read once from ``ASYNCFLOW_*`` environment variables and passed down.

Nothing here runs at import: call :func:`load_settings` at the edge (CLI, app
factory) and hand the object to constructors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_HOME = Path(".asyncflow")

# Each broker has its own priorities, confirms and ways to ask about its queues.
BrokerKind = Literal["embedded", "rabbitmq", "redis", "other"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCFLOW_", extra="ignore")

    # Embedded default: a SQLite file for tasks and another one as the broker,
    # both under ``home`` so that `asyncflow up` needs no server.
    home: Path = DEFAULT_HOME
    database_url: str | None = None
    broker_url: str | None = None
    flows: Path = Path("flows.yaml")

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # API processes on one port (uvicorn workers): the API is stateless, so one per core.
    api_workers: int = Field(default=1, ge=1, le=64)
    api_url: str | None = None

    # Intake limits (documented in the README); requests over them get a 413/422.
    max_body_bytes: int = 1_048_576
    max_parameters_bytes: int = 65_536
    list_limit_max: int = 1000

    worker_concurrency: int = 2
    # Who runs a worker's steps: consumer processes of our own on kombu
    # (shared.messaging.consumers), or Celery's prefork worker, which costs about 1.4
    # times their CPU per message.
    worker_pool: Literal["kombu", "celery"] = "kombu"
    # Deliveries a consumer process holds at once (`--pool kombu`). Above 1: their
    # handlers still run one at a time, and their transitions (starts, outcomes) are
    # committed together, several in one transaction (group commit); behind a step that
    # runs long, what the process holds and has not run goes to other consumers (what it
    # read and has not started within about 50 ms, its starts, stored or not, once its
    # round has run a second). 1: one at a time, each transition committed alone.
    worker_prefetch: int = Field(default=8, ge=1, le=64)
    # Port for a worker's Prometheus metrics (its pool processes included); 0 = off.
    worker_metrics_port: int = 0
    # Seconds past a step's timeout before its process is killed outright.
    hard_timeout_grace: float = 5.0
    scheduler_tick: float = 0.2
    # Governance sweeps (SPEC §4): a queued message nobody started is published
    # again after requeue_after; an attempt with no outcome by timeout +
    # expire_grace counts as failed; a failed publish is retried after publish_retry.
    requeue_after: float = 30.0
    # A batch's first steps are published while their module's queue holds fewer
    # than this many messages waiting; the rest wait in the database. Keep it
    # under what the module's workers start in ten times requeue_after: a message
    # still waiting in its queue after that is published again. A module's own
    # release_ahead in flows.yaml comes first.
    release_ahead: int = Field(default=200, ge=2)
    expire_grace: float = 15.0
    publish_retry: float = 2.0
    # 0 (default): a consumer records each attempt's start, then its outcome (two
    # commits per step). Above 0: one commit records the start and outcome together, and
    # an attempt still running after this many seconds also has its start recorded
    # on its own (the task shows it running; it expires at its deadline or when its
    # heartbeats stop, instead of being published again). The price: cancelling a
    # task whose step is queued completes only once that step is known not to run,
    # up to record_start_after + expire_grace seconds later.
    record_start_after: float = Field(default=0.0, ge=0)
    # A worker runs the next step of a flow itself, at once and without its queue,
    # when it serves that step's module and the step's timeout ends within what is
    # left of the delivery it took: a message may run for its step's timeout plus
    # this many seconds (its hard limit moves by as much). 0: every step goes
    # through its queue.
    continue_within: float = Field(default=5.0, ge=0)
    # Every process renews its registry row, and a worker each running attempt,
    # this often; a running attempt not renewed for 3 intervals is lost and runs
    # again, whatever its timeout.
    heartbeat_interval: float = Field(default=5.0, gt=0)
    # Registry rows (and the counters they hold, which /metrics adds up) of processes
    # stopped or silent this many seconds are deleted by the leading scheduler.
    process_retention: float = Field(default=86400.0, gt=0)
    # How long a consumer keeps trying to store a finished attempt's outcome
    # while the database is down, before leaving it to the expiry sweep.
    outcome_patience: float = 60.0
    # SIGTERM: in-flight attempts get this long to finish, then are recorded as
    # lost (so they run again elsewhere) and the worker stops.
    shutdown_grace: float = 30.0
    # "module.command" that receives alarms (rollback failed); empty = log only.
    alert_command: str = "monitor.report_event"
    # Schedules (SPEC §9): one scheduler leads while it renews its lease; another takes
    # over within scheduler_lease_ttl of its death. Schedules due within
    # schedule_load_ahead are held in the leader's memory.
    scheduler_lease_ttl: float = Field(default=5.0, gt=0)
    schedule_load_ahead: float = Field(default=60.0, gt=0)
    # Run records older than this many days are deleted (0: kept), with the ended
    # tasks they created if schedule_runs_delete_tasks (seed 002 §4.6: six months).
    schedule_runs_keep_days: float = Field(default=180.0, ge=0)
    schedule_runs_delete_tasks: bool = False
    # Whether RabbitMQ writes step messages to disk (persistent) or keeps them in
    # memory (transient, the default). The database holds every step, and the
    # scheduler publishes again what a broker restart lost, so a restart delays the
    # steps that were queued until they have waited requeue_after; persistent, they
    # wait for no sweep, at a cost measured in benchmarks/README.md ("Step messages
    # kept in the broker's memory"). Alarms are persistent either way.
    persistent_messages: bool = False
    # Poll interval of the embedded (SQLite) broker.
    embedded_poll_interval: float = 0.05
    migrate_on_start: bool = True

    # Logs (README "Logs"): one line per event, "text" (key=value fields) or "json"
    # (one object per line), to stderr or appended to log_file.
    log_level: str = Field(default="INFO")
    log_format: Literal["text", "json"] = "text"
    log_file: Path | None = None

    @model_validator(mode="after")
    def _start_recorded_before_requeue(self) -> Settings:
        if self.record_start_after >= self.requeue_after:
            raise ValueError(
                "record_start_after must be shorter than requeue_after: a running attempt whose start "
                "is not recorded by then would be published again"
            )
        return self

    # --- API keys (oss_api/auth.py; README "Authentication and tenancy").
    # Authentication is on when at least one key is configured, here or in the file.
    # "KEY=user" or "KEY=user:admin", comma-separated.
    api_keys: SecretStr = SecretStr("")
    # YAML or JSON mapping: KEY: {user: NAME, admin: false}.
    api_keys_file: Path | None = None
    # The key the CLI client sends (Authorization: Bearer ...).
    api_key: SecretStr | None = None

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'asyncflow.sqlite'}"

    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.home / 'broker.sqlite'}"

    def resolved_api_url(self) -> str:
        return self.api_url or f"http://{self.api_host}:{self.api_port}"

    def broker_kind(self) -> BrokerKind:
        url = self.resolved_broker_url()
        if url.startswith("sqla+sqlite"):
            return "embedded"
        if url.startswith(("amqp", "pyamqp")):
            return "rabbitmq"
        if url.startswith(("redis", "rediss")):
            return "redis"
        return "other"

    def is_embedded_broker(self) -> bool:
        return self.broker_kind() == "embedded"


def load_settings(**overrides: object) -> Settings:
    settings = Settings(**overrides)  # type: ignore[arg-type]
    if settings.database_url is None or settings.broker_url is None:
        settings.home.mkdir(parents=True, exist_ok=True)
    return settings
