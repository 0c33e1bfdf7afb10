"""The ``mysql`` module: creates and drops real database instances (a database plus its user).

Where instances live is set by ``ASYNCFLOW_MYSQL_ADMIN_URL``:

- unset (embedded default): one SQLite file per instance,
  ``<home>/instances/<name>.sqlite``, holding a ``users`` table with the instance user;
- ``postgresql+psycopg://admin@host/db``: CREATE DATABASE + CREATE ROLE ... LOGIN;
- ``mysql+pymysql://root@host:3306/``: CREATE DATABASE + CREATE USER + GRANT ALL.

A registry table ``mysql_instances`` (in ``ASYNCFLOW_MYSQL_DATABASE_URL``, default
the framework's database) records which task owns each name. Commands only ever
drop instances found in the registry, and a rollback only its own task's.

Parameters:
  Name          instance name (``^[a-z][a-z0-9_]{0,39}$``); default ``af_`` + 12
                characters of the task id. A name owned by another task, or a
                database/user of that name not created here, makes init fail.
  FailInit      if true, init_instance creates the database and then fails for
                good, to show that the failed step's rollback (clean_instance)
                removes the partial work.
  InstanceName  for check_instance and drop_instance (deprovisioning).

The generated password is kept in the registry, never in Parameters (they are
shown by the API and the dashboard); InstanceDsn carries no password.
``python -m modules.mysql`` lists the registered instances.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sqlite3
import time
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import (
    Column,
    Connection,
    Float,
    MetaData,
    Row,
    String,
    Table,
    delete,
    insert,
    make_url,
    select,
    text,
)
from sqlalchemy.exc import IntegrityError

from modules import _db, _drill
from shared.config import Settings, load_settings
from shared.module import Module, PermanentError, StepContext

module = Module("mysql")

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,39}$")

metadata = MetaData()

registry = Table(
    "mysql_instances",
    metadata,
    Column("name", String(40), primary_key=True),
    Column("task_id", String(255), nullable=False),
    Column("backend", String(16), nullable=False),
    Column("password", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
)


class MysqlSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCFLOW_MYSQL_", extra="ignore")

    admin_url: str | None = None
    database_url: str | None = None


class InstanceServer(Protocol):
    """Where instances are made. Every method is idempotent."""

    kind: str

    def occupied(self, name: str) -> bool:
        """A database or user of this name exists."""
        ...

    def create_database(self, name: str) -> None: ...

    def create_user(self, name: str, password: str) -> None: ...

    def drop(self, name: str) -> None: ...

    def dsn(self, name: str) -> str: ...


class SqliteServer:
    kind = "sqlite"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.sqlite"

    def occupied(self, name: str) -> bool:
        return self.path(name).exists()

    def create_database(self, name: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(self.path(name))) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS users ("
                " name TEXT PRIMARY KEY, password_sha256 TEXT NOT NULL, created_at REAL NOT NULL)"
            )
            conn.commit()

    def create_user(self, name: str, password: str) -> None:
        digest = hashlib.sha256(password.encode()).hexdigest()
        with closing(sqlite3.connect(self.path(name))) as conn:
            conn.execute(
                "INSERT INTO users (name, password_sha256, created_at) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET password_sha256 = excluded.password_sha256",
                (name, digest, time.time()),
            )
            conn.commit()

    def drop(self, name: str) -> None:
        base = self.path(name)
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{base}{suffix}").unlink(missing_ok=True)

    def dsn(self, name: str) -> str:
        return f"sqlite:///{self.path(name).resolve()}"


class _SqlServer:
    kind = ""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url

    def dsn(self, name: str) -> str:
        url = make_url(self.admin_url).set(username=name, password=None, database=name)
        return url.render_as_string(hide_password=False)

    def _any(self, query: str, **params: Any) -> bool:
        with _db.admin_connection(self.admin_url) as conn:
            return conn.execute(text(query), params).first() is not None


def _ident(conn: Connection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote_identifier(name)


def _literal(conn: Connection, value: str) -> str:
    # DDL takes no bind parameters; let the dialect escape the string literal.
    process = String().literal_processor(conn.dialect)
    assert process is not None
    return process(value)


class PostgresServer(_SqlServer):
    kind = "postgresql"

    def occupied(self, name: str) -> bool:
        return self._any(
            "SELECT 1 FROM pg_database WHERE datname = :n"
            " UNION ALL SELECT 1 FROM pg_roles WHERE rolname = :n",
            n=name,
        )

    def create_database(self, name: str) -> None:
        with _db.admin_connection(self.admin_url) as conn:
            db = _ident(conn, name)
            found = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
            if found is None:
                conn.execute(text(f"CREATE DATABASE {db}"))
            # Only the instance user (and superusers) may connect to it.
            conn.execute(text(f"REVOKE CONNECT ON DATABASE {db} FROM PUBLIC"))

    def create_user(self, name: str, password: str) -> None:
        with _db.admin_connection(self.admin_url) as conn:
            role = db = _ident(conn, name)  # the database is named after its user
            secret = _literal(conn, password)
            exists = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": name}).first()
            verb = "ALTER" if exists else "CREATE"
            conn.execute(text(f"{verb} ROLE {role} LOGIN PASSWORD {secret}"))
            conn.execute(text(f"ALTER DATABASE {db} OWNER TO {role}"))

    def drop(self, name: str) -> None:
        with _db.admin_connection(self.admin_url) as conn:
            ident = _ident(conn, name)
            # FORCE (PostgreSQL 13+) ends the instance's open sessions, which would block the drop.
            conn.execute(text(f"DROP DATABASE IF EXISTS {ident} WITH (FORCE)"))
            conn.execute(text(f"DROP ROLE IF EXISTS {ident}"))


class MariadbServer(_SqlServer):
    kind = "mysql"

    def occupied(self, name: str) -> bool:
        return self._any(
            "SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = :n"
            " UNION ALL SELECT 1 FROM mysql.user WHERE User = :n",
            n=name,
        )

    def create_database(self, name: str) -> None:
        with _db.admin_connection(self.admin_url) as conn:
            conn.execute(text(f"CREATE DATABASE IF NOT EXISTS {_ident(conn, name)}"))

    def create_user(self, name: str, password: str) -> None:
        with _db.admin_connection(self.admin_url) as conn:
            user = f"{_literal(conn, name)}@'%'"
            secret = _literal(conn, password)
            conn.execute(text(f"CREATE USER IF NOT EXISTS {user} IDENTIFIED BY {secret}"))
            conn.execute(text(f"ALTER USER {user} IDENTIFIED BY {secret}"))
            # In a GRANT, "_" in a database name is a wildcard for any character:
            # escaped, or this user could reach databases it merely resembles.
            scope = _ident(conn, name.replace("_", "\\_"))
            conn.execute(text(f"GRANT ALL PRIVILEGES ON {scope}.* TO {user}"))

    def drop(self, name: str) -> None:
        with _db.admin_connection(self.admin_url) as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {_ident(conn, name)}"))
            conn.execute(text(f"DROP USER IF EXISTS {_literal(conn, name)}@'%'"))


def server_for(admin_url: str | None, home: Path) -> InstanceServer:
    """The instance server an admin URL names; None means SQLite files under ``home``."""
    if admin_url is None:
        return SqliteServer(home / "instances")
    backend = make_url(admin_url).get_backend_name()
    if backend == "postgresql":
        return PostgresServer(admin_url)
    if backend in ("mysql", "mariadb"):
        return MariadbServer(admin_url)
    raise ValueError(f"ASYNCFLOW_MYSQL_ADMIN_URL: unsupported backend {backend!r} (use postgresql or mysql)")


@dataclass(frozen=True)
class _Config:
    url: str
    server: InstanceServer


def _setup(settings: Settings) -> _Config:
    own = MysqlSettings()
    url = own.database_url or settings.resolved_database_url()
    server = server_for(own.admin_url, settings.home)
    _db.create_tables(url, metadata)
    return _Config(url, server)


_config = _db.PerSettings(_setup)


@module.on_startup
def start(settings: Settings) -> None:
    """Create the registry table and check the admin URL."""
    _config(settings)


def instance_name(parameters: Mapping[str, Any], task_id: str) -> str:
    """Parameters["Name"], or one derived from the task id; PermanentError if invalid."""
    name = parameters.get("Name")
    if name is None:
        name = "af_" + re.sub(r"[^0-9a-zA-Z]", "", task_id).lower()[:12]
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise PermanentError(f"instance name {name!r} must match {NAME_PATTERN.pattern}")
    return name


def _named(parameters: Mapping[str, Any]) -> str:
    name = parameters.get("InstanceName")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise PermanentError(f"parameter InstanceName {name!r} must match {NAME_PATTERN.pattern}")
    return name


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@_drill.command(module, "init_instance")
def init_instance(ctx: StepContext) -> dict[str, Any]:
    name = instance_name(ctx.parameters, ctx.task_id)
    cfg = _config(ctx.settings)
    entry = _own_entry(cfg, name, ctx.task_id)
    cfg.server.create_database(name)
    if _flag(ctx.parameters.get("FailInit")):
        raise PermanentError(f"FailInit is set: failing after creating database {name!r}")
    cfg.server.create_user(name, entry.password)
    return {"InstanceName": name, "InstanceDsn": cfg.server.dsn(name)}


def _own_entry(cfg: _Config, name: str, task_id: str) -> Row[Any]:
    """This task's registry row for ``name``, claimed now if nobody has it."""
    entry = _lookup(cfg.url, name)
    if entry is None:
        # Not registered but present: someone else's database; never adopt it,
        # or a rollback would later drop it.
        if cfg.server.occupied(name):
            raise PermanentError(f"a database or user named {name!r} already exists and is not managed here")
        entry = _claim(cfg, name, task_id)
    if entry.task_id != task_id:
        raise PermanentError(f"instance name {name!r} is already taken")
    _same_server(cfg, entry)
    return entry


