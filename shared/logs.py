"""Logging set-up for the processes the CLI starts: one line per event, with fields."""

from __future__ import annotations

import logging

FIELDS = ("task_id", "flow", "step", "seq", "status")


class FieldFormatter(logging.Formatter):
    """Appends the structured fields passed through ``extra=`` as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(f"{k}={getattr(record, k)}" for k in FIELDS if hasattr(record, k))
        return f"{line} {fields}" if fields else line


def setup_logging(level: str, process: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        FieldFormatter(f"%(asctime)s %(levelname)s {process}[%(process)d] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
