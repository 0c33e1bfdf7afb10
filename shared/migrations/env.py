"""Alembic environment: the URL comes from the caller (shared.migrate), never from an ini."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from shared.storage.schema import metadata

config = context.config
url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")


def run_offline() -> None:
    context.configure(url=url, target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        postgres = conn.dialect.name == "postgresql"
        if postgres:
            # Several API replicas may start at once: one migrates, the others wait.
            conn.execute(text("SELECT pg_advisory_lock(720461)"))
            conn.commit()
        try:
            context.configure(
                connection=conn,
                target_metadata=metadata,
                render_as_batch=conn.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
        finally:
            if postgres:
                conn.rollback()  # a failed migration leaves the transaction aborted
                conn.execute(text("SELECT pg_advisory_unlock(720461)"))
                conn.commit()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