def _claim(cfg: _Config, name: str, task_id: str) -> Row[Any]:
    row = {
        "name": name,
        "task_id": task_id,
        "backend": cfg.server.kind,
        "password": secrets.token_hex(16),
        "created_at": time.time(),
    }
    try:
        with _db.writing(cfg.url) as conn:
            conn.execute(insert(registry).values(row))
    except IntegrityError:
        pass  # claimed concurrently; the row now there decides who owns it
    entry = _lookup(cfg.url, name)
    if entry is None:
        raise RuntimeError(f"instance {name!r} was claimed and released concurrently; try again")
    return entry


def _same_server(cfg: _Config, entry: Row[Any]) -> None:
    if entry.backend != cfg.server.kind:
        raise PermanentError(
            f"instance {entry.name!r} lives on a {entry.backend} server but this worker "
            f"is configured for {cfg.server.kind}; check ASYNCFLOW_MYSQL_ADMIN_URL"
        )


@_drill.command(module, "clean_instance")
def clean_instance(ctx: StepContext) -> dict[str, Any]:
    """Rollback of init_instance: removes this task's instance, and nothing else."""
    try:
        name = instance_name(ctx.parameters, ctx.task_id)
    except PermanentError:
        return {}  # init refused the name before creating anything
    cfg = _config(ctx.settings)
    entry = _lookup(cfg.url, name)
    if entry is None or entry.task_id != ctx.task_id:
        return {}
    _same_server(cfg, entry)
    cfg.server.drop(name)
    with _db.writing(cfg.url) as conn:
        conn.execute(delete(registry).where(registry.c.name == name, registry.c.task_id == ctx.task_id))
    return {}


