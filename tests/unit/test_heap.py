"""An API process settles its heap once its app is built: the collector no longer walks start-up's objects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def test_an_api_process_freezes_what_its_start_up_built(tmp_path: Path) -> None:
    # The factory `asyncflow api --workers N` loads in each process; one process runs the same call.
    script = (
        "import gc\n"
        "from oss_api.app import app_from_environment\n"
        "app_from_environment()\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
    env |= {"ASYNCFLOW_HOME": str(tmp_path), "ASYNCFLOW_FLOWS": str(SUPPORT / "flows.yaml")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    frozen, tracked = (int(n) for n in done.stdout.split())
    assert frozen > 10_000  # FastAPI, pydantic, SQLAlchemy, the routes and flows
    assert tracked < frozen / 100  # left for the collector: next to nothing
