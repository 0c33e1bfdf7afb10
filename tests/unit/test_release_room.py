"""How many of a batch's first steps each module's queue is given (Runtime.queue_room)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.config import Settings
from shared.flows import load_flows
from shared.testing import InProcess
from tests.e2e.stack import SUPPORT


def test_each_module_takes_first_steps_up_to_its_own_release_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = yaml.safe_load((SUPPORT / "flows.yaml").read_text(encoding="utf-8"))
    data["modules"]["beta"]["release_ahead"] = 10  # slow steps: few may wait in its queue
    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    rt = InProcess(load_flows(path), tmp_path, settings=Settings(home=tmp_path, release_ahead=200)).runtime
    depths = {"alpha": 60, "beta": 3, "monitor": 150}
    monkeypatch.setattr(rt, "_depths", lambda: depths)
    # alpha and monitor by the setting (200): 140 free, and 50 free, under half of it: none yet.
    assert rt.queue_room() == {"alpha": 140, "beta": 7, "monitor": 0}
    depths["beta"] = 6  # 4 free, under half of its 10: none until more of it drains
    assert rt.queue_room()["beta"] == 0