@_drill.command(module, "check_instance")
def check_instance(ctx: StepContext) -> dict[str, Any]:
    name = _named(ctx.parameters)
    entry = _lookup(_config(ctx.settings).url, name)
    if entry is None:
        raise PermanentError(f"no instance named {name!r}")
    return {"ReservationId": entry.task_id}


@_drill.command(module, "drop_instance")
def drop_instance(ctx: StepContext) -> dict[str, Any]:
    name = _named(ctx.parameters)
    cfg = _config(ctx.settings)
    entry = _lookup(cfg.url, name)
    if entry is None:
        return {}  # dropped already (a redelivery), or never made here
    _same_server(cfg, entry)
    cfg.server.drop(name)
    with _db.writing(cfg.url) as conn:
        conn.execute(delete(registry).where(registry.c.name == name))
    return {"DroppedInstance": name}


def _lookup(url: str, name: str) -> Row[Any] | None:
    with _db.reading(url) as conn:
        return conn.execute(select(registry).where(registry.c.name == name)).first()


def instances(settings: Settings) -> list[dict[str, Any]]:
    """Registered instances (without passwords), oldest first."""
    cols = [registry.c.name, registry.c.task_id, registry.c.backend, registry.c.created_at]
    with _db.reading(_config(settings).url) as conn:
        rows = conn.execute(select(*cols).order_by(registry.c.created_at)).all()
    return [dict(r._mapping) for r in rows]


def main() -> None:
    settings = load_settings()
    server = _config(settings).server
    for entry in instances(settings):
        where = server.dsn(entry["name"]) if entry["backend"] == server.kind else entry["backend"]
        print(f"{entry['name']:<42}{where}  (task {entry['task_id']})")


if __name__ == "__main__":
    main()
