"""API keys: who is calling, and which tasks they may see and act on.

Keys come from ``ASYNCFLOW_API_KEYS`` ("KEY=user" or "KEY=user:admin",
comma-separated) and from ``ASYNCFLOW_API_KEYS_FILE`` (YAML or JSON mapping
``KEY: {user: NAME, admin: false}``). Only SHA-256 digests of the keys are kept,
and no message ever contains a key. Authentication is on when at least one key
is configured; otherwise every caller is an anonymous admin (the embedded default).

A caller who is not an admin submits, lists and acts on the tasks whose
``user_id`` is its own user; another user's task answers 404, exactly like a
missing one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from shared.config import Settings
from shared.flows import UniqueKeyLoader
from shared.service import ServiceError, TaskNotFound, TaskService
from shared.task import Task

log = logging.getLogger(__name__)

KEY = re.compile(r"[!-~]{8,256}")  # visible ASCII, no spaces: it travels in a header
USER = re.compile(r"[A-Za-z0-9._@+-]{1,128}")
# Every id a task can be stored under: a body task_id or an Idempotency-Key header.
ANY_TASK_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

ENV = "ASYNCFLOW_API_KEYS"
KEY_RULE = "a key is 8-256 visible ASCII characters without spaces"
USER_RULE = "a user is 1-128 characters of A-Za-z0-9._@+-"


class AuthConfigError(ValueError):
    """The configured keys cannot be used; the message names the source and the entry."""


class Unauthorized(ServiceError):
    status_code = 401
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(ServiceError):
    status_code = 403


@dataclass(frozen=True)
class Caller:
    user: str | None
    admin: bool

    def may_see(self, task: Task) -> bool:
        return self.admin or task.user_id == self.user


# Authentication off: anyone may do anything, and user_id is whatever the request says.
ANONYMOUS = Caller(user=None, admin=True)


class KeyTable:
    """Caller by SHA-256 digest of the key."""

    def __init__(self, callers: dict[bytes, Caller], placeholders: tuple[str, ...] = ()) -> None:
        self._callers = callers
        # Users whose key is still a "change-me..." placeholder (docker-compose.yml's default).
        self.placeholders = placeholders

    @property
    def enabled(self) -> bool:
        return bool(self._callers)

    def __len__(self) -> int:
        return len(self._callers)

    def admins(self) -> int:
        return sum(c.admin for c in self._callers.values())

    def lookup(self, key: str) -> Caller | None:
        return self._callers.get(_digest(key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


# --- configuration ----------------------------------------------------------------------


def load_keys(settings: Settings) -> KeyTable:
    """The keys of ``settings``; raises AuthConfigError naming the bad entry."""
    callers: dict[bytes, Caller] = {}
    where: dict[bytes, str] = {}
    entries = list(_env_entries(settings.api_keys.get_secret_value()))
    path = settings.api_keys_file
    # An empty ASYNCFLOW_API_KEYS_FILE arrives as Path("."): treat it as unset.
    if path is not None and str(path) not in ("", "."):
        entries += _file_entries(Path(path))
    placeholders = []
    for key, caller, source in entries:
        digest = _digest(key)
        if digest in callers:
            raise AuthConfigError(f"{source}: the same key is already configured by {where[digest]}")
        callers[digest] = caller
        where[digest] = source
        if key.lower().startswith("change-me"):
            placeholders.append(str(caller.user))
    return KeyTable(callers, tuple(placeholders))


def _check(source: str, key: Any, user: Any, admin: bool) -> tuple[str, Caller, str]:
    if not isinstance(key, str):
        raise AuthConfigError(f"{source}: the key must be a string (quote it)")
    if KEY.fullmatch(key) is None:
        raise AuthConfigError(f"{source}: invalid key ({KEY_RULE})")
    if not isinstance(user, str) or USER.fullmatch(user) is None:
        raise AuthConfigError(f"{source}: invalid user {str(user)[:140]!r} ({USER_RULE})")
    return key, Caller(user=user, admin=admin), f"{source} (user {user!r})"


def _env_entries(text: str) -> Iterator[tuple[str, Caller, str]]:
    if not text.strip():
        return
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise AuthConfigError(f"{ENV} is set but holds no keys; expected KEY=user or KEY=user:admin")
    for n, item in enumerate(items, 1):
        if not item:
            continue  # a trailing comma
        source = f"{ENV}: entry {n}"
        key, sep, who = item.rpartition("=")  # keys may contain '=' (base64 padding), users may not
        if not sep or not key or not who:
            raise AuthConfigError(f"{source}: expected KEY=user or KEY=user:admin")
        user, colon, scope = who.partition(":")
        if colon and scope != "admin":
            raise AuthConfigError(f"{source}: unknown scope {scope[:40]!r} after the user (only ':admin')")
        yield _check(source, key, user, admin=bool(colon))


def _file_entries(path: Path) -> Iterator[tuple[str, Caller, str]]:
    data = _read_key_file(path)
    if not isinstance(data, dict):
        raise AuthConfigError(f"{path}: expected a mapping of API key to {{user: NAME, admin: false}}")
    if not data:
        raise AuthConfigError(f"{path}: the file holds no keys")
    for n, (key, value) in enumerate(data.items(), 1):
        source = f"{path}: entry {n}"
        if not isinstance(value, dict):
            raise AuthConfigError(f"{source}: expected {{user: NAME, admin: false}}")
        user = value.get("user")
        named = f"{source} (user {user!r})" if isinstance(user, str) and USER.fullmatch(user) else source
        unknown = sorted(str(k) for k in value if k not in ("user", "admin"))
        if unknown:
            raise AuthConfigError(f"{named}: unknown field(s) {', '.join(unknown)} (allowed: user, admin)")
        admin = value.get("admin", False)
        if not isinstance(admin, bool):
            raise AuthConfigError(f"{named}: admin must be true or false")
        yield _check(source, key, user, admin)


def _read_key_file(path: Path) -> Any:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise AuthConfigError(f"{path}: cannot read the API keys file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise AuthConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    # Parser messages quote the offending line, which may hold a key: report the position only.
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text, object_pairs_hook=_unique_pairs)
        except json.JSONDecodeError as exc:
            raise AuthConfigError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
        except _DuplicateKey as exc:
            raise AuthConfigError(f"{path}: a key appears twice (entry {exc.args[0]})") from None
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = "a key appears twice" if "duplicate key" in str(exc.problem) else exc.problem
        raise AuthConfigError(f"{path}: not valid YAML: {problem}{at}") from None
    except (yaml.YAMLError, RecursionError):
        raise AuthConfigError(f"{path}: not valid YAML") from None


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for n, (key, value) in enumerate(pairs, 1):
        if key in result:
            raise _DuplicateKey(n)
        result[key] = value
    return result


# --- requests ------------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer <key>`")
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="The same key, as `X-API-Key`")


async def caller(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header_key: Annotated[str | None, Depends(_api_key_header)],
) -> Caller:
    """The FastAPI dependency of every /api route: who is calling (401 when unknown)."""
    return identify(request, bearer.credentials if bearer is not None else header_key)


def identify(request: Request, key: str | None) -> Caller:
    """Who sends ``key`` (401 when unknown); ANONYMOUS when no keys are configured."""
    keys: KeyTable = request.app.state.api_keys
    if not keys.enabled:
        return ANONYMOUS
    key = (key or "").strip()
    if not key:
        if request.headers.get("authorization"):
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    found = keys.lookup(key)
    if found is None:
        log.info("request refused: invalid API key", extra={"client": request.client.host if request.client else None})
        raise Unauthorized("invalid API key")
    return found


CallerDep = Annotated[Caller, Depends(caller)]


# What a route that finds its caller with request_caller declares in the OpenAPI
# document (``openapi_extra``): the keys CallerDep's two schemes declare.
KEY_SECURITY: dict[str, Any] = {"security": [{_bearer.scheme_name: []}, {_api_key_header.scheme_name: []}]}


def request_caller(request: Request) -> Caller:
    """``caller`` without FastAPI's dependency machinery, for hot routes (the v1 API).

    Reads the same headers: ``Authorization: Bearer <key>``, else ``X-API-Key``.
    """
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    credentials = credentials.strip()  # as HTTPBearer reads it: a blank one falls back to X-API-Key
    key = credentials if scheme.lower() == "bearer" and credentials else request.headers.get("x-api-key")
    return identify(request, key)


async def _request_caller(request: Request) -> Caller:  # async: solved on the event loop, not in a thread
    return request_caller(request)


# CallerDep as one dependency instead of three (itself and its two schemes), for
# the hottest route, POST /api/tasks: 1.95 M instructions a submit become 1.79 M
# (benchmarks/submit_path.py). Like CallerDep, it is solved before the body's
# fields are checked: a wrong key is a 401 whatever they hold (a body that is not
# JSON at all is a 400 first, on every route). The route declares KEY_SECURITY.
RequestCallerDep = Annotated[Caller, Depends(_request_caller)]


def submit_user(who: Caller, requested: str | None) -> str | None:
    """The user_id a new task gets: the caller's own unless an admin names another."""
    if who.admin:
        return requested if requested is not None else who.user
    if requested is None or requested == who.user:
        return who.user
    raise Forbidden(f"cannot submit tasks for another user (this key belongs to {who.user!r})")


