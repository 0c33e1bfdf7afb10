"""Run one flow to success through `asyncflow up` on PostgreSQL with each real broker.

For an installation made the way users make it (`pip install .`, no test
extra): run with that environment's Python, from anywhere.

    VENV/bin/python tests/smoke/flow_on_each_broker.py rabbitmq redis

Needs only what the install brings (psycopg) and the local servers of the test
suite (PostgreSQL 127.0.0.1:5432 database `test`, RabbitMQ guest/guest, Redis).
Each broker gets a fresh database (and RabbitMQ vhost, when rabbitmqctl is at
hand); everything it started is stopped. Exits 1, with the logs, on any failure.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg

FLOWS = Path(__file__).resolve().parents[2] / "flows.yaml"
PG = "127.0.0.1:5432"
BOOT_LIMIT = 40.0  # seconds for `up` to say it is up
FLOW_LIMIT = 40.0  # seconds for the task to succeed


def asyncflow() -> list[str]:
    """This environment's CLI (never the repository's sources: the run happens outside the clone)."""
    return [sys.executable, "-m", "asyncflow"]


def admin() -> tuple[psycopg.Connection, str]:
    for user in ("postgres", "root"):
        try:
            return psycopg.connect(f"postgresql://{user}@{PG}/test", autocommit=True, connect_timeout=5), user
        except psycopg.OperationalError:
            continue
    raise SystemExit(f"smoke: no PostgreSQL at {PG} (database test, user postgres or root)")


def rabbitmq_vhost(name: str) -> tuple[str, Callable[[], None]]:
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return "amqp://guest:guest@127.0.0.1:5672//", lambda: None
    subprocess.run([ctl, "add_vhost", name], check=True, capture_output=True, timeout=60)
    subprocess.run([ctl, "set_permissions", "-p", name, "guest", ".*", ".*", ".*"], check=True,
                   capture_output=True, timeout=60)
    return f"amqp://guest:guest@127.0.0.1:5672/{name}", lambda: subprocess.run(
        [ctl, "delete_vhost", name], capture_output=True, timeout=60
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_flow(broker: str) -> None:
    name = f"af_smoke_{uuid.uuid4().hex[:10]}"
    conn, user = admin()
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    cleanups: list[Callable[[], None]] = []
    if broker == "rabbitmq":
        broker_url, drop_vhost = rabbitmq_vhost(name)
        cleanups.append(drop_vhost)
    else:
        broker_url = f"redis://127.0.0.1:6379/{random.randint(1, 15)}"
    home = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCFLOW_", "PYTHONPATH"))}
    env |= {
        "ASYNCFLOW_DATABASE_URL": f"postgresql+psycopg://{user}@{PG}/{name}",
        "ASYNCFLOW_BROKER_URL": broker_url,
        "ASYNCFLOW_FLOWS": str(FLOWS),
        "ASYNCFLOW_HOME": str(home / ".asyncflow"),
        "ASYNCFLOW_API_URL": f"http://127.0.0.1:{port}",
    }
    log_path = home / "up.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        up = subprocess.Popen([*asyncflow(), "up", "--port", str(port)], env=env, cwd=home,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + BOOT_LIMIT
        while "asyncflow is up" not in log_path.read_text(errors="replace"):
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`asyncflow up` on {broker} did not come up")
            time.sleep(0.2)
        submit = subprocess.run(
            [*asyncflow(), "submit", "create_mysql_instance", "--param", "Cpu=1", "--param", "Memory=1",
             "--param", "Storage=1", "--wait"],
            env=env, cwd=home, capture_output=True, text=True, timeout=FLOW_LIMIT,
        )
        if submit.returncode != 0:
            raise RuntimeError(f"the flow did not succeed on {broker}:\n{submit.stdout}\n{submit.stderr}")
        print(f"smoke: {broker}: create_mysql_instance succeeded in {time.monotonic() - started:.1f}s "
              "(up, submit, wait)", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"smoke: FAILED: {exc}\n--- up's log ({log_path}):\n{log_path.read_text(errors='replace')[-6000:]}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
        for cleanup in cleanups:
            cleanup()
        conn, _ = admin()
        with conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(home, ignore_errors=True)


def main(brokers: list[str]) -> None:
    unknown = set(brokers) - {"rabbitmq", "redis"}
    if not brokers or unknown:
        raise SystemExit(f"usage: {sys.argv[0]} rabbitmq|redis ...")
    for broker in brokers:
        run_flow(broker)


if __name__ == "__main__":
    main(sys.argv[1:])
