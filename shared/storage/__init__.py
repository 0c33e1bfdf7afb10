"""Task storage: interfaces, a SQL implementation per dialect, in-memory fakes.

The only place that runs SQL. :class:`TaskStore` holds saga tasks and their
attempts; :class:`PullStore` holds v1 pull-mode tasks and task types.
"""

from shared.storage.base import (
    AttemptRecord,
    Outstanding,
    PullStore,
    StorageError,
    StorageUnavailable,
    TaskConflict,
    TaskEvent,
    TaskFilter,
    TaskStore,
    patiently,
)
from shared.storage.memory import InMemoryPullStore, InMemoryStore
from shared.storage.sql import SqlStore, open_store

__all__ = [
    "AttemptRecord",
    "InMemoryPullStore",
    "InMemoryStore",
    "Outstanding",
    "PullStore",
    "SqlStore",
    "StorageError",
    "StorageUnavailable",
    "TaskConflict",
    "TaskEvent",
    "TaskFilter",
    "TaskStore",
    "open_store",
    "patiently",
]