def list_user(who: Caller, requested: str | None) -> str | None:
    """The user_id filter of a list: admins choose, everyone else sees only their own."""
    if who.admin:
        return requested
    if requested is None or requested == who.user:
        return who.user
    raise Forbidden(f"cannot list the tasks of another user (this key belongs to {who.user!r})")


def visible_task(svc: TaskService, who: Caller, task_id: str) -> Task:
    """The task, if ``who`` may see it; another user's task is 404 like a missing one."""
    if ANY_TASK_ID.fullmatch(task_id) is None:
        # No task can have this id: answer without asking the database.
        shown = task_id if len(task_id) <= 80 else task_id[:80] + "…"
        raise TaskNotFound(f"no task {shown!r} (task ids are 1-64 characters of A-Za-z0-9._:-)")
    task = svc.get(task_id)
    if not who.may_see(task):
        raise TaskNotFound(f"no task {task_id!r}")
    return task


def log_mode(keys: KeyTable) -> None:
    if keys.enabled:
        log.info("API authentication is on: %d key(s), %d with the admin scope", len(keys), keys.admins())
        if keys.placeholders:
            log.warning(
                "the API key of %s is still a 'change-me' placeholder: set real keys in ASYNCFLOW_API_KEYS",
                ", ".join(repr(u) for u in keys.placeholders),
            )
    else:
        log.warning(
            "API authentication is OFF: anyone who can reach this port can read and act on every task; "
            "set ASYNCFLOW_API_KEYS to enable it"
        )
