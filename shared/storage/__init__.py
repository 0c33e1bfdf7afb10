"""Task storage: one interface, a SQL implementation per dialect, an in-memory fake."""

from shared.storage.base import (
    AttemptRecord,
    StorageError,
    StorageUnavailable,
    TaskConflict,
    TaskFilter,
    TaskStore,
)
from shared.storage.memory import InMemoryStore
from shared.storage.sql import SqlStore, open_store

__all__ = [
    "AttemptRecord",
    "InMemoryStore",
    "SqlStore",
    "StorageError",
    "StorageUnavailable",
    "TaskConflict",
    "TaskFilter",
    "TaskStore",
    "open_store",
]
