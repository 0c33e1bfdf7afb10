"""The root error of the service layer, apart so that every module below the service can raise it."""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses; ``status_code`` is its HTTP answer, ``detail`` (optional) the fields."""

    status_code = 400
    detail: list[dict[str, str]] | None = None
