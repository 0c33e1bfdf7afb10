"""HTTP client of the native API, and the reading of KEY=VALUE parameters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import httpx


class ApiError(click.ClickException):
    """A 4xx/5xx answer: ``status``, the API's ``error`` and, for invalid input, ``detail``: [{field, problem}]."""

    def __init__(self, status: int, error: str, detail: list[dict[str, str]] | None = None) -> None:
        self.status = status
        self.error = error
        self.detail = detail or []
        super().__init__(self.describe())

    def describe(self, options: Mapping[str, str] | None = None) -> str:
        """One line, or a headline and one line per wrong field (``options``: field -> CLI option to name too)."""
        if not self.detail:
            return f"{self.status}: {self.error}"
        problems = [(d.get("field") or "body", d.get("problem", "")) for d in self.detail]
        # The API's error repeats the field problems after a headline ("invalid schedule: cron: ...").
        summary = "; ".join(f"{f}: {p}" for f, p in problems)
        headline = self.error.removesuffix(summary).rstrip(": ") or self.error
        lines = [f"{self.status}: {headline}"]
        for field, problem in problems:
            option = (options or {}).get(field.split(".")[0])
            lines.append(f"  {field} ({option}): {problem}" if option else f"  {field}: {problem}")
        return "\n".join(lines)


class ApiClient:
    def __init__(
        self, base_url: str, api_key: str | None = None, transport: httpx.BaseTransport | None = None
    ) -> None:
        """``api_key`` (``$ASYNCFLOW_API_KEY``) is sent as ``Authorization: Bearer <key>``."""
        self.base_url = base_url
        # httpx is imported here, not with the module: the server commands (`asyncflow
        # api`, `worker`, `scheduler`) load the CLI but never call the API, so they start
        # ~170 ms sooner (a worker serving `monitor` still imports it for that module).
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, timeout=30, headers=headers, transport=transport)
        self.last_status = 0  # of the latest answer (201 created / 200 already there)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer (None for an empty one); raises :class:`ApiError` on an error status."""
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise click.ClickException(
                f"cannot reach the API at {self.base_url} ({exc}); is `asyncflow up` running?"
            ) from exc
        self.last_status = response.status_code
        if response.status_code >= 400:
            detail = None
            try:
                body = response.json()
                message = body.get("error", response.text)
                if isinstance(body.get("detail"), list):
                    detail = [d for d in body["detail"] if isinstance(d, dict)]
            except (ValueError, AttributeError):
                message = response.text
            if response.status_code == 401:
                message = f"{message} (set ASYNCFLOW_API_KEY to a key the API accepts)"
            raise ApiError(response.status_code, str(message), detail)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()


def parse_param(text: str) -> tuple[str, Any]:
    """KEY=VALUE; VALUE is read as JSON when it parses (4, true, [1]), else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw
